"""The search: the space, the loop, the planner, confirmation and submission."""
