"""The host optimizer step in the simulation: the layer groups it steps one at a time, the optimizer thread's
order under each ``streaming`` mode, and a lower bound on the step's exposed time.

Pure module (standard library, :mod:`.plan`, :mod:`.schedule`, :mod:`.simulated_timeline`).
:func:`~lightning_roundpipe.planning.simulate.simulate_roundpipe` runs the thread between iterations.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

from lightning_roundpipe.planning.plan import LayerCost, Plan
from lightning_roundpipe.planning.schedule import Job, StageKind
from lightning_roundpipe.planning.simulated_timeline import (
    HostStep,
    _check,
    _iteration_jobs,
    _phases,
    _run_jobs,
    _SimulatedTimeline,
)

Streaming = Literal["off", "backward", "latest", "forward"]
STREAMING: tuple[str, ...] = ("off", "backward", "latest", "forward")


def step_groups(plan: Plan) -> tuple[range, ...]:
    """The layer groups of the streaming host step, deep to shallow: the fused stage's layers, then
    each backward stage's (``plan.backward`` order). Group ``g``'s gradients are final when the last
    job of its stage in the iteration has ended."""
    return (plan.fused, *plan.backward)


def layer_step_seconds(costs: Sequence[LayerCost], parameters: float, seconds_per_param: float) -> list[float]:
    """Per-layer host step seconds for a model of ``parameters`` trainable parameters stepped at
    ``seconds_per_param``: the parameters are spread over the layers in proportion to their
    ``param_bytes``, or to their ``forward`` time where every ``param_bytes`` is 0 (profiles that only
    carry times, such as the paper's)."""
    if parameters < 0 or seconds_per_param < 0:
        raise ValueError(f"need parameters >= 0 and seconds_per_param >= 0, got {parameters}, {seconds_per_param}")
    weights = [float(c.param_bytes) for c in costs]
    if not any(weights):
        weights = [c.forward for c in costs]
    total = sum(weights)
    if total <= 0:
        raise ValueError("cannot spread the parameters: every layer has zero param_bytes and zero forward time")
    return [parameters * seconds_per_param * w / total for w in weights]


def _groups_of(layers: range, groups: Sequence[range]) -> list[int]:
    """The step groups holding any of ``layers``."""
    return [g for g, r in enumerate(groups) if r.start < layers.stop and layers.start < r.stop]


def _final_times(jobs: Sequence[Job], ends: Mapping[int, Sequence[float]], num_groups: int) -> list[float]:
    """When each step group's gradients are final: the end of the last of its stage's jobs (every
    round's) in one iteration."""
    final = [0.0] * num_groups
    for job in jobs:
        if job.kind is not StageKind.FORWARD:
            g = 0 if job.kind is StageKind.FUSED else job.stage + 1
            final[g] = max(final[g], ends[job.index][-1])
    return final


def _step_thread(
    iteration: int,
    groups: Sequence[range],
    group_cost: Sequence[float],
    final: Sequence[float],
    end: float,
    free: float,
    streaming: str,
) -> list[HostStep]:
    """The optimizer thread's steps for one iteration, one group at a time from ``free`` on (see
    :func:`simulate_roundpipe`): ``"backward"`` deep to shallow, each once its gradients are final;
    ``"latest"`` whenever the thread is free, the shallowest group whose gradients are final;
    ``"forward"`` after the whole backward (``end``), shallow to deep; ``"off"`` after ``end``, deep to
    shallow (its order does not matter: the next iteration waits for all of it)."""
    steps: list[HostStep] = []
    t = free if streaming in ("backward", "latest") else max(free, end)
    if streaming == "latest":
        pending = list(range(len(groups)))
        while pending:
            t = max(t, min(final[h] for h in pending))  # idle until some gradients are final
            g = max(h for h in pending if final[h] <= t)
            pending.remove(g)
            steps.append(HostStep(iteration, g, groups[g], t, t + group_cost[g]))
            t += group_cost[g]
        return steps
    order = range(len(groups) - 1, -1, -1) if streaming == "forward" else range(len(groups))
    for g in order:
        start = max(t, final[g]) if streaming == "backward" else t
        t = start + group_cost[g]
        steps.append(HostStep(iteration, g, groups[g], start, t))
    return steps


class _HostThread:
    """The host's optimizer thread over sync iterations with a per-layer step (:func:`~.simulate.simulate_roundpipe`):
    steps each iteration's groups (:func:`_step_thread`) and, when streaming, says when each job of the next
    iteration may start: once the steps of the groups holding its layers have ended (per-stage readiness)."""

    def __init__(self, groups: Sequence[range], group_cost: Sequence[float], streaming: str) -> None:
        self.groups, self.group_cost, self.streaming = groups, group_cost, streaming
        self.steps: list[HostStep] = []
        self.free = 0.0
        self._done: list[float] = []  # when each group's step of the previous iteration ended (streaming only)
        self._needs: dict[range, list[int]] = {}  # the groups whose steps a job waits for, by its layers

    def ready(self, jobs: Sequence[Job]) -> dict[int, float] | None:
        """Per job, the earliest start the previous iteration's steps allow (``None``: no such wait)."""
        if not self._done:
            return None
        ready = {}
        for job in jobs:
            if job.layers not in self._needs:
                self._needs[job.layers] = _groups_of(job.layers, self.groups)
            ready[job.index] = max(self._done[g] for g in self._needs[job.layers])
        return ready

    def step(self, iteration: int, jobs: Sequence[Job], ends: Mapping[int, Sequence[float]], end: float) -> None:
        """Step the groups of ``iteration``, whose ``jobs`` ended at ``ends`` (the last at ``end``)."""
        final = _final_times(jobs, ends, len(self.groups))
        new = _step_thread(iteration, self.groups, self.group_cost, final, end, self.free, self.streaming)
        self.steps += new
        self.free = max(s.end for s in new)
        if self.streaming != "off":
            self._done = [0.0] * len(self.groups)
            for s in new:
                self._done[s.group] = s.end


def _tails(jobs: Sequence[Job], costs: Sequence[LayerCost], num_devices: int, hop: float,
           pre_ahead: bool) -> dict[int, float]:
    """For each job, the longest path from the start of its first op to the end of the last op of
    ``jobs`` when run alone (:func:`_run_jobs`): the least time the rest takes once that job starts,
    given each device's program order, the data edges and the hops. :meth:`_SimulatedTimeline.place` sets
    ``start = max(release, end of the device's previous op, each input's end + hop - (recompute, when
    it runs ahead))``, a max-plus system, so the run's end is ``max(release + tail)`` over its ops."""
    ops: list[tuple[float, list[tuple[int, float]]]] = []  # (duration, successors with edge weights)
    first: dict[int, int] = {}
    at: dict[tuple[int, int], int] = {}
    last_on: dict[int, int] = {}
    for job in jobs:
        (_, pre), (_, main) = _phases(job, costs)
        for m in range(job.num_microbatches):
            i = len(ops)
            ops.append((pre + main, []))
            at[(job.index, m)] = i
            first.setdefault(job.index, i)
            if job.device in last_on:
                ops[last_on[job.device]][1].append((i, 0.0))
            last_on[job.device] = i
            for d in job.depends_on:
                w = (hop if d % num_devices != job.device else 0.0) - (pre if pre_ahead else 0.0)
                ops[at[(d, m)]][1].append((i, w))
    tail = [0.0] * len(ops)
    for i in range(len(ops) - 1, -1, -1):
        duration, succ = ops[i]
        tail[i] = duration + max([0.0] + [w + tail[k] for k, w in succ])
    return {index: tail[i] for index, i in first.items()}


def exposed_step_bound(
    plan: Plan,
    costs: Sequence[LayerCost],
    num_devices: int,
    num_microbatches: int,
    hop: float = 0.0,
    *,
    host_step: Sequence[float],
    streaming: Streaming,
    round_size: int | None = None,
    recompute_ahead: bool = False,
) -> float:
    """A lower bound on the host step's exposed time per sync iteration (the next iteration's end,
    minus this one's end, minus an isolated iteration's makespan ``T0``) for any order of the group
    steps on one thread, given the dispatch and ``streaming``'s dependencies (``benchmarks/bubble.py``
    derives it)::

        max(0, max over jobs J of the next iteration of  C(U_J) + tail_J - E - T0)

    ``E = T0`` is this (isolated) iteration's end; ``U_J`` the groups of :func:`step_groups` holding
    layers of ``J`` or of any job ``J`` waits for (data edges, its device's earlier jobs); ``C(U)`` the
    earliest the thread can finish all of ``U``: with releases ``r_g`` (``"backward"``, ``"latest"``: when ``g``'s
    gradients are final; ``"forward"``: ``E``), ``max over g in U of r_g + (steps of U released at or
    after r_g)``; ``tail_J`` the longest path from ``J``'s start to the iteration's end (:func:`_tails`)."""
    if streaming not in ("backward", "latest", "forward"):
        raise ValueError(f"streaming must be 'backward', 'latest' or 'forward', got {streaming!r}")
    if len(host_step) != len(costs):
        raise ValueError(f"host_step needs a step time for each of the {len(costs)} layers")
    _check(plan, costs, num_microbatches)
    jobs = _iteration_jobs(plan, num_devices, num_microbatches, round_size, 0)
    tl = _SimulatedTimeline(num_devices, hop)
    ends = _run_jobs(tl, jobs, costs, pre_ahead=recompute_ahead)
    end = max(t for e in ends.values() for t in e)
    groups = step_groups(plan)
    cost = [sum(host_step[i] for i in g) for g in groups]
    # "backward", "latest": a group may go once its gradients are final; "forward": after the backward
    release = [end] * len(groups) if streaming == "forward" else _final_times(jobs, ends, len(groups))
    tails = _tails(jobs, costs, num_devices, hop, recompute_ahead)
    union: dict[int, frozenset[int]] = {}
    previous: dict[int, int] = {}
    best = 0.0
    for job in jobs:
        own = set(_groups_of(job.layers, groups))
        for d in (*job.depends_on, previous.get(job.device)):
            if d is not None:
                own |= union[d]
        union[job.index] = frozenset(own)
        previous[job.device] = job.index
        done, work = 0.0, 0.0
        # one thread's earliest finish of ``own``: the greedy in release order, max of r_g + later work
        for g in sorted(own, key=lambda g: release[g], reverse=True):
            work += cost[g]
            done = max(done, release[g] + work)
        best = max(best, done + tails[job.index] - end - end)
    return best
