"""The RoundPipe engine's facade: :class:`RoundPipeEngine`, whose public methods delegate to its parts.

The parts (the package docstring says how they work together): ``ring.py``, the threads start makes and close
stops; ``lifecycle.py``, started, failed, closed; ``dispatch.py``, calls into jobs on the ring; ``autograd.py``,
a call in the caller's autograd graph; ``step/caller.py`` and ``step/queued.py``, an optimizer step on the caller's
and on the optimizer's thread; ``follow.py``, state the module is given between calls; ``figures.py``, what it
reports. The planner's feedback (``_replan``) stays here.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from torch import nn

from lightning_roundpipe.engine.autograd import differentiable_call
from lightning_roundpipe.engine.batchnorm import check_trunk as check_batchnorms
from lightning_roundpipe.engine.call import Call, CallContext
from lightning_roundpipe.engine.dataparallel import DataParallel
from lightning_roundpipe.engine.device import AbortSignal, Device
from lightning_roundpipe.engine.dispatch import Dispatcher
from lightning_roundpipe.engine.errors import PipelineError
from lightning_roundpipe.engine.feedback import estimate_autocast_copies
from lightning_roundpipe.engine.figures import cuda_memory_figures
from lightning_roundpipe.engine.follow import ModuleFollower
from lightning_roundpipe.engine.frozen_weights import FrozenSelection, FrozenWeights, registered_outside, select_frozen
from lightning_roundpipe.engine.layers import LayerInput, Trunk, build_trunk
from lightning_roundpipe.engine.lifecycle import Lifecycle
from lightning_roundpipe.engine.master_files import MasterFiles
from lightning_roundpipe.engine.microbatch import LossWeight, merge, sample_count
from lightning_roundpipe.engine.options import EngineOptions, OptionError
from lightning_roundpipe.engine.ring import Ring, initial_plan, ring_devices
from lightning_roundpipe.engine.step.caller import StepQueue
from lightning_roundpipe.engine.step.disk_tier import DiskTier
from lightning_roundpipe.engine.step.window import GradWindow
from lightning_roundpipe.engine.transport import layer_sizes, transport_torch_dtype
from lightning_roundpipe.observe.trace import Timeline, TimelineEvent
from lightning_roundpipe.planning.partition import Plan

__all__ = ["PipelineError", "RoundPipeEngine"]

_Part = TypeVar("_Part")


class RoundPipeEngine:
    """Trains an ``nn.Sequential`` trunk whose state lives on the host over a ring of devices.

    Use as a context manager (or call :meth:`start` and :meth:`close`): threads run between the two.

    >>> with RoundPipeEngine(model, devices=2, options=EngineOptions(num_microbatches=4)) as engine:
    ...     loss = engine.forward_backward(x, y, torch.nn.functional.cross_entropy)
    ...     engine.step(optimizer)
    """

    def __init__(self, module: nn.Module | Trunk, devices: int | Sequence[torch.device | str] = 1,
                 options: EngineOptions | None = None, *, data_parallel: DataParallel | None = None,
                 model: nn.Module | None = None) -> None:
        """``model``: the whole model the trunk is part of, when other modules of it hold some of the trunk's
        weights (an embedding tied to an LM head): those are never kept at compute width (``frozen_weights``)."""
        # other processes training the same model on their own rings (by default none: one process alone)
        self.data_parallel = data_parallel if data_parallel is not None else DataParallel(1, 0)
        self.trunk = module if isinstance(module, Trunk) else build_trunk(module)
        self.torch_devices = ring_devices(devices)
        self.options = options or EngineOptions()
        if self.options.deferred_batchnorm:
            check_batchnorms(self.trunk)  # a module whose update cannot be deferred: refused before any thread
        self.num_devices = len(self.torch_devices)
        self.num_microbatches = self.options.microbatches_for(self.num_devices)
        # the dtype autocast-only weights travel in (``transport.py``), and the bytes a layer takes on a device
        self.transport = transport_torch_dtype(self.options.transport_dtype)
        if self.options.offload == "optimizer+masters" and self.transport is None:
            raise OptionError("offload", "'optimizer+masters' keeps on disk the masters that devices upload from a "
                                         "low-precision copy, and without a transport dtype there is none: train "
                                         "under precision='bf16-mixed' or '16-mixed' (transport_dtype='auto'), or "
                                         "use offload='optimizer'")
        self.layer_device_bytes = layer_sizes(self.trunk, self.transport)
        self.device_budget, self.planner = initial_plan(self.trunk, self.torch_devices, self.options,
                                                        self.layer_device_bytes)
        # under torch.use_deterministic_algorithms (Trainer(deterministic=True)) the plan never follows measured
        # times: they differ from run to run, and a stage boundary may change which kernels run (a layer's
        # forward without autograd, then recomputed with it), so results would depend on timing
        self.deterministic = torch.are_deterministic_algorithms_enabled()
        self._abort = AbortSignal(self.options.wait_timeout)  # starts no thread: every state has one
        # offload="optimizer+masters": the masters move into files layer by layer before the threads start
        self.master_files = (MasterFiles(self.trunk, self.transport, self.options.offload_dir, self._abort)
                             if self.options.offload == "optimizer+masters" and self.options.offload_dir
                             and self.transport is not None else None)
        self._life = Lifecycle(self._abort, lambda: self.close(finish_steps=False), lambda: self.torn_step)
        self._failures_surfaced = self._life.surfaced  # waits woken by a failure raise it
        self._ring: Ring | None = None           # made by start(): the threads and what they share
        self.base_seed: int | None = None        # seeds the random layers: `options.seed`, else torch's at start
        self._restored: dict[str, Any] = {}      # load_state_dict: what start() takes (seed, measurements)
        self._model = model
        self.frozen = FrozenWeights()  # the weights kept at compute width while started
        self.follower = ModuleFollower(self.trunk, deferred_batchnorm=self.options.deferred_batchnorm)
        self.dispatcher = Dispatcher(self.trunk, self.options, self.planner, self.num_devices, self.num_microbatches,
                                     self._abort, self._failures_surfaced)
        self.stepping = StepQueue(self.trunk, self.options, self.data_parallel, self.dispatcher,
                                  self.follower.retired_ids, self._failures_surfaced)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> RoundPipeEngine:
        if self._life.started:
            raise RuntimeError("the engine is already started")
        self.base_seed = self.options.seed if self.options.seed is not None else self._restored.get(
            "base_seed", torch.initial_seed())
        try:
            self.collect_again()
            # before the upload copies are made: a weight kept at compute width is its own copy
            self.frozen.narrow(self.frozen_selection(), self.trunk)
            masters = self.master_files
            if masters is not None:  # layer by layer (master_files.py); before pinning: never pinned
                for layer in range(len(self.trunk)):
                    masters.move([layer])
            ring = self._ring = Ring.start(self.trunk, self.torch_devices, self.options, self._abort,
                                           budget=self.device_budget, base_seed=self.base_seed,
                                           transport=self.transport, num_microbatches=self.num_microbatches,
                                           measure_times=not self.deterministic,
                                           module_dtypes=self.frozen.module_dtypes,
                                           disk=masters.disk if masters is not None else None,
                                           copies=masters.copies if masters is not None else None)
            if masters is not None:
                masters.hand_over()  # the ring's now: its stop ends the disk tier's thread
        except BaseException:
            self._close_unstarted()
            raise
        if self.options.pin_memory and ring.has_cuda:
            self.follower.start_pinning(ring.sources)
        ring.measurements.restore_activation_bytes(self._restored.get("activation_bytes", {}))
        self.dispatcher.workers = ring.workers
        self.stepping.attach(ring.sources, ring.optimizer, ring.timeline, ring.disk, self.base_seed)
        self._life.started = True
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

        Nothing here waits without a bound (:meth:`~lightning_roundpipe.engine.ring.Ring.stop`): a thread still
        running then is named in a ``RuntimeWarning`` and left to end by itself once its operation returns.
        """
        if not self._life.started or self._life.closed:
            self._close_unstarted()
            return
        self._life.closed = True
        if not finish_steps:
            self._abort.abort()
        timeout = self.options.wait_timeout
        if (finish_steps if finish_jobs is None else finish_jobs) and self._abort.error is None:
            self.dispatcher.finish_dispatched_jobs(time.monotonic() + timeout)
        ring = self._started_part(self._ring)
        # a thread still inside a copy, or a copy still running on a GPU, may use pinned memory: kept registered then
        if ring.stop(self._abort, timeout) and ring.wait_gpus_idle(timeout):
            self.follower.pinned.release()
            ring.release_staging()
        self._restore_frozen()

    def frozen_selection(self, layers: Sequence[int] | None = None) -> FrozenSelection:
        """The frozen weights ``frozen_weights`` keeps at compute width when the engine starts (``"auto"`` reads
        each candidate to check that the transport dtype holds it); ``layers``: of those trunk layers only."""
        outside = registered_outside(self._model, self.trunk) if self._model is not None else set()
        return select_frozen(self.trunk, self.transport, self.options.frozen_weights, outside, layers)

    def collect_again(self) -> None:
        """Before :meth:`start`: collect again the trunk layers the module has given other tensors since the
        engine was made (a module built on the meta device, materialized since); :meth:`start` does it too."""
        if self._life.started:
            raise RuntimeError("collect_again is for before start(): a started engine follows the module itself")
        for layer in self.trunk.changed_layers():
            self.trunk.recollect(layer)

    def settle(self, layers: Sequence[int]) -> None:
        """Before :meth:`start`: give trunk ``layers``, whole now, their host homes, so that a module materialized
        layer by layer never holds them all in the form it was built in: frozen weights kept at compute width (see
        :meth:`frozen_selection`), and with ``offload="optimizer+masters"`` the masters moved into files once their
        transport copies are made (``master_files.py``)."""
        if self._life.started:
            raise RuntimeError("settle is for before start()")
        self.collect_again()
        self.frozen.narrow(self.frozen_selection(layers), self.trunk)
        if self.master_files is not None:
            self.master_files.move(layers)

    def _close_unstarted(self) -> None:
        """An engine that never started (or failed to): widen the weights narrowed before start and end the disk
        tier's thread made for the masters moved before start; never raises, as :meth:`close`."""
        self._restore_frozen()
        if self.master_files is not None:
            still_running = self.master_files.close(time.monotonic() + self.options.wait_timeout)
            if still_running is not None:
                warnings.warn(f"RoundPipe's {still_running} did not end within `wait_timeout`", RuntimeWarning,
                              stacklevel=3)

    def _restore_frozen(self) -> None:
        """Give the module its dtypes back (:meth:`FrozenWeights.restore`); never raises, as :meth:`close`."""
        try:
            self.frozen.restore()
        except Exception as error:  # noqa: BLE001 - out of memory, say: the narrow weights hold the same values
            warnings.warn(f"RoundPipe could not widen {len(self.frozen)} frozen weights back to their dtype "
                          f"({type(error).__name__}: {error}); they hold the same values in "
                          f"{self.transport}", RuntimeWarning, stacklevel=2)

    @property
    def unreported_failure(self) -> BaseException | None:
        """The error that stopped the pipeline if no call has raised it yet (a step that failed after the
        last call, say)."""
        return self._life.unreported_failure

    def raise_unreported_failure(self) -> None:
        """Raise :attr:`unreported_failure` as a :class:`PipelineError`, if any (and close the engine). Call
        it after :meth:`close` when no exception is pending, so that no failure goes unnoticed."""
        if self.unreported_failure is not None:
            self._life.raise_failure()

    def __enter__(self) -> RoundPipeEngine:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, *exc_info: object) -> None:
        self.close(finish_steps=exc_type is None)
        if exc_type is None:
            self.raise_unreported_failure()

    def _started_part(self, part: _Part | None, what: str = "threads") -> _Part:
        return self._life.started_part(part, what)

    @property
    def torn_step(self) -> str | None:
        """Set when the pipeline stopped while a step cut by stage (``streaming_step``) waited for the rest of its
        gradients: which layers that step had updated. The module's weights then mix two steps; ``None``
        otherwise (every step applied whole or not at all)."""
        return self.stepping.torn_message()

    # ------------------------------------------------------------------ observability
    @property
    def closed(self) -> bool:
        return self._life.closed

    @property
    def failed(self) -> bool:
        """An error stopped the pipeline; the next call raises it and closes the engine."""
        return self._life.failed

    @property
    def plan(self) -> Plan:
        return self.planner.plan

    @property
    def timeline(self) -> Timeline:
        """What ran where and when since :meth:`start` (recorded with ``record_timeline``)."""
        return self._started_part(self._ring, "timeline").timeline

    def events(self) -> list[TimelineEvent]:
        return self.timeline.events()

    @property
    def devices(self) -> list[Device]:
        """The ring's devices (empty before :meth:`start`)."""
        return self._ring.devices if self._ring is not None else []

    def pipeline_metrics(self) -> dict[str, float]:
        """Figures since the previous call (the first call counts from :meth:`start`): ``bubble_ratio``,
        ``uploaded_bytes``, ``optimizer_seconds``, ``optimizer_exposed_seconds``, ``gradient_download_seconds``,
        ``peak_device_bytes`` and, on CUDA devices, :meth:`cuda_memory_figures` (each is defined at
        :meth:`~lightning_roundpipe.engine.figures.PipelineFigures.report`)."""
        return self._started_part(self._ring, "pipeline metrics").figures.report()

    def cuda_memory_figures(self) -> dict[str, float]:
        """Per GPU of the ring (``cuda<i>_...``), the caching allocator's peaks next to what the engine accounted
        there (:func:`~lightning_roundpipe.engine.figures.cuda_memory_figures`); empty without CUDA devices."""
        self._life.check_started("memory figures")
        return cuda_memory_figures(self.devices)

    def peak_resident_bytes(self) -> list[int]:
        """Per device, the most bytes it held at once so far."""
        self._life.check_started("resident bytes")
        return [device.residency.peak for device in self.devices]

    def peak_resident_stages(self) -> list[int]:
        """Per device, the most stages it held at once so far (at most two: see ``worker.py``)."""
        self._life.check_started("resident stages")
        return [device.residency.peak_stages for device in self.devices]

    # ------------------------------------------------------------------ calls
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the trunk. With grad enabled the result is wired into autograd: ``.backward()`` on
        anything computed from it runs the pipelined backward."""
        self._life.check_running()
        self._follow_module_state()
        context = CallContext.capture(self.trunk)
        inputs = (args, kwargs)
        if not context.grad_enabled or context.inference:
            return merge(self.dispatcher.run_forward(self._new_call(inputs, context, checkpoints=False)))
        return differentiable_call(self.dispatcher, self._new_call(inputs, context, checkpoints=True, transparent=True),
                                   inputs)

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
        self._life.check_running()
        self._follow_module_state()
        context = CallContext.capture(self.trunk)
        if not context.grad_enabled or context.inference:
            raise RuntimeError("forward_backward needs grad mode: it was called under no_grad or inference_mode")
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        self.dispatcher.check_target(args, target)
        call = self._new_call((args, {}), context, checkpoints=True)
        return self.dispatcher.run_training(call, target, loss_fn, loss_weight=loss_weight, scale=scale)

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
        Without it (and always in async mode) the step gives each group's summed gradients back once the group
        has stepped, and later sums reuse that memory: the host holds gradients only while they are in flight.
        """
        self._life.check_running()
        window = self.stepping.step(optimizer, before_step, keep_gradients)
        self._replan(window)
        if self.data_parallel.averaging and not self.options.freeze_plan:  # every ring runs process 0's plan
            self.planner.adopt(self.data_parallel.agree(self.planner.plan))
        self.timeline.mark_step()  # a bounded timeline keeps the last steps; one branch when recording is off

    def collect_gradients(self) -> None:
        """Wait for every backward dispatched so far and add its gradients into ``param.grad`` now, on this
        thread, rather than letting :meth:`step` hand them to the optimizer thread unseen (for code that reads
        gradients between backward and step, or after the step). Does not wait for a step in flight."""
        self._life.check_running()
        self.stepping.publish(self.dispatcher.window.wait_idle, self.dispatcher.window)

    def restore_gradients(self) -> None:
        """Wait for the last step and, if it was made with ``keep_gradients=True`` in sync mode, put into
        ``param.grad`` the gradients it stepped with where ``param.grad`` holds nothing newer (``None``, or what
        the step was lent: then into that very tensor, as autograd accumulates in place), as plain training
        leaves them until ``zero_grad()``. A step that follows no
        backward (Lightning's ``_skip_backward``, a manual step without ``manual_backward``) then applies what
        it would apply under plain training: these gradients again, unless they were cleared."""
        self.wait_for_steps()
        self.stepping.restore_gradients()

    def wait_for_steps(self) -> None:
        """Wait until every queued optimizer step has finished (and no longer reads the gradients it was lent)."""
        self._life.check_running()
        self.stepping.wait_for_steps()

    def synchronize(self) -> None:
        """Wait for every dispatched job and queued step; afterwards the module's weights are current."""
        self._life.check_running()
        self.dispatcher.wait_for_jobs()
        self.wait_for_steps()

    @property
    def disk(self) -> DiskTier | None:
        """The disk tier (``offload``), once started: what it holds (``state_bytes``, ``master_bytes``) and what of it
        is in memory (``resident_bytes``). ``None`` without offload or before start."""
        return self._ring.disk if self._ring is not None else None

    def offload_state(self, optimizer: torch.optim.Optimizer) -> None:
        """With ``offload``: move ``optimizer``'s state into the disk tier's files now, one parameter at a
        time (after ``optimizer.load_state_dict``, which makes it in memory; steps otherwise move what they
        make). Between steps only: waits for those queued. No-op without offload."""
        disk = self._started_part(self._ring).disk
        if disk is not None:
            self.wait_for_steps()
            disk.adopt_all(optimizer)

    def drop_offloaded_pages(self) -> None:
        """With ``offload``: write every page of the disk tier's files in memory (state and masters) to its file and
        drop it (after something read them all: a checkpoint). No-op without offload or before start."""
        if self._ring is not None and self._ring.disk is not None:
            self._ring.disk.drop_all()

    # ------------------------------------------------------------------ the module's state between calls
    def _follow_module_state(self) -> None:
        """Before each call, on the caller's thread: make the engine's view of the trunk what the module holds now
        (``follow.py``); only when a layer changed does it wait for every job and step, then follow it."""
        if self.frozen:
            self.frozen.widen_trainable()  # a weight made trainable trains in its own dtype: seen as changed below
        changed = self.follower.changed_layers()
        if changed:
            self.synchronize()
            ring = self._started_part(self._ring)
            self.follower.follow_layers(changed, ring.runner, ring.sources,
                                        self.dispatcher.window)
            self.layer_device_bytes = layer_sizes(self.trunk, self.transport)

    # ------------------------------------------------------------------ planning
    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps so that a resumed run continues this one exactly, as plain values (they load
        with ``torch.load(weights_only=True)``): the optimizer steps queued so far and the base seed (together they
        seed the random layers of the next steps), the ring position, the planner's plan and what it has learned,
        and the activation measurements it has not been given yet. Call it between steps, after
        :meth:`synchronize`, so that every measurement of the steps so far is in."""
        measurements = self._ring.measurements if self._ring is not None else None
        return {
            "version": 1,
            "step": self.dispatcher.step,
            "base_seed": self.base_seed,
            "num_devices": self.num_devices,
            "ring_position": self.dispatcher.next_job % self.num_devices,
            "planner": self.planner.state_dict(),
            "activation_bytes": measurements.pending_activation_bytes() if measurements is not None else {},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict` (before :meth:`start`): the step count, the base seed unless the
        ``seed`` option sets one, and, on as many devices and with the same ``num_stages``, the ring position,
        the plan and what the planner had learned (otherwise the planner starts afresh)."""
        if self._life.started:
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
        """After each step, what the planner learns (:meth:`Measurements.replan`)."""
        with self._failures_surfaced():
            self._started_part(self._ring).measurements.replan(self.planner, closed, self.layer_device_bytes)

    def _estimate_autocast_copies(self, context: CallContext) -> None:
        """Before anything is measured: room for autocast's weight copies (:func:`estimate_autocast_copies`)."""
        estimate_autocast_copies(self.planner, self.trunk, self._started_part(self._ring).sources,
                                 context.autocast_dtype(self.torch_devices[0].type))

    def _new_call(self, inputs: LayerInput, context: CallContext, checkpoints: bool, *,
                  transparent: bool = False) -> Call:
        if checkpoints and not self.planner.activations_observed and not self.options.freeze_plan:
            self._estimate_autocast_copies(context)
        return self.dispatcher.new_call(inputs, context, checkpoints, transparent=transparent)

