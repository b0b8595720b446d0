"""Deterministic randomness for recomputation, and ``is_recomputing()`` for user code.

Why not just save and restore the RNG state around each layer: torch's CPU generator (and CUDA's,
per physical device) is one object shared by every thread. Workers that re-seed it concurrently
interleave, and a dropout mask then depends on timing. So a layer that draws random numbers runs
with the generator re-seeded from (base seed, step, call, layer, microbatch) while holding the one
lock that guards every generator. The seed does not depend on the device, so masks are the same for any
device count, and a recompute replays the forward's masks exactly. Layers that draw no random
numbers (the common case) never take the lock, so they run concurrently.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

# Guards every default generator, the CPU one and each GPU's: it serialises the random layers of all
# devices (a random layer on one GPU waits for one on another), which keeps the code simple and costs
# little because layers that draw no random numbers never take it. Like the generators it guards, it is
# process-global: two engines in one process share them.
_GENERATOR_LOCK = threading.Lock()
_recomputing = threading.local()  # per thread: set while that thread's backward stage recomputes

_MASK64 = (1 << 64) - 1


def _mix(value: int) -> int:
    # splitmix64 finaliser: nearby inputs give unrelated seeds
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def layer_seed(base_seed: int, step: int, call: int, layer: int, microbatch: int) -> int:
    """The seed of one layer on one microbatch; independent of devices and timing."""
    seed = _mix(base_seed & _MASK64)
    for part in (step, call, layer, microbatch):
        seed = _mix(seed ^ (part & _MASK64))
    return seed & ((1 << 63) - 1)


def draws_random_numbers(layer: nn.Module) -> bool:
    """Whether ``layer`` may draw random numbers now: one of its modules in training mode is a dropout
    module or sets ``roundpipe_random = True`` (for custom random ops)."""
    return any(
        module.training
        and (isinstance(module, nn.modules.dropout._DropoutNd) or getattr(module, "roundpipe_random", False))
        for module in layer.modules()
    )


@contextmanager
def seeded(seed: int, device: torch.device) -> Iterator[None]:
    """Run the block with ``device``'s generator seeded to ``seed``; restore it afterwards."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        generator = torch.cuda.default_generators[index]
    else:
        generator = torch.default_generator
    with _GENERATOR_LOCK:
        saved = generator.get_state()
        generator.manual_seed(seed)
        try:
            yield
        finally:
            generator.set_state(saved)


def is_recomputing() -> bool:
    """True while a backward stage re-runs a layer's forward. User code can skip side effects then."""
    return getattr(_recomputing, "active", False)


@contextmanager
def recomputing() -> Iterator[None]:
    previous = is_recomputing()
    _recomputing.active = True
    try:
        yield
    finally:
        _recomputing.active = previous
