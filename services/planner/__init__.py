"""Capacity planning: a discrete-event simulator driving the real scheduler core."""
