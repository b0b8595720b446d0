"""The device memory budget: what of a device's memory the planner may give to stages, and how bytes are shown.

Pure module (standard library only); :mod:`.search` fits each stage in half of the stage budget.
"""

from __future__ import annotations

# A device's budget is spent on: a fixed workspace reserve (GPUs only), the stage-boundary activations in
# flight and the temporaries inside a layer's compute (ACTIVATION_RESERVE of the rest), and two stages, the
# running one and the prefetched one, each with what its compute keeps for backward (LayerCost.activation_bytes).
ACTIVATION_RESERVE = 0.25
"""Share of the device budget, after the workspace reserve, kept for the stage-boundary activations in
flight and for the temporaries of a layer's compute that are never saved for backward; the planner fits
two stages (the running one and the prefetched one) in the rest."""

_MiB = 2**20
CUDA_WORKSPACE_RESERVE = 2 * (32 + 32) * _MiB + 4 * 2 * _MiB
"""Bytes each ring member on a GPU keeps for what kernels and the allocator hold beyond tensors: 136 MiB.

* cuBLAS and cuBLASLt each keep a workspace per (handle, stream): PyTorch's default is 32 MiB each on
  Hopper and newer (less on older GPUs: the larger figure is the bound). Two threads launch matmuls on a
  ring member's compute stream, each with its own handle (the compute stream's thread, and in backward
  autograd's device thread): 2 x (32 + 32) MiB.
* The caching allocator never lends a block one stream has freed to another stream, so each of the
  member's four streams keeps at least one 2 MiB segment of its own: 4 x 2 MiB.

CPU stand-ins reserve nothing: their budget simulates what the engine holds."""


def workspace_reserve(device_type: str) -> int:
    """The fixed reserve of a ring member on a ``device_type`` device (see :data:`CUDA_WORKSPACE_RESERVE`)."""
    return CUDA_WORKSPACE_RESERVE if device_type == "cuda" else 0


def autocast_copy_bytes(cast_bytes: int, *, stored_itemsize: int = 4, autocast_itemsize: int = 2) -> int:
    """What autocast's weight copies take on a device while a fused or backward stage back-propagates.

    With its cache off (as the engine runs it, see ``engine/call.py``) autocast casts a weight on every call,
    and the op saves the copy for backward, so a differentiating stage keeps a copy of every weight it casts
    until its backward frees it (about half of the stage's float32 weight bytes for bfloat16). A forward stage
    runs without autograd: each copy is freed after its op. ``cast_bytes``: the stored bytes of the weights
    autocast still casts: by default every float32 parameter, less those that arrive already in autocast's
    dtype (``EngineOptions.transport_dtype``)."""
    return cast_bytes * autocast_itemsize // stored_itemsize


def stage_memory_budget(device_memory_limit: int | None, workspace_bytes: int = 0) -> int | None:
    """Bytes the planner lets two stages (running and prefetched) use: what the device budget leaves after
    the workspace reserve (``workspace_bytes``, see :func:`workspace_reserve`) and then the activation
    reserve (at least 1, so that a budget below the reserve fails as too small for every layer)."""
    if device_memory_limit is None:
        return None
    return max(1, int((device_memory_limit - workspace_bytes) * (1.0 - ACTIVATION_RESERVE)))


def format_bytes(nbytes: int | float | None) -> str:
    """``1536`` -> ``'1.5 KiB'``; ``None`` -> ``'unlimited'``."""
    if nbytes is None:
        return "unlimited"
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if unit == "B" and abs(value) < 1024:
            return f"{int(value)} B"
        if unit != "B" and abs(round(value, 1)) < 1024:
            return f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"
