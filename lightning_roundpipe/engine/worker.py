"""One worker thread per device: turns stage jobs into stream operations, in ring order.

The worker never blocks on device work; it only enqueues operations on the device's four streams, and
events order them. A stream runs its operations one after another. ``wait X`` holds back that stream
only, until event X is set (on a GPU also until the work before X has run, waited for on the GPU);
``-> X`` records X when the stream gets there. Job ``k`` is this device's k-th job, ``m`` each of its
microbatches::

    param upload  [1] wait released[k-2]   [2] wait weights   [3] wait buffers
                  upload params -> params_ready ----------------------+
                                                                      |
    act upload    per m: [4] wait the host slots of input m           |
                         upload input m -> inputs_uploaded[m] --+     |
                                                                |     |
    compute       [5] wait params_ready <-----------------------|-----+
                  bind                                          |
                  per m: [6] wait inputs_uploaded[m] <----------+
                         compute m -> computed[m] --------------+
                  unbind -> job_computed ----------------+      |
                                                         |      |
    download      per m: [7] wait computed[m] <----------|------+
                         download m -> its host slots set ==> [4] of the jobs (or the caller) reading them
                  [8] wait job_computed <----------------+
                  finish -> released[k] ==> [1] of job k+2 on this device

[1] At most two stages are resident on a device: an upload waits until the job two back has released
    its memory. The worker enqueues job k+1's upload before job k's compute (prefetch), so the upload
    overlaps job k's compute once job k-1 is released.
[2] The weights of the last optimizer step queued before the job: sync mode waits until the step has
    written them, async mode until it has published its copy (see ``optim.py``), each only for the
    parameters this stage uploads (the step runs stage by stage: ``step_groups.py``). A host wait,
    timed: it is the part of the step the pipeline does not hide.
[3] A job that writes buffers (forward, fused) uploads them once the previous job writing the same
    layers' buffers has copied them back to the host (its [8]).
[4] The stage input (the previous stage's output, the call's inputs, or output gradients) and, for a
    backward job, its checkpoints and buffer snapshots: host slots another device's download fills.
[4'] A backward job's microbatch is two uploads and two computes: its checkpoints and snapshots upload,
    and its deepest recompute group (the whole stage at stage grain) recomputes, *ahead* of its output
    gradient, which uploads after them; the backward proper waits for it. The recompute then overlaps the
    previous stage's work instead of following it (a device runs a microbatch's recompute right after the
    previous microbatch's backward, as the paper's simulator does).
    Each slot is consumed after its copy, which drops the host value after its last counted reader. On a
    GPU the copy is only enqueued then (no host sync): the host memory outlives it (see ``upload``).
[5] Parameters and buffers are on the device: bind them into the device's layer replicas.
[6] Microbatch m computes once its own inputs are there. They have their own stream, so a long
    parameter prefetch never delays them, and input m+1 uploads while m computes.
[7] The host slots are filled once their copies are: on a CPU stand-in the download stream synchronizes
    first; on a GPU each slot carries a CUDA event recorded after its copies, which the reading upload
    stream waits for on the GPU ([4]) and a host reader (the caller) synchronizes. A stage boundary thus
    costs no host sync on a GPU, only GPU-side event waits.
[8] Every microbatch has computed and the replicas are unbound: the job's gradients go into the
    step's window, its buffers back to the host layers, its memory is released and ``released[k]`` set.

A microbatch's upload, compute and download run on three threads; they pass the device tensors on
through a :class:`_Handoff`, and each drops them as soon as the next one has them.

Each microbatch's compute (and, for the planner, each layer call) is a device-time span of the compute
stream (``timing.py``: CUDA events on a GPU), resolved at [8], when the events are complete; the compute
events of the timeline and the device's compute seconds come from those spans. While a fused or backward
microbatch computes, what its layers save for backward is held in the device's residency
(``activations.py``) until its backward frees it.

In stress mode (``EngineOptions.stress``, CPU stand-ins only) every copy lands late (see ``device.py``)
and what the engine releases is poisoned where it is released: a microbatch's device inputs after its
compute, its device outputs after their download, a stage's copy at [8], and a downloaded host slot
after its last counted reader's copy [4]. Tensors the outputs or the stage's copy still share are kept.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_roundpipe.engine.call import PipelineError, Slot
from lightning_roundpipe.engine.device import (
    AbortSignal,
    Device,
    EngineAborted,
    HostEvent,
    error_hint,
    join_until,
    poison,
)
from lightning_roundpipe.engine.feedback import Measurements
from lightning_roundpipe.engine.stage import Recomputed, StageCopy, StageRunner, Task
from lightning_roundpipe.engine.transfer import HOST, copy_tensor, copy_tree, tensors_nbytes, tree_nbytes, tree_tensors
from lightning_roundpipe.engine.transport import GradStaging
from lightning_roundpipe.planning.schedule import StageKind


@dataclass
class _InputSlots:
    """The host slots one microbatch of a job reads [4]."""

    layer_input: Slot | None  # the (args, kwargs) of the stage's first layer; backward: output gradients
    checkpoints: list[tuple[int, Slot]] = field(default_factory=list)  # backward: per recompute start, its input
    snapshots: list[tuple[int, Slot]] = field(default_factory=list)    # backward: buffers the forward saw

    def all(self) -> list[Slot]:
        first = [self.layer_input] if self.layer_input is not None else []
        return [*first, *(slot for _, slot in self.checkpoints), *(slot for _, slot in self.snapshots)]


@dataclass
class _DeviceInputs:
    """One microbatch's inputs on the device, from their upload until its compute has run."""

    layer_input: Any        # None in a backward job's recompute inputs (its output gradients come separately)
    checkpoints: dict[int, Any]
    snapshots: dict[int, Any]
    target: Any = None      # fused job: the loss target
    nbytes: int = 0         # accounted on the device until the compute has run


@dataclass
class _DeviceOutputs:
    """One microbatch's results on the device, from its compute until their download."""

    output: Any             # the next stage's input; for a fused or backward job, the stage input's gradients
    checkpoints: dict[int, Any] = field(default_factory=dict)              # forward job
    snapshots: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # forward job
    loss: torch.Tensor | None = None                                        # fused job
    nbytes: int = 0         # accounted on the device until the download has run (the loss excepted)


@dataclass
class _Handoff:
    """What one microbatch's upload, compute and download pass on: each field is set by one operation
    and taken by the next, after the event between them ([6], [7])."""

    inputs: _DeviceInputs | None = None      # a backward job's: the checkpoints and snapshots it recomputes from
    gradients: _DeviceInputs | None = None   # a backward job's output gradients, uploaded after its checkpoints
    recomputed: tuple[Recomputed, _DeviceInputs] | None = None  # a backward job: from its recompute to its backward
    outputs: _DeviceOutputs | None = None


class Worker:
    """One device's host thread: turns jobs into stream operations, in ring order."""

    def __init__(self, runner: StageRunner, measurements: Measurements, device: Device, abort: AbortSignal) -> None:
        self.runner = runner
        self.measurements = measurements
        self._abort = abort
        self.device = device
        self._tasks: deque[Task | None] = deque()
        self._ready = threading.Condition()
        # touched by this worker's thread only: uploads enqueued ahead of their job, by job index, and
        # released[k] [1] by this device's job sequence number, the last three
        self._uploads: dict[int, tuple[StageCopy, HostEvent]] = {}
        self._released: dict[int, HostEvent] = {}
        # gradients download into one reused host buffer: pinned on CUDA, and in stress mode on CPU stand-ins
        # (which poison it once the window has copied out of it)
        reuse = device.pin_downloads or device.stress
        self._grad_staging = GradStaging(pin=device.pin_downloads) if reuse else None
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
        stream = self.device.param_stream
        if sequence >= 2:
            stream.wait_event(self._released[sequence - 2])  # [1]
        weights_ready = [event for event in task.weights_ready if not event.is_set()]
        if weights_ready:
            stream.submit(lambda: self._wait_for_weights(weights_ready))  # [2]
        for event in task.buffer_waits:
            stream.wait_event(event)  # [3]
        stage_copy = StageCopy(device=self.device)
        job = task.job
        stream.submit(_named(lambda: self._upload_params(task, stage_copy),
                             lambda: f"uploading the parameters of stage {job.label} (job {job.index}) to device "
                                     f"{self.device.index}", self.device))
        params_ready = stream.record(f"the parameters of stage {job.label} (job {job.index}) uploaded")
        self._uploads[job.index] = (stage_copy, params_ready)

    def _wait_for_weights(self, weights_ready: list[HostEvent]) -> None:
        """[2], timed: how much of the host step the devices see."""
        start = self.runner.timeline.now()
        for event in weights_ready:
            event.wait(self._abort)
        self.device.counters.weight_wait_seconds += self.runner.timeline.now() - start

    def _upload_params(self, task: Task, stage_copy: StageCopy) -> None:
        start = self.runner.timeline.now()
        self.runner.upload_stage(self.device, task, stage_copy)
        task.upload_done.set()
        task.window.upload_finished()  # an async step may now publish what this upload read
        self.runner.timeline.add(self.device.index, task.job.index, task.job.label, -1, "upload_params", start)

    # ------------------------------------------------------------------ one job
    def _enqueue_job(self, task: Task, sequence: int) -> None:
        """Bind, every microbatch, unbind, then finish on the download stream and record ``released``."""
        runner, device, job = self.runner, self.device, task.job
        stage_copy, params_ready = self._uploads.pop(job.index)
        compute, download = device.compute_stream, device.download_stream
        where = f"stage {job.label} (job {job.index}) on device {device.index}"
        compute.wait_event(params_ready)  # [5]
        compute.submit(_named(lambda: runner.bind(device, task, stage_copy), lambda: f"binding {where}", device))
        for microbatch in job.microbatches:
            self._enqueue_microbatch(task, stage_copy, microbatch)
        # unbind on the compute stream: the next job on this device may reuse the same replicas
        compute.submit(_named(lambda: runner.unbind(device, task), lambda: f"unbinding {where}", device))
        download.wait_event(compute.record(f"stage {job.label} (job {job.index}) computed"))  # [8]
        download.submit(_named(lambda: self._finish(task, stage_copy),
                               lambda: f"finishing {where} (its gradients and buffers to the host)", device))
        self._released[sequence] = download.record(f"stage {job.label} (job {job.index}) released")
        self._released.pop(sequence - 3, None)
        download.submit(task.done.set)

    def _finish(self, task: Task, stage_copy: StageCopy) -> None:
        """[8] on the download stream: gradients into the window, buffers to the host, memory released."""
        runner, device, job = self.runner, self.device, task.job
        start = runner.timeline.now()
        # the stage's compute has run on the GPU (this stream waited for it there) before its memory is
        # released below, also for a forward stage that downloads nothing that would wait for it
        device.download_stream.synchronize()
        if task.needs_grad:
            self._download_gradients(task, stage_copy)
        if job.kind is not StageKind.BACKWARD:  # a backward job recomputes on snapshots and writes no buffer
            with torch.no_grad():
                for layer in job.layers:
                    # the module's buffers as collected when the job was dispatched: the engine follows a
                    # buffer the module was given anew (SWA's BatchNorm reset) only once every job dispatched
                    # before has finished here, so the new tensor keeps what its owner assigned
                    host_buffers = runner.trunk.states[layer].buffers
                    for host, copied in zip(host_buffers, stage_copy.buffers[layer], strict=True):
                        host.copy_(copied)
                    if layer in task.buffer_done:
                        task.buffer_done[layer].set()  # [3] of the next job that writes these buffers
        self.measurements.record(task, stage_copy)
        device.residency.release(stage_copy.nbytes, stage=True)
        if device.stress:  # the stage's copy is released: nothing may read it any more
            poison(stage_copy.tensors())
        stage_copy.params.clear()
        stage_copy.buffers.clear()
        if task.needs_grad:
            task.window.job_finished()
        runner.timeline.add(device.index, job.index, job.label, -1, "release", start)

    def _download_gradients(self, task: Task, stage_copy: StageCopy) -> None:
        """The job's gradients into the step's window: every copy enqueued at once (into the reused staging
        buffer where there is one), one synchronize, then the window sums them in the masters' dtype."""
        device = self.device
        start = self.runner.timeline.now()
        # one per slot the window expects of this job, in its order; None where no gradient reached a copy
        slots = [stage_copy.params[layer][position].grad for layer, position in task.grad_slots]
        grads = [grad for grad in slots if grad is not None]
        staging = self._grad_staging
        if staging is not None:
            host = staging.views(grads)
            for target, grad in zip(host, grads, strict=True):
                target.copy_(grad, non_blocking=True)
        else:
            host = [copy_tensor(grad, HOST) for grad in grads]
        device.download_stream.copy_late(grads, host)  # stress mode: they land at the synchronize
        device.download_stream.synchronize()
        downloaded = iter(host)
        task.window.deliver(task.ticket, [None if grad is None else next(downloaded) for grad in slots],
                            borrowed=staging is not None)
        if device.stress and staging is not None:
            poison(host)  # the window has its copies: the next job may overwrite the staging buffer
        device.counters.gradient_download_seconds += self.runner.timeline.now() - start

    # ------------------------------------------------------------------ one microbatch
    def _enqueue_microbatch(self, task: Task, stage_copy: StageCopy, microbatch: int) -> None:
        job, device = task.job, self.device
        where = f"stage {job.label} (job {job.index}) microbatch {microbatch} on device {device.index}"
        handoff = _Handoff()
        slots = self._input_slots(task, microbatch)
        compute = device.compute_stream
        if job.kind is StageKind.BACKWARD:
            # [4'] the recompute needs only the checkpoints, on the host long before: it runs ahead of the
            # output gradient, so that only the backward proper waits for the previous stage
            recompute_inputs = _InputSlots(None, slots.checkpoints, slots.snapshots)
            compute.wait_event(self._enqueue_input_upload(task, microbatch, recompute_inputs, handoff, where))  # [6]
            self._enqueue_recompute(task, stage_copy, microbatch, handoff, where)
            gradients = _InputSlots(slots.layer_input)
            compute.wait_event(self._enqueue_input_upload(task, microbatch, gradients, handoff, where,
                                                          gradients=True))
        else:
            compute.wait_event(self._enqueue_input_upload(task, microbatch, slots, handoff, where))  # [6]
        computed = self._enqueue_compute(task, stage_copy, microbatch, handoff, where)
        device.download_stream.wait_event(computed)  # [7]
        self._enqueue_download(task, stage_copy, microbatch, handoff, where)

    def _input_slots(self, task: Task, microbatch: int) -> _InputSlots:
        call, job = task.call, task.job
        slots = _InputSlots(call.input_slot(job, microbatch))
        if job.kind is StageKind.BACKWARD:
            starts = [job.layers.start] if self.runner.recompute == "stage" else list(job.layers)
            slots.checkpoints = [  # layer 0 recomputes from the call's own input
                (layer, call.checkpoints[(layer, microbatch)] if layer != 0 else call.inputs[microbatch])
                for layer in starts]
            slots.snapshots = [(layer, call.snapshots[(layer, microbatch)]) for layer in job.layers
                               if (layer, microbatch) in call.snapshots]
        return slots

    def _enqueue_input_upload(self, task: Task, microbatch: int, slots: _InputSlots, handoff: _Handoff,
                              where: str, *, gradients: bool = False) -> HostEvent:
        """[4] on the activation stream: ``slots`` to the device, into ``handoff.inputs`` (``gradients``: a
        backward job's output gradients, uploaded after its recompute inputs, into ``handoff.gradients``);
        returns the event after the copies (``inputs_uploaded[m]``)."""
        runner, device, job, call = self.runner, self.device, task.job, task.call
        acts, compute = device.act_stream, device.compute_stream
        for slot in slots.all():
            acts.wait_event(slot.event)  # [4]

        def upload() -> None:
            start = runner.timeline.now()
            target_device, asynchronous = device.torch_device, device.is_cuda

            def to_device(tree: Any) -> Any:
                copied = copy_tree(tree, target_device, asynchronous)
                if acts.stress:  # lands late, at the synchronize below
                    acts.copy_late(tree_tensors(tree), tree_tensors(copied))
                return copied

            inputs = _DeviceInputs(
                layer_input=to_device(slots.layer_input.value) if slots.layer_input is not None else None,
                checkpoints={layer: to_device(slot.value) for layer, slot in slots.checkpoints},
                snapshots={layer: to_device(slot.value) for layer, slot in slots.snapshots},
                target=to_device(call.fused_loss.targets[microbatch]) if job.kind is StageKind.FUSED else None,
            )
            if not device.is_cuda:
                acts.synchronize()  # stand-ins: the late copies land before the host sources are dropped below
            # on CUDA no host sync: a source may be dropped while its copy runs, as torch's caching host
            # allocator keeps a pinned block (every download lands in one) until the copies recorded on it
            # have run, and a pageable source is staged before the copy call returns; the compute stream
            # waits for the copies on the GPU ([6])
            for slot in slots.all():
                slot.consume()  # copied: the host copy is dropped once its last counted reader has it
            tensors = tree_tensors([inputs.layer_input, inputs.checkpoints, inputs.snapshots, inputs.target])
            if compute.cuda_stream is not None:
                # allocated on this stream, used by compute: the compute thread drops them as soon as it has
                # enqueued its kernels, so the allocator must not reuse them before those kernels have run
                for tensor in tensors:
                    tensor.record_stream(compute.cuda_stream)
            inputs.nbytes = tensors_nbytes(tensors)
            device.residency.allocate(inputs.nbytes, f"the inputs of {job.label} microbatch {microbatch}")
            device.counters.uploaded_activation_bytes += inputs.nbytes
            if gradients:
                handoff.gradients = inputs
            else:
                handoff.inputs = inputs
            runner.timeline.add(device.index, job.index, job.label, microbatch, "upload_acts", start)

        acts.submit(_named(upload, lambda: f"uploading the inputs of {where}", device))
        return acts.record(f"the inputs of {where} uploaded")

    def _enqueue_recompute(self, task: Task, stage_copy: StageCopy, microbatch: int, handoff: _Handoff,
                           where: str) -> None:
        """A backward job's recompute of one microbatch, ahead of its output gradient ([4'])."""
        runner, device = self.runner, self.device

        def run() -> None:
            inputs, handoff.inputs = handoff.inputs, None
            assert inputs is not None, "the recompute ran before its checkpoints were uploaded"  # [6]
            stage_copy.activations = self.measurements.activation_meter(device, task, stage_copy,
                                                             tree_tensors([inputs.checkpoints, inputs.snapshots]))
            timer = device.compute_timer
            started = timer.start()
            recomputed = runner.recompute_microbatch(device, task, stage_copy, microbatch, inputs.checkpoints,
                                                     inputs.snapshots)
            stage_copy.compute_spans.append((microbatch, "recompute", timer.stop(started)))
            handoff.recomputed = (recomputed, inputs)

        device.compute_stream.submit(_named(run, lambda: f"recomputing {where}", device))

    def _enqueue_compute(self, task: Task, stage_copy: StageCopy, microbatch: int, handoff: _Handoff,
                         where: str) -> HostEvent:
        """The microbatch's forward, fused or backward compute; returns ``computed[m]``."""
        runner, device, job, call = self.runner, self.device, task.job, task.call

        def run() -> None:
            recomputed = None
            if job.kind is StageKind.BACKWARD:
                pending, handoff.recomputed = handoff.recomputed, None
                gradients, handoff.gradients = handoff.gradients, None
                assert pending is not None and gradients is not None, "the backward ran before its inputs"  # [6]
                recomputed, inputs = pending
                inputs.layer_input, inputs.nbytes = gradients.layer_input, inputs.nbytes + gradients.nbytes
            else:
                taken, handoff.inputs = handoff.inputs, None
                assert taken is not None, "the compute ran before its inputs were uploaded"  # [6]
                inputs = taken
                if task.needs_grad:  # what the layers save for backward is held in the residency until freed
                    stage_copy.activations = self.measurements.activation_meter(device, task, stage_copy, tree_tensors(
                        [inputs.layer_input, inputs.checkpoints, inputs.snapshots, inputs.target]))
            timer = device.compute_timer  # device time, resolved when the job finishes (timing.py)
            started = timer.start()
            if job.kind is StageKind.FORWARD:
                with call.context.applied(grad=False):
                    output, checkpoints, snapshots = runner.forward_microbatch(
                        device, task, stage_copy, microbatch, inputs.layer_input)
                outputs = _DeviceOutputs(output, checkpoints, snapshots)
            elif job.kind is StageKind.FUSED:
                loss, input_grads = runner.fused_microbatch(
                    device, task, stage_copy, microbatch, inputs.layer_input, inputs.target)
                outputs = _DeviceOutputs(input_grads, loss=loss)
            else:
                assert recomputed is not None
                outputs = _DeviceOutputs(runner.backward_microbatch(
                    device, task, stage_copy, microbatch, recomputed, inputs.checkpoints, inputs.snapshots,
                    inputs.layer_input))
            del recomputed  # its graph, if no gradient reached it
            stage_copy.compute_spans.append((microbatch, job.kind.name.lower(), timer.stop(started)))
            meter, stage_copy.activations = stage_copy.activations, None
            if meter is not None:  # what no backward freed went with the compute's autograd graph
                for layer, nbytes in self.measurements.activations_done(meter).items():
                    stage_copy.activation_bytes[layer] = max(stage_copy.activation_bytes.get(layer, 0), nbytes)
            device.residency.release(inputs.nbytes)
            if device.stress:  # released: poison what the outputs or the stage do not share
                _poison_unshared(tree_tensors([inputs.layer_input, inputs.checkpoints, inputs.snapshots,
                                               inputs.target]),
                                 [*tree_tensors([outputs.output, outputs.checkpoints, outputs.snapshots]),
                                  *([outputs.loss] if outputs.loss is not None else []), *stage_copy.tensors()])
            del inputs  # the device inputs may be freed now
            outputs.nbytes = tree_nbytes([outputs.output, outputs.checkpoints, outputs.snapshots])
            device.residency.allocate(outputs.nbytes, f"the outputs of {job.label} microbatch {microbatch}")
            handoff.outputs = outputs

        device.compute_stream.submit(_named(run, lambda: f"computing {where}", device))
        return device.compute_stream.record(f"{where} computed")

    def _enqueue_download(self, task: Task, stage_copy: StageCopy, microbatch: int, handoff: _Handoff,
                          where: str) -> None:
        """The microbatch's results into their host slots, which set the events other jobs wait for [4]."""
        runner, device, job, call = self.runner, self.device, task.job, task.call
        output_slot = call.outputs[job.index][microbatch]

        def store() -> None:
            start = runner.timeline.now()
            outputs, handoff.outputs = handoff.outputs, None
            assert outputs is not None, "the download ran before its compute"  # [7]
            pin = device.pin_downloads
            checkpoints = {layer: copy_tree(value, HOST, pin=pin) for layer, value in outputs.checkpoints.items()}
            snapshots = {layer: [copy_tensor(buffer, HOST, pin=pin) for buffer in buffers]
                         for layer, buffers in outputs.snapshots.items()}
            loss = copy_tensor(outputs.loss, HOST, pin=pin) if outputs.loss is not None else None
            output = copy_tree(outputs.output, HOST, pin=pin)
            stress = device.stress
            released = tree_tensors([outputs.output, outputs.checkpoints, outputs.snapshots, outputs.loss])
            if stress:  # the host copies land late, at the synchronize below
                device.download_stream.copy_late(released, tree_tensors([output, checkpoints, snapshots, loss]))
            # on a GPU no host sync: the slots carry a CUDA event after the copies, which a reading stream waits
            # for on the GPU and a host reader synchronizes; the device outputs, dropped below, keep their
            # memory until the copies are done. A CPU stand-in's copies are complete (landed) at the synchronize.
            download = device.download_stream
            copied = download.mark()
            if copied is None or download.cuda_stream is None:
                download.synchronize()
            else:
                for tensor in released:
                    tensor.record_stream(download.cuda_stream)
            for layer, value in checkpoints.items():
                call.checkpoints[(layer, microbatch)].put(value, poison_on_drop=stress, copied=copied)
            for layer, value in snapshots.items():
                call.snapshots[(layer, microbatch)].put(value, poison_on_drop=stress, copied=copied)
            if loss is not None:
                call.fused_loss.losses[microbatch].put(loss, copied=copied)
            output_slot.put(output, poison_on_drop=stress, copied=copied)
            device.residency.release(outputs.nbytes)
            if stress:  # downloaded: the device outputs are released (the stage's copy is released later)
                _poison_unshared(released, stage_copy.tensors())
            runner.timeline.add(device.index, job.index, job.label, microbatch, "download", start)

        device.download_stream.submit(_named(store, lambda: f"downloading the outputs of {where}", device))


def _poison_unshared(released: list[torch.Tensor], kept: list[torch.Tensor]) -> None:
    """Stress mode: poison the ``released`` tensors whose memory none of ``kept`` shares (a layer may return
    its input, or a view of it, and a ``NoGrad`` travels on unchanged)."""
    shared = {tensor.untyped_storage().data_ptr() for tensor in kept}
    poison([tensor for tensor in released if tensor.untyped_storage().data_ptr() not in shared])


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
