"""Typed engine options, validated when constructed so that a bad value fails before any thread starts."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from lightning_roundpipe.planning.partition import Plan

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: int | str | None, option: str = "device_memory_limit") -> int | None:
    """``20GiB``, ``"512 MB"`` or an int number of bytes; ``None`` means no limit."""
    if value is None or isinstance(value, int) and not isinstance(value, bool):
        if value is not None and value <= 0:
            raise ValueError(f"`{option}` must be positive, got {value}")
        return value
    if isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        if match and match.group(2).lower() in _UNITS:
            parsed = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
            if parsed > 0:
                return parsed
    raise ValueError(
        f"`{option}` must be a positive number of bytes or a string such as '20GiB' or '512MB', got {value!r}"
    )


@dataclass
class EngineOptions:
    """How the RoundPipe engine runs. Every field has a safe default."""

    num_microbatches: int | None = None
    """Microbatches per trunk call (M). ``None``: number of devices + 1, which keeps every device busy
    in the steady state. Set it explicitly for results that do not depend on the device count."""

    num_stages: Literal["auto"] | int | Plan = "auto"
    """The chunk count: the number of *forward* stages. ``"auto"`` sizes stages from per-layer costs
    (bytes first, measured times later); an ``int`` splits the non-fused layers into that many forward
    stages and derives the (smaller) backward stages; a :class:`~lightning_roundpipe.planning.partition.Plan`
    fixes the partition exactly."""

    async_step: bool = False
    """``False`` (sync): exact, identical to plain training. ``True``: the paper's one-step-stale update,
    iteration k runs on W(k-2) and W(k) = step(W(k-1), g(k)), so the host step overlaps device work."""

    recompute: Literal["stage", "layer"] = "stage"
    """Recomputation grain of backward stages: ``"stage"`` keeps one input per backward stage, ``"layer"``
    keeps every layer's input (less device memory, more host traffic)."""

    pin_memory: bool = True
    """Pin host staging buffers (CUDA only; ignored on CPU devices)."""

    device_memory_limit: int | str | None = None
    """Per-device memory budget in bytes or as ``"20GiB"``: stage parameters, gradients and buffers,
    plus the stage-boundary activations in flight. The planner fits two stages (running and prefetched)
    in three quarters of it and leaves the rest to activations. On CPU devices this is the simulated
    budget that the residency accounting enforces. ``None``: unlimited on CPU."""

    freeze_plan: bool = False
    """Keep the first plan: never replan from measured times (deterministic timelines)."""

    replan_hysteresis: float = 0.1
    """Adopt a new plan only when its predicted iteration time is this fraction better."""

    seed: int | None = None
    """Base seed for per-(step, call, layer, microbatch) randomness. ``None``: ``torch.initial_seed()``."""

    record_timeline: bool = False
    """Record (device, job, microbatch, kind, start, end) events; read them with ``engine.timeline``."""

    jitter: float = 0.0
    """Test mode: CPU stand-in streams sleep up to this many seconds before each operation, so an
    ordering bug (a missing wait) shows up on CPU instead of only on a GPU."""

    wait_timeout: float = 600.0
    """Seconds any internal wait may block before the engine gives up with an error instead of hanging."""

    def __post_init__(self) -> None:
        if self.num_microbatches is not None and (
            not isinstance(self.num_microbatches, int) or self.num_microbatches < 1
        ):
            raise ValueError(f"`num_microbatches` must be a positive int or None, got {self.num_microbatches!r}")
        if not (self.num_stages == "auto" or isinstance(self.num_stages, Plan) or (
            isinstance(self.num_stages, int) and not isinstance(self.num_stages, bool) and self.num_stages >= 1
        )):
            raise ValueError(
                f"`num_stages` must be 'auto', a positive int (the number of forward stages) or a Plan, "
                f"got {self.num_stages!r}"
            )
        if self.recompute not in ("stage", "layer"):
            raise ValueError(f"`recompute` must be 'stage' or 'layer', got {self.recompute!r}")
        self.device_memory_limit = parse_bytes(self.device_memory_limit)
        if self.replan_hysteresis < 0:
            raise ValueError(f"`replan_hysteresis` must be >= 0, got {self.replan_hysteresis}")
        if self.jitter < 0:
            raise ValueError(f"`jitter` must be >= 0 seconds, got {self.jitter}")
        if self.wait_timeout <= 0:
            raise ValueError(f"`wait_timeout` must be > 0 seconds, got {self.wait_timeout}")

    def microbatches_for(self, num_devices: int) -> int:
        return self.num_microbatches if self.num_microbatches is not None else num_devices + 1
