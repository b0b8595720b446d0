"""What each stream operation of a stage job does on one device: the bodies the worker enqueues.

``worker.py`` decides on which stream and after which events an operation runs (its diagram's markers
[1]-[8] are cited here); :class:`StageOperations` is what runs then: the parameter upload, a microbatch's
input upload, recompute, compute and download, and the job's finish. Each takes what the operation before
it produced and returns what the next one takes, and keeps the device's books as it goes: the residency
(what the device holds), its counters, the timeline, the activation meter, and stress mode's poisoning of
what it releases (``device.py``). The layers themselves run in :class:`~lightning_roundpipe.engine.stage.StageRunner`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_roundpipe.engine.call import HostCell
from lightning_roundpipe.engine.device import AbortSignal, Device, HostEvent
from lightning_roundpipe.engine.feedback import Measurements
from lightning_roundpipe.engine.stage import Recomputed, StageCopy, StageRunner, Task
from lightning_roundpipe.engine.step.summing import GradSummer
from lightning_roundpipe.engine.transfer import (
    download_to_host,
    tree_nbytes,
    tree_tensors,
    upload_to,
)
from lightning_roundpipe.engine.transport import GradStaging, WideGradSums
from lightning_roundpipe.planning.schedule import StageKind


@dataclass
class InputCells:
    """The host cells one microbatch of a job reads [4]."""

    layer_input: HostCell | None  # the (args, kwargs) of the stage's first layer; backward: output gradients
    checkpoints: list[tuple[int, HostCell]] = field(default_factory=list)  # backward: per recompute start, its input
    snapshots: list[tuple[int, HostCell]] = field(default_factory=list)    # backward: buffers the forward saw

    def all(self) -> list[HostCell]:
        first = [self.layer_input] if self.layer_input is not None else []
        return [*first, *(cell for _, cell in self.checkpoints), *(cell for _, cell in self.snapshots)]


@dataclass
class DeviceInputs:
    """One microbatch's inputs on the device, from their upload until its compute has run."""

    layer_input: Any        # None in a backward job's recompute inputs (its output gradients come separately)
    checkpoints: dict[int, Any]
    snapshots: dict[int, Any]
    target: Any = None      # fused job: the loss target
    nbytes: int = 0         # accounted on the device until the compute has run
    recomputed: Recomputed | None = None  # a backward job: from its recompute to its backward


@dataclass
class DeviceOutputs:
    """One microbatch's results on the device, from its compute until their download."""

    output: Any             # the next stage's input; for a fused or backward job, the stage input's gradients
    checkpoints: dict[int, Any] = field(default_factory=dict)              # forward job
    snapshots: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # forward job
    loss: torch.Tensor | None = None                                        # fused job
    nbytes: int = 0         # accounted on the device until the download has run (the loss excepted)


class StageOperations:
    """The stream operations of stage jobs on one device (one per worker)."""

    def __init__(self, runner: StageRunner, measurements: Measurements, device: Device, abort: AbortSignal,
                 summer: GradSummer) -> None:
        self.runner = runner
        self.measurements = measurements
        self.device = device
        self._abort = abort
        self._timeline = runner.timeline
        self._summer = summer
        # gradients download into reused host buffers (pinned on CUDA; in stress mode poisoned once summed)
        self.grad_staging = GradStaging(pin=device.pin_downloads)
        self.wide_sums = WideGradSums()  # low-precision leaves' gradients, summed over microbatches in float32

    # ------------------------------------------------------------------ parameter stream
    def wait_for_weights(self, weights_ready: list[HostEvent]) -> None:
        """[2], timed: how much of the host step the devices see."""
        start = self._timeline.now()
        for event in weights_ready:
            event.wait(self._abort)
        self.device.counters.weight_wait_seconds += self._timeline.now() - start

    def upload_params(self, task: Task, stage_copy: StageCopy) -> None:
        start = self._timeline.now()
        self.runner.upload_stage(self.device, task, stage_copy)
        self._stage_on_device(task, stage_copy)
        self._timeline.add("upload_params", task.job.label, start, device=self.device.index, job=task.job.index)

    def adopt_kept_graph(self, task: Task, stage_copy: StageCopy) -> None:
        """[2'] instead of the upload of a backward job that uses its call's kept graphs: the forward job's
        stage copy (``stage_copy``) becomes this job's, released at its finish."""
        assert task.held is not None
        task.held.adopt()
        self._stage_on_device(task, stage_copy)

    def _stage_on_device(self, task: Task, stage_copy: StageCopy) -> None:
        """The job's stage is on the device (uploaded or adopted): its float32 gradient sums where it needs them,
        then the job's upload is done."""
        if task.needs_grad and len(task.job.microbatches) > 1:
            self._sum_wide(task, stage_copy)
        task.upload_done.set()
        task.window.upload_finished()  # an async step may now publish what this upload read

    def _sum_wide(self, task: Task, stage_copy: StageCopy) -> None:
        """Trained leaves uploaded narrower than their masters (the transport dtype) sum their gradients over
        the job's microbatches in the master's dtype (``WideGradSums``), accounted with the stage: the sums
        instead of the narrow gradients the upload counted (as ``transport.layer_device_bytes`` plans them)."""
        states = self.runner.trunk.states
        narrow = [(copied, param.dtype) for layer in task.job.layers
                  for param, copied in zip(states[layer].params, stage_copy.params[layer], strict=True)
                  if param.requires_grad and copied.dtype != param.dtype]
        if narrow:
            wider = self.wide_sums.watch(narrow) - sum(leaf.numel() * leaf.element_size() for leaf, _ in narrow)
            self.device.residency.allocate(wider, f"the float32 gradient sums of stage {task.job.label}")
            stage_copy.nbytes += wider  # released with the stage

    # ------------------------------------------------------------------ activation stream
    def input_cells(self, task: Task, microbatch: int) -> InputCells:
        """The host cells the job's ``microbatch`` reads: its layer input and, for a backward job, the
        checkpoints its recompute groups start from and the buffer snapshots the forward saw."""
        call, job = task.call, task.job
        cells = InputCells(call.input_cell(job, microbatch))
        if task.recomputes:
            starts = [job.layers.start] if self.runner.recompute == "stage" else list(job.layers)
            cells.checkpoints = [  # layer 0 recomputes from the call's own input
                (layer, call.checkpoints[(layer, microbatch)] if layer != 0 else call.inputs[microbatch])
                for layer in starts]
            cells.snapshots = [(layer, call.snapshots[(layer, microbatch)]) for layer in job.layers
                               if (layer, microbatch) in call.snapshots]
        return cells

    def upload_inputs(self, task: Task, microbatch: int, cells: InputCells) -> DeviceInputs:
        """[4] ``cells`` to the device, for the compute stream; each cell is consumed once copied."""
        device, job = self.device, task.job
        start = self._timeline.now()
        target = task.call.fused_loss.targets[microbatch] if job.kind is StageKind.FUSED else None
        layer_input, checkpoints, snapshots, target = upload_to(
            (cells.layer_input.value if cells.layer_input is not None else None,
             {layer: cell.value for layer, cell in cells.checkpoints},
             {layer: cell.value for layer, cell in cells.snapshots}, target),
            device.torch_device, device.act_stream, device.compute_stream)
        for cell in cells.all():
            cell.consume()  # copied: the host copy is dropped once its last counted reader has it
        inputs = DeviceInputs(layer_input, checkpoints, snapshots, target)
        inputs.nbytes = tree_nbytes([layer_input, checkpoints, snapshots, target])
        device.residency.allocate(inputs.nbytes, f"the inputs of {job.label} microbatch {microbatch}")
        device.counters.uploaded_activation_bytes += inputs.nbytes
        self._timeline.add("upload_acts", job.label, start, device=device.index, job=job.index, microbatch=microbatch)
        return inputs

    # ------------------------------------------------------------------ compute stream
    def recompute(self, task: Task, stage_copy: StageCopy, microbatch: int, inputs: DeviceInputs) -> DeviceInputs:
        """A backward job's recompute of one microbatch, ahead of its output gradient ([4']): ``inputs``
        with what it recomputed."""
        device = self.device
        stage_copy.activations = self.measurements.activation_meter(
            device, task, stage_copy, tree_tensors([inputs.checkpoints, inputs.snapshots]))
        timer = device.compute_timer
        started = timer.start()
        inputs.recomputed = self.runner.recompute_microbatch(device, task, stage_copy, microbatch,
                                                             inputs.checkpoints, inputs.snapshots)
        stage_copy.compute_spans.append((microbatch, "recompute", timer.stop(started)))
        return inputs

    def compute(self, task: Task, stage_copy: StageCopy, microbatch: int, inputs: DeviceInputs) -> DeviceOutputs:
        """The microbatch's forward, fused or backward compute (a backward one continues from
        :meth:`recompute`, its output gradients as ``inputs.layer_input``); the inputs are released after it."""
        device = self.device
        if task.needs_grad and task.kind is not StageKind.BACKWARD:
            # what the layers save for backward is held in the residency until freed
            stage_copy.activations = self.measurements.activation_meter(device, task, stage_copy, tree_tensors(
                [inputs.layer_input, inputs.checkpoints, inputs.snapshots, inputs.target]))
        timer = device.compute_timer  # device time, resolved when the job finishes (timing.py)
        started = timer.start()
        outputs = self._run(task, stage_copy, microbatch, inputs)
        stage_copy.compute_spans.append((microbatch, task.kind.name.lower(), timer.stop(started)))
        meter, stage_copy.activations = stage_copy.activations, None
        if meter is not None:  # what no backward freed went with the compute's autograd graph
            for layer, nbytes in self.measurements.activations_done(meter).items():
                stage_copy.activation_bytes[layer] = max(stage_copy.activation_bytes.get(layer, 0), nbytes)
        device.residency.release(inputs.nbytes)
        if not task.keeps_graph:  # a kept graph may have saved its inputs
            # released: poison what the outputs or the stage do not share
            device.stress_mode.poison_released(
                [inputs.layer_input, inputs.checkpoints, inputs.snapshots, inputs.target],
                [outputs.output, outputs.checkpoints, outputs.snapshots, outputs.loss, stage_copy.tensors()])
        del inputs  # the device inputs may be freed now
        outputs.nbytes = tree_nbytes([outputs.output, outputs.checkpoints, outputs.snapshots])
        device.residency.allocate(outputs.nbytes, f"the outputs of {task.job.label} microbatch {microbatch}")
        return outputs

    def _run(self, task: Task, stage_copy: StageCopy, microbatch: int, inputs: DeviceInputs) -> DeviceOutputs:
        """The stage's layers on one microbatch, by job kind."""
        runner, device = self.runner, self.device
        if task.keeps_graph:
            return DeviceOutputs(runner.forward_keeping_graph(device, task, stage_copy, microbatch,
                                                              inputs.layer_input))
        if task.uses_kept_graph:
            return DeviceOutputs(runner.backward_kept_graph(task, microbatch, inputs.layer_input))
        if task.kind is StageKind.FORWARD:
            with task.call.context.applied(grad=False):
                output, checkpoints, snapshots = runner.forward_microbatch(
                    device, task, stage_copy, microbatch, inputs.layer_input)
            return DeviceOutputs(output, checkpoints, snapshots)
        if task.kind is StageKind.FUSED:
            loss, input_grads = runner.fused_microbatch(
                device, task, stage_copy, microbatch, inputs.layer_input, inputs.target)
            return DeviceOutputs(input_grads, loss=loss)
        recomputed, inputs.recomputed = inputs.recomputed, None
        assert recomputed is not None, "the backward ran before its recompute"  # [6]
        return DeviceOutputs(runner.backward_microbatch(
            device, task, stage_copy, microbatch, recomputed, inputs.checkpoints, inputs.snapshots,
            inputs.layer_input))  # the recomputed graph, if no gradient reached it, goes on return

    # ------------------------------------------------------------------ download stream
    def download(self, task: Task, stage_copy: StageCopy, microbatch: int, outputs: DeviceOutputs) -> None:
        """The microbatch's results into their host cells, which set the events other jobs wait for [4]."""
        device, job, call = self.device, task.job, task.call
        start = self._timeline.now()
        stress = device.stress
        (checkpoints, snapshots, loss, output), copied = download_to_host(
            (outputs.checkpoints, outputs.snapshots, outputs.loss, outputs.output), device.download_stream,
            pin=device.pin_downloads)
        for layer, value in checkpoints.items():
            call.checkpoints[(layer, microbatch)].put(value, poison_on_drop=stress, copied=copied)
        for layer, value in snapshots.items():
            call.snapshots[(layer, microbatch)].put(value, poison_on_drop=stress, copied=copied)
        if loss is not None:
            call.fused_loss.losses[microbatch].put(loss, copied=copied)
        call.outputs[job.index][microbatch].put(output, poison_on_drop=stress, copied=copied)
        device.residency.release(outputs.nbytes)
        if not task.keeps_graph:  # a kept graph's outputs are in it
            # downloaded: the device outputs are released (the stage's copy is released later)
            device.stress_mode.poison_released(
                [outputs.output, outputs.checkpoints, outputs.snapshots, outputs.loss], stage_copy.tensors())
        self._timeline.add("download", job.label, start, device=device.index, job=job.index, microbatch=microbatch)

    def finish(self, task: Task, stage_copy: StageCopy) -> None:
        """[8]: gradients to the host, buffers to the host, measurements resolved, memory released; then the
        gradients are summed into the window on the summing thread, which no device waits for."""
        device, job = self.device, task.job
        start = self._timeline.now()
        # the stage's compute has run on the GPU (this stream waited for it there) before its memory is
        # released below, also for a forward stage that downloads nothing that would wait for it
        device.download_stream.synchronize()
        downloaded = self._download_gradients(task, stage_copy) if task.needs_grad else None
        if job.kind is not StageKind.BACKWARD:  # a backward job recomputes on snapshots and writes no buffer
            with torch.no_grad():
                for layer in job.layers:
                    # the module's buffers as collected when the job was dispatched: the engine follows a
                    # buffer the module was given anew (SWA's BatchNorm reset) only once every job dispatched
                    # before has finished here, so the new tensor keeps what its owner assigned
                    host_buffers = self.runner.trunk.states[layer].buffers
                    for host, copied in zip(host_buffers, stage_copy.buffers[layer], strict=True):
                        host.copy_(copied)
                    if layer in task.buffer_done:
                        task.buffer_done[layer].set()  # [3] of the next job that writes these buffers
        self.measurements.record(task, stage_copy)
        if task.keeps_graph:  # the stage copy stays with the graphs, for the call's backward job
            assert task.held is not None
            task.held.keep(device.residency, stage_copy.nbytes)
        else:
            device.residency.release(stage_copy.nbytes, stage=True)
            device.stress_mode.poison_released(stage_copy.tensors())  # released: nothing may read it any more
            stage_copy.params.clear()
            stage_copy.buffers.clear()
        if downloaded is not None:
            # last: the window counts the job in flight until its sum is done, so a reader of the window (the
            # planner's measurements, the buffers, the gradients) finds everything above done too
            self._summer.submit(f"the gradients of stage {job.label} (job {job.index}) from device {device.index}",
                                downloaded)
        self._timeline.add("release", job.label, start, device=device.index, job=job.index)

    def _download_gradients(self, task: Task, stage_copy: StageCopy) -> Callable[[], None]:
        """The job's gradients to the host, into a staging buffer (waiting for one only while every buffer is
        still being summed): every copy enqueued at once, one synchronize. Returns their sum into the step's
        window, in the masters' dtype, for the summing thread; it gives the buffer back."""
        device, staging = self.device, self.grad_staging
        start = self._timeline.now()
        # one per slot the window expects of this job, in its order; None where no gradient reached a copy
        per_slot = [self.wide_sums.gradient(stage_copy.params[layer][position])
                    for layer, position in task.grad_positions]
        grads = [grad for grad in per_slot if grad is not None]
        buffer = staging.acquire(self._abort)
        host = buffer.views(grads)
        if device.is_cuda:
            for target, grad in zip(host, grads, strict=True):
                target.copy_(grad, non_blocking=True)
        elif host:  # one torch call for them all: each call gives up the GIL (StagingBuffer.views says why)
            torch._foreach_copy_(host, grads)
        device.download_stream.copy_late(grads, host)  # stress mode: they land at the synchronize
        device.download_stream.synchronize()
        downloaded = iter(host)
        delivered = [None if grad is None else next(downloaded) for grad in per_slot]
        device.counters.gradient_download_seconds += self._timeline.now() - start
        del grads, per_slot, downloaded  # the device gradients go with the stage

        def sum_into_window() -> None:
            try:
                task.window.wait_for_room(task.ticket, delivered, f"the gradients of stage {task.job.label}")
                task.window.deliver(task.ticket, delivered, borrowed=True)
                device.stress_mode.poison_released(host)  # the window has its copies: the buffer may be reused
            finally:
                buffer.release()
            task.window.job_finished()

        return sum_into_window
