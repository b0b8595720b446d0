"""Stage partitions: which layers each forward, fused and backward stage holds.

Pure module (no torch, no threads): per-layer costs and a memory budget in, a :class:`Plan` out.

Why not just "equal layers per stage": a backward stage recomputes its forward and then
back-propagates (about 3x a forward), and the LM head is often the heaviest indivisible layer.
Equal-cost stages therefore need *different* forward and backward partitions (forward stages
hold about 3x more layers) and a stage-time bound near the heaviest layer. ``plan_chunks`` turns a
user-chosen forward stage count into such a plan; ``plan_auto`` also picks the count.

Costs: a forward stage costs the sum of its layers' ``forward``; the fused stage and a (recomputing)
backward stage cost the sum of ``forward + backward``. Memory: a forward stage needs its layers'
``param_bytes`` on the device, the fused and backward stages ``param_bytes + grad_bytes``; each must
fit in half of the memory budget, because one stage runs while the next one is prefetched.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class LayerCost:
    """What one layer costs, per microbatch.

    ``forward`` is the forward time; ``backward`` the backward time *excluding* recomputation, so a
    recomputing backward stage costs ``forward + backward`` per layer and the fused stage (never
    recomputed) costs ``forward + backward`` too. ``param_bytes`` is what uploading the layer costs
    in device memory; ``grad_bytes`` the extra bytes its trainable parameters' gradients take in a
    backward stage.
    """

    forward: float
    backward: float
    param_bytes: int = 0
    grad_bytes: int = 0


@dataclass(frozen=True)
class Plan:
    """A partition of ``num_layers`` layers into stages.

    ``forward`` covers layers ``[0, fused.start)`` in ascending order; ``fused`` is the deepest run
    of layers ``[fused.start, num_layers)``, run forward, loss and backward back to back; ``backward``
    covers ``[0, fused.start)`` listed deep to shallow (``backward[0]`` ends at ``fused.start``).
    A plan whose fused stage holds every layer has no forward and no backward stages.
    """

    forward: tuple[range, ...]
    fused: range
    backward: tuple[range, ...]

    @property
    def num_layers(self) -> int:
        return self.fused.stop

    @property
    def num_stages(self) -> int:
        """Stage jobs per training iteration: forward stages, the fused stage, backward stages."""
        return len(self.forward) + 1 + len(self.backward)

    def validate(self, num_layers: int) -> None:
        """Raise ``ValueError`` unless the plan covers ``num_layers`` layers exactly, in order."""
        if self.fused.stop != num_layers or self.fused.step != 1 or len(self.fused) == 0:
            raise ValueError(
                f"the fused stage must be a non-empty run of the deepest layers ending at layer "
                f"{num_layers}, got {self.fused}"
            )
        _check_cover(self.forward, self.fused.start, "forward")
        _check_cover(tuple(reversed(self.backward)), self.fused.start, "backward")

    @staticmethod
    def from_sizes(forward: list[int] | tuple[int, ...], fused: int, backward: list[int] | tuple[int, ...]) -> Plan:
        """Build a plan from layers per stage: ``forward`` shallow to deep, ``backward`` deep to shallow."""
        fwd: list[range] = []
        start = 0
        for size in forward:
            fwd.append(range(start, start + size))
            start += size
        fused_range = range(start, start + fused)
        bwd: list[range] = []
        stop = start
        for size in backward:
            bwd.append(range(stop - size, stop))
            stop -= size
        plan = Plan(tuple(fwd), fused_range, tuple(bwd))
        plan.validate(start + fused)
        return plan


def _check_cover(stages: tuple[range, ...], end: int, what: str) -> None:
    position = 0
    for stage in stages:
        if stage.step != 1 or stage.start != position or len(stage) == 0:
            raise ValueError(
                f"{what} stages must be non-empty contiguous runs covering layers [0, {end}) in order; "
                f"stage {stage} starts at {stage.start}, expected {position}"
            )
        position = stage.stop
    if position != end:
        raise ValueError(f"{what} stages cover layers [0, {position}), expected [0, {end})")


# Stage sums are accumulated in different orders (deep to shallow, shallow to deep), so "fits under
# W" allows a rounding-sized slack; otherwise a candidate W equal to a run's sum could cut it.
_SLACK = 1e-9


def _fits(total: float, limit: float) -> bool:
    return total <= limit + _SLACK * abs(limit)


def _stage_cap(costs: Sequence[LayerCost], memory_budget: int | None) -> float:
    """Bytes one stage may use: half the budget (the other half holds the next stage's prefetch)."""
    if memory_budget is None:
        return math.inf
    if memory_budget <= 0:
        raise ValueError(f"memory_budget must be positive or None (unlimited), got {memory_budget}")
    cap = memory_budget / 2
    for i, c in enumerate(costs):
        # Every layer sits in a backward or the fused stage, so its gradients must fit too.
        need = c.param_bytes + c.grad_bytes
        if need > cap:
            raise ValueError(
                f"layer {i} needs {need} bytes on a device (parameters + gradients) but a stage may "
                f"use at most {memory_budget // 2} bytes, half of the memory budget of {memory_budget} bytes (the "
                f"other half holds the next stage's prefetch); raise `device_memory_limit` or split "
                f"the layer"
            )
    return cap


def _greedy(order: Sequence[int], time: Sequence[float], size: Sequence[int], w: float, cap: float) -> list[range]:
    """Pack layers in ``order`` into stages, closing a stage when the next layer would break ``w`` or
    ``cap``; every stage gets at least one layer. Returns ascending ranges in packing order."""
    groups: list[list[int]] = []
    t = b = 0.0
    for i in order:
        if not groups or not (_fits(t + time[i], w) and b + size[i] <= cap):
            groups.append([])
            t = b = 0.0
        groups[-1].append(i)
        t, b = t + time[i], b + size[i]
    return [range(min(g), max(g) + 1) for g in groups]


def _run_sums(seq: Sequence[float], lo: float, hi: float) -> set[float]:
    """Sums of contiguous runs of ``seq`` lying in ``[lo, hi]``."""
    out = set()
    for a in range(len(seq)):
        total = 0.0
        for x in seq[a:]:
            total += x
            if total > hi:
                break  # costs are non-negative, so longer runs only grow
            if total >= lo:
                out.add(total)
    return out


def _split(costs: Sequence[LayerCost]) -> tuple[list[float], list[float], list[int], list[int]]:
    """Per-layer forward time, forward+backward time, forward bytes, backward bytes (validated)."""
    if not costs:
        raise ValueError("cannot partition a model with no layers")
    for i, c in enumerate(costs):
        if not all(math.isfinite(v) and v >= 0 for v in (c.forward, c.backward, c.param_bytes, c.grad_bytes)):
            raise ValueError(f"layer {i} has a negative or non-finite cost: {c}")
    fwd = [c.forward for c in costs]
    both = [c.forward + c.backward for c in costs]
    return fwd, both, [c.param_bytes for c in costs], [c.param_bytes + c.grad_bytes for c in costs]


def costs_from_bytes(
    param_bytes: Sequence[int], grad_bytes: Sequence[int] | None = None, backward_ratio: float = 2.0
) -> list[LayerCost]:
    """First cost estimate, before anything is measured: time proportional to size.

    ``forward = param_bytes`` (in "byte" time units) and ``backward = backward_ratio * forward``, so a
    recomputing backward stage costs ``(1 + backward_ratio)`` times its forward. A layer with no
    parameters is not free: it gets 1% of the mean layer size (1 if every layer has 0 bytes).
    ``grad_bytes=None`` means every parameter is trainable with a gradient as large as itself.
    """
    if grad_bytes is None:
        grad_bytes = param_bytes
    if len(grad_bytes) != len(param_bytes):
        raise ValueError(f"got {len(param_bytes)} param_bytes but {len(grad_bytes)} grad_bytes")
    if backward_ratio < 0 or any(b < 0 for b in (*param_bytes, *grad_bytes)):
        raise ValueError("byte counts and backward_ratio must be non-negative")
    mean = sum(param_bytes) / len(param_bytes) if param_bytes else 0.0
    floor = 0.01 * mean if mean > 0 else 1.0
    out = []
    for p, g in zip(param_bytes, grad_bytes):
        forward = float(p) if p > 0 else floor
        out.append(LayerCost(forward, backward_ratio * forward, int(p), int(g)))
    return out


def _check_num_stages(num_stages: object, num_layers: int) -> None:
    most = num_layers - 1 if num_layers > 1 else math.inf  # one layer: fused only, count ignored
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or not 1 <= num_stages <= most:
        valid = f"1 to {most}" if num_layers > 1 else "at least 1 (ignored)"
        raise ValueError(
            f"num_stages={num_stages!r} is out of range: a model of {num_layers} layers (the last one "
            f"forms the fused stage) has {valid} forward stages; set `num_stages` in that range or "
            f"to 'auto'"
        )


def _min_max_split(fwd: Sequence[float], size: Sequence[int], k: int, cap: float) -> list[range]:
    """Exactly ``k`` contiguous stages over ``fwd`` minimising the largest stage sum, within ``cap``.

    The optimum is one of the O(L^2) run sums; binary search over them with a greedy feasibility test
    (greedy is optimal for "fewest stages under a bound"). Then cut from the deep end, forcing cuts
    once the layers left only just cover the stages left, so there are exactly ``k``.
    """
    m = len(fwd)
    sums = sorted(_run_sums(fwd, 0.0, math.inf))
    need = len(_greedy(range(m), fwd, size, math.inf, cap))
    if need > k:
        raise ValueError(
            f"num_stages={k} is too few: the memory budget needs at least {need} forward stages; raise "
            f"`num_stages` (at most {m}) or `device_memory_limit`"
        )
    # The stage count greedy needs falls as the bound grows: find the first bound that needs <= k.
    bound = sums[bisect.bisect_left(sums, True, key=lambda w: len(_greedy(range(m), fwd, size, w, cap)) <= k)]
    stages: list[range] = []
    stop, t, b = m, 0.0, 0
    for i in reversed(range(m)):
        left_after = k - len(stages) - 1  # stages still to open once the current one closes
        if stop - i > 1 and (i + 1 == left_after or not (_fits(t + fwd[i], bound) and b + size[i] <= cap)):
            stages.append(range(i + 1, stop))
            stop, t, b = i + 1, 0.0, 0
        t, b = t + fwd[i], b + size[i]
    stages.append(range(0, stop))
    return stages[::-1]


def plan_chunks(costs: Sequence[LayerCost], num_stages: int, *, memory_budget: int | None = None) -> Plan:
    """The plan for a user-chosen chunk count.

    ``num_stages`` is the number of FORWARD stages. The fused stage is the last layer alone (the
    deepest layer, typically the head and loss). Layers ``[0, L-1)`` are split into ``num_stages``
    contiguous forward stages minimising the largest stage forward cost (exact linear partition).
    Then ``W = max(largest forward stage cost, fused stage cost fwd+bwd, largest single-layer
    fwd+bwd)`` and backward stages are packed greedily from layer 0 upwards so that each holds
    layers whose summed ``forward + backward`` is at most ``W`` (at least one layer each; a short
    remainder lands at the deep end). Backward stages thus hold about 1/3 the layers of forward
    stages. With ``memory_budget`` every stage also fits in half of it. With one layer the plan is
    the fused stage alone and ``num_stages`` (any value >= 1) is ignored.

    Raises ``ValueError`` when ``num_stages`` is not in ``[1, L-1]`` or memory needs more stages.
    """
    fwd, both, fsize, bsize = _split(costs)
    n = len(costs)
    _check_num_stages(num_stages, n)
    cap = _stage_cap(costs, memory_budget)
    if n == 1:
        return Plan((), range(0, 1), ())
    forward = _min_max_split(fwd[:-1], fsize, num_stages, cap)
    w = max(max(sum(fwd[i] for i in s) for s in forward), max(both))
    backward = _greedy(range(n - 1), both, bsize, w, cap)[::-1]
    return Plan(tuple(forward), range(n - 1, n), tuple(backward))


def _auto_for(fwd: list[float], both: list[float], fsize: list[int], bsize: list[int], w: float, cap: float) -> Plan:
    n = len(fwd)
    start, t, b = n - 1, both[-1], bsize[-1]  # the fused stage holds at least the last layer
    while start > 0 and _fits(t + both[start - 1], w) and b + bsize[start - 1] <= cap:
        start -= 1
        t, b = t + both[start], b + bsize[start]
    # Forward from the deep end (short remainder at layer 0, which often holds a light embedding);
    # backward from layer 0 upwards and listed deep to shallow (remainder at the deep end).
    forward = _greedy(range(start - 1, -1, -1), fwd, fsize, w, cap)[::-1]
    backward = _greedy(range(start), both, bsize, w, cap)[::-1]
    return Plan(tuple(forward), range(start, n), tuple(backward))


def plan_auto(
    costs: Sequence[LayerCost],
    *,
    num_devices: int,
    memory_budget: int | None = None,
    upper_threshold: float = 1.1,
) -> Plan:
    """Choose the stage count and partition, the way the RoundPipe planner does.

    ``Wmax`` is the heaviest indivisible unit: the largest per-layer ``forward`` and
    ``forward + backward``. Candidate stage-time bounds ``W`` are ``Wmax`` and every sum of a
    contiguous run of per-layer ``forward`` or ``forward + backward`` costs in
    ``[Wmax, upper_threshold * Wmax]``. For each ``W``: the fused stage peels the deepest layers while
    their ``forward + backward`` stays within ``W`` and memory (at least the last layer); forward
    stages are packed greedily from the deep end toward layer 0; backward stages greedily from
    layer 0 upward. The plan minimising ``max(num_stages, num_devices) * W`` (the padded work of one
    iteration: fewer stages than devices leave devices idle) wins; ties go to fewer stages.
    O(L^2) candidates x O(L) packing.
    """
    if num_devices < 1 or upper_threshold < 1:
        raise ValueError(f"need num_devices >= 1 and upper_threshold >= 1, got {num_devices}, {upper_threshold}")
    fwd, both, fsize, bsize = _split(costs)
    cap = _stage_cap(costs, memory_budget)
    wmax = max(max(fwd), max(both))
    hi = upper_threshold * wmax
    candidates = {wmax} | _run_sums(fwd, wmax, hi) | _run_sums(both, wmax, hi)
    best: tuple[float, int, Plan] = (math.inf, 0, Plan((), range(0), ()))
    for w in sorted(candidates):
        plan = _auto_for(fwd, both, fsize, bsize, w, cap)
        cost = max(plan.num_stages, num_devices) * w
        if (cost, plan.num_stages) < best[:2]:
            best = (cost, plan.num_stages, plan)
    return best[2]


def predicted_cost(plan: Plan, costs: Sequence[LayerCost], num_devices: int) -> float:
    """``max(num_stages, num_devices) * (slowest stage)``: the padded work of one iteration."""
    fwd, both, _, _ = _split(costs)
    slowest = max(
        [sum(fwd[i] for i in s) for s in plan.forward] + [sum(both[i] for i in s) for s in (plan.fused, *plan.backward)]
    )
    return max(plan.num_stages, num_devices) * slowest


class Planner:
    """Holds the current plan between iterations and re-plans from measured costs.

    ``mode``: ``"auto"`` (:func:`plan_auto`), an int (:func:`plan_chunks` with that many forward
    stages, re-balanced on replan) or an explicit :class:`Plan` (used as is, never changed).
    Measured costs are smoothed per layer by an exponential moving average (``smoothing`` is the
    weight of the past), bias-corrected like Adam's moments so early estimates are not pulled toward
    zero. The first observation is discarded: it includes one-off warm-up (allocator, kernel
    selection, caches). Byte counts always come from :meth:`initial`.
    """

    def __init__(
        self,
        mode: Literal["auto"] | int | Plan,
        num_layers: int,
        num_devices: int,
        *,
        memory_budget: int | None = None,
        hysteresis: float = 0.1,
        frozen: bool = False,
        smoothing: float = 0.9,
    ) -> None:
        if num_layers < 1 or num_devices < 1:
            raise ValueError(f"need num_layers >= 1 and num_devices >= 1, got {num_layers}, {num_devices}")
        if not 0 <= smoothing < 1 or hysteresis < 0:
            raise ValueError(f"need 0 <= smoothing < 1 and hysteresis >= 0, got {smoothing}, {hysteresis}")
        if isinstance(mode, Plan):
            try:
                mode.validate(num_layers)
            except ValueError as err:
                raise ValueError(
                    f"`num_stages` is an explicit plan that does not fit the model's {num_layers} "
                    f"layers: {err}"
                ) from None
        elif mode != "auto":
            _check_num_stages(mode, num_layers)
        self.mode, self.num_layers, self.num_devices = mode, num_layers, num_devices
        self.memory_budget, self.hysteresis, self.frozen, self.smoothing = memory_budget, hysteresis, frozen, smoothing
        self._plan: Plan | None = mode if isinstance(mode, Plan) else None
        self._bytes: list[tuple[int, int]] | None = None
        self._ema: list[tuple[float, float]] = []
        self._seen = 0  # observations, the discarded warm-up included

    def _make(self, costs: Sequence[LayerCost]) -> Plan:
        if isinstance(self.mode, Plan):
            return self.mode
        if self.mode == "auto":
            return plan_auto(costs, num_devices=self.num_devices, memory_budget=self.memory_budget)
        return plan_chunks(costs, self.mode, memory_budget=self.memory_budget)

    def _check_len(self, costs: Sequence[LayerCost]) -> None:
        if len(costs) != self.num_layers:
            raise ValueError(f"got costs for {len(costs)} layers, the model has {self.num_layers}")

    def initial(self, costs: Sequence[LayerCost]) -> Plan:
        """Plan from first estimates (usually :func:`costs_from_bytes`) and remember the byte counts."""
        self._check_len(costs)
        self._bytes = [(c.param_bytes, c.grad_bytes) for c in costs]
        self._plan = self._make(costs)
        return self._plan

    @property
    def plan(self) -> Plan:
        if self._plan is None:
            raise RuntimeError("Planner.initial() must be called before the plan is read")
        return self._plan

    def observe(self, measured: Sequence[LayerCost]) -> None:
        """Fold one iteration's measured per-layer times into the smoothed estimate."""
        self._check_len(measured)
        self._seen += 1
        if self._seen == 1:
            return  # warm-up iteration
        a = self.smoothing
        if not self._ema:
            self._ema = [(0.0, 0.0)] * self.num_layers
        self._ema = [(a * f + (1 - a) * m.forward, a * b + (1 - a) * m.backward) for (f, b), m in zip(self._ema, measured)]

    @property
    def estimate(self) -> list[LayerCost] | None:
        """The bias-corrected smoothed costs, or ``None`` before the first post-warm-up observation."""
        if not self._ema or self._bytes is None:
            return None
        norm = 1 - self.smoothing ** (self._seen - 1)
        return [LayerCost(f / norm, b / norm, p, g) for (f, b), (p, g) in zip(self._ema, self._bytes)]

    def replan(self) -> bool:
        """Between iterations only: adopt a plan built from the smoothed costs if its
        :func:`predicted_cost` beats the current plan's (under the same costs) by more than
        ``hysteresis`` (a fraction), so noise does not make the partition flap. Returns whether the
        plan changed."""
        costs = self.estimate
        if self.frozen or isinstance(self.mode, Plan) or costs is None or self._plan is None:
            return False
        candidate = self._make(costs)
        if candidate == self._plan:
            return False
        now = predicted_cost(self._plan, costs, self.num_devices)
        if predicted_cost(candidate, costs, self.num_devices) < now * (1 - self.hysteresis):
            self._plan = candidate
            return True
        return False
