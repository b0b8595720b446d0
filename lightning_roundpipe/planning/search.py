"""The partition search: which layers each forward, fused and backward stage holds.

Pure module (no torch, no threads): per-layer costs and a memory budget in, a :class:`~.plan.Plan` out.

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
import functools
import math
from collections.abc import Sequence
from typing import Any

from lightning_roundpipe.planning.plan import LayerCost, Plan

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

    On several devices with ``job_cost == 0`` this is the reference planner. There the window stays: it
    keeps the stages even and many enough to rotate over the ring, where the padded work is a fair model (a
    bound far above ``Wmax`` gives a few stages that fill the ring unevenly, which it does not see), and
    ``job_cost`` only weighs the shapes in it. On one device there is no ring to fill: the stages run one
    after another, so the objective bounds the iteration's time (the stage sums and the jobs' cost) and every
    run sum above the window is open too, as far as any could still win (``W + job_cost`` below the best
    objective found): without a memory budget that is the fused stage alone (no plan's padded work is less:
    it recomputes nothing); with one, fewer and larger stages that fit it, as far as they pay. The shape
    changes only at a few bounds (each count and the fused stage's start fall as ``W`` grows), so they are
    found by bisection, not packed one by one.

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
    shape_of = functools.partial(_counts_for, fwd, both, fsize, bsize, cap=cap)  # of a bound w
    best = _best_shape({wmax} | _run_sums(fwd, wmax, hi) | _run_sums(both, wmax, hi), shape_of, num_devices,
                       job_cost, _NO_SHAPE)
    if num_devices == 1:
        # any W' >= W costs at least W + job_cost (one stage at least): beyond that nothing wins
        reach = best[0] - job_cost
        if reach > hi:
            above = {w for w in _run_sums(fwd, hi, reach) | _run_sums(both, hi, reach) if w > hi}
            best = _best_shape(above, shape_of, num_devices, job_cost, best)
    return _balanced_plan(fwd, both, fsize, bsize, *best[3], cap, best[2])


_Choice = tuple[float, int, float, tuple[int, int, int]]
"""A candidate of :func:`plan_auto`: (objective, stage count, bound ``W``, shape: fused start, forward and
backward stage counts)."""
_NO_SHAPE: _Choice = (math.inf, 0, 0.0, (0, 0, 0))


def _best_shape(
    candidates: set[float], shape_of: Any, num_devices: int, job_cost: float, best: _Choice
) -> _Choice:
    """``best``, or the shape of a bound in ``candidates`` that beats it: the smaller :func:`plan_auto`
    objective, then fewer stages, then (bounds ascending, the first that wins) the smaller bound."""
    for w, shape in _shape_starts(sorted(candidates), shape_of):
        stages = shape[1] + 1 + shape[2]
        cost = max(stages, num_devices) * w + stages * job_cost
        if (cost, stages) < best[:2]:
            best = (cost, stages, w, shape)
    return best


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

