"""Event simulation of pipeline schedules: makespan, bubble ratio and where the bubble sits.

Pure module (standard library and the planning modules). What it builds on: the timeline, the costs
and the bubble accounting (:mod:`.simulated_timeline`), the host optimizer step (:mod:`.simulated_step`)
and the weight-bound baselines (:mod:`.baselines`), all importable from here.

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
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from lightning_roundpipe.planning.baselines import simulate_1f1b, simulate_gpipe
from lightning_roundpipe.planning.plan import LayerCost, Plan
from lightning_roundpipe.planning.schedule import Job, training_jobs
from lightning_roundpipe.planning.simulated_step import (
    STREAMING,
    Streaming,
    _HostThread,
    exposed_step_bound,
    layer_step_seconds,
    step_groups,
)
from lightning_roundpipe.planning.simulated_timeline import (
    HostStep,
    SimResult,
    SimulatedEvent,
    _breakdown,
    _check,
    _iteration_jobs,
    _run,
    _run_jobs,
    _SimulatedTimeline,
)

__all__ = [
    "STREAMING", "HostStep", "SimResult", "SimulatedEvent", "Streaming", "choose_round_size", "exposed_step_bound",
    "layer_step_seconds", "simulate_1f1b", "simulate_gpipe", "simulate_jobs", "simulate_paper_roundpipe",
    "simulate_roundpipe", "step_groups", "sync_iteration_time",
]


def simulate_jobs(
    jobs: Sequence[Job], costs: Sequence[LayerCost], num_devices: int, hop: float = 0.0, *,
    recompute_ahead: bool = False,
) -> SimResult:
    """Time any job list of :mod:`.schedule` (one call, or several back to back with indices
    continuing) the way our runtime runs it: each device takes its jobs in list order, microbatches
    ``0..M-1``; microbatch ``m`` starts when its device is free and microbatch ``m`` of each
    dependency has ended (+ ``hop`` from another device). ``recompute_ahead`` lets a backward stage
    recompute before its output gradient arrives (only the backward proper waits for it)."""
    tl = _SimulatedTimeline(num_devices, hop)
    _run(tl, jobs, costs, pre_ahead=recompute_ahead)
    return _breakdown(tl, warmup_phase=False)


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
    _check_runtime_options(costs, iterations, mode, optimizer_time, round_size, host_step, streaming)
    groups = step_groups(plan)
    group_cost = [] if host_step is None else [sum(host_step[i] for i in g) for g in groups]
    step_time = optimizer_time if host_step is None else sum(group_cost)
    thread = _HostThread(groups, group_cost, streaming) if host_step is not None and mode == "sync" else None
    tl = _SimulatedTimeline(num_devices, hop)
    iteration_ends: list[float] = []
    barrier, first_index = 0.0, 0
    for it in range(iterations):
        jobs = _iteration_jobs(plan, num_devices, num_microbatches, round_size, first_index)
        first_index += len(jobs)
        ready = None if thread is None else thread.ready(jobs)
        ends = _run_jobs(tl, jobs, costs, not_before=barrier, ready=ready, pre_ahead=recompute_ahead)
        end = max((t for e in ends.values() for t in e), default=barrier)
        iteration_ends.append(end)
        if mode == "sync" and (host_step is None or streaming == "off"):
            barrier = end + step_time
        if thread is not None:  # sync mode with a per-layer host step
            thread.step(it, jobs, ends, end)
    return _breakdown(tl, warmup_phase=False, iteration_ends=iteration_ends, host_steps=thread.steps if thread else [])


def _check_runtime_options(
    costs: Sequence[LayerCost],
    iterations: int,
    mode: str,
    optimizer_time: float,
    round_size: int | None,
    host_step: Sequence[float] | None,
    streaming: Streaming,
) -> None:
    """Refuse :func:`simulate_roundpipe`'s arguments that do not go together (``ValueError``)."""
    if iterations < 1 or mode not in ("async", "sync") or optimizer_time < 0:
        raise ValueError(
            f"need iterations >= 1, mode 'async' or 'sync' and optimizer_time >= 0; got {iterations}, "
            f"{mode!r}, {optimizer_time}"
        )
    if round_size is not None and round_size < 1:
        raise ValueError(f"round_size must be >= 1 or None (whole jobs), got {round_size}")
    if streaming not in STREAMING:
        raise ValueError(f"streaming must be one of {STREAMING}, got {streaming!r}")
    if host_step is not None:
        if len(host_step) != len(costs) or not all(0 <= t < float("inf") for t in host_step):
            raise ValueError(f"host_step needs a finite step time >= 0 for each of the {len(costs)} layers")
        if optimizer_time:
            raise ValueError("give the host step as optimizer_time (one figure) or host_step (per layer), not both")
    if streaming != "off" and (host_step is None or mode != "sync"):
        raise ValueError(f"streaming={streaming!r} needs mode='sync' and host_step (per-layer step seconds)")


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

    SimulatedEvent ``job`` numbers count dispatched jobs over the rounds. A fused stage holding more than the
    loss head runs those layers' forward inside it (our runtime's semantics; in the paper's input
    format their forward sits in the forward stages). The paper's partitions all have a head-only
    fused stage, where the two agree."""
    _check(plan, costs, num_microbatches)
    tl = _SimulatedTimeline(num_devices, hop)
    start_dev, dispatched = 0, 0
    for r0 in range(0, num_microbatches, num_devices):
        size = min(num_devices, num_microbatches - r0)
        jobs = training_jobs(plan, num_devices, size, first_index=start_dev)
        _run(tl, jobs, costs, pre_ahead=True, paper_edges=True, first_mb=r0, job_offset=dispatched - start_dev)
        dispatched += len(jobs)
        start_dev = min(range(num_devices), key=lambda d: (tl.free[d], d))
    return _breakdown(tl, warmup_phase=False)
