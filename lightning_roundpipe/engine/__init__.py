"""The engine: executes a plan on a ring of devices with worker threads and a host optimizer thread.

Plain PyTorch, no Lightning: :class:`~lightning_roundpipe.engine.engine.RoundPipeEngine` is usable alone.
Imports :mod:`lightning_roundpipe.planning` and :mod:`lightning_roundpipe.observe`, never the adapter.
"""
