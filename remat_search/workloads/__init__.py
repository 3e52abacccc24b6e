"""Workloads: the training steps a study optimises (built-in and the user's own)."""
