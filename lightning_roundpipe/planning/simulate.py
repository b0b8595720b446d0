"""Event simulation of pipeline schedules: makespan, bubble ratio and where the bubble sits.

Pure module (standard library, :mod:`.partition`, :mod:`.schedule`). Costs are per microbatch:
a forward stage costs the sum of its layers' ``forward``; the fused stage ``forward`` then
``backward`` (never recomputed); a backward stage recomputes (``forward``) then back-propagates
(``backward``). A *hop* is one stage boundary crossing between two different devices, per
microbatch; it delays the consumer and never occupies a device, so where it stalls it is idle time.

Four schedules, one placement rule (an op starts when its device is free and its inputs arrived):

* :func:`simulate_roundpipe`: our runtime. Jobs from :func:`.schedule.training_jobs` in ring order,
  each over all ``M`` microbatches, or from :func:`.schedule.training_rounds` (rounds of ``R``);
  optionally several iterations, the ring counter continuing, and in sync mode the host optimizer
  step between them, whole or streamed per stage (:func:`step_groups`). :func:`choose_round_size`
  picks whole jobs or rounds from the predicted sync iteration; :func:`exposed_step_bound` bounds
  the host step's exposed time from below.
* :func:`simulate_paper_roundpipe`: the paper's simulator (RoundPipe artifact, ``pp-simulate``), to
  compare against its published figures. It differs from our runtime in three ways, all needed to
  reproduce its numbers: microbatches go in *rounds* of at most ``N``, the whole stage sequence per
  round, and each round after the first starts its ring at the device that is free earliest; every
  backward stage also waits for the last forward stage's output (with a hop across devices); and
  recompute is *backward-aligned*: it may run before the output gradient arrives, only the backward
  proper waits for it.
* :func:`simulate_gpipe`, :func:`simulate_1f1b`: one stage per device, weights bound to devices;
  backward ops recompute every layer but the model's last (the loss head, kept from the forward).

The bubble split follows the paper: *fill* is a device's idle time before its first op; *drain*
after its last backward phase; *switch* the idle time between the end of its warm-up forwards
(the ``N - d``-th forward for 1F1B/GPipe; for RoundPipe, which has no warm-up phase, its last
forward before the first backward) and its first backward phase; *intra* is the rest. The paper's
"RoundPipe-async" figure is ``switch + intra`` of one isolated iteration
(:attr:`SimResult.async_bubble_ratio`); a multi-iteration run also gives the measured steady state
(:meth:`SimResult.steady_bubble_ratio`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

from lightning_roundpipe.planning.partition import LayerCost, Plan
from lightning_roundpipe.planning.schedule import Job, StageKind, training_jobs, training_rounds

Streaming = Literal["off", "backward", "latest", "forward"]
STREAMING: tuple[str, ...] = ("off", "backward", "latest", "forward")


class Event(NamedTuple):
    """One phase of one microbatch of one job on one device."""

    device: int
    label: str  #: the job's label: ``F0``, ``L``, ``B3``
    microbatch: int
    start: float
    end: float
    phase: str  #: ``fwd`` (forward stages and the fused stage's forward), ``recompute`` or ``bwd``
    job: int  #: dispatch position (the ring index for our runtime)


class HostStep(NamedTuple):
    """One group's optimizer step on the host's optimizer thread (:func:`simulate_roundpipe`)."""

    iteration: int  #: the iteration whose gradients it applies
    group: int  #: position in :func:`step_groups`: 0 the fused stage's layers, ``b + 1`` backward stage ``b``
    layers: range
    start: float
    end: float


@dataclass(frozen=True)
class SimResult:
    """Timeline and bubble accounting of one simulation. Times are in the costs' unit; the four
    bubble parts are summed over devices and add up to :attr:`idle`."""

    makespan: float
    busy: tuple[float, ...]  #: per device
    fill: float
    switch: float
    drain: float
    intra: float
    events: tuple[Event, ...]
    iteration_ends: tuple[float, ...] = ()  #: when each simulated iteration's last op ended
    host_steps: tuple[HostStep, ...] = ()  #: the optimizer thread's group steps (sync mode with ``host_step``)

    @property
    def num_devices(self) -> int:
        return len(self.busy)

    @property
    def capacity(self) -> float:
        return self.makespan * self.num_devices

    @property
    def idle(self) -> float:
        return self.capacity - sum(self.busy)

    def _ratio(self, t: float) -> float:
        return t / self.capacity if self.capacity > 0 else 0.0

    @property
    def bubble_ratio(self) -> float:
        """Idle time / (makespan x devices): the paper's definition, fill and drain included."""
        return self._ratio(self.idle)

    @property
    def fill_ratio(self) -> float:
        return self._ratio(self.fill)

    @property
    def switch_ratio(self) -> float:
        return self._ratio(self.switch)

    @property
    def drain_ratio(self) -> float:
        return self._ratio(self.drain)

    @property
    def intra_ratio(self) -> float:
        return self._ratio(self.intra)

    @property
    def async_bubble_ratio(self) -> float:
        """The paper's "RoundPipe-async" figure: ``switch + intra`` (fill and drain are assumed to
        overlap neighbouring iterations), as a share of this run's makespan x devices."""
        return self._ratio(self.switch + self.intra)

    def steady_bubble_ratio(self, warmup: int = 2) -> float:
        """Measured steady-state bubble of a multi-iteration run: ``1 - work / (N x period)``, with
        ``work`` one iteration's busy time and ``period`` the mean gap between iteration ends after
        the first ``warmup`` iterations (the start-up transient). The ring's stage-to-device map
        rotates every ``N / gcd(num_stages, N)`` iterations, and so does the gap: for an exact figure
        make ``iterations - 1 - warmup`` a multiple of that (``N`` always is)."""
        ends = self.iteration_ends
        if len(ends) < warmup + 2:
            raise ValueError(
                f"steady_bubble_ratio(warmup={warmup}) needs at least {warmup + 2} iterations, the run "
                f"has {len(ends)}; pass iterations=... to simulate_roundpipe"
            )
        period = (ends[-1] - ends[warmup]) / (len(ends) - 1 - warmup)
        work = sum(self.busy) / len(ends)
        return 1.0 - work / (self.num_devices * period)


class _Timeline:
    """Places ops one at a time, in the order given: that order is each device's program order."""

    def __init__(self, num_devices: int, hop: float) -> None:
        if num_devices < 1:
            raise ValueError(f"num_devices must be >= 1, got {num_devices}")
        if hop < 0:
            raise ValueError(f"hop must be >= 0, got {hop}")
        self.free = [0.0] * num_devices
        self.hop = hop
        self.events: list[Event] = []

    def place(
        self,
        device: int,
        label: str,
        job: int,
        mb: int,
        phases: tuple[tuple[str, float], tuple[str, float]],
        deps: Sequence[tuple[float, int]],
        *,
        not_before: float = 0.0,
        pre_ahead: bool = False,
    ) -> float:
        """Run ``phases`` (a pre phase, then the main phase) back to back; ``deps`` are
        ``(end, device)`` of the inputs, and a hop is paid when that device differs. With
        ``pre_ahead`` only the main phase waits for inputs: the pre phase (recompute) is slid as
        late as possible before it, as in the paper's simulator. Returns the end time."""
        ready = not_before
        for end, dev in deps:
            ready = max(ready, end + (self.hop if dev != device else 0.0))
        pre = phases[0][1]
        if pre_ahead:
            # ``not_before`` (the parameters' optimizer step) holds the recompute too
            start = max(max(self.free[device] + pre, ready) - pre, not_before)
        else:
            start = max(self.free[device], ready)
        t = start
        for kind, length in phases:
            if length > 0:  # zero-length phases leave no event (as in the paper's statistics)
                self.events.append(Event(device, label, mb, t, t + length, kind, job))
            t += length
        self.free[device] = t
        return t


def _breakdown(
    timeline: _Timeline, warmup_phase: bool, iteration_ends: Sequence[float] = (), host_steps: Sequence[HostStep] = ()
) -> SimResult:
    """Fill / switch / drain / intra per the paper's definitions (see the module docstring)."""
    events = timeline.events
    n = len(timeline.free)
    makespan = max((e.end for e in events), default=0.0)
    per_dev: list[list[Event]] = [[] for _ in range(n)]
    for e in events:
        per_dev[e.device].append(e)
    busy, fill, switch, drain = [0.0] * n, 0.0, 0.0, 0.0
    for d, evs in enumerate(per_dev):
        if not evs:
            continue
        evs.sort(key=lambda e: (e.start, e.end))
        busy[d] = sum(e.end - e.start for e in evs)  # a device's events never overlap
        fill += evs[0].start
        bwd = [e for e in evs if e.phase == "bwd"]
        drain += makespan - (max(e.end for e in bwd) if bwd else evs[-1].end)
        if not bwd:
            continue
        first_bwd = bwd[0].start
        fwd_ends = sorted(e.end for e in evs if e.phase == "fwd" and e.end <= first_bwd)
        if not fwd_ends:
            continue
        k = min(n - d, len(fwd_ends)) if warmup_phase else len(fwd_ends)
        lo = fwd_ends[k - 1]
        # Recompute (and any forward) inside the window is work, not bubble.
        inside = sum(max(0.0, min(e.end, first_bwd) - max(e.start, lo)) for e in evs)
        switch += max(first_bwd - lo - inside, 0.0)
    idle = makespan * n - sum(busy)
    intra = max(idle - fill - switch - drain, 0.0)
    return SimResult(makespan, tuple(busy), fill, switch, drain, intra, tuple(events), tuple(iteration_ends),
                     tuple(host_steps))


def _phases(job: Job, costs: Sequence[LayerCost]) -> tuple[tuple[str, float], tuple[str, float]]:
    fwd = sum(costs[i].forward for i in job.layers)
    if job.kind is StageKind.FORWARD:
        return ("fwd", 0.0), ("fwd", fwd)
    bwd = sum(costs[i].backward for i in job.layers)
    return ("fwd" if job.kind is StageKind.FUSED else "recompute", fwd), ("bwd", bwd)


def _check(plan: Plan, costs: Sequence[LayerCost], num_microbatches: int) -> None:
    plan.validate(len(costs))
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")


def _run(
    tl: _Timeline,
    jobs: Sequence[Job],
    costs: Sequence[LayerCost],
    *,
    not_before: float = 0.0,
    pre_ahead: bool = False,
    paper_edges: bool = False,
    first_mb: int = 0,
    job_offset: int = 0,
) -> float:
    """Place ``jobs`` in order, microbatches in order; return when the last op ends. Microbatch
    ``m`` waits for microbatch ``m`` of each job in ``depends_on`` (a job's device is its index mod
    N). ``paper_edges`` adds the paper's edge from the last forward stage to every backward stage."""
    ends = _run_jobs(tl, jobs, costs, not_before=not_before, pre_ahead=pre_ahead, paper_edges=paper_edges,
                     first_mb=first_mb, job_offset=job_offset)
    return max((t for e in ends.values() for t in e), default=not_before)


def _run_jobs(
    tl: _Timeline,
    jobs: Sequence[Job],
    costs: Sequence[LayerCost],
    *,
    not_before: float = 0.0,
    ready: Mapping[int, float] | None = None,
    pre_ahead: bool = False,
    paper_edges: bool = False,
    first_mb: int = 0,
    job_offset: int = 0,
) -> dict[int, list[float]]:
    """:func:`_run`, returning each job's microbatch end times. ``ready[job.index]`` (when given) is a
    further earliest start for that job's microbatches (its parameters' optimizer steps)."""
    n = len(tl.free)
    ends: dict[int, list[float]] = {}
    last_fwd = max((j.index for j in jobs if j.kind is StageKind.FORWARD), default=None)
    for job in jobs:
        deps = list(job.depends_on)
        if paper_edges and job.kind is StageKind.BACKWARD and last_fwd is not None:
            deps.append(last_fwd)
        phases = _phases(job, costs)
        start = not_before if ready is None else max(not_before, ready.get(job.index, not_before))
        ends[job.index] = [
            tl.place(
                job.device, job.label, job.index + job_offset, first_mb + job.first_microbatch + m, phases,
                [(ends[d][m], d % n) for d in deps], not_before=start, pre_ahead=pre_ahead,
            )
            for m in range(job.num_microbatches)
        ]
    return ends


def simulate_jobs(
    jobs: Sequence[Job], costs: Sequence[LayerCost], num_devices: int, hop: float = 0.0, *,
    recompute_ahead: bool = False,
) -> SimResult:
    """Time any job list of :mod:`.schedule` (one call, or several back to back with indices
    continuing) the way our runtime runs it: each device takes its jobs in list order, microbatches
    ``0..M-1``; microbatch ``m`` starts when its device is free and microbatch ``m`` of each
    dependency has ended (+ ``hop`` from another device). ``recompute_ahead`` lets a backward stage
    recompute before its output gradient arrives (only the backward proper waits for it)."""
    tl = _Timeline(num_devices, hop)
    _run(tl, jobs, costs, pre_ahead=recompute_ahead)
    return _breakdown(tl, warmup_phase=False)


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


def _iteration_jobs(plan: Plan, num_devices: int, num_microbatches: int, round_size: int | None,
                    first_index: int) -> list[Job]:
    if round_size is None:
        return training_jobs(plan, num_devices, num_microbatches, first_index)
    return training_rounds(plan, num_devices, num_microbatches, round_size, first_index)


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


def simulate_roundpipe(
    plan: Plan,
    costs: Sequence[LayerCost],
    num_devices: int,
    num_microbatches: int,
    hop: float = 0.0,
    *,
    iterations: int = 1,
    mode: str = "async",
    optimizer_time: float = 0.0,
    recompute_ahead: bool = False,
    round_size: int | None = None,
    host_step: Sequence[float] | None = None,
    streaming: Streaming = "off",
) -> SimResult:
    """Our runtime's schedule for ``iterations`` iterations: :func:`.schedule.training_jobs` (whole
    jobs, ``round_size=None``) or :func:`.schedule.training_rounds` (rounds of ``round_size``
    microbatches), the ring counter continuing from iteration to iteration.

    ``mode="async"``: iteration ``k+1`` needs nothing from iteration ``k`` (its weights are one step
    older), so its first forward runs as soon as its ring device is free, overlapping the backward
    tail; the host step is not modelled. ``mode="sync"``: iteration ``k+1`` waits for iteration
    ``k``'s host optimizer step, which costs ``optimizer_time`` in all, or ``sum(host_step)`` with
    ``host_step`` the step seconds of each layer's parameters. One optimizer thread steps the layer
    groups of :func:`step_groups` one at a time (:attr:`SimResult.host_steps`), per ``streaming``:

    * ``"off"``: the whole step after iteration ``k``'s last op; every job of iteration ``k+1``
      waits for all of it;
    * ``"backward"`` (no whole-gradient consumer): groups deep to shallow, each as soon as its
      gradients are final (the last job of its stage ended) and the thread is free;
    * ``"latest"``: as ``"backward"``, but whenever the thread is free it steps the *shallowest*
      group whose gradients are final. The same order while the thread keeps up with the backward;
      with a backlog the shallow groups the next iteration needs first go first;
    * ``"forward"`` (clipping): all groups after iteration ``k``'s last op, shallow to deep.

    With ``"backward"``, ``"latest"`` or ``"forward"`` a job of iteration ``k+1`` waits only for the steps of the
    groups holding any of its layers (per-stage readiness). ``iteration_ends`` gives each
    iteration's end."""
    _check(plan, costs, num_microbatches)
    if iterations < 1 or mode not in ("async", "sync") or optimizer_time < 0:
        raise ValueError(
            f"need iterations >= 1, mode 'async' or 'sync' and optimizer_time >= 0; got {iterations}, "
            f"{mode!r}, {optimizer_time}"
        )
    if round_size is not None and round_size < 1:
        raise ValueError(f"round_size must be >= 1 or None (whole jobs), got {round_size}")
    if streaming not in STREAMING:
        raise ValueError(f"streaming must be one of {STREAMING}, got {streaming!r}")
    groups = step_groups(plan)
    group_cost: list[float] = []
    if host_step is not None:
        if len(host_step) != len(costs) or not all(0 <= t < float("inf") for t in host_step):
            raise ValueError(f"host_step needs a finite step time >= 0 for each of the {len(costs)} layers")
        if optimizer_time:
            raise ValueError("give the host step as optimizer_time (one figure) or host_step (per layer), not both")
        group_cost = [sum(host_step[i] for i in g) for g in groups]
    if streaming != "off" and (host_step is None or mode != "sync"):
        raise ValueError(f"streaming={streaming!r} needs mode='sync' and host_step (per-layer step seconds)")
    step_time = optimizer_time if host_step is None else sum(group_cost)
    needs: dict[range, list[int]] = {}  # the groups whose steps a job waits for, by its layers
    tl = _Timeline(num_devices, hop)
    iteration_ends: list[float] = []
    steps: list[HostStep] = []
    barrier, thread_free = 0.0, 0.0
    done: list[float] = []  # when each group's step of the previous iteration ended
    first_index = 0
    for it in range(iterations):
        jobs = _iteration_jobs(plan, num_devices, num_microbatches, round_size, first_index)
        first_index += len(jobs)
        ready: dict[int, float] | None = None
        if done:
            ready = {}
            for job in jobs:
                if job.layers not in needs:
                    needs[job.layers] = _groups_of(job.layers, groups)
                ready[job.index] = max(done[g] for g in needs[job.layers])
        ends = _run_jobs(tl, jobs, costs, not_before=barrier, ready=ready, pre_ahead=recompute_ahead)
        end = max((t for e in ends.values() for t in e), default=barrier)
        iteration_ends.append(end)
        if mode != "sync":
            continue
        if host_step is None or streaming == "off":
            barrier = end + step_time
        if host_step is not None:
            final = _final_times(jobs, ends, len(groups))
            new = _step_thread(it, groups, group_cost, final, end, thread_free, streaming)
            steps += new
            thread_free = max(s.end for s in new)
            if streaming != "off":
                done = [0.0] * len(groups)
                for s in new:
                    done[s.group] = s.end
    return _breakdown(tl, warmup_phase=False, iteration_ends=iteration_ends, host_steps=steps)


def sync_iteration_time(
    plan: Plan,
    costs: Sequence[LayerCost],
    num_devices: int,
    num_microbatches: int,
    hop: float = 0.0,
    *,
    round_size: int | None = None,
    host_step: Sequence[float] | None = None,
    streaming: Streaming = "off",
    recompute_ahead: bool = False,
) -> float:
    """Predicted time of one sync iteration: the makespan of an isolated iteration without a host
    step; with ``host_step``, the gap between the ends of the third and the second of three sync
    iterations (the step's exposed part included; the first gap carries the start-up)."""
    if host_step is None:
        return simulate_roundpipe(plan, costs, num_devices, num_microbatches, hop, mode="sync",
                                  round_size=round_size, recompute_ahead=recompute_ahead).makespan
    ends = simulate_roundpipe(plan, costs, num_devices, num_microbatches, hop, mode="sync", iterations=3,
                              round_size=round_size, host_step=host_step, streaming=streaming,
                              recompute_ahead=recompute_ahead).iteration_ends
    return ends[2] - ends[1]


def _tails(jobs: Sequence[Job], costs: Sequence[LayerCost], num_devices: int, hop: float,
           pre_ahead: bool) -> dict[int, float]:
    """For each job, the longest path from the start of its first op to the end of the last op of
    ``jobs`` when run alone (:func:`_run_jobs`): the least time the rest takes once that job starts,
    given each device's program order, the data edges and the hops. :meth:`_Timeline.place` sets
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
    tl = _Timeline(num_devices, hop)
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


def choose_round_size(
    plan: Plan,
    costs: Sequence[LayerCost],
    num_devices: int,
    num_microbatches: int,
    hop: float = 0.0,
    *,
    host_step: Sequence[float] | None = None,
    streaming: Streaming = "off",
    recompute_ahead: bool = False,
    candidates: Sequence[int] | None = None,
    job_cost: float = 0.0,
) -> int | None:
    """Whole jobs (``None``) or rounds of ``R`` microbatches, whichever :func:`sync_iteration_time`
    predicts fastest. Candidates: ``N`` and ``2N`` (the paper dispatches rounds of at most ``N``),
    those below ``num_microbatches`` (a round of all of them is whole jobs); ties go to fewer rounds.
    ``job_cost``: a fixed cost of each job (hand-offs, binding; seconds like ``costs``), paid by its device:
    each candidate's time grows by it times the jobs per device, ``ceil(jobs / N)``.

    Assumption: the simulator has no upload cost. Rounds upload each stage's parameters once per
    round instead of once per iteration; in our runtime those uploads are prefetched behind the
    previous job's compute, so only the first job's upload is exposed, and that one exists with
    whole jobs as well. Cost: one simulation per candidate (three iterations with a host step)."""
    if candidates is None:
        candidates = [num_devices, 2 * num_devices]
    options: list[int | None] = [None] + sorted({r for r in candidates if 1 <= r < num_microbatches}, reverse=True)
    best: tuple[float, int | None] = (float("inf"), None)
    if not (math.isfinite(job_cost) and job_cost >= 0):
        raise ValueError(f"job_cost must be finite and >= 0, got {job_cost}")
    stages = len(plan.forward) + 1 + len(plan.backward)
    for r in options:
        t = sync_iteration_time(plan, costs, num_devices, num_microbatches, hop, round_size=r, host_step=host_step,
                                streaming=streaming, recompute_ahead=recompute_ahead)
        jobs = stages * (1 if r is None else math.ceil(num_microbatches / r))
        t += job_cost * math.ceil(jobs / num_devices)
        if t < best[0] * (1 - 1e-12):
            best = (t, r)
    return best[1]


def simulate_paper_roundpipe(
    plan: Plan, costs: Sequence[LayerCost], num_devices: int, num_microbatches: int, hop: float = 0.0
) -> SimResult:
    """One isolated iteration as the paper's simulator schedules it (see the module docstring).

    Round ``r`` holds microbatches ``[rN, rN + N)``. It runs every stage in training order (forward
    stages, fused, backward stages), each over the round's microbatches, stage ``k`` on device
    ``(s_r + k) % N``; ``s_0 = 0`` and ``s_{r+1}`` is the device free earliest once round ``r`` is
    placed (lowest index on ties). Ops are placed in that order, so each device runs them in it::

        N=2, 5 stages, M=3:  round 0 (mb 0,1): F0 F1 L B0 B1 on devices 0 1 0 1 0
                             round 1 (mb 2):   the same five stages from the earliest-free device

    Event ``job`` numbers count dispatched jobs over the rounds. A fused stage holding more than the
    loss head runs those layers' forward inside it (our runtime's semantics; in the paper's input
    format their forward sits in the forward stages). The paper's partitions all have a head-only
    fused stage, where the two agree."""
    _check(plan, costs, num_microbatches)
    tl = _Timeline(num_devices, hop)
    start_dev, dispatched = 0, 0
    for r0 in range(0, num_microbatches, num_devices):
        size = min(num_devices, num_microbatches - r0)
        jobs = training_jobs(plan, num_devices, size, first_index=start_dev)
        _run(tl, jobs, costs, pre_ahead=True, paper_edges=True, first_mb=r0, job_offset=dispatched - start_dev)
        dispatched += len(jobs)
        start_dev = min(range(num_devices), key=lambda d: (tl.free[d], d))
    return _breakdown(tl, warmup_phase=False)


def _bound(stages: Sequence[int], costs: Sequence[LayerCost], num_microbatches: int) -> list[range]:
    if sum(stages) != len(costs) or any(s < 1 for s in stages):
        raise ValueError(f"stage sizes {list(stages)} must be positive and sum to the {len(costs)} layers")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    out, start = [], 0
    for s in stages:
        out.append(range(start, start + s))
        start += s
    return out


def _simulate_bound(
    programs: list[list[tuple[str, int]]], ranges: list[range], costs: Sequence[LayerCost], hop: float
) -> SimResult:
    """Weight-bound pipelines: device ``s`` holds stage ``s`` and runs ``programs[s]``, a list of
    ``("F" | "B", microbatch)``. F(s, m) needs F(s-1, m); B(s, m) needs B(s+1, m) (and its own F).
    Devices advance whenever their next op is ready; the resulting times do not depend on the
    order in which ready ops are committed."""
    n, last = len(ranges), len(costs) - 1
    tl = _Timeline(n, hop)
    done: dict[tuple[str, int, int], float] = {}
    cursor = [0] * n
    remaining = sum(len(p) for p in programs)
    while remaining:
        progressed = False
        for s in range(n):
            if cursor[s] == len(programs[s]):
                continue
            kind, m = programs[s][cursor[s]]
            dep = ("F", s - 1, m) if kind == "F" else ("B", s + 1, m)
            need = [("F", s, m)] if kind == "B" else []
            if not all(k in done for k in need) or (0 <= dep[1] < n and dep not in done):
                continue
            deps = [(done[dep], dep[1])] if 0 <= dep[1] < n else []
            fwd = sum(costs[i].forward for i in ranges[s])
            if kind == "F":
                phases = (("fwd", 0.0), ("fwd", fwd))
            else:  # recompute everything but the loss head, whose activations the forward kept
                recompute = fwd - (costs[last].forward if last in ranges[s] else 0.0)
                phases = (("recompute", recompute), ("bwd", sum(costs[i].backward for i in ranges[s])))
            done[(kind, s, m)] = tl.place(s, f"{kind}{s}", s, m, phases, deps)
            cursor[s] += 1
            remaining -= 1
            progressed = True
        if not progressed:
            raise RuntimeError("weight-bound schedule deadlocked: no device's next op is ready")
    return _breakdown(tl, warmup_phase=True)


def simulate_gpipe(stages: Sequence[int], costs: Sequence[LayerCost], num_microbatches: int,
                   hop: float = 0.0) -> SimResult:
    """GPipe with ``len(stages)`` devices, device ``s`` holding ``stages[s]`` consecutive layers
    (sizes cover every layer of ``costs``; the loss head is the last). All forwards, then all
    backwards, microbatches in order."""
    ranges = _bound(stages, costs, num_microbatches)
    prog = [[("F", m) for m in range(num_microbatches)] + [("B", m) for m in range(num_microbatches)] for _ in ranges]
    return _simulate_bound(prog, ranges, costs, hop)


def simulate_1f1b(stages: Sequence[int], costs: Sequence[LayerCost], num_microbatches: int,
                  hop: float = 0.0) -> SimResult:
    """1F1B (PipeDream-flush, as PyTorch's ``Schedule1F1B``): device ``s`` runs ``min(M, N - s)``
    warm-up forwards, then alternates one backward and one forward, then the remaining backwards."""
    ranges = _bound(stages, costs, num_microbatches)
    n, m_total = len(ranges), num_microbatches
    prog: list[list[tuple[str, int]]] = []
    for s in range(n):
        warm = min(m_total, n - s)
        ops = [("F", m) for m in range(warm)]
        f, b = warm, 0
        while b < m_total:
            ops.append(("B", b))
            b += 1
            if f < m_total:
                ops.append(("F", f))
                f += 1
        prog.append(ops)
    return _simulate_bound(prog, ranges, costs, hop)
