"""One worker thread per device: turns stage jobs into stream operations, in ring order.

The worker never blocks on device work; it only enqueues operations on the device's four streams, and
events order them. A stream runs its operations one after another. ``wait X`` holds back that stream
only, until event X is set (on a GPU also until the work before X has run, waited for on the GPU);
``-> X`` records X when the stream gets there. Job ``k`` is this device's k-th job, ``m`` each of its
microbatches::

    param upload  [1] wait released[k-2]   [2] wait weights   [3] wait buffers
                  upload params -> params_ready ----------------------+
                                                                      |
    act upload    per m: [4] wait the host cells of input m           |
                         upload input m -> inputs_uploaded[m] --+     |
                                                                |     |
    compute       [5] wait params_ready <-----------------------|-----+
                  bind                                          |
                  per m: [6] wait inputs_uploaded[m] <----------+
                         compute m -> computed[m] --------------+
                  unbind -> job_computed ----------------+      |
                                                         |      |
    download      per m: [7] wait computed[m] <----------|------+
                         download m -> its host cells set ==> [4] of the jobs (or the caller) reading them
                  [8] wait job_computed <----------------+
                  finish -> released[k] ==> [1] of job k+2 on this device

[1] At most two stages are resident on a device: an upload waits until the job two back has released
    its memory. The worker enqueues job k+1's upload before job k's compute (prefetch), so the upload
    overlaps job k's compute once job k-1 is released.
[2] The weights of the last optimizer step queued before the job: sync mode waits until the step has
    written them, async mode until it has published its copy (see ``step/__init__.py``), each only for the
    parameters this stage uploads (the step runs stage by stage: ``step/groups.py``). A host wait,
    timed: it is the part of the step the pipeline does not hide.
[2'] A transparent call on a one-device ring keeps its deepest stage's forward graphs on the device for its
    backward (``stage.HeldGraph``): its first backward job uploads nothing, binds nothing and recomputes
    nothing. Instead of [1]-[3] its parameter stream waits for the forward job's finish and adopts that
    job's stage copy (released at this job's [8]); each microbatch uploads only its output gradient [4] and
    back-propagates the kept graph [6]. Its first microbatch's compute sets ``task.backpropagating`` as it
    starts, which the caller's backward waits for (``Dispatcher.run_backward``).
[3] A job that writes buffers (forward, fused) uploads them once the previous job writing the same
    layers' buffers has copied them back to the host (its [8]).
[4] The stage input (the previous stage's output, the call's inputs, or output gradients) and, for a
    backward job, its checkpoints and buffer snapshots: host cells another device's download fills.
[4'] A backward job's microbatch is two uploads and two computes: its checkpoints and snapshots upload,
    and its deepest recompute group (the whole stage at stage grain) recomputes, *ahead* of its output
    gradient, which uploads after them; the backward proper waits for it. The recompute then overlaps the
    previous stage's work instead of following it (a device runs a microbatch's recompute right after the
    previous microbatch's backward, as the paper's simulator does).
    On a one-device ring a training call's first backward job sets ``task.backpropagating`` as its first
    microbatch's backward proper starts, which the caller waits for before it gets the loss
    (``Dispatcher.run_training``): its Python then runs beside autograd's engine, not beside the recompute.
    Each cell is consumed after its copy, which drops the host value after its last counted reader. On a
    GPU the copy is only enqueued then (no host sync): the host memory outlives it (see ``upload``).
[5] Parameters and buffers are on the device: bind them into the device's layer replicas.
[6] Microbatch m computes once its own inputs are there. They have their own stream, so a long
    parameter prefetch never delays them, and input m+1 uploads while m computes.
[7] The host cells are filled once their copies are: on a CPU stand-in the download stream synchronizes
    first; on a GPU each cell carries a CUDA event recorded after its copies, which the reading upload
    stream waits for on the GPU ([4]) and a host reader (the caller) synchronizes. A stage boundary thus
    costs no host sync on a GPU, only GPU-side event waits.
[8] Every microbatch has computed and the replicas are unbound: the job's gradients go to the host, its
    buffers back to the host layers, its memory is released and ``released[k]`` set; the gradients are
    then summed into the step's window by the device's summing thread (``step/summing.py``), which nothing
    on the device waits for.

A microbatch's upload, compute and download run on three threads; they pass the device tensors on
through a :class:`_Handoff`, and each drops them as soon as the next one has them. What each operation
does is in ``operations.py`` (:class:`~lightning_roundpipe.engine.operations.StageOperations`); this
module decides only where and after what it runs.

Each microbatch's compute (and, for the planner, each layer call) is a device-time span of the compute
stream (``timing.py``: CUDA events on a GPU), resolved at [8], when the events are complete; the compute
events of the timeline and the device's compute seconds come from those spans. While a fused or backward
microbatch computes, what its layers save for backward is held in the device's residency
(``activations.py``) until its backward frees it.

In stress mode (``EngineOptions.stress``, CPU stand-ins only) every copy lands late (see ``device.py``)
and what the engine releases is poisoned where it is released: a microbatch's device inputs after its
compute, its device outputs after their download, a stage's copy at [8], and a downloaded host cell
after its last counted reader's copy [4]. Tensors the outputs or the stage's copy still share are kept.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from lightning_roundpipe.engine.call import PipelineError
from lightning_roundpipe.engine.device import (
    AbortSignal,
    Device,
    EngineAborted,
    HostEvent,
    error_hint,
    join_until,
)
from lightning_roundpipe.engine.feedback import Measurements
from lightning_roundpipe.engine.operations import DeviceInputs, DeviceOutputs, InputCells, StageOperations
from lightning_roundpipe.engine.stage import StageCopy, StageRunner, Task
from lightning_roundpipe.engine.step.summing import GradSummer


@dataclass
class _Handoff:
    """What one microbatch's upload, compute and download pass on: each field is set by one operation
    and taken by the next, after the event between them ([6], [7])."""

    inputs: DeviceInputs | None = None      # a backward job: the checkpoints and snapshots it recomputes from
    gradients: DeviceInputs | None = None   # a backward job's output gradients, uploaded after its checkpoints
    recomputed: DeviceInputs | None = None  # a backward job: from its recompute to its backward
    outputs: DeviceOutputs | None = None

    def take_inputs(self) -> DeviceInputs:
        inputs, self.inputs = self.inputs, None
        assert inputs is not None, "a compute ran before its inputs were uploaded"  # [6]
        return inputs

    def take_recomputed(self) -> DeviceInputs:
        """A backward microbatch's recomputed inputs, its output gradients now their layer input."""
        inputs, self.recomputed = self.recomputed, None
        gradients, self.gradients = self.gradients, None
        assert inputs is not None and gradients is not None, "the backward ran before its inputs"  # [6]
        inputs.layer_input, inputs.nbytes = gradients.layer_input, inputs.nbytes + gradients.nbytes
        return inputs

    def take_outputs(self) -> DeviceOutputs:
        outputs, self.outputs = self.outputs, None
        assert outputs is not None, "the download ran before its compute"  # [7]
        return outputs


class Worker:
    """One device's host thread: turns jobs into stream operations, in ring order."""

    def __init__(self, runner: StageRunner, measurements: Measurements, device: Device, abort: AbortSignal,
                 summer: GradSummer) -> None:
        self.runner = runner
        self._abort = abort
        self.device = device
        self.operations = StageOperations(runner, measurements, device, abort, summer)
        self._tasks: deque[Task | None] = deque()
        self._ready = threading.Condition()
        # touched by this worker's thread only: uploads enqueued ahead of their job, by job index, and
        # released[k] [1] by this device's job sequence number, the last three
        self._uploads: dict[int, tuple[StageCopy, HostEvent]] = {}
        self._released: dict[int, HostEvent] = {}
        self._thread = threading.Thread(target=self._run, name=f"roundpipe-worker{device.index}", daemon=True)
        self._thread.start()

    def put(self, task: Task | None) -> None:
        with self._ready:
            self._tasks.append(task)
            self._ready.notify()

    def close(self, deadline: float) -> str | None:
        """End the thread (it never blocks on device work, only enqueues it); wait until ``deadline`` at
        most and return its name if it is still running then."""
        self.put(None)
        return join_until(self._thread, deadline)

    def _take(self) -> Task | None:
        with self._ready:
            while not self._tasks:
                self._ready.wait()
            return self._tasks.popleft()

    def _peek(self) -> Task | None:
        with self._ready:
            return self._tasks[0] if self._tasks else None

    def _run(self) -> None:
        # the prefetch look-ahead below is the only place the worker side decides order: jobs run as the
        # engine dispatched them, and only the next job's upload is moved ahead of this job's compute [1]
        sequence = 0
        while True:
            task = self._take()
            if task is None:
                return
            if self._abort.aborted:
                continue
            try:
                if task.job.index not in self._uploads:
                    self._enqueue_upload(task, sequence)
                following = self._peek()
                if following is not None and following.job.index not in self._uploads:
                    self._enqueue_upload(following, sequence + 1)  # prefetch [1]
                self._enqueue_job(task, sequence)
            except BaseException as error:  # noqa: BLE001
                self._abort.fail(error)
            sequence += 1
            task = following = None  # hold no call alive while idle: its host activations would leak

    # ------------------------------------------------------------------ parameter stream
    def _enqueue_upload(self, task: Task, sequence: int) -> None:
        """Upload ``task``'s stage once the stage two jobs back on this device has been released."""
        stream, operations, job = self.device.param_stream, self.operations, task.job
        if task.uses_kept_graph:  # [2']
            assert task.held is not None and task.held.ready is not None and task.held.stage_copy is not None
            stage_copy = task.held.stage_copy  # made by this worker for the forward job, enqueued before
            stream.wait_event(task.held.ready)
            stream.submit(_named(partial(operations.adopt_kept_graph, task, stage_copy),
                                 lambda: f"adopting the kept graphs of stage {job.label} (job {job.index})",
                                 self.device))
            self._uploads[job.index] = (stage_copy, stream.record(
                f"the kept graphs of stage {job.label} (job {job.index}) adopted"))
            return
        if sequence >= 2:
            stream.wait_event(self._released[sequence - 2])  # [1]
        weights_ready = [event for event in task.weights_ready if not event.is_set()]
        if weights_ready:
            stream.submit(partial(operations.wait_for_weights, weights_ready))  # [2]
        for event in task.buffer_waits:
            stream.wait_event(event)  # [3]
        stage_copy = StageCopy(device=self.device)
        if task.held is not None:
            task.held.stage_copy = stage_copy
        stream.submit(_named(partial(operations.upload_params, task, stage_copy),
                             lambda: f"uploading the parameters of stage {job.label} (job {job.index}) to device "
                                     f"{self.device.index}", self.device))
        params_ready = stream.record(f"the parameters of stage {job.label} (job {job.index}) uploaded")
        self._uploads[job.index] = (stage_copy, params_ready)

    # ------------------------------------------------------------------ one job
    def _enqueue_job(self, task: Task, sequence: int) -> None:
        """Bind, every microbatch, unbind, then finish on the download stream and record ``released``."""
        runner, device, job = self.runner, self.device, task.job
        stage_copy, params_ready = self._uploads.pop(job.index)
        compute, download = device.compute_stream, device.download_stream
        where = f"stage {job.label} (job {job.index}) on device {device.index}"
        compute.wait_event(params_ready)  # [5]
        runs_layers = not task.uses_kept_graph  # back-propagating a kept graph runs no layer: nothing to bind
        if runs_layers:
            compute.submit(_named(partial(runner.bind, device, task, stage_copy), lambda: f"binding {where}",
                                  device))
        for microbatch in job.microbatches:
            self._enqueue_microbatch(task, stage_copy, microbatch)
        if runs_layers:
            # unbind on the compute stream: the next job on this device may reuse the same replicas
            compute.submit(_named(partial(runner.unbind, device, task), lambda: f"unbinding {where}", device))
        download.wait_event(compute.record(f"stage {job.label} (job {job.index}) computed"))  # [8]
        download.submit(_named(partial(self.operations.finish, task, stage_copy),
                               lambda: f"finishing {where} (its gradients and buffers to the host)", device))
        self._released[sequence] = download.record(f"stage {job.label} (job {job.index}) released")
        self._released.pop(sequence - 3, None)
        download.submit(task.done.set)

    # ------------------------------------------------------------------ one microbatch
    def _enqueue_microbatch(self, task: Task, stage_copy: StageCopy, microbatch: int) -> None:
        job, device, operations = task.job, self.device, self.operations
        where = f"stage {job.label} (job {job.index}) microbatch {microbatch} on device {device.index}"
        handoff = _Handoff()
        cells = operations.input_cells(task, microbatch)
        compute = device.compute_stream
        if task.recomputes:
            # [4'] the recompute needs only the checkpoints, on the host long before: it runs ahead of the
            # output gradient, so that only the backward proper waits for the previous stage
            recompute_inputs = InputCells(None, cells.checkpoints, cells.snapshots)
            compute.wait_event(self._enqueue_input_upload(task, microbatch, recompute_inputs, handoff, where))  # [6]

            def recompute() -> None:
                handoff.recomputed = operations.recompute(task, stage_copy, microbatch, handoff.take_inputs())

            compute.submit(_named(recompute, lambda: f"recomputing {where}", device))
            gradients = InputCells(cells.layer_input)
            compute.wait_event(self._enqueue_input_upload(task, microbatch, gradients, handoff, where,
                                                          gradients=True))
            take = handoff.take_recomputed
        else:
            compute.wait_event(self._enqueue_input_upload(task, microbatch, cells, handoff, where))  # [6]
            take = handoff.take_inputs

        started = task.backpropagating if microbatch == job.microbatches[0] else None

        def run() -> None:  # the inputs are passed on, not held here: the compute releases them
            if started is not None:
                started.set()
            handoff.outputs = operations.compute(task, stage_copy, microbatch, take())

        compute.submit(_named(run, lambda: f"computing {where}", device))
        device.download_stream.wait_event(compute.record(f"{where} computed"))  # [7]

        def download() -> None:
            operations.download(task, stage_copy, microbatch, handoff.take_outputs())

        device.download_stream.submit(_named(download, lambda: f"downloading the outputs of {where}", device))

    def _enqueue_input_upload(self, task: Task, microbatch: int, cells: InputCells, handoff: _Handoff,
                              where: str, *, gradients: bool = False) -> HostEvent:
        """[4] on the activation stream: ``cells`` to the device, into ``handoff.inputs`` (``gradients``: a
        backward job's output gradients, uploaded after its recompute inputs, into ``handoff.gradients``);
        returns the event after the copies (``inputs_uploaded[m]``)."""
        acts = self.device.act_stream
        for cell in cells.all():
            acts.wait_event(cell.event)  # [4]

        def upload() -> None:
            inputs = self.operations.upload_inputs(task, microbatch, cells)
            if gradients:
                handoff.gradients = inputs
            else:
                handoff.inputs = inputs

        acts.submit(_named(upload, lambda: f"uploading the inputs of {where}", self.device))
        return acts.record(f"the inputs of {where} uploaded")


def _named(operation: Callable[[], None], what: Callable[[], str], device: Device) -> Callable[[], None]:
    """``operation``, whose failure is reported as a :class:`PipelineError` saying ``what`` failed (the
    original error is its ``__cause__``). Errors that already say where they come from pass through."""
    def run() -> None:
        try:
            operation()
        except (PipelineError, EngineAborted, TimeoutError):
            raise
        except Exception as error:
            raise PipelineError(f"{what()} failed: {type(error).__name__}: {error}"
                               f"{error_hint(error, device.residency.advice)}") from error

    return run
