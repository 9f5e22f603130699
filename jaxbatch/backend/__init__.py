"""Backends: the runner executes a plan with the real model; the simulator only clocks it."""
