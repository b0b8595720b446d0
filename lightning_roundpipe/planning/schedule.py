"""The RoundPipe schedule as data: which stage job runs on which device, after which job.

Pure module (standard library and :mod:`.partition` only). The runtime executes exactly the
:class:`Job` lists built here; the simulator times them; tests check them with :func:`validate`.

A *job* is one stage over all ``M`` microbatches, run in microbatch order ``0 .. M-1`` (or, in a
training iteration dispatched in *rounds* by :func:`training_rounds`, over one round's microbatches
``job.microbatches``: each round is a whole training chain over its share of the batch). Jobs are
dealt to devices round-robin by a counter that is never reset, so job ``j`` runs on device
``j % N`` and the next call (or iteration) simply continues the count. One training iteration
(the fused path) on 2 devices with 2 forward stages and 3 backward stages::

    index   0    1    2    3    4    5        job 6 (next iteration's F0) -> device 0
    job     F0   F1   L    B0   B1   B2
    device  0    1    0    1    0    1

Microbatch ``m`` of a job waits for microbatch ``m`` of the job it depends on: a forward stage on
the previous forward stage, the fused stage ``L`` (forward, loss and backward back to back) on the
last forward stage, a backward stage on the previous (deeper) backward stage. A backward stage also
reads the recompute checkpoint of its first layer; that was written to the host by a forward job of
the same call long before, so it is *not* listed in ``depends_on`` (it can never be the binding
wait, and listing it would make every backward job depend on many jobs).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lightning_roundpipe.planning.plan import Plan, format_layers, walk_runs


class StageKind(str, enum.Enum):
    """What a job computes: a forward stage, the fused last stage, or a recomputing backward stage."""

    FORWARD = "F"
    FUSED = "L"
    BACKWARD = "B"


@dataclass(frozen=True)
class Job:
    """One stage over all microbatches, as dispatched to one device."""

    index: int  #: global ring position; the engine's counter continues across calls and iterations
    device: int  #: ``index % num_devices``
    kind: StageKind
    stage: int  #: position within its kind: forward shallow->deep, backward deep->shallow, fused 0
    layers: range
    num_microbatches: int
    depends_on: tuple[int, ...]  #: jobs whose microbatch ``m`` output microbatch ``m`` consumes
    first_microbatch: int = 0  #: global index of the job's first microbatch (a round's offset into the batch)

    @property
    def microbatches(self) -> range:
        """The global microbatch indices the job runs, in order: ``first_microbatch ..`` (all ``M`` for a
        whole job, one round's for a job of :func:`training_rounds`). Its ``k``-th microbatch consumes the
        ``k``-th of each job in ``depends_on``."""
        return range(self.first_microbatch, self.first_microbatch + self.num_microbatches)

    @property
    def label(self) -> str:
        """``"F0"``, ``"L"``, ``"B3"``: short names for grids, traces and messages."""
        return "L" if self.kind is StageKind.FUSED else f"{self.kind.value}{self.stage}"


def default_microbatches(num_devices: int) -> int:
    """Microbatches per call when none are set. A ring of N > 1 devices: N + 1, which keeps every device busy
    in the steady state. One device has no ring to fill: the batch runs whole (one microbatch), as under
    Lightning's default strategy, so batch statistics and kernel sizes are plain training's and no per-microbatch
    cost is paid for nothing."""
    return 1 if num_devices == 1 else num_devices + 1


def _chain(
    stages: Sequence[tuple[StageKind, int, range]],
    num_devices: int,
    num_microbatches: int,
    first_index: int,
    first_microbatch: int = 0,
) -> list[Job]:
    """Jobs for ``stages`` at consecutive ring positions, each consuming the one before it (in all
    three calls the data flows straight down the dispatch order)."""
    if num_devices < 1:
        raise ValueError(f"num_devices must be >= 1, got {num_devices}")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    if first_microbatch < 0:
        raise ValueError(f"first_microbatch must be >= 0, got {first_microbatch}")
    jobs: list[Job] = []
    for k, (kind, stage, layers) in enumerate(stages):
        index = first_index + k
        deps = (index - 1,) if k > 0 else ()
        jobs.append(Job(index, index % num_devices, kind, stage, layers, num_microbatches, deps, first_microbatch))
    return jobs


def training_jobs(
    plan: Plan, num_devices: int, num_microbatches: int, first_index: int = 0, *, first_microbatch: int = 0
) -> list[Job]:
    """One iteration of the fused path: forward stages, the fused stage, backward stages, each over
    microbatches ``first_microbatch .. first_microbatch + num_microbatches - 1`` (one round of
    :func:`training_rounds`; the whole batch by default)."""
    stages = [(StageKind.FORWARD, s, r) for s, r in enumerate(plan.forward)]
    stages.append((StageKind.FUSED, 0, plan.fused))
    stages += [(StageKind.BACKWARD, b, r) for b, r in enumerate(plan.backward)]
    # In the fused path every job consumes the one dispatched just before it.
    return _chain(stages, num_devices, num_microbatches, first_index, first_microbatch)


def training_rounds(
    plan: Plan, num_devices: int, num_microbatches: int, round_size: int, first_index: int = 0
) -> list[Job]:
    """One iteration of the fused path dispatched in rounds: round ``r`` is a whole
    :func:`training_jobs` chain over microbatches ``[r R, min(M, (r+1) R))``, at the ring positions
    following round ``r - 1``'s (the counter is never reset). Returns every round's jobs in dispatch
    order. Jobs depend only on jobs of their own round. ``round_size >= num_microbatches`` gives
    :func:`training_jobs`. 2 devices, plan ``F0 | L | B0``, 3 microbatches in rounds of 2::

        index       0    1    2    3    4    5
        job         F0   L    B0   F0   L    B0
        device      0    1    0    1    0    1
        microbatch  0-1  0-1  0-1  2    2    2
    """
    if round_size < 1:
        raise ValueError(f"round_size must be >= 1, got {round_size}")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    jobs: list[Job] = []
    for first in range(0, num_microbatches, round_size):
        size = min(round_size, num_microbatches - first)
        jobs += training_jobs(plan, num_devices, size, first_index + len(jobs), first_microbatch=first)
    return jobs


def forward_jobs(plan: Plan, num_devices: int, num_microbatches: int, first_index: int = 0) -> list[Job]:
    """The transparent path's forward call: the forward stages, then the fused layers as one more
    forward stage (no loss: the caller computes it on the merged output)."""
    stages = [(StageKind.FORWARD, s, r) for s, r in enumerate(plan.forward)]
    stages.append((StageKind.FORWARD, len(plan.forward), plan.fused))
    return _chain(stages, num_devices, num_microbatches, first_index)


def backward_jobs(plan: Plan, num_devices: int, num_microbatches: int, first_index: int = 0) -> list[Job]:
    """The transparent path's backward call: the fused layers as a recomputing backward stage 0,
    then ``plan.backward`` as stages 1... Stage 0 depends on no job: its output gradient comes
    from the caller's autograd graph."""
    stages = [(StageKind.BACKWARD, 0, plan.fused)]
    stages += [(StageKind.BACKWARD, b + 1, r) for b, r in enumerate(plan.backward)]
    return _chain(stages, num_devices, num_microbatches, first_index)


def validate(jobs: Sequence[Job], num_layers: int, num_devices: int) -> None:
    """Raise ``ValueError`` unless ``jobs`` is one well-formed call: training (``F* L B*``),
    forward (``F+``) or backward (``B+``). Checks the ring rule, index continuity, microbatches,
    stage numbering, dependencies (each job on the previous one in the data flow, so all point
    backwards) and that forward stages cover the layers shallow->deep and backward stages
    deep->shallow, without gaps or overlaps."""
    if num_devices < 1:
        raise ValueError(f"num_devices must be >= 1, got {num_devices}")
    if not jobs:
        raise ValueError("a schedule needs at least one job, got none")
    _check_ring_and_flow(jobs, num_devices)
    kinds = "".join(j.kind.value for j in jobs)
    if not re.fullmatch(r"F*L?B*", kinds) or ("F" in kinds and "B" in kinds and "L" not in kinds):
        raise ValueError(
            f"jobs run {' '.join(j.label for j in jobs)}; a call is forward stages, then the fused "
            f"stage, then backward stages (training), forward stages only, or backward stages only"
        )
    fwd = [j for j in jobs if j.kind is StageKind.FORWARD]
    fused = [j for j in jobs if j.kind is StageKind.FUSED]
    bwd = [j for j in jobs if j.kind is StageKind.BACKWARD]
    for group in (fwd, fused, bwd):
        for s, job in enumerate(group):
            if job.stage != s:
                raise ValueError(f"job at index {job.index} is {job.label}, expected stage {s} of its kind")
    if fwd or fused:
        _check_forward([*fwd, *fused], num_layers)
    if fused or bwd:
        _check_backward(bwd, fused[0].layers.start if fused else num_layers)


def _check_ring_and_flow(jobs: Sequence[Job], num_devices: int) -> None:
    """:func:`validate`'s checks of each job against the call: consecutive ring positions on the ring's devices,
    the same microbatches, and a dependency on the previous job only."""
    first = jobs[0]
    for k, job in enumerate(jobs):
        if job.index != first.index + k:
            raise ValueError(
                f"job {job.label} has index {job.index}, expected {first.index + k}: a call's jobs take "
                f"consecutive ring positions"
            )
        if job.device != job.index % num_devices:
            raise ValueError(
                f"job {job.label} (index {job.index}) is on device {job.device}, but the ring puts it on "
                f"device {job.index % num_devices} (index % {num_devices})"
            )
        if job.num_microbatches < 1:
            raise ValueError(f"job {job.label} has num_microbatches={job.num_microbatches}, expected >= 1")
        if job.num_microbatches != first.num_microbatches:
            raise ValueError(
                f"job {job.label} has {job.num_microbatches} microbatches but job {first.label} has "
                f"{first.num_microbatches}: one call splits its batch once"
            )
        if job.first_microbatch != first.first_microbatch:
            raise ValueError(
                f"job {job.label} starts at microbatch {job.first_microbatch} but job {first.label} at "
                f"{first.first_microbatch}: the jobs of one call (or round) run the same microbatches"
            )
        if any(d >= job.index for d in job.depends_on):
            raise ValueError(
                f"job {job.label} (index {job.index}) depends on {tuple(job.depends_on)}: dependencies "
                f"must point to earlier jobs"
            )
        # Each job consumes the previous one; the call's first job consumes the caller's data.
        expected = (jobs[k - 1].index,) if k > 0 else ()
        if tuple(job.depends_on) != expected:
            raise ValueError(
                f"job {job.label} (index {job.index}) depends on {tuple(job.depends_on)}, expected "
                f"{expected}: each job consumes the previous job in the data flow"
            )


def validate_rounds(jobs: Sequence[Job], num_layers: int, num_devices: int) -> None:
    """Raise ``ValueError`` unless ``jobs`` is one training iteration in rounds (:func:`training_rounds`):
    consecutive runs of jobs with the same ``first_microbatch`` are the rounds; each must pass
    :func:`validate` as a training call (with the fused stage), the first starts at microbatch 0, each
    next one where the previous ended, all rounds but the last have the same size and the ring
    positions continue from round to round. Whole jobs (one round) pass too."""
    if not jobs:
        raise ValueError("a schedule needs at least one job, got none")
    rounds: list[list[Job]] = []
    for job in jobs:
        if not rounds or job.first_microbatch != rounds[-1][0].first_microbatch:
            rounds.append([])
        rounds[-1].append(job)
    expected_mb, expected_index = 0, jobs[0].index
    size = rounds[0][0].num_microbatches
    for r, group in enumerate(rounds):
        head = group[0]
        if head.first_microbatch != expected_mb:
            raise ValueError(
                f"round {r} starts at microbatch {head.first_microbatch}, expected {expected_mb}: rounds cover "
                f"the batch in order from microbatch 0"
            )
        if head.index != expected_index:
            raise ValueError(
                f"round {r} starts at ring position {head.index}, expected {expected_index}: the ring counter "
                f"continues from round to round"
            )
        if head.num_microbatches > size or (head.num_microbatches < size and r < len(rounds) - 1):
            raise ValueError(
                f"round {r} has {head.num_microbatches} microbatches, expected {size}: all rounds but the last "
                f"have the first round's size, the last at most that"
            )
        if not any(j.kind is StageKind.FUSED for j in group):
            raise ValueError(f"round {r} runs {' '.join(j.label for j in group)}: a round is a whole training call")
        validate(group, num_layers, num_devices)
        expected_mb = head.first_microbatch + head.num_microbatches
        expected_index = group[-1].index + 1


def _check_forward(jobs: Sequence[Job], num_layers: int) -> None:
    pos, broken = walk_runs([job.layers for job in jobs], 0)
    if broken is not None:
        job = jobs[broken]
        raise ValueError(
            f"forward job {job.label} holds layers {format_layers(job.layers)}, expected a run starting at layer "
            f"{pos}: forward stages (and the fused stage) cover the layers shallow to deep from layer 0"
        )
    if pos != num_layers:
        raise ValueError(f"forward jobs cover layers [0, {pos}), expected [0, {num_layers})")


def _check_backward(jobs: Sequence[Job], top: int) -> None:
    pos, broken = walk_runs([job.layers for job in jobs], top, downward=True)
    if broken is not None:
        job = jobs[broken]
        raise ValueError(
            f"backward job {job.label} holds layers {format_layers(job.layers)}, expected a run ending at layer "
            f"{pos - 1}: backward stages cover the layers deep to shallow from layer {top - 1}"
        )
    if pos != 0:
        raise ValueError(f"backward jobs cover layers [{pos}, {top}), expected [0, {top})")


def format_plan(plan: Plan) -> str:
    """One line per kind, e.g. ``forward  [0-2] [3-5]`` (layer ranges are inclusive)."""
    return "\n".join(
        (
            f"forward  ({len(plan.forward)}): " + " ".join(format_layers(r) for r in plan.forward),
            f"fused    (1): {format_layers(plan.fused)}",
            f"backward ({len(plan.backward)}): " + " ".join(format_layers(r) for r in plan.backward),
        )
    )


def format_grid(jobs: Sequence[Job], num_devices: int, *, cost: Callable[[Job], float] | None = None) -> str:
    """ASCII timeline, one row per device, one cell per (job, microbatch). Plan ``F0 F1 | L | B0 B1``,
    2 devices, 2 microbatches::

        t      0    1    2    3    4    5
        dev0  |F0.0|F0.1|L.0 |L.1 |B1.0|B1.1|
        dev1  |    |F1.0|F1.1|B0.0|B0.1|    |

    ``cost(job)`` is a job's time per microbatch (default 1). Times come from a plain in-order
    placement (a device runs its jobs in ring order; microbatch ``m`` waits for microbatch ``m`` of
    its dependencies; no transfer cost), quantised to the cheapest job's time. For timings with
    transfers or recompute, use :mod:`.simulate`."""
    if not jobs:
        return "(no jobs)"
    per_mb = {j.index: float(cost(j)) if cost else 1.0 for j in jobs}
    unit = min((c for c in per_mb.values() if c > 0), default=1.0)
    free = [0.0] * num_devices
    ends: dict[int, list[float]] = {}
    cells: list[tuple[int, int, int, str]] = []  # device, first column, last column (excl.), text
    for job in jobs:
        ends[job.index] = []
        for m in range(job.num_microbatches):
            start = max([free[job.device]] + [ends[d][m] for d in job.depends_on if d in ends])
            end = start + per_mb[job.index]
            free[job.device] = end
            ends[job.index].append(end)
            cells.append((job.device, round(start / unit), round(end / unit), f"{job.label}.{m}"))
    width = max(4, max(len(t) for *_, t in cells))
    columns = max(c for _, _, c, _ in cells)
    axis = "".join(f"{c:<{width + 1}}" for c in range(columns))
    lines = [f"{'t':<6} {axis}".rstrip()]
    for d in range(num_devices):
        row = [" " * width] * columns
        for dev, a, b, text in cells:
            if dev == d:
                for c in range(a, b):
                    row[c] = (text if c == a else "=" * len(text)).ljust(width)
        lines.append(f"{f'dev{d}':<6}|" + "|".join(row) + "|")
    return "\n".join(lines)
