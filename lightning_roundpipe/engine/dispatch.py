"""Dispatch: a call's microbatches become stage jobs handed to the devices' workers in ring order.

:class:`Dispatcher` owns what dispatch decides on the caller's thread: the ring position (job j runs on device
j mod N, the counter continuing across calls and iterations), the gradient window the jobs of the current
optimizer step add into, the events the next jobs wait on (each layer's buffers back on the host, each layer's
weights updated by the last queued step), and the round size of a training call. It hands jobs over and waits
for their host cells; it knows nothing of autograd (``autograd.py``) or of the optimizer step
(``step/caller.py``).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from lightning_roundpipe.engine.call import Call, CallContext, FusedLoss, HostCell
from lightning_roundpipe.engine.device import AbortSignal, HostEvent
from lightning_roundpipe.engine.layers import LayerInput, Trunk, single_argument
from lightning_roundpipe.engine.microbatch import LossWeight, batch_size, microbatch_sizes, split
from lightning_roundpipe.engine.options import EngineOptions
from lightning_roundpipe.engine.stage import HeldGraph, Task
from lightning_roundpipe.engine.step.window import GradWindow, SumBuffers
from lightning_roundpipe.engine.transfer import differentiable_leaves
from lightning_roundpipe.engine.worker import Worker
from lightning_roundpipe.planning.partition import Plan, Planner
from lightning_roundpipe.planning.schedule import Job, StageKind, backward_jobs, forward_jobs, training_rounds
from lightning_roundpipe.planning.simulate import Streaming, choose_round_size

log = logging.getLogger(__name__)


class Dispatcher:
    """Turns calls into jobs on the ring's workers (:attr:`workers`, set when the engine starts).

    ``surfaced`` is a context manager under which a wait woken by the abort flag raises the pipeline's own
    error (the engine's failure surfacing)."""

    def __init__(self, trunk: Trunk, options: EngineOptions, planner: Planner, num_devices: int,
                 num_microbatches: int, abort: AbortSignal,
                 surfaced: Callable[[], AbstractContextManager[None]]) -> None:
        self.trunk = trunk
        self.options = options
        self.planner = planner
        self.num_devices = num_devices
        self.num_microbatches = num_microbatches
        self._abort = abort
        self._surfaced = surfaced
        self.workers: list[Worker] = []
        self.next_job = 0                       # ring position of the next job: job j runs on device j mod N
        self.step = 0                           # optimizer steps queued so far: calls now belong to the next one
        self._calls_in_step = 0
        self.sum_buffers = SumBuffers()         # the memory of gradient sums, reused where nothing else holds it
        self.window = GradWindow(abort, sums=self.sum_buffers)  # the gradients of the step being accumulated
        # per layer, what its next upload waits for: the step groups of the last queued step owning its weights
        self.upload_waits: list[tuple[HostEvent, ...]] = [() for _ in range(len(trunk))]
        self._buffer_ready: dict[int, HostEvent] = {}    # per layer: its buffers are back on the host
        self._last_done: list[HostEvent | None] = [None] * num_devices  # per device: its last job
        # what round_size="auto" weighs of the host step (written by the step's two halves): the order the last
        # step's parts ran in (the simulator's name for it) and, per layer, the seconds the last whole step spent
        # on its parameters (optimizer thread; None until a step has run whole)
        self.step_order: Streaming = "off"
        self.layer_step_seconds: list[float] | None = None
        # round_size="auto": for what (plan, microbatches, planner settled) the dispatch was chosen, and the choice
        self._rounds_for: tuple[tuple[Plan, int, bool] | None, int | None] = (None, None)
        # the dispatch last logged at INFO, once the planner settled: (round size or None,), or None before
        self._dispatch_logged: tuple[int | None] | None = None
        self._warned_short_batch = False

    # ------------------------------------------------------------------ steps and waits
    def restore(self, step: int, ring_position: int | None) -> None:
        """Continue a checkpointed run (before the engine starts): its step count and, if given, ring position."""
        self.step = step
        self.window = GradWindow(self._abort, step, self.sum_buffers)
        if ring_position is not None:
            self.next_job = ring_position

    def next_window(self) -> GradWindow:
        """Close step :attr:`step` for dispatch: its window is returned, and later jobs add into the next one."""
        window, self.window = self.window, GradWindow(self._abort, self.step + 1, self.sum_buffers)
        self.step += 1
        self._calls_in_step = 0
        return window

    def wait(self, event: HostEvent) -> None:
        """Wait on this thread until what ``event`` guards may be read here (a downloaded cell: also until its
        copies have run on the GPU)."""
        with self._surfaced():
            event.wait(self._abort)
        if event.cuda_event is not None:
            event.cuda_event.synchronize()

    def wait_for_jobs(self) -> None:
        """Wait for every job dispatched so far."""
        for event in self._last_done:
            if event is not None:
                self.wait(event)

    def finish_dispatched_jobs(self, deadline: float) -> None:
        """On a healthy engine, let the jobs already dispatched end before the devices stop: a call returns
        once its outputs have arrived, while its jobs may still be copying buffers back into the module (a
        no-grad call's BatchNorm statistics), which stopping the devices would drop. Bounded by ``deadline``:
        a job that does not end by then is dropped with the rest of the device work."""
        for event in self._last_done:
            if event is not None and event.wait_until(deadline) and event.cuda_event is not None:
                event.cuda_event.synchronize()

    # ------------------------------------------------------------------ calls
    def new_call(self, inputs: LayerInput, context: CallContext, checkpoints: bool, *,
                 transparent: bool = False) -> Call:
        """A call of ``inputs`` split into microbatches on the current plan; ``checkpoints``: it will run
        backward, so the forward keeps the inputs backward stages recompute from. ``transparent``: a
        forward call whose backward autograd dispatches later (``differentiable_call``).

        Such a call keeps its deepest stage's forward graphs on the device for its backward instead of
        recomputing them (:class:`~lightning_roundpipe.engine.stage.HeldGraph`), as the fused stage of a
        training call never recomputes, when the ring has one device (the backward job then runs where the
        forward job did), BatchNorm is not deferred (its forward then runs other code than a plain one) and
        the graphs fit (``Planner.fused_graphs_fit``)."""
        size = batch_size(inputs)
        if size is None:
            if self.num_microbatches != 1:
                raise ValueError(
                    "no input tensor has a batch dimension (dim 0) to split into microbatches; pass batched "
                    "tensors or set `num_microbatches=1`"
                )
            sizes = [1]
            chunks = [inputs]
        else:
            sizes = microbatch_sizes(size, self.num_microbatches)
            if len(sizes) < self.num_microbatches and not self._warned_short_batch:
                self._warned_short_batch = True
                warnings.warn(
                    f"a batch of {size} samples is smaller than `num_microbatches={self.num_microbatches}`; it "
                    f"runs as {len(sizes)} microbatches of one sample (this warning is shown once)",
                    stacklevel=4,
                )
            chunks = split(inputs, sizes)
        plan = self.planner.plan
        layers: set[int] = set()
        keeps_graph = (checkpoints and transparent and self.num_devices == 1 and not self.options.deferred_batchnorm
                       and self.planner.fused_graphs_fit(len(sizes)))
        if checkpoints:
            if self.options.recompute == "layer":
                layers = set(range(len(self.trunk)))
            else:
                layers = {stage.start for stage in plan.backward} | {plan.fused.start}
            if keeps_graph:  # nothing recomputes the deepest stage
                layers -= set(plan.fused)
        call = Call(
            step=self.step, index=self._calls_in_step, plan=plan, context=context, sizes=sizes,
            inputs=[HostCell.ready(chunk) for chunk in chunks],
            input_requires_grad=[leaf.requires_grad for leaf in differentiable_leaves(inputs)],
            checkpoint_layers=frozenset(layers), held=HeldGraph() if keeps_graph else None,
        )
        self._calls_in_step += 1
        return call

    def run_forward(self, call: Call) -> list[Any]:
        """Dispatch the forward jobs of ``call`` and return its outputs, one per microbatch."""
        jobs = forward_jobs(call.plan, self.num_devices, call.num_microbatches, self.next_job)
        self.next_job += len(jobs)
        self.dispatch(call, jobs, first_output_grads=None)
        outputs = []
        for cell in call.job_outputs(jobs[-1]):
            self.wait(cell.event)
            # a stage's output cell holds the next layer's input. Taken, not read: a differentiable call returns
            # these very tensors, whose grad_fn keeps the call, which would otherwise keep them in a cycle that
            # only the garbage collector frees (a language model's logits, after the caller has let them go)
            outputs.append(single_argument(cell.take()))
        return outputs

    def run_backward(self, call: Call, output_grads: list[list[torch.Tensor | None]]) -> list[HostCell]:
        """Dispatch the backward jobs of ``call`` from the gradients of its outputs (per microbatch); returns the
        cells of its inputs' gradients.

        A call that kept its deepest stage's graphs (one device) returns only once the first backward job has
        started back-propagating them, which is as soon as its output gradients are on the device: until then
        that job's upload and compute threads need the GIL for Python of their own, which the caller would
        hold for the rest of its batch (Lightning's end of the batch, the next fetch) up to a switch interval
        at a time. Once back-propagating, the compute thread runs autograd's engine without the GIL."""
        if call.held is not None:
            call.held.claim()
        jobs = backward_jobs(call.plan, self.num_devices, call.num_microbatches, self.next_job)
        self.next_job += len(jobs)
        first = self.dispatch(call, jobs, first_output_grads=output_grads)[0]
        if first.backpropagating is not None:
            self.wait(first.backpropagating)
        return call.job_outputs(jobs[-1])

    @staticmethod
    def check_target(args: tuple[Any, ...], target: Any) -> None:
        """A training call's ``target`` must have as many samples as its inputs: they are split together."""
        target_size, input_size = batch_size(target, "target"), batch_size(args)
        if target_size is not None and target_size != input_size:
            raise ValueError(
                f"the target has {target_size} samples on dim 0 but the inputs have {input_size}; they are "
                "split into microbatches together and must agree"
            )

    def run_training(self, call: Call, target: Any, loss_fn: Callable[[Any, Any], torch.Tensor], *,
                     loss_weight: LossWeight, scale: float) -> torch.Tensor:
        """Dispatch the forward, the fused loss and the backward of ``call`` in rounds of :meth:`round_size`
        microbatches, and return the batch loss (``RoundPipeEngine.forward_backward`` says what the arguments
        mean).

        On a one-device ring the loss returns only once the call's first backward job has started
        back-propagating, after its recompute, as :meth:`run_backward` does for a kept graph: the caller's
        Python that follows (the rest of the user's ``training_step``, Lightning's closure) would otherwise hold
        the GIL the recompute needs after each of its operations, on the critical path, while the backward
        proper runs in autograd's engine without it. Measured on one CPU device (``benchmarks/overhead.py``):
        that recompute took 6.2 ms against 3.6 ms once the loss came later."""
        targets = (split(target, call.sizes) if batch_size(target, "target") is not None
                   else [target] * call.num_microbatches)
        weights = [float(loss_weight(t)) for t in targets]
        total = sum(weights)
        if total <= 0:
            raise ValueError(f"the loss weights of the batch sum to {total}; nothing to learn from "
                             "(every target ignored?)")
        fused = call.fused = FusedLoss(
            loss_fn=loss_fn, targets=targets, scales=[w / total for w in weights], backward_scale=scale,
            losses=[HostCell(f"the loss of microbatch {m}") for m in range(call.num_microbatches)])
        round_size = self.round_size(call.plan, call.num_microbatches)
        jobs = training_rounds(call.plan, self.num_devices, call.num_microbatches,
                               round_size or call.num_microbatches, self.next_job)
        self.next_job += len(jobs)
        first_backward = (next((job for job in jobs if job.kind is StageKind.BACKWARD), None)
                          if self.num_devices == 1 else None)
        tasks = self.dispatch(call, jobs, first_output_grads=None, signals_backpropagation=first_backward)
        losses = []
        for cell, weight in zip(fused.losses, fused.scales, strict=True):
            self.wait(cell.event)
            if weight != 0.0:  # a microbatch with nothing to count has a NaN mean and no say
                losses.append(cell.value * weight)
        for task in tasks:
            if task.job is first_backward:
                assert task.backpropagating is not None
                self.wait(task.backpropagating)
        return torch.stack(losses).sum()

    # ------------------------------------------------------------------ rounds
    def round_size(self, plan: Plan, num_microbatches: int) -> int | None:
        """Microbatches per round of a training call, or None for whole jobs (``EngineOptions.round_size``).
        ``"auto"``: whole jobs until layer times and the cost of a job are measured (a round costs every stage's
        fixed cost once more, which the first estimates do not know; under deterministic algorithms nothing is
        measured, so always), then the dispatch :func:`~lightning_roundpipe.planning.simulate.choose_round_size`
        predicts fastest for a sync iteration from those costs and the last step's time per layer, in the order
        its parts ran. Never with the disk tier (``offload``): a round's gradient sums wait for the last round, so
        rounds hold every step group's gradients, the memory the tier is there to save. Decided again only when the
        plan, the batch split or the settled state of the measurements changes, so the dispatch (and the order
        gradients are summed in) does not flap."""
        option = self.options.round_size
        if option == "whole" or num_microbatches == 1:
            return None
        if option != "auto":
            return option if option < num_microbatches else None
        costs = self.planner.estimate
        if not self.options.auto_may_use_rounds or costs is None:
            return None
        key = (plan, num_microbatches, self.planner.settled)
        if self._rounds_for[0] != key:
            host_step = self.layer_step_seconds
            chosen = choose_round_size(plan, costs, self.num_devices, num_microbatches, host_step=host_step,
                                       streaming=self.step_order if host_step is not None else "off",
                                       recompute_ahead=True, job_cost=self.planner.job_cost)
            self._log_dispatch(chosen)
            self._rounds_for = (key, chosen)
        return self._rounds_for[1]

    def _log_dispatch(self, chosen: int | None) -> None:
        """Say the dispatch ``round_size="auto"`` chose: at INFO once the planner has settled, and again only
        if a settled choice changes; before that at DEBUG, as provisional (early measurements are noisy, and
        the choice can go back and forth between whole jobs and rounds until they settle)."""
        how = "in whole jobs" if chosen is None else f"in rounds of {chosen} microbatches"
        if not self.planner.settled:
            log.debug("RoundPipe dispatches each training batch %s for now (provisional: the measured costs "
                      "have not settled)", how)
        elif self._dispatch_logged != (chosen,):
            log.info("RoundPipe dispatches each training batch %s (predicted fastest from the settled measured "
                     "costs)", how)
            self._dispatch_logged = (chosen,)

    # ------------------------------------------------------------------ jobs
    def dispatch(self, call: Call, jobs: list[Job], first_output_grads: list | None, *,
                 signals_backpropagation: Job | None = None) -> list[Task]:
        """Make the host cells ``jobs`` exchange (all of them first: a job's reader may be enqueued before it),
        then hand each job to its device's worker with the events it waits on; returns their tasks.
        ``signals_backpropagation``: a backward job whose task also says when it starts back-propagating (set
        before the worker can see the task)."""
        for job in jobs:
            call.outputs[job.index] = {m: HostCell(f"the output of stage {job.label} (job {job.index}) microbatch {m}")
                                       for m in job.microbatches}
        if first_output_grads is not None:
            call.first_grads = [HostCell.ready(g) for g in first_output_grads]
        for job in jobs:
            for microbatch in job.microbatches:
                call.input_cell(job, microbatch).expect_reader()
            if job.kind is StageKind.FORWARD and call.checkpoint_layers and not call.holds(job):
                self._make_checkpoint_cells(call, job)
        tasks = []
        for job in jobs:
            task = self._task(call, job, signals_backpropagation=job is signals_backpropagation)
            self.workers[job.device].put(task)
            self._last_done[job.device] = task.done  # after the put: never wait for a job that was not queued
            tasks.append(task)
        return tasks

    def _task(self, call: Call, job: Job, *, signals_backpropagation: bool = False) -> Task:
        """What the worker needs for ``job``: the events it waits on and sets, and where its gradients go
        (``signals_backpropagation``: also when its first microbatch starts back-propagating)."""
        differentiates = job.kind is not StageKind.FORWARD
        buffer_waits, buffer_done = [], {}
        if job.kind is not StageKind.BACKWARD:  # it writes the layers' buffers
            for layer in job.layers:
                if self.trunk.states[layer].buffers:
                    previous = self._buffer_ready.get(layer)
                    if previous is not None:
                        buffer_waits.append(previous)
                    buffer_done[layer] = self._buffer_ready[layer] = HostEvent(
                        f"the buffers of layer {layer} from stage {job.label} (job {job.index})")
        upload_done = HostEvent(f"the parameter upload of stage {job.label} (job {job.index})")
        grad_positions: list[tuple[int, int]] = []
        ticket = -1
        if differentiates:
            # the window sums each parameter's gradients in this order (deepest layer first), whatever
            # order the jobs finish in: see GradWindow
            grad_positions = [(layer, position) for layer in reversed(job.layers)
                          for position, param in enumerate(self.trunk.states[layer].params) if param.requires_grad]
            ticket = self.window.job_started(upload_done, [self.trunk.states[layer].params[position]
                                                           for layer, position in grad_positions], job.layers)
        else:
            self.window.job_read_only(upload_done, job.layers)
        weights_ready = tuple({id(event): event for layer in job.layers
                               for event in self.upload_waits[layer] if not event.is_set()}.values())
        task = Task(
            job=job, call=call, window=self.window, weights_ready=weights_ready,
            buffer_waits=buffer_waits, buffer_done=buffer_done, upload_done=upload_done,
            done=HostEvent(f"stage {job.label} (job {job.index})"),
            needs_grad=differentiates, grad_positions=grad_positions, ticket=ticket,
            held=call.held if call.holds(job) else None,
        )
        if task.keeps_graph:
            assert call.held is not None
            call.held.ready = task.done
        elif task.uses_kept_graph or signals_backpropagation:
            task.backpropagating = HostEvent(f"stage {job.label} (job {job.index}) back-propagating")
        return task

    def _make_checkpoint_cells(self, call: Call, job: Job) -> None:
        """Cells for the checkpoints and buffer snapshots a forward job produces. Made here, in dispatch
        order, because the backward job that reads them may be enqueued first by another worker."""
        for microbatch in job.microbatches:
            source = call.input_cell(job, microbatch)
            for layer in job.layers:
                if layer in call.checkpoint_layers:
                    checkpoint = call.checkpoints[(layer, microbatch)] = (
                        source if layer == job.layers.start
                        else HostCell(f"the checkpoint of layer {layer} microbatch {microbatch}"))
                    checkpoint.expect_reader()  # the backward stage that recomputes from it
                if self.trunk.states[layer].buffers:
                    snapshot = call.snapshots[(layer, microbatch)] = HostCell(
                        f"the buffer snapshot of layer {layer} microbatch {microbatch}")
                    snapshot.expect_reader()
