"""Planner feedback: what the devices measure, and what the planner learns from it after each step.

One loop, one owner. :class:`Measurements` is written by the devices' threads (a computing microbatch's
activation meter, a finished job's device-time spans, resolved on its download stream) and read on the
caller's thread after each optimizer step (:meth:`Measurements.replan`), which hands the planner what
layers kept for backward and, per step measured whole, each layer's forward and backward time and the
fixed cost of a job. :func:`estimate_autocast_copies` gives the planner its first memory figures, before
anything is measured.

Measurements are device time (``timing.py``): each layer call and each microbatch's compute is a span of
the device's compute stream, resolved when the job finishes (:meth:`Measurements.record`), and what a
differentiating job's layers keep for backward is counted as they save it (``activations.py``).
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch

from lightning_roundpipe.engine.activations import ActivationMeter
from lightning_roundpipe.engine.device import Device
from lightning_roundpipe.engine.layers import Trunk
from lightning_roundpipe.engine.stage import StageCopy, Task
from lightning_roundpipe.engine.step.window import GradWindow
from lightning_roundpipe.engine.transport import UploadSources
from lightning_roundpipe.observe.trace import Timeline
from lightning_roundpipe.planning.partition import LayerCost, Planner, autocast_copy_bytes
from lightning_roundpipe.planning.schedule import StageKind

ACTIVATIONS_SETTLE = 3
"""Metered microbatches in a row that find no layer keeping more than before, after which a stage's compute is
charged its known figures instead of metered (for the same inputs' shapes, autocast and training flags)."""

ACTIVATIONS_REMETER = 50
"""Once settled, one microbatch in this many is metered again (a layer that keeps more for the same shapes, a
data-dependent one say, is found within that many); each re-metering that agrees doubles the interval, up to
:data:`ACTIVATIONS_REMETER_MOST`, and one that finds more starts over (a metered backward takes the GIL on
autograd's device thread once per saved tensor: ``activations.py``)."""

ACTIVATIONS_REMETER_MOST = 800
"""The longest interval between re-meterings of settled figures (see :data:`ACTIVATIONS_REMETER`)."""

_ACTIVATION_KEYS = 1024
"""Distinct (stage, inputs' shapes, ...) whose activation figures are kept (the oldest go first)."""

_RECENT_JOBS = 4096
"""Jobs whose compute bounds are kept for :attr:`StepTimes.job_seconds` (far more than a step has)."""


@dataclass
class _ActivationFigures:
    """What one stage's compute keeps for backward per microbatch, for inputs of one shape (see
    :meth:`Measurements.activation_meter`)."""

    per_layer: dict[int, int]
    agreeing: int = 1    # metered microbatches in a row that found no layer above ``per_layer``
    charged: int = 0     # microbatches charged from ``per_layer`` since the last metered one
    interval: int = field(default_factory=lambda: ACTIVATIONS_REMETER)  # once settled: meter one in this many


@dataclass
class StepTimes:
    """One optimizer step's measured per-layer times per microbatch, in device time (for the planner), and
    its jobs' fixed cost."""

    forward: dict[int, list[float]] = field(default_factory=dict)
    backward: dict[int, list[float]] = field(default_factory=dict)
    jobs: list[int] = field(default_factory=list)  # the jobs that reported times, by index
    # per job that reads another job's output: how long its device waited to compute once both that output
    # was computed and its own previous job was done (the hand-offs between them, unbinding and binding:
    # what a job costs whatever its size), in seconds; filled when the step is taken
    job_seconds: list[float] = field(default_factory=list)

    def complete(self, num_layers: int) -> bool:
        """Every layer has been measured forward and backward."""
        return all(layer in self.forward and layer in self.backward for layer in range(num_layers))

    def job_cost(self) -> float | None:
        """The fixed cost of one job in this step (the median of :attr:`job_seconds`), None if unmeasured:
        ``Planner.observe(..., job_cost=...)``."""
        if not self.job_seconds:
            return None
        ordered = sorted(self.job_seconds)
        middle = len(ordered) // 2
        return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


class Measurements:
    """The devices' measurements until the planner takes them; shared by the workers of one engine.

    ``measure``: learn at all (off with a frozen plan: only the timeline and the device counters are fed);
    ``measure_times``: also per-layer times (off under deterministic algorithms, where the plan never
    follows measured times)."""

    def __init__(self, timeline: Timeline, num_layers: int, num_devices: int, *, measure: bool,
                 measure_times: bool) -> None:
        self.timeline = timeline
        self.measure = measure
        self.measure_times = measure and measure_times
        self._num_layers = num_layers
        self._num_devices = num_devices
        self._lock = threading.Lock()
        self._step_times: dict[int, StepTimes] = {}     # by optimizer step, until taken
        # per recent job (by index, in the order they finished): the jobs it reads from, whether its first
        # compute waits for their output (a backward job's recompute ahead does not), its first microbatch's
        # compute start and end, and its last microbatch's compute end (for StepTimes.job_seconds)
        self._job_spans: dict[int, tuple[tuple[int, ...], bool, float, float, float]] = {}
        self._steps_taken = -1                          # the last step taken: later samples of it are dropped
        # per optimizer step (its window's number), per layer, the most one microbatch kept, until taken
        self._activation_bytes: dict[int, dict[int, int]] = {}
        # per (stage, kind, inputs' shapes and dtypes, autocast, training flags): what its compute keeps
        self._activation_figures: dict[Hashable, _ActivationFigures] = {}
        self._previous_window: GradWindow | None = None  # the last closed one: its activations go next

    # ------------------------------------------------------------------ the planner's side
    def replan(self, planner: Planner, closed: GradWindow, layer_device_bytes: Sequence[tuple[int, int]]) -> None:
        """After each step, what the planner learns: first what layers kept for backward in the step before
        (memory: a plan that no longer fits is replaced at once), then the times of each step measured whole, in
        device time (``timing.py``). The planner discards the warm-up step and changes the plan only once its
        observations agree (see :class:`~lightning_roundpipe.planning.partition.Planner`).

        Memory is learned one step late, after every job of that step has finished (in sync mode they have,
        as this step's jobs waited for its update: the wait here raises only if the pipeline failed), so a
        plan changes for memory at the same step in every run, whatever the timing. Times are learned only
        when measured (``measure_times``). ``layer_device_bytes``: per layer, its parameters' and gradients'
        bytes on a device."""
        previous, self._previous_window = self._previous_window, closed
        if not self.measure:
            return
        if previous is not None:
            previous.wait_complete()
            activations = self.take_activation_bytes(before=previous.number + 1)
            if activations:
                planner.observe_activations(activations)
        if not self.measure_times:
            return
        for times in self.take_step_times():
            measured = []
            for index, (param_bytes, grad_bytes) in enumerate(layer_device_bytes):
                forward, backward = times.forward[index], times.backward[index]
                measured.append(LayerCost(max(sum(forward) / len(forward), 1e-9),
                                          max(sum(backward) / len(backward), 1e-9), param_bytes, grad_bytes))
            planner.observe(measured, job_cost=times.job_cost())  # so one device gets few, large stages
        planner.replan()

    def take_step_times(self) -> list[StepTimes]:
        """The times of the steps measured whole (every layer forward and backward) since the last call, in
        step order, each once. A step that has finished measuring is taken even if a job of it is still to
        report; what such jobs report later is dropped, and so are older steps never measured whole (a step
        that ran no backward, say)."""
        with self._lock:
            complete = sorted(step for step, times in self._step_times.items() if times.complete(self._num_layers))
            if not complete:
                return []
            self._steps_taken = complete[-1]
            taken = [self._step_times[step] for step in complete]
            self._step_times = {step: times for step, times in self._step_times.items() if step > self._steps_taken}
            for times in taken:
                times.job_seconds = [wait for wait in map(self._job_wait, times.jobs) if wait is not None]
        return taken

    def _job_wait(self, index: int) -> float | None:
        """For :attr:`StepTimes.job_seconds`: job ``index``'s wait, None where a job it depends on has not
        reported (or it reads none: the call's inputs are there before it is dispatched)."""
        if index not in self._job_spans:
            return None
        depends_on, gated, start, _, _ = self._job_spans[index]
        if not depends_on or any(job not in self._job_spans for job in depends_on):
            return None
        # their first microbatch's output computed, unless the job starts with a recompute that needs none
        ready = max(self._job_spans[job][3] for job in depends_on) if gated else float("-inf")
        previous = index - self._num_devices  # ring order: job j runs on device j mod N
        if previous >= 0:
            if previous not in self._job_spans:
                return None
            ready = max(ready, self._job_spans[previous][4])  # the device's previous job computed
        if ready == float("-inf"):
            return None  # a device's first job that waits for no output: nothing to measure the start against
        return max(start - ready, 0.0)

    def take_activation_bytes(self, before: int | None = None) -> dict[int, int]:
        """Per layer, the most one microbatch's compute kept for backward, measured by the jobs of the
        optimizer steps numbered below ``before`` (``None``: all) and not taken yet."""
        taken: dict[int, int] = {}
        with self._lock:
            for step in [step for step in self._activation_bytes if before is None or step < before]:
                for layer, nbytes in self._activation_bytes.pop(step).items():
                    taken[layer] = max(taken.get(layer, 0), nbytes)
        return taken

    def pending_activation_bytes(self) -> dict[int, dict[int, int]]:
        """What :meth:`take_activation_bytes` has not taken yet, by step (plain values, for a checkpoint)."""
        with self._lock:
            return {step: dict(per_layer) for step, per_layer in self._activation_bytes.items()}

    def restore_activation_bytes(self, pending: dict[int, dict[int, int]]) -> None:
        """Take back :meth:`pending_activation_bytes` of an earlier run (a resumed one continues it)."""
        with self._lock:
            for step, per_layer in pending.items():
                merged = self._activation_bytes.setdefault(int(step), {})
                for layer, nbytes in per_layer.items():
                    merged[int(layer)] = max(merged.get(int(layer), 0), int(nbytes))

    # ------------------------------------------------------------------ the devices' side
    def activation_meter(self, device: Device, task: Task, stage_copy: StageCopy,
                         inputs: list[torch.Tensor]) -> ActivationMeter:
        """The meter of one microbatch of a differentiating job (``inputs``: its device inputs' tensors). It
        counts what the layers save for backward (saved-tensor hooks) until that has settled for the job's
        layers, kind, inputs' shapes and dtypes, autocast dtype and training flags: then it charges the known
        figures and installs no hook (:data:`ACTIVATIONS_SETTLE`), metering again one microbatch in
        :data:`ACTIVATIONS_REMETER`, then ever less often while the figures hold. Give it back with
        :meth:`activations_done`."""
        call, job = task.call, task.job
        key = (job.layers, job.kind, call.context.autocast_dtype(device.torch_device.type),
               tuple(call.input_requires_grad), tuple(call.context.training[layer] for layer in job.layers),
               tuple((tensor.shape, tensor.dtype) for tensor in inputs))
        with self._lock:
            known = self._activation_figures.get(key)
            if known is not None and known.agreeing >= ACTIVATIONS_SETTLE and known.charged < known.interval - 1:
                known.charged += 1
                return ActivationMeter(device.residency, (), figures=known.per_layer, key=key)
        return ActivationMeter(device.residency, [*stage_copy.tensors(), *inputs], key=key)

    def activations_done(self, meter: ActivationMeter) -> dict[int, int]:
        """Release what :meth:`activation_meter`'s meter still holds once the microbatch's compute is over;
        returns what it measured per layer (nothing if it charged known figures)."""
        meter.release()  # what no backward freed went with the compute's autograd graph
        if not meter.measured:
            return {}
        with self._lock:
            known = self._activation_figures.get(meter.key)
            if known is None:
                self._activation_figures[meter.key] = _ActivationFigures(dict(meter.by_layer))
                while len(self._activation_figures) > _ACTIVATION_KEYS:
                    del self._activation_figures[next(iter(self._activation_figures))]
            elif all(nbytes <= known.per_layer.get(layer, 0) for layer, nbytes in meter.by_layer.items()):
                if known.agreeing >= ACTIVATIONS_SETTLE:  # a re-metering agreed: meter less often
                    known.interval = min(2 * known.interval, ACTIVATIONS_REMETER_MOST)
                known.agreeing += 1
                known.charged = 0
            else:  # kept more than before: the larger figures, and settle again
                for layer, nbytes in meter.by_layer.items():
                    known.per_layer[layer] = max(known.per_layer.get(layer, 0), nbytes)
                known.agreeing, known.charged, known.interval = 1, 0, ACTIVATIONS_REMETER
        return meter.by_layer

    def record(self, task: Task, stage_copy: StageCopy) -> None:
        """Resolve a finished job's device-time spans: the device's compute time (pipeline metrics), the
        timeline's compute events and, when measuring, what the layers kept for backward (by the job's
        optimizer step) and, with ``measure_times``, per-layer times per microbatch (compute only, waits
        excluded), for the planner. A backward or fused job's time beyond its layers' forward calls is split
        among them by forward time. With the times go the job's compute bounds, from which
        :meth:`take_step_times` works out its fixed cost (``StepTimes.job_seconds``).

        Called when the job finishes, on its download stream after that stream has synchronized: the stream
        waited for the job's compute on the GPU, so its CUDA events are complete and resolve at no cost."""
        bounds = self._resolve_spans(task, stage_copy)
        if not self.measure:
            return
        job = task.job
        with self._lock:
            if stage_copy.activation_bytes:
                per_layer = self._activation_bytes.setdefault(task.window.number, {})
                for layer, nbytes in stage_copy.activation_bytes.items():
                    per_layer[layer] = max(per_layer.get(layer, 0), nbytes)
            if not self.measure_times or not bounds:
                return
            first, last = bounds[job.microbatches[0]], bounds[job.microbatches[-1]]
            # a backward job's first compute (its recompute ahead) waits for no other job's output
            gated = job.kind is not StageKind.BACKWARD
            self._job_spans[job.index] = (job.depends_on, gated, first[0], first[1], last[1])
            while len(self._job_spans) > _RECENT_JOBS:
                del self._job_spans[next(iter(self._job_spans))]
            if not stage_copy.forward_time or task.call.step <= self._steps_taken:
                return
            self._add_layer_times(task, stage_copy)

    def _resolve_spans(self, task: Task, stage_copy: StageCopy) -> dict[int, tuple[float, float]]:
        """The job's compute spans into the timeline, its compute time and its layers' forward times; returns,
        per microbatch, its first compute's start and its last one's end."""
        job = task.job
        compute_spans, stage_copy.compute_spans = stage_copy.compute_spans, []
        layer_spans, stage_copy.layer_spans = stage_copy.layer_spans, []
        bounds: dict[int, tuple[float, float]] = {}
        computed = 0.0
        for microbatch, kind, span in compute_spans:
            start, end = span.bounds()
            bounds[microbatch] = (bounds.get(microbatch, (start, end))[0], end)
            computed += end - start
            self.timeline.add_span(kind, job.label, start, end, device=job.device, job=job.index, microbatch=microbatch)
        # a backward job on kept graphs (stage.HeldGraph) continues its forward job's stage copy: its forward
        # times and compute time, as a recomputing job's would hold them, to which its backward adds
        stage_copy.compute_time += computed
        if stage_copy.device is not None:
            stage_copy.device.counters.compute_seconds += computed
        for layer, span in layer_spans:
            start, end = span.bounds()
            stage_copy.forward_time[layer] = stage_copy.forward_time.get(layer, 0.0) + (end - start)
        return bounds

    def _add_layer_times(self, task: Task, stage_copy: StageCopy) -> None:
        """The job's per-layer times per microbatch into its step's :class:`StepTimes` (under the lock)."""
        microbatches = task.job.num_microbatches
        forward_total = sum(stage_copy.forward_time.values())
        beyond_forward = max(stage_copy.compute_time - forward_total, 0.0)
        times = self._step_times.setdefault(task.call.step, StepTimes())
        times.jobs.append(task.job.index)
        for layer, forward in stage_copy.forward_time.items():
            times.forward.setdefault(layer, []).append(forward / microbatches)
            if task.kind is not StageKind.FORWARD:
                backward = beyond_forward * forward / (forward_total or 1.0)
                times.backward.setdefault(layer, []).append(backward / microbatches)


def estimate_autocast_copies(planner: Planner, trunk: Trunk, sources: UploadSources,
                             dtype: torch.dtype | None) -> None:
    """Before anything is measured: what autocast (to ``dtype``, None: off) will take for its weight copies in
    the fused and backward stages (:func:`~lightning_roundpipe.planning.partition.autocast_copy_bytes` of the
    float32 weights that do not travel in autocast's dtype already), so that the first plan leaves room for
    them."""
    estimate: dict[int, int] = {}
    if dtype is not None:
        transported = sources.transport == dtype
        for index, state in enumerate(trunk.states):
            cast = sum(param.numel() * param.element_size() for param in state.params
                       if param.dtype == torch.float32
                       and not (transported and sources.is_low_precision(index, param)))
            estimate[index] = autocast_copy_bytes(cast, autocast_itemsize=dtype.itemsize)
    planner.observe_activations(estimate, measured=False)
