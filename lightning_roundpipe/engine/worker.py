"""One worker thread per device: turns stage jobs into stream operations, in ring order.

For each job the worker enqueues, without blocking: the parameter upload (prefetched: the next job's
upload is enqueued when the current one starts, and waits until the job two back on this device has
released its memory, so at most two stages are resident); then per microbatch an input upload, the
compute and the download; then the job's finish (gradients into the step's window, buffers back to
the host module, memory released). Streams run the operations and events order them.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from lightning_roundpipe.engine.call import PipelineError, Slot
from lightning_roundpipe.engine.device import AbortSignal, Device, EngineAborted, HostEvent, error_hint, join_until
from lightning_roundpipe.engine.stage import Stage, StageRunner, Task
from lightning_roundpipe.engine.transfer import HOST, copy_tensor, copy_tree, tree_nbytes, tree_tensors
from lightning_roundpipe.planning.schedule import StageKind


class Worker:
    """One device's host thread: turns jobs into stream operations, in ring order."""

    def __init__(self, runner: StageRunner, device: Device, abort: AbortSignal) -> None:
        self.runner = runner
        self._abort = abort
        self.device = device
        self._tasks: deque[Task | None] = deque()
        self._ready = threading.Condition()
        self._uploads: dict[int, tuple[Stage, HostEvent]] = {}
        self._releases: dict[int, HostEvent] = {}  # by this device's job sequence number, last three
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
                    self._enqueue_upload(following, sequence + 1)
                self._enqueue_job(task, sequence)
            except BaseException as error:  # noqa: BLE001
                self._abort.fail(error)
            sequence += 1
            task = following = None  # hold no call alive while idle: its host activations would leak

    def _enqueue_upload(self, task: Task, sequence: int) -> None:
        """Upload ``task``'s stage once the stage two jobs back on this device has been released."""
        stream = self.device.param_stream
        if sequence >= 2:
            stream.wait_event(self._releases[sequence - 2])
        weights_ready = task.weights_ready
        if weights_ready is not None and not weights_ready.is_set():
            def wait_for_weights() -> None:  # timed: how much of the host step the devices see
                start = self.runner.timeline.now()
                weights_ready.wait(self._abort)
                self.device.counters.weight_wait_seconds += self.runner.timeline.now() - start

            stream.submit(wait_for_weights)
        for event in task.buffer_waits:
            stream.wait_event(event)
        stage = Stage()

        def upload() -> None:
            start = self.runner.timeline.now()
            self.runner.upload_stage(self.device, task, stage)
            task.upload_done.set()
            self.runner.timeline.add(self.device.index, task.job.index, task.job.label, -1, "upload_params", start)

        stream.submit(_named(upload, lambda: f"uploading the parameters of stage {task.job.label} (job "
                                             f"{task.job.index}) to device {self.device.index}"))
        self._uploads[task.job.index] = (stage, stream.record(f"the parameters of stage {task.job.label} "
                                                              f"(job {task.job.index}) uploaded"))

    def _enqueue_job(self, task: Task, sequence: int) -> None:
        runner, device, job, call = self.runner, self.device, task.job, task.call
        stage, params_ready = self._uploads.pop(job.index)
        compute, download = device.compute_stream, device.download_stream
        compute.wait_event(params_ready)
        compute.submit(_named(lambda: runner.bind(device, task, stage),
                              lambda: f"binding stage {job.label} (job {job.index}) on device {device.index}"))
        for microbatch in range(call.num_microbatches):
            self._enqueue_microbatch(task, stage, microbatch)
        # unbind on the compute stream: the next job on this device may reuse the same replicas
        compute.submit(_named(lambda: runner.unbind(device, task),
                              lambda: f"unbinding stage {job.label} (job {job.index}) on device {device.index}"))
        finished = compute.record(f"stage {job.label} (job {job.index}) computed")
        download.wait_event(finished)

        def finish() -> None:
            start = runner.timeline.now()
            # the stage's compute has run on the GPU (this stream waited for it there) before its memory is
            # released below, also for a forward stage that downloads nothing that would wait for it
            download.synchronize()
            if task.needs_grad:
                for layer in job.layers:
                    state = runner.trunk.states[layer]
                    for param, copied in zip(state.params, stage.params[layer]):
                        if param.requires_grad and copied.grad is not None:
                            task.window.add(param, copy_tensor(copied.grad, HOST))
            if job.kind is not StageKind.BACKWARD:
                with torch.no_grad():
                    for layer in job.layers:
                        for host, copied in zip(runner.trunk.states[layer].buffers, stage.buffers[layer]):
                            host.copy_(copied)
                        if layer in task.buffer_done:
                            task.buffer_done[layer].set()
            runner.record_measurements(task, stage)
            device.residency.release(stage.nbytes, stage=True)
            stage.params.clear()
            stage.buffers.clear()
            if task.needs_grad:
                task.window.job_finished()
            runner.timeline.add(device.index, job.index, job.label, -1, "release", start)

        download.submit(_named(finish, lambda: f"finishing stage {job.label} (job {job.index}) on device "
                                               f"{device.index} (its gradients and buffers to the host)"))
        release = download.record(f"stage {job.label} (job {job.index}) released")
        self._releases[sequence] = release
        self._releases.pop(sequence - 3, None)
        download.submit(task.done.set)

    def _enqueue_microbatch(self, task: Task, stage: Stage, microbatch: int) -> None:
        runner, device, job, call = self.runner, self.device, task.job, task.call
        acts, compute, download = device.act_stream, device.compute_stream, device.download_stream
        source = call.input_slots(job)[microbatch]
        uploaded: dict[str, Any] = {}
        kind = job.kind
        checkpoint_slots: list[tuple[int, Slot]] = []
        snapshot_slots: list[tuple[int, Slot]] = []
        if kind is StageKind.BACKWARD:
            starts = [job.layers.start] if runner.recompute == "stage" else list(job.layers)
            checkpoint_slots = [(layer, call.checkpoints[(layer, microbatch)]) if layer != 0
                                else (layer, call.inputs[microbatch]) for layer in starts]
            snapshot_slots = [(layer, call.snapshots[(layer, microbatch)]) for layer in job.layers
                              if (layer, microbatch) in call.snapshots]

        acts.wait_event(source.event)
        for _, slot in checkpoint_slots + snapshot_slots:
            acts.wait_event(slot.event)

        def upload() -> None:
            start = runner.timeline.now()
            target_device, asynchronous = device.torch_device, device.is_cuda
            uploaded["input"] = copy_tree(source.value, target_device, asynchronous)
            uploaded["checkpoints"] = {layer: copy_tree(slot.value, target_device, asynchronous)
                                       for layer, slot in checkpoint_slots}
            uploaded["snapshots"] = {layer: copy_tree(slot.value, target_device, asynchronous)
                                     for layer, slot in snapshot_slots}
            if kind is StageKind.FUSED:
                uploaded["target"] = copy_tree(call.targets[microbatch], target_device, asynchronous)
            acts.synchronize()  # the host sources may be dropped right below
            for slot in (source, *(slot for _, slot in checkpoint_slots + snapshot_slots)):
                slot.consume()  # copied: the host copy is dropped once its last counted reader has it
            if compute.cuda_stream is not None:
                # allocated on this stream, used by compute: the compute thread drops them as soon as it has
                # enqueued its kernels, so the allocator must not reuse them before those kernels have run
                for tensor in tree_tensors(list(uploaded.values())):
                    tensor.record_stream(compute.cuda_stream)
            uploaded["nbytes"] = tree_nbytes([value for key, value in uploaded.items()])
            device.residency.allocate(uploaded["nbytes"], f"the inputs of {job.label} microbatch {microbatch}")
            device.counters.uploaded_bytes += uploaded["nbytes"]
            runner.timeline.add(device.index, job.index, job.label, microbatch, "upload_acts", start)

        where = f"stage {job.label} (job {job.index}) microbatch {microbatch} on device {device.index}"
        acts.submit(_named(upload, lambda: f"uploading the inputs of {where}"))
        compute.wait_event(acts.record(f"the inputs of {where} uploaded"))
        result: dict[str, Any] = {}

        def run() -> None:
            start = runner.timeline.now()
            if kind is StageKind.FORWARD:
                with call.context.applied(grad=False):
                    output, checkpoints, snapshots = runner.forward_microbatch(
                        device, task, stage, microbatch, uploaded["input"])
                result.update(output=output, checkpoints=checkpoints, snapshots=snapshots)
            elif kind is StageKind.FUSED:
                loss, input_grads = runner.fused_microbatch(
                    device, task, stage, microbatch, uploaded["input"], uploaded["target"])
                result.update(output=input_grads, loss=loss)
            else:
                result["output"] = runner.backward_microbatch(
                    device, task, stage, microbatch, uploaded["checkpoints"], uploaded["snapshots"],
                    uploaded["input"])
            elapsed = runner.timeline.now() - start
            stage.compute_time += elapsed
            device.counters.compute_seconds += elapsed
            device.residency.release(uploaded["nbytes"])
            uploaded.clear()
            result["nbytes"] = tree_nbytes([result.get(key) for key in ("output", "checkpoints", "snapshots")])
            device.residency.allocate(result["nbytes"], f"the outputs of {job.label} microbatch {microbatch}")
            runner.timeline.add(device.index, job.index, job.label, microbatch, kind.name.lower(), start)

        compute.submit(_named(run, lambda: f"computing {where}"))
        download.wait_event(compute.record(f"{where} computed"))
        out_slot = call.outputs[job.index][microbatch]

        def store() -> None:
            start = runner.timeline.now()
            pin = device.pin_downloads
            checkpoints = {layer: copy_tree(value, HOST, pin=pin) for layer, value in result.get("checkpoints", {}).items()}
            snapshots = {layer: [copy_tensor(b, HOST, pin=pin) for b in value]
                         for layer, value in result.get("snapshots", {}).items()}
            loss = copy_tensor(result["loss"], HOST) if "loss" in result else None
            output = copy_tree(result.get("output"), HOST, pin=pin)
            download.synchronize()  # every host copy complete before another thread reads it
            for layer, value in checkpoints.items():
                call.checkpoints[(layer, microbatch)].put(value)
            for layer, value in snapshots.items():
                call.snapshots[(layer, microbatch)].put(value)
            if loss is not None:
                call.losses[microbatch].put(loss)
            out_slot.put(output)
            device.residency.release(result["nbytes"])
            result.clear()
            runner.timeline.add(device.index, job.index, job.label, microbatch, "download", start)

        download.submit(_named(store, lambda: f"downloading the outputs of {where}"))


def _named(operation: Callable[[], None], what: Callable[[], str]) -> Callable[[], None]:
    """``operation``, whose failure is reported as a :class:`PipelineError` saying ``what`` failed (the
    original error is its ``__cause__``). Errors that already say where they come from pass through."""
    def run() -> None:
        try:
            operation()
        except (PipelineError, EngineAborted, TimeoutError):
            raise
        except Exception as error:
            raise PipelineError(f"{what()} failed: {type(error).__name__}: {error}{error_hint(error)}") from error

    return run
