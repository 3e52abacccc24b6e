"""Measuring a plan: compile, read memory, time, check gradients, in a worker process."""
