"""Stage partitions: which layers each forward, fused and backward stage holds.

Pure module (no torch, no threads): per-layer costs and a memory budget in, a :class:`Plan` out.

Why not just "equal layers per stage": a backward stage recomputes its forward and then
back-propagates (about 3x a forward), and the LM head is often the heaviest indivisible layer.
Equal-cost stages therefore need *different* forward and backward partitions (forward stages
hold about 3x more layers) and a stage-time bound near the heaviest layer. ``plan_chunks`` turns a
user-chosen forward stage count into such a plan; ``plan_auto`` also picks the count. Once the counts
are fixed, both partitions are balanced: the largest stage as small as possible, then the stages as
even as possible with the lighter ones at the shallow end (no short leftover stage).

Costs: a forward stage costs the sum of its layers' ``forward``; the fused stage and a (recomputing)
backward stage cost the sum of ``forward + backward``. Every job also has a fixed cost whatever its size
(``job_cost``: binding its replicas, the hand-offs between the streams that move its inputs and outputs);
``plan_auto`` weighs it against the padded work, so that where it matters (one device, small layers) the
plan has fewer, larger stages. Memory: a forward stage needs its layers'
``param_bytes`` on the device, the fused and backward stages ``param_bytes + grad_bytes +
activation_bytes`` (what their compute keeps for backward); each must fit in half of the memory budget,
because one stage runs while the next one is prefetched.
"""

from __future__ import annotations

import bisect
import contextlib
import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True)
class LayerCost:
    """What one layer costs, per microbatch.

    ``forward`` is the forward time; ``backward`` the backward time *excluding* recomputation, so a
    recomputing backward stage costs ``forward + backward`` per layer and the fused stage (never
    recomputed) costs ``forward + backward`` too. ``param_bytes`` is what uploading the layer costs
    in device memory; ``grad_bytes`` the extra bytes its trainable parameters' gradients take in a
    backward stage; ``activation_bytes`` what its compute keeps for backward per microbatch in a fused or
    backward stage (saved activations, autocast's weight copies), which the stage holds on top (summed over
    its layers: with ``recompute="layer"`` that is an upper bound).
    """

    forward: float
    backward: float
    param_bytes: int = 0
    grad_bytes: int = 0
    activation_bytes: int = 0


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

    def sizes(self) -> dict[str, Any]:
        """Layers per stage as plain values (for checkpoints): ``Plan.from_sizes(**plan.sizes()) == plan``."""
        return {"forward": [len(stage) for stage in self.forward], "fused": len(self.fused),
                "backward": [len(stage) for stage in self.backward]}


def format_layers(layers: range) -> str:
    """A run of layers as people read it, inclusive: ``[3-5]``, ``[7]``, or ``[]`` when empty."""
    if len(layers) == 0:
        return "[]"
    return f"[{layers.start}]" if len(layers) == 1 else f"[{layers.start}-{layers.stop - 1}]"


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
        # Every layer sits in a backward or the fused stage, so its gradients and activations must fit too.
        need = c.param_bytes + c.grad_bytes + c.activation_bytes
        if need > cap:
            raise ValueError(
                f"layer {i} needs {need} bytes on a device (parameters + gradients"
                f"{' + activations kept for backward' if c.activation_bytes else ''}) but a stage may "
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
        values = (c.forward, c.backward, c.param_bytes, c.grad_bytes, c.activation_bytes)
        if not all(math.isfinite(v) and v >= 0 for v in values):
            raise ValueError(f"layer {i} has a negative or non-finite cost: {c}")
    fwd = [c.forward for c in costs]
    both = [c.forward + c.backward for c in costs]
    return (fwd, both, [c.param_bytes for c in costs],
            [c.param_bytes + c.grad_bytes + c.activation_bytes for c in costs])


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
    for p, g in zip(param_bytes, grad_bytes, strict=True):
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


def _min_max_bound(
    t: Sequence[float], size: Sequence[int], k: int, cap: float, what: str, hi: float = math.inf
) -> float:
    """The smallest possible largest stage sum when ``t`` is cut into ``k`` contiguous stages within
    ``cap``. It is one of the run sums between the heaviest layer and ``hi`` (a bound the caller
    knows to be feasible, else all of them): binary search over them with a greedy feasibility test
    (greedy is optimal for "fewest stages under a bound")."""
    m = len(t)
    need = len(_greedy(range(m), t, size, math.inf, cap))
    if need > k:
        raise ValueError(
            f"num_stages={k} is too few: the memory budget needs at least {need} {what} stages; raise "
            f"`num_stages` (at most {m}) or `device_memory_limit`"
        )

    def feasible(w: float) -> bool:
        return len(_greedy(range(m), t, size, w, cap)) <= k

    # Widened by the slack: greedy under ``hi`` may have packed a stage a rounding error above it.
    sums = sorted(_run_sums(t, max(t), hi + 2 * _SLACK * abs(hi)))
    if not sums or not feasible(sums[-1]):
        sums = sorted(_run_sums(t, 0.0, math.inf))
    # The stage count greedy needs falls as the bound grows: find the first bound that needs <= k.
    return sums[bisect.bisect_left(sums, True, key=feasible)]


def _balanced_split(
    t: Sequence[float], size: Sequence[int], k: int, cap: float, what: str = "forward", hi: float = math.inf
) -> list[range]:
    """Exactly ``k`` contiguous stages over ``t`` (ascending), as even as possible, within ``cap``.

    First the largest stage sum is minimised, exactly (:func:`_min_max_bound`; ``hi``, a feasible
    bound the caller knows, narrows the search). Under that bound the stages are cut from layer 0
    upward, each taking the layers whose sum stays within its fair share, ``(cost left) / (stages
    left)``, but at least as many as keep the rest feasible and at most what the bound, ``cap`` and
    the stages left allow. Rounding down puts the lighter stages at the shallow end, as the reference
    planner's partitions do (32 equal layers in 6 stages: ``5,5,5,5,6,6``; 28 in 10: ``2,2,3,...,3``):
    a light first forward stage shortens the pipeline fill and a light last (shallowest) backward
    stage the drain. O(L) after the bound.
    """
    m = len(t)
    bound = _min_max_bound(t, size, k, cap, what, hi)
    # deep[j]: the lowest start from which layers [start, m) fit in j stages (greedy from the deep
    # end covers the most), so a cut at c leaves a feasible rest of j stages iff c >= deep[j].
    deep = [m]
    pos = m
    for _ in range(k):
        if pos > 0:  # one stage: at least one layer, then as many as fit
            pos -= 1
            acc, b = t[pos], size[pos]
            while pos > 0 and _fits(acc + t[pos - 1], bound) and b + size[pos - 1] <= cap:
                pos -= 1
                acc, b = acc + t[pos], b + size[pos]
        deep.append(pos)
    prefix = [0.0]
    for x in t:
        prefix.append(prefix[-1] + x)
    stages: list[range] = []
    start = 0
    for left in range(k, 1, -1):  # stages still to cut, this one included
        # The cut lies in [first, last]: the rest stays feasible and keeps a layer per stage. Such a
        # cut exists whenever [start, m) fits in ``left`` stages, which the previous cut ensured.
        first, last = max(start + 1, deep[left - 1]), m - (left - 1)
        share = (prefix[m] - prefix[start]) / left
        end, acc, b = first, 0.0, 0
        for i in range(start, last):
            acc, b = acc + t[i], b + size[i]
            if not (_fits(acc, bound) and b <= cap) or (i + 1 > first and not _fits(acc, share)):
                break
            end = max(end, i + 1)
        stages.append(range(start, end))
        start = end
    stages.append(range(start, m))
    return stages


def plan_chunks(costs: Sequence[LayerCost], num_stages: int, *, memory_budget: int | None = None) -> Plan:
    """The plan for a user-chosen chunk count.

    ``num_stages`` is the number of FORWARD stages. The fused stage is the last layer alone (the
    deepest layer, typically the head and loss). Layers ``[0, L-1)`` are split into ``num_stages``
    contiguous forward stages minimising the largest stage forward cost (exact linear partition),
    then evened out (:func:`_balanced_split`: lighter stages shallow). With ``W = max(largest
    forward stage cost, largest single-layer fwd+bwd, the fused last layer included)``, the backward
    stage count is the fewest stages of summed ``forward + backward`` at most ``W`` each (at least
    one layer each), and the backward partition is balanced the same way at that count (listed deep
    to shallow, so its lighter stages come last). Backward stages thus hold about 1/3 the layers of
    forward stages. With ``memory_budget`` every stage also fits in half of it. With one layer the
    plan is the fused stage alone and ``num_stages`` (any value >= 1) is ignored.

    Raises ``ValueError`` when ``num_stages`` is not in ``[1, L-1]`` or memory needs more stages.
    """
    fwd, both, fsize, bsize = _split(costs)
    n = len(costs)
    _check_num_stages(num_stages, n)
    cap = _stage_cap(costs, memory_budget)
    if n == 1:
        return Plan((), range(0, 1), ())
    forward = _balanced_split(fwd[:-1], fsize[:-1], num_stages, cap)
    w = max(max(sum(fwd[i] for i in s) for s in forward), max(both))
    count = len(_greedy(range(n - 1), both, bsize, w, cap))
    backward = _balanced_split(both[:-1], bsize[:-1], count, cap, "backward", w)[::-1]
    return Plan(tuple(forward), range(n - 1, n), tuple(backward))


def _counts_for(
    fwd: list[float], both: list[float], fsize: list[int], bsize: list[int], w: float, cap: float
) -> tuple[int, int, int]:
    """Under bound ``w``: where the fused stage starts (it peels the deepest layers while their
    ``forward + backward`` fits, at least the last layer), and the fewest forward and backward
    stages that cover the rest within ``w`` (greedy packing)."""
    n = len(fwd)
    start, t, b = n - 1, both[-1], bsize[-1]
    while start > 0 and _fits(t + both[start - 1], w) and b + bsize[start - 1] <= cap:
        start -= 1
        t, b = t + both[start], b + bsize[start]
    return start, len(_greedy(range(start), fwd, fsize, w, cap)), len(_greedy(range(start), both, bsize, w, cap))


def plan_auto(
    costs: Sequence[LayerCost],
    *,
    num_devices: int,
    memory_budget: int | None = None,
    upper_threshold: float = 1.1,
    job_cost: float = 0.0,
) -> Plan:
    """Choose the stage counts the way the RoundPipe planner does, then balance the stages.

    ``Wmax`` is the heaviest indivisible unit: the largest per-layer ``forward`` and
    ``forward + backward``. Candidate stage-time bounds ``W`` are ``Wmax`` and every sum of a
    contiguous run of per-layer ``forward`` or ``forward + backward`` costs in
    ``[Wmax, upper_threshold * Wmax]``. Each ``W`` fixes a shape: the fused stage peels the deepest
    layers while their ``forward + backward`` stays within ``W`` and memory (at least the last
    layer), and the forward and backward stage counts are the fewest that cover the rest within
    ``W`` (greedy packing, as the reference). The shape minimising ``max(num_stages, num_devices) *
    W + num_stages * job_cost`` (the padded work of one iteration: fewer stages than devices leave
    devices idle; and each job's fixed cost, in the units of the costs) wins; ties go to fewer
    stages, then to the smaller ``W``. Its forward and backward partitions are then balanced at those
    counts (:func:`_balanced_split`: the largest stage minimised, lighter stages at the shallow end),
    which removes the short leftover stage greedy packing leaves.

    With ``job_cost == 0`` this is the reference planner. On several devices the window stays: it keeps
    the stages even and many enough to rotate over the ring, where the padded work is a fair model (a
    bound far above ``Wmax`` gives a few stages that fill the ring unevenly, which it does not see), and
    ``job_cost`` only weighs the shapes in it. On one device the stages run one after another, so the
    objective is the iteration's time exactly (the stage sums and the jobs' cost) and a positive
    ``job_cost`` opens every run sum above the window, as far as any could still win (``W + job_cost``
    below the best objective found): without a memory budget that is the fused stage alone (no plan's
    padded work is less: it recomputes nothing); with one, the fewest stages that fit it, as far as they
    pay. The shape changes only at a few bounds (each count and the fused stage's start fall as ``W``
    grows), so they are found by bisection, not packed one by one.

    Balancing does not change the choice: a shape's balanced slowest stage equals the smallest
    candidate ``W`` that gives the shape (that ``W`` is where a count dropped or the fused stage
    grew, so some optimal stage sum reaches it, and balancing never exceeds it), so the objective is
    the :func:`predicted_cost` of the plan returned. O(L^2) candidates, O(L) packing for O(L log L)
    of them.
    """
    if num_devices < 1 or upper_threshold < 1:
        raise ValueError(f"need num_devices >= 1 and upper_threshold >= 1, got {num_devices}, {upper_threshold}")
    if not (math.isfinite(job_cost) and job_cost >= 0):
        raise ValueError(f"job_cost must be finite and >= 0, got {job_cost}")
    fwd, both, fsize, bsize = _split(costs)
    cap = _stage_cap(costs, memory_budget)
    wmax = max(max(fwd), max(both))
    hi = upper_threshold * wmax
    best: tuple[float, int, float, tuple[int, int, int]] = (math.inf, 0, 0.0, (0, 0, 0))

    def consider(candidates: set[float]) -> None:
        nonlocal best
        for w, shape in _shape_starts(sorted(candidates), lambda w: _counts_for(fwd, both, fsize, bsize, w, cap)):
            stages = shape[1] + 1 + shape[2]
            cost = max(stages, num_devices) * w + stages * job_cost
            if (cost, stages) < best[:2]:
                best = (cost, stages, w, shape)

    consider({wmax} | _run_sums(fwd, wmax, hi) | _run_sums(both, wmax, hi))
    if job_cost > 0 and num_devices == 1:
        # any W' >= W costs at least W + job_cost (one stage at least): beyond that nothing wins
        reach = best[0] - job_cost
        if reach > hi:
            consider({w for w in _run_sums(fwd, hi, reach) | _run_sums(both, hi, reach) if w > hi})
    return _balanced_plan(fwd, both, fsize, bsize, *best[3], cap, best[2])


def _shape_starts(
    ws: Sequence[float], shape_of: Any
) -> list[tuple[float, tuple[int, int, int]]]:
    """``(w, shape_of(w))`` for the first ``w`` of each run of equal shapes along ascending ``ws``.

    Each part of a shape (the fused stage's start, the forward and the backward stage counts) never grows
    as ``w`` grows, so two bounds with the same shape have it for every bound between them: bisection finds
    where it changes, with O(log len(ws)) evaluations per change."""
    if not ws:
        return []
    shapes: dict[int, tuple[int, int, int]] = {}

    def shape(index: int) -> tuple[int, int, int]:
        if index not in shapes:
            shapes[index] = shape_of(ws[index])
        return shapes[index]

    starts = [0]
    pending = [(0, len(ws) - 1)]
    while pending:  # intervals whose ends differ in shape; depth first, lower half first, so starts ascend
        lo, hi = pending.pop()
        if shape(lo) == shape(hi):
            continue
        if hi == lo + 1:
            starts.append(hi)
            continue
        mid = (lo + hi) // 2
        pending.append((mid, hi))
        pending.append((lo, mid))
    return [(ws[index], shape(index)) for index in starts]


def _balanced_plan(
    fwd: list[float],
    both: list[float],
    fsize: list[int],
    bsize: list[int],
    start: int,
    kf: int,
    kb: int,
    cap: float,
    w: float,
) -> Plan:
    """Fused stage ``[start, L)``; ``kf`` forward and ``kb`` backward stages over ``[0, start)``, each
    partition balanced by :func:`_balanced_split` (``w`` is a bound they are known to meet)."""
    forward = _balanced_split(fwd[:start], fsize[:start], kf, cap, "forward", w) if start else []
    backward = _balanced_split(both[:start], bsize[:start], kb, cap, "backward", w)[::-1] if start else []
    return Plan(tuple(forward), range(start, len(fwd)), tuple(backward))


def _slowest(plan: Plan, fwd: Sequence[float], both: Sequence[float]) -> float:
    return max(
        [sum(fwd[i] for i in s) for s in plan.forward] + [sum(both[i] for i in s) for s in (plan.fused, *plan.backward)]
    )


def predicted_cost(plan: Plan, costs: Sequence[LayerCost], num_devices: int, job_cost: float = 0.0) -> float:
    """``max(num_stages, num_devices) * (slowest stage) + num_stages * job_cost``: the padded work of one
    iteration and its jobs' fixed cost."""
    fwd, both, _, _ = _split(costs)
    return max(plan.num_stages, num_devices) * _slowest(plan, fwd, both) + plan.num_stages * job_cost


def plan_fits(plan: Plan, costs: Sequence[LayerCost], memory_budget: int | None) -> bool:
    """Whether every stage of ``plan`` fits in half of ``memory_budget``: a forward stage with its layers'
    parameters, the fused and backward stages with their gradients and activations too."""
    if memory_budget is None:
        return True
    _, _, fsize, bsize = _split(costs)
    cap = memory_budget / 2
    return (all(sum(fsize[i] for i in stage) <= cap for stage in plan.forward)
            and all(sum(bsize[i] for i in stage) <= cap for stage in (plan.fused, *plan.backward)))


class Planner:
    """Holds the current plan between iterations and re-plans from measured costs.

    ``mode``: ``"auto"`` (:func:`plan_auto`), an int (:func:`plan_chunks` with that many forward
    stages, re-balanced on replan) or an explicit :class:`Plan` (used as is, never changed).

    Times: the plan follows a measurement only once it can be trusted, or it would flap with noise. An
    observation is one optimizer step's per-layer times (the engine measures them in device time, see
    ``engine/timing.py``). The first ``warmup`` observations are discarded: they include one-off warm-up
    (allocator growth, kernel selection and autotuning, caches). The rest are smoothed per layer by an
    exponential moving average (``smoothing`` is the weight of the past), bias-corrected like Adam's
    moments so early estimates are not pulled toward zero. A new plan is considered only once the last
    ``settle`` observations agree, each within ``tolerance`` of their mean (the relative L1 distance of the
    per-layer ``forward + backward`` times, so a layer weighs by its share of the work), and adopted only
    if it is better by ``hysteresis``.

    Jobs: ``mode="auto"`` also weighs each job's fixed cost (:func:`plan_auto`'s ``job_cost``, in seconds like
    the measured times): ``job_cost`` until a step reports one (``observe(..., job_cost=...)``, from the stage
    runner's ``StepTimes.job_cost``: how long a job's hand-offs and binding keep its device from computing),
    then the smoothed reports, like the times. It applies to measured times only: first estimates are in
    other units.

    Bytes: parameter and gradient bytes come from :meth:`initial`; what each layer's compute keeps for
    backward from :meth:`observe_activations`. A plan that no longer fits memory is replaced at once:
    memory is a hard limit, not a matter of trust.
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
        warmup: int = 1,
        settle: int = 2,
        tolerance: float = 0.25,
        job_cost: float = 0.0,
    ) -> None:
        if num_layers < 1 or num_devices < 1:
            raise ValueError(f"need num_layers >= 1 and num_devices >= 1, got {num_layers}, {num_devices}")
        if not 0 <= smoothing < 1 or hysteresis < 0:
            raise ValueError(f"need 0 <= smoothing < 1 and hysteresis >= 0, got {smoothing}, {hysteresis}")
        if warmup < 0 or settle < 1 or tolerance < 0:
            raise ValueError(f"need warmup >= 0, settle >= 1 and tolerance >= 0, got {warmup}, {settle}, {tolerance}")
        if not (math.isfinite(job_cost) and job_cost >= 0):
            raise ValueError(f"job_cost must be finite and >= 0, got {job_cost}")
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
        self.warmup, self.settle, self.tolerance = warmup, settle, tolerance
        self._plan: Plan | None = mode if isinstance(mode, Plan) else None
        self._initial: list[LayerCost] | None = None
        self._bytes: list[tuple[int, int]] | None = None
        self._activations = [0] * num_layers       # per layer: bytes its compute keeps for backward
        self._measured_activations: set[int] = set()  # layers whose figure is measured (an estimate no longer counts)
        self.activations_observed = False  # observe_activations has been called (an estimate, or measurements)
        self._ema: list[tuple[float, float]] = []
        self._recent: deque[list[float]] = deque(maxlen=settle)  # the last observations' per-layer fwd+bwd times
        self._seen = 0  # observations, the discarded warm-up included
        self._job_cost = job_cost  # until a job cost is observed
        self._job_ema = 0.0        # smoothed observed job costs (biased toward 0 like _ema), and their count
        self._jobs_seen = 0

    def _make(self, costs: Sequence[LayerCost], job_cost: float = 0.0) -> Plan:
        if isinstance(self.mode, Plan):
            return self.mode
        if self.mode == "auto":
            return plan_auto(costs, num_devices=self.num_devices, memory_budget=self.memory_budget, job_cost=job_cost)
        return plan_chunks(costs, self.mode, memory_budget=self.memory_budget)

    def _check_len(self, costs: Sequence[LayerCost]) -> None:
        if len(costs) != self.num_layers:
            raise ValueError(f"got costs for {len(costs)} layers, the model has {self.num_layers}")

    def initial(self, costs: Sequence[LayerCost]) -> Plan:
        """Plan from first estimates (usually :func:`costs_from_bytes`) and remember the byte counts."""
        self._check_len(costs)
        self._initial = list(costs)
        self._bytes = [(c.param_bytes, c.grad_bytes) for c in costs]
        self._plan = self._make(costs)
        return self._plan

    @property
    def plan(self) -> Plan:
        if self._plan is None:
            raise RuntimeError("Planner.initial() must be called before the plan is read")
        return self._plan

    def adopt(self, plan: Plan) -> None:
        """Use ``plan`` from now on (another process's, so that every ring runs the same plan)."""
        plan.validate(self.num_layers)
        self._plan = plan

    def observe(self, measured: Sequence[LayerCost], *, job_cost: float | None = None) -> None:
        """Fold one step's measured per-layer times, and the fixed cost of its jobs if measured (seconds per
        job, see the class docstring), into the smoothed estimates (the first ``warmup`` are discarded)."""
        self._check_len(measured)
        if job_cost is not None and not (math.isfinite(job_cost) and job_cost >= 0):
            raise ValueError(f"job_cost must be finite and >= 0, got {job_cost}")
        self._seen += 1
        if self._seen <= self.warmup:
            return
        a = self.smoothing
        if job_cost is not None:
            self._job_ema = a * self._job_ema + (1 - a) * job_cost
            self._jobs_seen += 1
        if not self._ema:
            self._ema = [(0.0, 0.0)] * self.num_layers
        self._ema = [(a * f + (1 - a) * m.forward, a * b + (1 - a) * m.backward)
                     for (f, b), m in zip(self._ema, measured, strict=True)]
        self._recent.append([m.forward + m.backward for m in measured])

    @property
    def settled(self) -> bool:
        """The last ``settle`` observations after warm-up agree: each within ``tolerance`` of their mean."""
        if len(self._recent) < self.settle:
            return False
        mean = [sum(times) / len(times) for times in zip(*self._recent, strict=True)]
        total = sum(mean)
        return all(sum(abs(x - m) for x, m in zip(times, mean, strict=True)) <= self.tolerance * total
                   for times in self._recent)

    @property
    def estimate(self) -> list[LayerCost] | None:
        """The bias-corrected smoothed costs, or ``None`` before the first post-warm-up observation."""
        if not self._ema or self._bytes is None:
            return None
        norm = 1 - self.smoothing ** (self._seen - self.warmup)
        return [LayerCost(f / norm, b / norm, p, g, act) for (f, b), (p, g), act
                in zip(self._ema, self._bytes, self._activations, strict=True)]

    @property
    def job_cost(self) -> float:
        """The fixed cost per job the plan weighs (seconds): the bias-corrected smoothed observations, else
        the ``job_cost`` given."""
        if not self._jobs_seen:
            return self._job_cost
        return self._job_ema / (1 - self.smoothing ** self._jobs_seen)

    def _costs_job(self) -> tuple[list[LayerCost] | None, float]:
        """The costs to plan with (the smoothed measurements, else the first estimates) and the job cost that
        goes with them (none with the first estimates: they are not in seconds)."""
        estimate = self.estimate
        if estimate is not None:
            return estimate, self.job_cost
        return self._initial_costs(), 0.0

    @property
    def activation_bytes(self) -> list[int]:
        """Per layer, what its compute keeps for backward per microbatch, as far as known (0: nothing yet)."""
        return list(self._activations)

    def observe_activations(self, per_layer: Mapping[int, int], *, measured: bool = True) -> bool:
        """Learn what layers' compute keeps for backward per microbatch (``layer -> bytes``): an estimate
        (``measured=False``: :func:`autocast_copy_bytes` before anything ran, say), or a measurement, which
        replaces the layer's estimate and then only grows (the largest batch so far). If the current plan no
        longer fits the memory budget, one that does is adopted at once (warm-up, settling and hysteresis do
        not apply to memory); when none does, the plan stays and the device accounting reports the shortfall
        if it happens. Returns whether the plan changed."""
        self.activations_observed = True
        for layer, nbytes in per_layer.items():
            if measured:
                known = self._activations[layer] if layer in self._measured_activations else 0
                self._activations[layer] = max(known, nbytes)
                self._measured_activations.add(layer)
            elif layer not in self._measured_activations:
                self._activations[layer] = max(self._activations[layer], nbytes)
        costs, job_cost = self._costs_job()
        if self.frozen or isinstance(self.mode, Plan) or self._plan is None or costs is None:
            return False
        if plan_fits(self._plan, costs, self.memory_budget):
            return False
        try:
            candidate = self._make(costs, job_cost)
        except ValueError:  # no plan fits: a layer alone is over half the budget
            return False
        changed, self._plan = candidate != self._plan, candidate
        return changed

    def _initial_costs(self) -> list[LayerCost] | None:
        """The first estimates, with what is known of the activations."""
        if self._initial is None:
            return None
        return [LayerCost(c.forward, c.backward, c.param_bytes, c.grad_bytes, act)
                for c, act in zip(self._initial, self._activations, strict=True)]

    def replan(self) -> bool:
        """Between iterations only: adopt a plan built from the smoothed costs if its
        :func:`predicted_cost` beats the current plan's (under the same costs) by more than
        ``hysteresis`` (a fraction), so noise does not make the partition flap. Returns whether the
        plan changed. Nothing changes before the measured times have settled (see the class docstring)."""
        costs = self.estimate
        if self.frozen or isinstance(self.mode, Plan) or costs is None or self._plan is None or not self.settled:
            return False
        job_cost = self.job_cost
        try:
            candidate = self._make(costs, job_cost)
        except ValueError:  # no plan fits memory with these activations: keep the current one
            return False
        if candidate == self._plan:
            return False
        now = predicted_cost(self._plan, costs, self.num_devices, job_cost)
        if predicted_cost(candidate, costs, self.num_devices, job_cost) < now * (1 - self.hysteresis):
            self._plan = candidate
            return True
        return False

    def state_dict(self) -> dict[str, Any]:
        """The plan in use and what the planner has learned, as plain values (a checkpoint loads them with
        ``torch.load(weights_only=True)``), for :meth:`load_state_dict`."""
        return {
            "mode": _mode_key(self.mode), "num_layers": self.num_layers, "num_devices": self.num_devices,
            "plan": self.plan.sizes(),
            "activations": list(self._activations), "measured_activations": sorted(self._measured_activations),
            "activations_observed": self.activations_observed,
            "ema": [list(pair) for pair in self._ema], "recent": [list(times) for times in self._recent],
            "seen": self._seen, "job_ema": self._job_ema, "jobs_seen": self._jobs_seen,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> bool:
        """Continue from :meth:`state_dict`: its plan (unless the plan is explicit) and what it learned.
        Returns whether it was taken: a state made for another layer count, device count or ``mode`` is not,
        and the current plan stays. A restored plan that does not fit this planner's memory budget is
        replaced at once, as in :meth:`observe_activations` (unless frozen)."""
        if (state.get("num_layers"), state.get("num_devices"), state.get("mode")) != (
                self.num_layers, self.num_devices, _mode_key(self.mode)):
            return False
        self._activations = [int(value) for value in state["activations"]]
        self._measured_activations = {int(layer) for layer in state["measured_activations"]}
        self.activations_observed = bool(state["activations_observed"])
        self._ema = [(float(forward), float(backward)) for forward, backward in state["ema"]]
        self._recent = deque(([float(x) for x in times] for times in state["recent"]), maxlen=self.settle)
        self._seen = int(state["seen"])
        # a checkpoint from before job costs were measured has none: this planner's stands
        self._job_ema = float(state.get("job_ema", 0.0))
        self._jobs_seen = int(state.get("jobs_seen", 0))
        if isinstance(self.mode, Plan):
            return True
        self._plan = Plan.from_sizes(**state["plan"])
        self._plan.validate(self.num_layers)
        costs, job_cost = self._costs_job()
        if not self.frozen and costs is not None and not plan_fits(self._plan, costs, self.memory_budget):
            with contextlib.suppress(ValueError):  # no plan fits: keep it, the device accounting reports it
                self._plan = self._make(costs, job_cost)
        return True


def _mode_key(mode: Literal["auto"] | int | Plan) -> str | int:
    """The planner's ``mode`` as a plain value: an explicit plan is ``"plan"``."""
    return "plan" if isinstance(mode, Plan) else mode


# ---------------------------------------------------------------------------- device memory budget
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
