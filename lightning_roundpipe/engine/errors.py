"""The engine's exception types, in one place (each is raised where its docstring says).

The modules that raise them import them from here; the names also stay importable from where they were
defined before (``call``, ``device``, ``dataparallel``, ``engine``) and ``PipelineError`` from the package.
"""

from __future__ import annotations

__all__ = ["DataParallelError", "EngineAborted", "OffloadError", "OutOfDeviceMemory", "PipelineError"]


class PipelineError(RuntimeError):
    """A layer, the loss or a transfer failed inside the pipeline; ``__cause__`` is the original error."""


class EngineAborted(RuntimeError):
    """Raised in waits once the engine has failed or is shutting down."""


class OutOfDeviceMemory(RuntimeError):
    """A device's accounted bytes would exceed its budget."""


class DataParallelError(RuntimeError):
    """A collective across the data-parallel processes failed or timed out (a process was lost or stopped)."""


class OffloadError(PipelineError):
    """The disk tier (``EngineOptions.offload``) cannot keep the state in its directory: the disk is full, or it
    failed to read or write."""
