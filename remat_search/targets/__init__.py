"""Targets: where a plan will run (local devices, TPU topologies compiled ahead of time) and the step-time model of compile-only targets."""
