"""Deterministic randomness for recomputation, and ``is_recomputing()`` for user code.

Why not just save and restore the RNG state around each layer: torch's CPU generator (and CUDA's,
per physical device) is one object shared by every thread. Workers that re-seed it concurrently
interleave, and a dropout mask then depends on timing. So a layer that draws random numbers draws from a
generator seeded from (base seed, step, call, layer, microbatch). The seed does not depend on the device,
so masks are the same for any device count, and a recompute replays the forward's masks exactly.

* On a GPU the layer runs with that device's generator re-seeded, holding the one lock that guards every
  generator (CUDA's fused dropout takes no generator argument). Layers that draw no random numbers (the
  common case) never take the lock, so they run concurrently.
* On a CPU stand-in a lock is not enough: the main thread draws from torch's CPU generator too, without it
  (a ``DataLoader`` draws a seed for every epoch's iterator, a sampler shuffles), and would both change a
  worker's masks and have its own numbers changed by a worker's re-seeding, depending on timing. So the
  layer's random operations get a private generator instead (:class:`_PrivateGenerator`, a dispatch mode,
  which is per thread), seeded with the same seed, which draws the same numbers; torch's own generator
  is never touched there.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

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


def mixed_seed(base_seed: int, *parts: int) -> int:
    """A seed for the random numbers of ``parts`` (step, layer, ...): each part mixed in turn (splitmix64), so
    nearby inputs give unrelated seeds; a non-negative 63-bit integer, as ``Generator.manual_seed`` takes."""
    seed = _mix(base_seed & _MASK64)
    for part in parts:
        seed = _mix(seed ^ (part & _MASK64))
    return seed & ((1 << 63) - 1)


def layer_seed(base_seed: int, step: int, call: int, layer: int, microbatch: int) -> int:
    """The seed of one layer on one microbatch; independent of devices and timing."""
    return mixed_seed(base_seed, step, call, layer, microbatch)


def module_draws_random_numbers(module: nn.Module) -> bool:
    """Whether ``module`` itself (not its children) may draw random numbers now: it is a dropout module in
    training mode, or in training mode and sets ``roundpipe_random = True`` (for custom random ops). A layer
    draws them if any of its modules does."""
    return module.training and (isinstance(module, nn.modules.dropout._DropoutNd)
                                or getattr(module, "roundpipe_random", False))


@contextmanager
def seeded(seed: int, device: torch.device) -> Iterator[None]:
    """Run the block with its random numbers drawn from a generator seeded to ``seed``: ``device``'s own,
    re-seeded and restored afterwards, on a GPU; a private one on a CPU stand-in (see the module note)."""
    if device.type != "cuda":
        with _PrivateGenerator(torch.Generator().manual_seed(seed)):
            yield
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _reseeded(torch.cuda.default_generators[index], seed):
        yield


@contextmanager
def _reseeded(generator: torch.Generator, seed: int) -> Iterator[None]:
    with _GENERATOR_LOCK:
        saved = generator.get_state()
        generator.manual_seed(seed)
        try:
            yield
        finally:
            generator.set_state(saved)


class _PrivateGenerator(TorchDispatchMode):
    """On this thread, random operations that take a ``generator`` argument and were given none draw from
    ``generator``. The few that take none (``native_dropout``, the fused attention kernels) run directly when
    told to draw nothing (a dropout probability of 0), else with torch's CPU generator in ``generator``'s state,
    under the lock, which then goes back into ``generator``: the same numbers as one generator would draw (only
    there can the main thread's draws still interleave)."""

    def __init__(self, generator: torch.Generator) -> None:
        super().__init__()
        self.generator = generator

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded not in func.tags or kwargs.get("generator") is not None:
            return func(*args, **kwargs)
        if _takes_generator(func):
            return func(*args, **{**kwargs, "generator": self.generator})
        if _draws_nothing(func, args, kwargs):
            return func(*args, **kwargs)
        shared = torch.default_generator
        with _GENERATOR_LOCK:
            saved = shared.get_state()
            shared.set_state(self.generator.get_state())
            try:
                return func(*args, **kwargs)
            finally:
                self.generator.set_state(shared.get_state())
                shared.set_state(saved)


_TAKES_GENERATOR: dict[Any, bool] = {}
_DROPOUT_ARGUMENTS = ("dropout_p", "dropout", "p")


def _draws_nothing(func: Any, args: Any, kwargs: Any) -> bool:
    """A random operation without a generator argument that is told to draw nothing: a dropout probability
    of 0 (attention kernels run so on every call) or ``train=False``."""
    for position, argument in enumerate(func._schema.arguments):
        if position < len(args):
            value = args[position]
        elif argument.name in kwargs:
            value = kwargs[argument.name]
        elif argument.has_default_value():
            value = argument.default_value
        else:
            continue
        if (argument.name in _DROPOUT_ARGUMENTS and value == 0) or (argument.name == "train" and value is False):
            return True
    return False


def _takes_generator(func: Any) -> bool:
    known = _TAKES_GENERATOR.get(func)
    if known is None:
        known = _TAKES_GENERATOR[func] = any(argument.name == "generator" for argument in func._schema.arguments)
    return known


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
