"""Planning, pure: partition, schedule, simulator and the device memory budget.

Standard library only (no torch), so the planner and ``python -m lightning_roundpipe.planning`` run and
are tested anywhere in milliseconds.
"""
