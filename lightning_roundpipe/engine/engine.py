"""The RoundPipe engine: runs stage jobs on a ring of stateless devices.

The main thread plans a call, splits it into microbatches and hands stage jobs to devices in ring
order (job j to device j mod N, the counter continuing across calls and iterations). Each device
has a worker thread that turns a job into stream operations: upload the stage's parameters
(prefetched while the previous job computes), then for every microbatch upload its input, compute,
download the output. Data moves between devices only through the host. A device holds at most two
stages' parameters: the upload of its k-th job waits until its (k-2)-th job has released its own.

Job kinds (see ``planning/schedule.py``)::

    forward   run layers without autograd; keep the inputs backward stages will need (checkpoints)
    fused     run the deepest layers, the loss and the backward per microbatch; never recomputed
    backward  recompute the stage's layers from their checkpoint (ahead of the output gradient), then
              back-propagate

A training call (``forward_backward``) may dispatch its microbatches in rounds (``round_size``): each
round is the whole chain of jobs over its share of the batch, so backward starts before the last
microbatch has run forward.

Gradients of parameters accumulate on the device over the job's microbatches, then are added on
the host into the optimizer step's :class:`~lightning_roundpipe.engine.optim.GradWindow`, in an order
fixed at dispatch, so that results do not depend on which job finishes first.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
from torch import nn

from lightning_roundpipe.engine.autograd import differentiable_call
from lightning_roundpipe.engine.batchnorm import check_trunk as check_batchnorms
from lightning_roundpipe.engine.call import Call, CallContext, FusedLoss, Slot
from lightning_roundpipe.engine.dataparallel import DataParallel
from lightning_roundpipe.engine.device import (
    AbortSignal,
    Device,
    cuda_memory_budget,
    memory_advice,
)
from lightning_roundpipe.engine.dispatch import Dispatcher
from lightning_roundpipe.engine.errors import EngineAborted, PipelineError
from lightning_roundpipe.engine.follow import ModuleFollower
from lightning_roundpipe.engine.layers import LayerInput, Trunk, build_trunk
from lightning_roundpipe.engine.microbatch import LossWeight, batch_size, merge, sample_count, split
from lightning_roundpipe.engine.optim import (
    GradWindow,
    HostOptimizer,
)
from lightning_roundpipe.engine.options import EngineOptions
from lightning_roundpipe.engine.stage import StageRunner
from lightning_roundpipe.engine.stepping import StepQueue
from lightning_roundpipe.engine.transport import (
    UploadSources,
    layer_sizes,
    transport_torch_dtype,
)
from lightning_roundpipe.engine.worker import Worker
from lightning_roundpipe.observe.trace import Timeline, TimelineEvent
from lightning_roundpipe.planning.partition import (
    LayerCost,
    Plan,
    Planner,
    autocast_copy_bytes,
    costs_from_bytes,
    stage_memory_budget,
    workspace_reserve,
)

__all__ = ["PipelineError", "RoundPipeEngine"]

log = logging.getLogger(__name__)

_Part = TypeVar("_Part")


class RoundPipeEngine:
    """Trains an ``nn.Sequential`` trunk whose state lives on the host over a ring of devices.

    Use as a context manager (or call :meth:`start` and :meth:`close`): threads run between the two.

    >>> with RoundPipeEngine(model, devices=2, options=EngineOptions(num_microbatches=4)) as engine:
    ...     loss = engine.forward_backward(x, y, torch.nn.functional.cross_entropy)
    ...     engine.step(optimizer)
    """

    def __init__(self, module: nn.Module | Trunk, devices: int | Sequence[torch.device | str] = 1,
                 options: EngineOptions | None = None, *, data_parallel: DataParallel | None = None) -> None:
        # other processes training the same model on their own rings; one process alone by default
        self.data_parallel = data_parallel if data_parallel is not None else DataParallel(1, 0)
        self.trunk = module if isinstance(module, Trunk) else build_trunk(module)
        if isinstance(devices, int):
            if devices < 1:
                raise ValueError(f"`devices` must be at least 1, got {devices}")
            devices = [torch.device("cpu")] * devices
        self.torch_devices = [torch.device(device) for device in devices]
        if not self.torch_devices:
            raise ValueError("`devices` is empty; give at least one device")
        self.options = options or EngineOptions()
        if self.options.deferred_batchnorm:
            check_batchnorms(self.trunk)  # a module whose update cannot be deferred: refused before any thread
        self.num_devices = len(self.torch_devices)
        self.num_microbatches = self.options.microbatches_for(self.num_devices)
        # the dtype autocast-only weights travel in (``transport.py``), and the bytes a layer takes on a device
        self.transport = transport_torch_dtype(self.options.transport_dtype)
        self.layer_device_bytes = layer_sizes(self.trunk, self.transport)
        initial = costs_from_bytes([params for params, _ in self.layer_device_bytes],
                                   [grads for _, grads in self.layer_device_bytes])
        limit = self.options.device_memory_limit_bytes
        if limit is None and any(device.type == "cuda" for device in self.torch_devices):
            limit = self._cuda_budget()
        self.device_budget = limit
        # stages get what remains after a reserve for the microbatch activations in flight
        on_gpu = any(device.type == "cuda" for device in self.torch_devices)
        stage_budget = stage_memory_budget(limit, workspace_reserve("cuda" if on_gpu else "cpu"))
        self.planner = Planner(self.options.num_stages, len(self.trunk), self.num_devices,
                               memory_budget=stage_budget,
                               hysteresis=self.options.replan_hysteresis, frozen=self.options.freeze_plan)
        self.planner.initial(initial)
        # under torch.use_deterministic_algorithms (Trainer(deterministic=True)) the plan never follows measured
        # times: they differ from run to run, and a stage boundary may change which kernels run (a layer's
        # forward without autograd, then recomputed with it), so results would depend on timing
        self.deterministic = torch.are_deterministic_algorithms_enabled()
        self._started = False
        self._closed = False
        self._failure_reported = False
        self._abort = AbortSignal(self.options.wait_timeout)  # starts no thread: every state has one
        # made by start(), as they start threads or must see the weights and seed of that moment
        self._timeline: Timeline | None = None
        self.devices: list[Device] = []
        self.base_seed: int | None = None        # seeds the random layers: `options.seed`, else torch's at start
        self._sources: UploadSources | None = None  # what devices upload: published and low-precision copies
        self.follower = ModuleFollower(self.trunk, deferred_batchnorm=self.options.deferred_batchnorm)
        self._runner: StageRunner | None = None
        self._workers: list[Worker] = []
        self._optimizer: HostOptimizer | None = None
        self.dispatcher = Dispatcher(self.trunk, self.options, self.planner, self.num_devices, self.num_microbatches,
                                     self._abort, self._failures_surfaced)
        self._previous_window: GradWindow | None = None  # the last closed one: its measurements go to the planner
        self._restored: dict[str, Any] = {}      # load_state_dict: what start() takes (seed, measurements)
        self.stepping = StepQueue(self.trunk, self.options, self.data_parallel, self.dispatcher,
                                  self.follower.retired_ids, self._failures_surfaced)
        self._metrics_mark: tuple[float, dict[str, float]] = (0.0, {})  # set by start

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> RoundPipeEngine:
        if self._started:
            raise RuntimeError("the engine is already started")
        timeline = self._timeline = Timeline(self.options.record_timeline)
        advice = memory_advice(recompute=self.options.recompute, num_stages=self.options.num_stages,
                               num_layers=len(self.trunk), num_microbatches=self.num_microbatches)
        self.devices = [
            Device(index, device, self._abort, budget=self.device_budget, jitter=self.options.jitter,
                   pin_memory=self.options.pin_memory, stress=self.options.stress, memory_advice=advice)
            for index, device in enumerate(self.torch_devices)
        ]
        self.base_seed = self.options.seed if self.options.seed is not None else self._restored.get(
            "base_seed", torch.initial_seed())
        sources = self._sources = UploadSources(self.trunk, async_step=self.options.async_step,
                                                transport=self.transport)
        if self.options.pin_memory and any(device.is_cuda for device in self.devices):
            self.follower.start_pinning(sources)
        self._runner = StageRunner(self.trunk, self.num_devices, self.options.recompute, timeline,
                                   self.base_seed, sources, measure=not self.options.freeze_plan,
                                   measure_times=not self.deterministic,
                                   deferred_batchnorm=self.options.deferred_batchnorm)
        self._runner.restore_activation_bytes(self._restored.get("activation_bytes", {}))
        self._workers = self.dispatcher.workers = [Worker(self._runner, device, self._abort) for device in self.devices]
        self._optimizer = HostOptimizer(self._abort, timeline)
        self.stepping.attach(sources, self._optimizer, timeline)
        self._metrics_mark = (timeline.now(), dict.fromkeys(("compute", "uploaded", "optimizer", "exposed", "download"),
                                                            0.0))
        self._started = True
        return self

    def close(self, *, finish_steps: bool = True, finish_jobs: bool | None = None) -> None:
        """Stop every thread. Safe to call twice and after an error; never raises (see
        :meth:`raise_unreported_failure`).

        With ``finish_steps`` queued optimizer steps complete first; without it (after an exception) only
        a step already doing its arithmetic finishes and the rest are dropped. Either way every step is
        applied whole or not at all, so the module holds consistent weights afterwards, unless the pipeline
        failed while a step cut by stage waited for gradients (:attr:`torn_step` says so). With
        ``finish_jobs`` (default: ``finish_steps``) on a healthy engine the jobs already dispatched end first,
        so a call that returned has all its effects (a no-grad call's BatchNorm statistics are copied back
        after its outputs arrive); pass ``False`` when a call in flight is abandoned (an exception
        propagating). Otherwise device work still queued is dropped.

        Nothing here waits without a bound: the optimizer thread is given ``wait_timeout`` per step, the
        other threads ``wait_timeout`` in all to finish the operation they are running. A thread still
        running then (inside a layer that does not return, say) is named in a ``RuntimeWarning`` and left
        to end by itself once that operation returns; it runs nothing else. An optimizer step still
        running is also the engine's failure (the weights may be mid-update): see
        :meth:`raise_unreported_failure`.
        """
        if not self._started or self._closed:
            return
        self._closed = True
        if not finish_steps:
            self._abort.abort()
        timeout = self.options.wait_timeout
        if (finish_steps if finish_jobs is None else finish_jobs) and self._abort.error is None:
            self.dispatcher.finish_dispatched_jobs(time.monotonic() + timeout)
        optimizer = self._started_part(self._optimizer)
        stuck = [optimizer.close(timeout)]
        if stuck[0] is not None:  # the module's weights may be mid-update: never a silent success
            self._abort.fail(TimeoutError(
                f"{stuck[0]} has not finished {optimizer.running or 'its task'} within "
                f"`wait_timeout={timeout:g}` s while the engine closed; the module's weights may be mid-update. "
                "Raise `wait_timeout` if a single optimizer step really takes that long."))
        self._abort.abort()
        deadline = time.monotonic() + timeout
        for device in self.devices:
            device.stop()  # every stream at once: a stuck one must not hold up the others' ends
        stuck += [worker.close(deadline) for worker in self._workers]
        for device in self.devices:
            stuck += device.join(deadline)
        still_running = [name for name in stuck if name is not None]
        if not still_running:
            self.follower.pinned.release()  # a thread still inside a copy may read pinned memory: kept registered then
        else:
            warnings.warn(
                f"RoundPipe closed its engine but {len(still_running)} thread(s) are still inside an operation that "
                f"has not returned within `wait_timeout={timeout:g}` s: {', '.join(still_running)}. They run nothing "
                "else and end by themselves once it returns (a layer, loss or optimizer step that never returns "
                "keeps its thread for good).",
                RuntimeWarning, stacklevel=2,
            )

    def _cuda_budget(self) -> int:
        """The per-ring-member budget from what the GPUs have free; members sharing a GPU split it."""
        budgets = []
        for device in self.torch_devices:
            if device.type == "cuda":
                sharing = sum(other == device for other in self.torch_devices)
                budgets.append(cuda_memory_budget(device, sharing))
        return min(budgets)

    @property
    def unreported_failure(self) -> BaseException | None:
        """The error that stopped the pipeline if no call has raised it yet (a step that failed after the
        last call, say)."""
        if not self._started or self._failure_reported:
            return None
        return self._abort.error

    def raise_unreported_failure(self) -> None:
        """Raise :attr:`unreported_failure` as a :class:`PipelineError`, if any (and close the engine). Call
        it after :meth:`close` when no exception is pending, so that no failure goes unnoticed."""
        if self.unreported_failure is not None:
            self._raise_failure()

    def __enter__(self) -> RoundPipeEngine:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, *exc_info: object) -> None:
        self.close(finish_steps=exc_type is None)
        if exc_type is None:
            self.raise_unreported_failure()

    def _check_started(self, what: str) -> None:
        if not self._started:
            raise RuntimeError(f"the engine is not started, so it has no {what} yet: use `with RoundPipeEngine(...) "
                               "as engine:` or call start() first")

    def _started_part(self, part: _Part | None, what: str = "threads") -> _Part:
        """``part``, one of the things :meth:`start` makes; before that, a clear error."""
        self._check_started(what)
        if part is None:  # started, yet not made: a bug in start()
            raise RuntimeError(f"the engine is started but has no {what}")
        return part

    def _check_running(self) -> None:
        if not self._started:
            raise RuntimeError("the engine is not started: use `with RoundPipeEngine(...) as engine:` or call start()")
        if self._closed:
            error = self._abort.error
            reason = f" after an error ({type(error).__name__}: {error})" if error is not None else ""
            raise RuntimeError(f"the engine is closed{reason}; create a new engine to continue")
        if self._abort.error is not None:
            self._raise_failure()

    def _raise_failure(self) -> None:
        error = self._abort.error
        self._failure_reported = True
        self.close(finish_steps=False)
        torn = self.torn_step
        suffix = (" " if str(error).endswith(".") else ". ") + torn if torn else ""  # one full stop between them
        if isinstance(error, PipelineError):
            raise PipelineError(f"{error}{suffix}") from error.__cause__
        raise PipelineError(f"the pipeline failed: {type(error).__name__}: {error}{suffix}") from error

    @property
    def torn_step(self) -> str | None:
        """Set when the pipeline stopped while a step cut by stage (``streaming_step``) waited for the rest of its
        gradients: which layers that step had updated. The module's weights then mix two steps; ``None``
        otherwise (every step applied whole or not at all)."""
        if self.stepping.torn is None:
            return None
        number, labels = self.stepping.torn
        return (f"Optimizer step {number} had updated the parameters of layers {', '.join(labels)} when the pipeline "
                f"stopped; the other layers keep step {number - 1}'s weights, so the module's weights mix two steps. "
                "Resume from a checkpoint written before the failure (or set streaming_step='off' to apply every "
                "step whole or not at all)")

    @contextmanager
    def _failures_surfaced(self) -> Iterator[None]:
        """A wait woken by the abort flag raises the pipeline's own error (and closes the engine)."""
        try:
            yield
        except (EngineAborted, TimeoutError):
            if self._abort.error is not None:
                self._raise_failure()
            raise

    # ------------------------------------------------------------------ observability
    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def failed(self) -> bool:
        """An error stopped the pipeline; the next call raises it and closes the engine."""
        return self._started and self._abort.error is not None

    @property
    def plan(self) -> Plan:
        return self.planner.plan

    @property
    def timeline(self) -> Timeline:
        """What ran where and when since :meth:`start` (recorded with ``record_timeline``)."""
        return self._started_part(self._timeline, "timeline")

    def events(self) -> list[TimelineEvent]:
        return self.timeline.events()

    def pipeline_metrics(self) -> dict[str, float]:
        """Figures since the previous call (the first call counts from :meth:`start`):

        ``bubble_ratio``: share of device time not spent computing over that wall time; ``uploaded_bytes``:
        host-to-device traffic; ``optimizer_seconds``: host step time; ``optimizer_exposed_seconds``: device
        time spent waiting for a step's weights (the part of the step the pipeline did not hide);
        ``gradient_download_seconds``: download-thread time bringing jobs' gradients to the host and summing
        them (all devices; off the compute stream, but it delays the release of a stage's memory);
        ``peak_device_bytes``: the largest resident bytes on any device so far (accounted: stages, stage-boundary
        activations, what the compute keeps for backward and, on GPUs, the workspace reserve).

        Compute time is device time (``timing.py``), counted when a job finishes: a job still running is counted
        in a later call. On CUDA devices the allocator's own figures per GPU come next to the accounted peak
        (see :meth:`cuda_memory_figures`).
        """
        optimizer = self._started_part(self._optimizer, "pipeline metrics")
        now = self.timeline.now()
        totals = {
            "compute": sum(d.counters.compute_seconds for d in self.devices),
            "uploaded": float(sum(d.counters.uploaded_bytes for d in self.devices)),
            "optimizer": optimizer.busy_seconds,
            "exposed": sum(d.counters.weight_wait_seconds for d in self.devices),
            "download": sum(d.counters.gradient_download_seconds for d in self.devices),
        }
        last_time, last = self._metrics_mark
        self._metrics_mark = (now, totals)
        span = (now - last_time) * self.num_devices
        busy = totals["compute"] - last["compute"]
        return {
            "bubble_ratio": max(0.0, 1.0 - busy / span) if span > 0 else 0.0,
            "uploaded_bytes": totals["uploaded"] - last["uploaded"],
            "optimizer_seconds": totals["optimizer"] - last["optimizer"],
            "optimizer_exposed_seconds": (totals["exposed"] - last["exposed"]) / self.num_devices,
            "gradient_download_seconds": totals["download"] - last["download"],
            "peak_device_bytes": float(max(self.peak_resident_bytes())),
            **self.cuda_memory_figures(),
        }

    def cuda_memory_figures(self) -> dict[str, float]:
        """Per GPU of the ring (``cuda<i>_...``), the caching allocator's peaks next to what the engine accounted
        there: ``max_reserved_bytes``, what the allocator held from the driver (the figure an out-of-memory error
        is about); ``max_allocated_bytes``, what tensors used; ``accounted_peak_bytes``, the sum of the accounted
        peaks of the ring members on that GPU (:meth:`peak_resident_bytes`; they need not peak at once, so it
        bounds their joint peak); and ``alloc_retries``, how often the allocator freed its cache and retried an
        allocation (a device-wide synchronization: a silent slowdown near the limit). Peaks count from the
        process's start or the last ``torch.cuda.reset_peak_memory_stats``. Empty without CUDA devices."""
        self._check_started("memory figures")
        figures: dict[str, float] = {}
        for index in sorted({device.torch_device.index for device in self.devices if device.is_cuda}):
            members = [device for device in self.devices if device.is_cuda and device.torch_device.index == index]
            figures[f"cuda{index}_max_reserved_bytes"] = float(torch.cuda.max_memory_reserved(index))
            figures[f"cuda{index}_max_allocated_bytes"] = float(torch.cuda.max_memory_allocated(index))
            figures[f"cuda{index}_accounted_peak_bytes"] = float(sum(member.residency.peak for member in members))
            figures[f"cuda{index}_alloc_retries"] = float(torch.cuda.memory_stats(index).get("num_alloc_retries", 0))
        return figures

    def peak_resident_bytes(self) -> list[int]:
        """Per device, the most bytes it held at once so far."""
        self._check_started("resident bytes")
        return [device.residency.peak for device in self.devices]

    def peak_resident_stages(self) -> list[int]:
        """Per device, the most stages it held at once so far (at most two: see ``worker.py``)."""
        self._check_started("resident stages")
        return [device.residency.peak_stages for device in self.devices]

    # ------------------------------------------------------------------ calls
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the trunk. With grad enabled the result is wired into autograd: ``.backward()`` on
        anything computed from it runs the pipelined backward."""
        self._check_running()
        self._follow_module_state()
        context = CallContext.capture(self.trunk)
        inputs = (args, kwargs)
        wants_backward = context.grad_enabled and not context.inference
        if not wants_backward:
            call = self._new_call(inputs, context, checkpoints=False)
            output = merge(self.dispatcher.run_forward(call))
            return output
        return differentiable_call(self.dispatcher, self._new_call(inputs, context, checkpoints=True), inputs)

    def forward_backward(self, inputs: Any, target: Any, loss_fn: Callable[[Any, Any], torch.Tensor], *,
                         loss_weight: LossWeight = sample_count, scale: float = 1.0) -> torch.Tensor:
        """Forward, loss and backward of a whole batch, the loss fused into the last stage.

        ``inputs`` is the first layer's argument (a tuple is passed as several arguments). ``loss_fn(output,
        target)`` returns a microbatch's loss as a mean over its ``loss_weight(target)`` elements (default:
        samples); microbatch losses are combined with those weights, so the gradient is the whole batch's
        (also for token means with ignored targets: use ``token_count()``). ``scale`` multiplies the loss
        before backward only (gradient accumulation, loss scaling). Returns the batch loss, detached.
        Parameter gradients are added into the current step's window; :meth:`step` applies them.
        """
        self._check_running()
        self._follow_module_state()
        context = CallContext.capture(self.trunk)
        if not context.grad_enabled or context.inference:
            raise RuntimeError("forward_backward needs grad mode: it was called under no_grad or inference_mode")
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        target_size, input_size = batch_size(target, "target"), batch_size(args)
        if target_size is not None and target_size != input_size:
            raise ValueError(
                f"the target has {target_size} samples on dim 0 but the inputs have {input_size}; they are "
                "split into microbatches together and must agree"
            )
        call = self._new_call((args, {}), context, checkpoints=True)
        targets = split(target, call.sizes) if target_size is not None else [target] * call.num_microbatches
        weights = [float(loss_weight(t)) for t in targets]
        total = sum(weights)
        if total <= 0:
            raise ValueError(f"the loss weights of the batch sum to {total}; nothing to learn from "
                             "(every target ignored?)")
        fused = call.fused = FusedLoss(
            loss_fn=loss_fn, targets=targets, scales=[w / total for w in weights], backward_scale=scale,
            losses=[Slot(f"the loss of microbatch {m}") for m in range(call.num_microbatches)])
        self.dispatcher.run_training(call)
        losses = []
        for slot, weight in zip(fused.losses, fused.scales, strict=True):
            self.dispatcher.wait(slot.event)
            if weight != 0.0:  # a microbatch with nothing to count has a NaN mean and no say
                losses.append(slot.value * weight)
        return torch.stack(losses).sum()

    def step(self, optimizer: torch.optim.Optimizer, *, before_step: Callable[[], bool | None] | None = None,
             keep_gradients: bool = False) -> None:
        """Apply the step's gradients with ``optimizer`` on the optimizer thread.

        The step's gradients are what ``param.grad`` holds now (gradients published by
        :meth:`collect_gradients`, or computed by autograd on this thread) plus what the pipeline's backward
        still adds; the optimizer thread steps with its own references to them and never touches
        ``param.grad``. ``before_step`` runs on the calling thread once every gradient is final and in
        ``param.grad`` (clipping, an inf check, hooks); returning ``False`` skips the update. Hyperparameters
        are read now. In sync mode later uploads wait for this step; in async mode they run on the weights
        published by this step (one step stale).

        Afterwards this thread clears ``param.grad`` of the optimizer's parameters, so the next step starts
        from nothing; ``keep_gradients=True`` leaves them (as plain training does until ``zero_grad()``), and
        the caller clears them: with ``set_to_none=True`` at any time, in place only after
        :meth:`wait_for_steps` (the step reads those tensors). Either way gradients may be read or cleared
        on this thread as soon as this returns. With ``keep_gradients=True`` in sync mode,
        :meth:`restore_gradients` afterwards puts the gradients the step applied into ``param.grad``.
        """
        self._check_running()
        window = self.stepping.step(optimizer, before_step, keep_gradients)
        self._replan(window)
        if self.data_parallel.averaging and not self.options.freeze_plan:  # every ring runs process 0's plan
            self.planner.adopt(self.data_parallel.agree(self.planner.plan))
        self.timeline.mark_step()  # a bounded timeline keeps the last steps; one branch when recording is off

    def collect_gradients(self) -> None:
        """Wait for every backward dispatched so far and add its gradients into ``param.grad`` now, on this
        thread, rather than letting :meth:`step` hand them to the optimizer thread unseen (for code that reads
        gradients between backward and step, or after the step). Does not wait for a step in flight."""
        self._check_running()
        self.stepping.publish(self.dispatcher.window.wait_idle, self.dispatcher.window)

    def restore_gradients(self) -> None:
        """Wait for the last step and, if it was made with ``keep_gradients=True`` in sync mode, put into
        ``param.grad`` the gradients it stepped with where ``param.grad`` holds nothing newer (``None``, or what
        the step was lent), as plain training leaves them until ``zero_grad()``. A step that follows no
        backward (Lightning's ``_skip_backward``, a manual step without ``manual_backward``) then applies what
        it would apply under plain training: these gradients again, unless they were cleared."""
        self.wait_for_steps()
        self.stepping.restore_gradients()

    def wait_for_steps(self) -> None:
        """Wait until every queued optimizer step has finished (and no longer reads the gradients it was
        handed)."""
        self._check_running()
        self.stepping.wait_for_steps()

    def synchronize(self) -> None:
        """Wait for every dispatched job and queued step; afterwards the module's weights are current."""
        self._check_running()
        self.dispatcher.wait_for_jobs()
        self.wait_for_steps()

    # ------------------------------------------------------------------ the module's state between calls
    def _follow_module_state(self) -> None:
        """Before each call, on the caller's thread: make the engine's view of the trunk what the module holds
        now (``follow.py``). Only when a layer changed does the engine wait (every dispatched job and queued
        step) and follow it."""
        changed = self.follower.changed_layers()
        if changed:
            self.synchronize()
            self.follower.follow_layers(changed, self._started_part(self._runner), self._started_part(self._sources),
                                        self.dispatcher.window)
            self.layer_device_bytes = layer_sizes(self.trunk, self.transport)

    # ------------------------------------------------------------------ planning
    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps so that a resumed run continues this one exactly, as plain values (they load
        with ``torch.load(weights_only=True)``): the optimizer steps queued so far and the base seed (together they
        seed the random layers of the next steps), the ring position, the planner's plan and what it has learned,
        and the activation measurements it has not been given yet. Call it between steps, after
        :meth:`synchronize`, so that every measurement of the steps so far is in."""
        runner = self._runner
        return {
            "version": 1,
            "step": self.dispatcher.step,
            "base_seed": self.base_seed,
            "num_devices": self.num_devices,
            "ring_position": self.dispatcher.next_job % self.num_devices,
            "planner": self.planner.state_dict(),
            "activation_bytes": runner.pending_activation_bytes() if runner is not None else {},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict` (before :meth:`start`): the step count, the base seed unless the
        ``seed`` option sets one, and, on as many devices and with the same ``num_stages``, the ring position,
        the plan and what the planner had learned (otherwise the planner starts afresh)."""
        if self._started:
            raise RuntimeError("load_state_dict must come before start(): the step count seeds every call")
        version = state.get("version")
        if version != 1:
            raise ValueError(f"cannot continue from an engine state of version {version!r}; this release writes 1")
        restored: dict[str, Any] = {}
        ring_position = None
        if state.get("base_seed") is not None:
            restored["base_seed"] = int(state["base_seed"])
        if self.planner.load_state_dict(state["planner"]):
            restored["activation_bytes"] = state.get("activation_bytes", {})
            if state.get("num_devices") == self.num_devices:
                ring_position = int(state["ring_position"])
        self.dispatcher.restore(int(state["step"]), ring_position)
        self._restored = restored

    def _replan(self, closed: GradWindow) -> None:
        """After each step, what the planner learns: first what layers kept for backward in the step before
        (memory: a plan that no longer fits is replaced at once), then the times of each step measured whole, in
        device time (``timing.py``). The planner discards the warm-up step and changes the plan only once its
        observations agree (see :class:`~lightning_roundpipe.planning.partition.Planner`).

        Memory is learned one step late, after every job of that step has finished (in sync mode they have,
        as this step's jobs waited for its update), so a plan changes for memory at the same step in every
        run, whatever the timing. Times are learned only when not :attr:`deterministic`."""
        runner = self._started_part(self._runner)
        previous, self._previous_window = self._previous_window, closed
        if self.options.freeze_plan:
            return
        if previous is not None:
            with self._failures_surfaced():
                previous.wait_complete()
            activations = runner.take_activation_bytes(before=previous.number + 1)
            if activations:
                self.planner.observe_activations(activations)
        if self.deterministic:
            return
        for times in runner.take_step_times():
            measured = []
            for index, (param_bytes, grad_bytes) in enumerate(self.layer_device_bytes):
                forward, backward = times.forward[index], times.backward[index]
                measured.append(LayerCost(max(sum(forward) / len(forward), 1e-9),
                                          max(sum(backward) / len(backward), 1e-9), param_bytes, grad_bytes))
            self.planner.observe(measured, job_cost=times.job_cost())  # so one device gets few, large stages
        self.planner.replan()

    def _estimate_autocast_copies(self, context: CallContext) -> None:
        """Before anything is measured: what autocast's weight copies will take in the fused and backward
        stages (:func:`~lightning_roundpipe.planning.partition.autocast_copy_bytes` of the float32 weights
        that do not travel in autocast's dtype already), so that the first plan leaves room for them."""
        dtype = context.autocast_dtype(self.torch_devices[0].type)
        estimate: dict[int, int] = {}
        if dtype is not None:
            sources = self._started_part(self._sources)
            transported = sources.transport == dtype
            for index, state in enumerate(self.trunk.states):
                cast = sum(param.numel() * param.element_size() for param in state.params
                           if param.dtype == torch.float32
                           and not (transported and sources.is_low_precision(index, param)))
                estimate[index] = autocast_copy_bytes(cast, autocast_itemsize=dtype.itemsize)
        self.planner.observe_activations(estimate, measured=False)

    def _new_call(self, inputs: LayerInput, context: CallContext, checkpoints: bool) -> Call:
        if checkpoints and not self.planner.activations_observed and not self.options.freeze_plan:
            self._estimate_autocast_copies(context)
        return self.dispatcher.new_call(inputs, context, checkpoints)
