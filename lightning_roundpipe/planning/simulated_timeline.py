"""The simulated timeline: ops placed on devices one at a time, the events they leave, and the bubble accounting.

Pure module (standard library, :mod:`.plan`, :mod:`.schedule`). Costs are per microbatch:
a forward stage costs the sum of its layers' ``forward``; the fused stage ``forward`` then
``backward`` (never recomputed); a backward stage recomputes (``forward``) then back-propagates
(``backward``). A *hop* is one stage boundary crossing between two different devices, per
microbatch; it delays the consumer and never occupies a device, so where it stalls it is idle time.
One placement rule: an op starts when its device is free and its inputs arrived.

The bubble split follows the paper: *fill* is a device's idle time before its first op; *drain*
after its last backward phase; *switch* the idle time between the end of its warm-up forwards
(the ``N - d``-th forward for 1F1B/GPipe; for RoundPipe, which has no warm-up phase, its last
forward before the first backward) and its first backward phase; *intra* is the rest. The paper's
"RoundPipe-async" figure is ``switch + intra`` of one isolated iteration
(:attr:`SimResult.async_bubble_ratio`); a multi-iteration run also gives the measured steady state
(:meth:`SimResult.steady_bubble_ratio`).

Named apart from the engine's recorded timeline (``observe/trace.py``: ``Timeline``, ``TimelineEvent``):
these are simulated.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from lightning_roundpipe.planning.plan import LayerCost, Plan
from lightning_roundpipe.planning.schedule import Job, StageKind, training_jobs, training_rounds


class SimulatedEvent(NamedTuple):
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
    events: tuple[SimulatedEvent, ...]
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


class _SimulatedTimeline:
    """Places ops one at a time, in the order given: that order is each device's program order."""

    def __init__(self, num_devices: int, hop: float) -> None:
        if num_devices < 1:
            raise ValueError(f"num_devices must be >= 1, got {num_devices}")
        if hop < 0:
            raise ValueError(f"hop must be >= 0, got {hop}")
        self.free = [0.0] * num_devices
        self.hop = hop
        self.events: list[SimulatedEvent] = []

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
                self.events.append(SimulatedEvent(device, label, mb, t, t + length, kind, job))
            t += length
        self.free[device] = t
        return t


def _breakdown(
    timeline: _SimulatedTimeline,
    warmup_phase: bool,
    iteration_ends: Sequence[float] = (),
    host_steps: Sequence[HostStep] = (),
) -> SimResult:
    """Fill / switch / drain / intra per the paper's definitions (see the module docstring)."""
    events = timeline.events
    n = len(timeline.free)
    makespan = max((e.end for e in events), default=0.0)
    per_dev: list[list[SimulatedEvent]] = [[] for _ in range(n)]
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
    tl: _SimulatedTimeline,
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
    tl: _SimulatedTimeline,
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


def _iteration_jobs(plan: Plan, num_devices: int, num_microbatches: int, round_size: int | None,
                    first_index: int) -> list[Job]:
    if round_size is None:
        return training_jobs(plan, num_devices, num_microbatches, first_index)
    return training_rounds(plan, num_devices, num_microbatches, round_size, first_index)
