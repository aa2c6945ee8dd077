"""Discrete-event shells that drive the scheduler core in virtual time."""
