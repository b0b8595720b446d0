"""``RoundPipeStrategy``: the Lightning adapter. Hook overrides and validation only; the engine does the work.

The host is the root device: the module, batches and ``self.device`` stay on the CPU, and only the engine
touches the devices Lightning hands over as ``parallel_devices``. The trunk's ``forward`` is redirected to the
engine while the strategy is set up.

Processes: one by default, driving every device of the Trainer as one ring; with ``rings_per_node * num_nodes
> 1`` one per ring, training data parallel, launched and ranked as Lightning's ``DDPStrategy`` does it
(:mod:`~lightning_roundpipe.strategy_processes`); only global rank 0 writes checkpoints.

Checkpoints: beside Lightning's entries, ``checkpoint["roundpipe"]`` holds the engine's state (the plan in use, the
step count and base seed that seed the random layers), which ``ckpt_path`` gives back to the next run's engine, so
that a resumed run continues the saved one exactly (:mod:`~lightning_roundpipe.strategy_checkpoints`).

Optimizer contract: the module's parameters are the master weights, stepped on the engine's optimizer
thread, which steps its own references to the gradients and never touches ``param.grad``: only the main
thread reads or assigns it. The precision plugin's ``optimizer_step``, and in it anything that must see final
gradients (``on_before_optimizer_step``, clipping), runs on the main thread before the step is queued, so
``self.log`` works there. Gradients are where Lightning's default strategy has them, in ``param.grad`` from the
backward that made them until ``zero_grad``, whenever user code could read them, at the least cost:

* before the step (manual optimization, ``on_after_backward``, an ``optimizer_zero_grad`` that may keep
  gradients: :data:`BEFORE_STEP_GRADIENT_HOOKS`): the main thread waits for the pipeline's backward after
  each backward and gathers its gradients into ``param.grad``;
* after the step (``on_train_batch_end``, then the next batch's ``on_train_batch_start`` and
  ``on_before_zero_grad``: :data:`AFTER_STEP_GRADIENT_HOOKS`): in sync mode nothing waits for them. The step
  streams as without the hook, and once it is done (``optimizer_step`` waits for it anyway) the gradients it
  applied go into ``param.grad``, into the very tensors ``param.grad`` held, as autograd accumulates in place.
  Only a batch that does not step (gradient accumulation) waits for its backward, there being no step to
  show them after. Async mode has no such point: what Lightning would show there is this batch's gradients,
  the ones the step applies, and they are final only once this backward is over, which nothing else waits
  for (the step runs on while the next batch starts). Showing older ones, or none, would be a silent
  difference, so a hook after the step makes each backward wait there, as a hook before it does (the step
  still overlaps the next iteration);
* otherwise (and for objects that declare ``roundpipe_reads_gradients = False``) the gradients go from the
  pipeline to the optimizer thread without a wait; sync mode still shows the step's gradients after it.

A sync step is waited for before user code can see the weights it writes: right after it is queued where a hook
of the user's may run before the next batch arrives, else when it arrives (``batch_to_device``), so that Lightning's
end of the batch and the next fetch overlap the step (:mod:`~lightning_roundpipe.weight_readers`).

``zero_grad`` works as usual; zeroing in place (``set_to_none=False``) first lets the step in flight finish,
as it reads those tensors.

The rest lives beside it, along Lightning's own seams: options in :mod:`~lightning_roundpipe.strategy_options`,
trunk discovery in :mod:`~lightning_roundpipe.trunk`, the precision plugin's part of a step in
:mod:`~lightning_roundpipe.precision`, checkpoint writing in :mod:`~lightning_roundpipe.checkpoint_io`, the
metrics callback in :mod:`~lightning_roundpipe.metrics`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager
from typing import Any, Literal

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_roundpipe import metrics, precision, preflight, pretrained
from lightning_roundpipe.checkpoint_io import StreamingCheckpointIO
from lightning_roundpipe.engine.engine import RoundPipeEngine
from lightning_roundpipe.engine.options import FrozenWeights, Offload, Recompute, TransportDtype
from lightning_roundpipe.engine.pipelined import InstancePatch, ZeroGradGuard
from lightning_roundpipe.engine.step.groups import StreamingStep
from lightning_roundpipe.engine.step.kernels import HostKernels
from lightning_roundpipe.engine.transport import transport_torch_dtype
from lightning_roundpipe.gradient_readers import (
    AFTER_STEP_GRADIENT_HOOKS,
    BEFORE_STEP_GRADIENT_HOOKS,
    GRADIENT_HOOKS,
    gradient_hook_reader,
    trainer_of,
    whole_gradients_reader,
)
from lightning_roundpipe.materialize import has_meta_tensors, materialize
from lightning_roundpipe.observe.trace import write_timeline
from lightning_roundpipe.planning.partition import Plan
from lightning_roundpipe.preflight import MemoryPlan
from lightning_roundpipe.strategy_checkpoints import CheckpointingStrategy
from lightning_roundpipe.strategy_names import register_near_misses
from lightning_roundpipe.strategy_options import (
    TIMELINE_MAX_EVENTS,
    KeepGradients,
    PreflightMode,
    ReduceDtype,
    build_options,
)
from lightning_roundpipe.trunk import build_module_trunk
from lightning_roundpipe.weight_readers import weights_reader_between_steps

log = logging.getLogger(__name__)


class RoundPipeStrategy(CheckpointingStrategy):
    """Train a LightningModule with RoundPipe: ``Trainer(strategy="roundpipe", accelerator=..., devices=N)``.

    Each option is summed up here and documented in full where it is declared, in
    :class:`~lightning_roundpipe.strategy_options.StrategyOptions` or
    :class:`~lightning_roundpipe.engine.options.EngineOptions`.

    Args:
        pipeline: dotted attribute path of the trunk, e.g. ``"net"``. Default: the Hugging Face causal LM if
            any, else the ``nn.Sequential`` holding the most parameters.
        num_microbatches: microbatches per batch. Default: devices + 1 (one device: 1, the whole batch).
        num_stages: ``"auto"``, the chunk count (number of forward stages), or a ``Plan``.
        async_step: ``False``: exact sync step. ``True``: the paper's one-step-stale update.
        round_size: ``"auto"`` (sync: whole jobs or rounds of microbatches, whichever is predicted faster),
            ``"whole"`` (each stage job runs every microbatch) or microbatches per round.
        streaming_step: ``"auto"``: a ``torch.optim`` optimizer steps stage by stage, each backward stage's
            parameters as soon as their gradients are final, and each upload waits only for its own; ``"on"``:
            also another optimizer, declared to update each parameter on its own; ``"off"``: whole steps.
        host_optimizer: ``"exact"``: torch's fused CPU kernel only where it is bitwise the default (SGD without
            momentum). ``"fused"``: also Adam, AdamW and SGD with momentum (faster; equal within float rounding).
        offload: ``"none"``: the optimizer state in host memory. ``"optimizer"``: in files under ``offload_dir``,
            read ahead of each step group and written behind it (bitwise the same results; Linux).
            ``"optimizer+masters"``: under ``bf16-mixed``/``16-mixed`` also the fp32 masters devices upload from
            a low-precision copy (the Linear and Conv weights).
        offload_dir: the directory of ``offload``'s files, on a local disk with room for the state.
        frozen_weights: ``"auto"``: under ``bf16-mixed``/``16-mixed`` a frozen Linear or Conv weight whose values
            autocast's dtype holds exactly (a bf16 checkpoint's) is kept on the host in that dtype alone (2 bytes
            per parameter instead of 6); ``"as_stored"``: never; ``"round"``: every one, rounded. State dicts keep
            the module's dtypes.
        stochastic_rounding: bfloat16 parameters (``precision="bf16-true"``) are stepped in float32 (their state
            too) and rounded back stochastically, unbiased, so small updates are not lost; ``False``: as plain
            training.
        recompute: ``"stage"`` or ``"layer"``: the inputs a backward stage keeps.
        pin_memory: CUDA: pin the host weights in place for fast uploads.
        transport_dtype: under ``bf16-mixed``/``16-mixed`` (``"auto"``), upload the Linear and Conv weights in
            autocast's dtype: half the bytes, the same results; ``"off"``: as stored.
        device_memory_limit: per-device budget, bytes or ``"20GiB"``. Default on GPUs: 90% of what the
            process can still allocate, split between ring members that share a GPU.
        ring: the ring's members as indices into the Trainer's devices, e.g. ``[0, 0]`` with ``devices=1``.
        rings_per_node: processes per node, each driving ``devices // rings_per_node`` of the node's devices as
            its ring; with more than one process in all, data parallel (gradients averaged at each step).
        shard_optimizer: several processes: each keeps and steps the optimizer state of its own share of the
            parameters (ZeRO-1), then broadcasts them; less host memory per node.
        reduce_dtype: several processes: the dtype gradients are averaged in (``"auto"``: their own; ``"bfloat16"``
            halves the traffic).
        log_pipeline_metrics: log ``roundpipe/*`` figures every ``log_every_n_steps`` optimizer steps.
        timeline: record the pipeline's timeline and write ``timeline.json`` and ``timeline.png`` at teardown.
        timeline_dir: where the timeline goes (default: ``default_root_dir``); giving it switches ``timeline`` on.
        timeline_steps: the timeline keeps the last this many optimizer steps (``None``: all).
        preflight: the memory plan at setup: ``"refuse"`` what does not fit, ``"warn"``, or ``"off"``.
        fp16_accumulation: CUDA, ``16-mixed`` only: fp16 matmuls accumulate in fp16 (faster, less precise; see
            ``StrategyOptions.fp16_accumulation``), for the run's duration.
        keep_gradients: sync mode: ``"auto"`` keeps each step's gradients in ``param.grad`` until ``zero_grad``
            only where something may read them whole (a gradient hook, clipping, ...); otherwise they exist only
            while in flight. ``"always"``: keep them (``StrategyOptions.keep_gradients``).
        weights_from: a safetensors file or Hugging Face model directory that a module built on the meta device
            (so built, with this set, by ``configure_model`` and ``Trainer.init_module()``) takes its weights from,
            tensor by tensor (``StrategyOptions.weights_from``).
        freeze_plan: never replan from measured times.
        replan_hysteresis: adopt a new plan only when predicted this fraction faster.
        deferred_batchnorm: BatchNorm running statistics updated once per batch from all its microbatches
            (the whole batch's), not per microbatch; normalization stays per microbatch.
        seed: base seed of per-microbatch randomness (default: ``torch.initial_seed()``, or a resumed checkpoint's).
        jitter: test mode: random delays of up to this many seconds in CPU stand-in streams.
        stress: test mode: CPU stand-ins land copies late and poison released buffers (CUDA semantics).
        wait_timeout: seconds any internal wait may block before the engine fails instead of hanging.
        accelerator: Lightning's, as for any strategy.
        parallel_devices: Lightning's: the node's devices, which its rings are made of.
        checkpoint_io: Default: :class:`~lightning_roundpipe.checkpoint_io.StreamingCheckpointIO`, unless the
            Trainer has a plugin of the user's.
        precision_plugin: Lightning's, as for any strategy.
    """

    strategy_name = "roundpipe"

    def __init__(self, pipeline: str | None = None, num_microbatches: int | None = None,
                 num_stages: Literal["auto"] | int | Plan = "auto", async_step: bool = False,
                 recompute: Recompute = "stage", pin_memory: bool = True,
                 device_memory_limit: int | str | None = None, *, transport_dtype: TransportDtype = "auto",
                 streaming_step: StreamingStep = "auto", host_optimizer: HostKernels = "exact",
                 offload: Offload = "none", offload_dir: str | os.PathLike[str] | None = None,
                 frozen_weights: FrozenWeights = "auto", stochastic_rounding: bool = False,
                 round_size: Literal["auto", "whole"] | int = "auto", ring: list[int] | None = None,
                 rings_per_node: int = 1, shard_optimizer: bool = False, reduce_dtype: ReduceDtype = "auto",
                 log_pipeline_metrics: bool = True, timeline: bool = False,
                 timeline_dir: str | os.PathLike[str] | None = None, timeline_steps: int | None = 3,
                 preflight: PreflightMode = "refuse", fp16_accumulation: bool = False,
                 keep_gradients: KeepGradients = "auto", weights_from: str | os.PathLike[str] | None = None,
                 freeze_plan: bool = False, replan_hysteresis: float = 0.1,
                 deferred_batchnorm: bool = False, seed: int | None = None, jitter: float = 0.0, stress: bool = False,
                 wait_timeout: float = 600.0,
                 accelerator: Accelerator | None = None, parallel_devices: list[torch.device] | None = None,
                 checkpoint_io: CheckpointIO | None = None, precision_plugin: Precision | None = None) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        self.options, self.engine_options = build_options(dict(
            pipeline=pipeline, ring=ring, rings_per_node=rings_per_node, shard_optimizer=shard_optimizer,
            reduce_dtype=reduce_dtype, log_pipeline_metrics=log_pipeline_metrics, timeline=timeline,
            timeline_dir=timeline_dir, timeline_steps=timeline_steps, preflight=preflight,
            fp16_accumulation=fp16_accumulation, keep_gradients=keep_gradients, weights_from=weights_from,
            num_microbatches=num_microbatches, num_stages=num_stages, async_step=async_step, recompute=recompute,
            pin_memory=pin_memory, device_memory_limit=device_memory_limit, transport_dtype=transport_dtype,
            streaming_step=streaming_step, host_optimizer=host_optimizer, round_size=round_size,
            offload=offload,
            offload_dir=os.fspath(offload_dir) if isinstance(offload_dir, os.PathLike) else offload_dir,
            frozen_weights=frozen_weights, stochastic_rounding=stochastic_rounding,
            freeze_plan=freeze_plan, replan_hysteresis=replan_hysteresis, deferred_batchnorm=deferred_batchnorm,
            seed=seed, jitter=jitter, stress=stress, wait_timeout=wait_timeout))
        self.memory_plan: MemoryPlan | None = None  #: the last setup's pre-flight plan (None with preflight='off')
        self.timeline_files: list[str] = []  #: what the last teardown wrote
        self._timeline_pending = False
        self.engine: RoundPipeEngine | None = None
        self._patches: list[InstancePatch] = []
        self._fused_backward_done = False
        self._stepping = False  # inside optimizer_step's closure: the backward there is shown after its step
        self._resume_state: dict[str, Any] | None = None  # the engine state of the checkpoint being resumed
        # a module built on the meta device: the resumed checkpoint's state dict (and strict), for setup
        self._materialize_from: tuple[Mapping[str, Any], bool] | None = None
        self._restore_matmul: Callable[[], None] | None = None  # undoes fp16_accumulation's process-global flag
        self._gradients_said: tuple[str | None] | None = None  # what kept the last step's gradients, once logged
        self._waits_said: tuple[str | None] | None = None  # where sync steps are waited for, once logged
        self._step_unwaited = False  # a sync step runs on until the next batch arrives (``_wait_for_step``)

    # ------------------------------------------------------------------ the host as root device
    @property
    @override
    def root_device(self) -> torch.device:
        return torch.device("cpu")

    @override
    def model_to_device(self) -> None:
        pass  # the module is the host copy; devices get stages from the engine

    @property
    @override
    def checkpoint_io(self) -> CheckpointIO:
        # the streaming writer unless the user gave a CheckpointIO (here, or as a Trainer plugin, which
        # Lightning assigns after __init__ and refuses beside one given here); Lightning completes a wrapper
        # such as AsyncCheckpointIO
        if self._checkpoint_io is None:
            self._checkpoint_io = StreamingCheckpointIO()
        return super().checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO) -> None:
        self._checkpoint_io = io

    # ------------------------------------------------------------------ setup and teardown
    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        # empty_init=True (Trainer.init_module(empty_init=True)), or weights_from and not empty_init=False: on the
        # meta device, as Lightning's FSDP; setup gives each module host memory and values, layer by layer
        # (materialize.py)
        if not (empty_init or (empty_init is None and self.options.weights_from is not None)):
            with super().tensor_init_context(empty_init):
                yield
            return
        with torch.device("meta"), self.precision_plugin.tensor_init_context():
            yield

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        module = self.lightning_module
        if module is not None and has_meta_tensors(module):  # loaded module by module as setup materializes it
            self._materialize_from = (checkpoint["state_dict"], strict)
            return
        super().load_model_state_dict(checkpoint, strict=strict)

    @override
    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        module = self.lightning_module
        assert module is not None
        (source, strict), self._materialize_from = self._materialize_from or (None, True), None
        if source is None and self.options.weights_from is not None:
            source, strict = pretrained.source_for(module, self.options.weights_from, trainer.ckpt_path), False
        data_parallel = self.data_parallel if self.world_size > 1 else None
        if data_parallel is not None:  # the checkpoint being resumed, if any, is loaded already: on every process
            pretrained.report(materialize(module, source, strict=strict),  # whole, before processes compare weights
                              source, log)
            self.agree_initial_weights(module)
        trunk, driven, forward_patch = build_module_trunk(module, self.options.pipeline)
        devices = self.ring_devices or self.parallel_devices or [torch.device("cpu")]
        fitting = trainer.state.fn == TrainerFn.FITTING
        options, mode = precision.resolve_transport(self.engine_options, self.precision_plugin), self.options.preflight
        if self.options.fp16_accumulation and self._restore_matmul is None:  # restored in _release
            self._restore_matmul = precision.enable_fp16_accumulation(self.precision_plugin, devices[0].type)
        # pre-flight, before any thread starts: a layer too large for the device budget first (the planner
        # would refuse it tersely), then, with the plan and the optimizers known, the whole memory plan
        self.memory_plan = None
        transport = transport_torch_dtype(options.transport_dtype)
        preflight.enforce_layers(trunk, options.device_memory_limit_bytes, mode, devices[0].type, transport)
        engine = RoundPipeEngine(trunk, devices, options, data_parallel=data_parallel,  # plans; threads start below
                                 model=module)
        try:
            if has_meta_tensors(module):  # each trunk layer given its host home once it is whole (engine.settle)
                if source is None:
                    log.warning("RoundPipe: the module was built on the meta device (Trainer.init_module("
                                "empty_init=True)) and no checkpoint is being resumed, so each module's "
                                "reset_parameters() initialises it now. Weights loaded into it before fit with "
                                "load_state_dict(...) were not kept (meta tensors hold no values): load them with "
                                "load_state_dict(..., assign=True), or pass ckpt_path to fit.")
                pretrained.report(materialize(module, source, strict=strict, layers=trunk.layers,
                                              after_layer=lambda index: engine.settle([index])), source, log)
                engine.collect_again()
            resumed, self._resume_state = self._resume_state, None
            if resumed is not None and trainer.ckpt_path is not None:
                engine.load_state_dict(resumed)  # the plan, step count and seed the checkpointed run had
            if data_parallel is not None:  # every ring starts with process 0's plan (the engine agrees after each step)
                engine.planner.adopt(data_parallel.agree(engine.planner.plan))
            if fitting:
                self.setup_optimizers(trainer)
            if mode != "off":
                self.memory_plan = preflight.plan_for(engine, module, self.optimizers, trainer.state.fn,
                                                      self.num_processes,
                                                      gradients_kept_for=self.whole_gradients_reader())
                preflight.enforce(self.memory_plan, mode, log)
            self.engine = engine.start()
        except BaseException:
            engine.close(finish_steps=False)  # not started: gives narrowed frozen weights their dtype back
            raise
        if self.options.timeline:
            self.engine.timeline.bound(keep_steps=self.options.timeline_steps, max_events=TIMELINE_MAX_EVENTS)
            self._timeline_pending = True
        self._patches = [forward_patch(driven, self.engine, self._backward_scale, self._mark_fused_backward),
                         ZeroGradGuard(module, self.engine)]
        for patch in self._patches:
            patch.install()
        self.setup_precision_plugin()  # may replace the optimizers and their LightningOptimizer wrappers
        if fitting:
            self._guard_zero_grad()
            if self.options.log_pipeline_metrics:
                metrics.attach(trainer, lambda: self.engine)

    def _guard_zero_grad(self) -> None:
        # zero_grad clears param.grad on the main thread, as always; only zeroing in place must first let a
        # step in flight finish (it reads those tensors). Lightning calls it through its LightningOptimizer
        # wrappers, whose class inherits the optimizer's own zero_grad, so both get the guard.
        assert self.engine is not None and self.lightning_module is not None
        wrappers = self.lightning_module.optimizers()
        for wrapper in wrappers if isinstance(wrappers, list) else [wrappers]:
            for owner in (wrapper.optimizer, wrapper):
                if not isinstance(owner.__dict__.get("zero_grad"), ZeroGradGuard):
                    self._patches.append(ZeroGradGuard(owner, self.engine, zeroes=wrapper.optimizer))
                    self._patches[-1].install()

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self._guard_zero_grad()  # in case Lightning rebuilt its optimizer wrappers after setup

    def _release(self, finish_steps: bool, finish_jobs: bool = True) -> None:
        self._step_unwaited = False  # closing finishes the steps, or drops them after a failure
        if self.engine is not None:
            self.engine.close(finish_steps=finish_steps, finish_jobs=finish_steps and finish_jobs)
            self._write_timeline()
        if self._restore_matmul is not None:  # once the last job has run
            self._restore_matmul()
            self._restore_matmul = None
        for patch in self._patches:
            patch.remove()
        self._patches = []
        trainer = trainer_of(self.lightning_module)
        if trainer is not None:
            metrics.detach(trainer)

    def _write_timeline(self) -> None:
        """Write the recorded timeline once per engine; a failure is logged, never raised (this runs while
        an exception may be propagating)."""
        if not self._timeline_pending or self.engine is None:
            return
        self._timeline_pending = False
        try:
            folder = self.options.timeline_dir
            if folder is None:
                trainer = trainer_of(self.lightning_module)
                folder = trainer.default_root_dir if trainer is not None else os.getcwd()
            events = self.engine.events()
            # one file per process when there are several: never two processes to one path
            name = "timeline" if self.world_size == 1 else f"timeline_rank{self.global_rank}"
            self.timeline_files = write_timeline(events, folder, self.engine.num_devices, name=name)
            log.info(f"RoundPipe timeline ({len(events)} events): {', '.join(self.timeline_files)}")
        except Exception as error:  # noqa: BLE001 - a picture is never worth masking the run's own outcome
            log.warning(f"RoundPipe could not write its timeline: {type(error).__name__}: {error}")

    @override
    def teardown(self) -> None:
        self._release(finish_steps=True)
        module = self.lightning_module
        if module is None or not has_meta_tensors(module):
            super().teardown()
        else:  # setup failed before materializing it: Lightning's move to the CPU would raise on a meta tensor,
            module.cpu = lambda: module  # type: ignore[method-assign]  # over the error being raised; nothing to move
            try:
                super().teardown()
            finally:
                del module.cpu
        engine = self.engine
        if engine is None or engine.unreported_failure is None:
            return
        if self._interrupted():  # an exception is propagating already: say it, never mask it
            error = engine.unreported_failure
            log.warning(f"RoundPipe's pipeline had also failed: {type(error).__name__}: {error}")
            return
        # a failure no call has raised yet (the last optimizer step's, say): fit must not end as a success
        engine.raise_unreported_failure()

    @override
    def on_exception(self, exception: BaseException) -> None:
        # the steps Lightning has counted complete (they are whole or not at all), unless the pipeline itself
        # failed; the batch in flight is dropped. Every wait in there is bounded by `wait_timeout`.
        self._release(finish_steps=self.engine is not None and not self.engine.failed, finish_jobs=False)

    # ------------------------------------------------------------------ training
    def _backward_scale(self) -> float:
        return precision.backward_scale(self.precision_plugin, self.lightning_module)

    def _mark_fused_backward(self) -> None:
        self._fused_backward_done = True

    def gradients_read(self, hooks: tuple[str, ...] = GRADIENT_HOOKS) -> bool:
        """Whether user code may read ``param.grad`` in ``hooks`` (by default any hook of :data:`GRADIENT_HOOKS`),
        or anywhere in manual optimization (right after ``manual_backward``, say): a module or callback overrides
        one of them."""
        return gradient_hook_reader(self.lightning_module, hooks) is not None

    def whole_gradients_reader(self) -> str | None:
        """What may read the whole model's gradients of a step, so that the host keeps them through it (and a
        sync step leaves them in ``param.grad``); ``None``: nothing, and each step group's gradients exist only
        while in flight (``StrategyOptions.keep_gradients``). Asked at every step: the answer may change during
        a run (``GradientAccumulationScheduler``)."""
        if self.options.keep_gradients == "always" and not self.engine_options.async_step:
            return "keep_gradients='always'"
        return whole_gradients_reader(self.lightning_module, self.precision_plugin)

    def _say_gradients_kept(self, reader: str | None) -> None:
        """Log, when it changes, whether the steps keep the whole model's gradients and for what."""
        if self._gradients_said == (reader,):
            return
        self._gradients_said = (reader,)
        if reader is None:
            log.info("RoundPipe holds each step group's gradients only while in flight: nothing reads them whole, so "
                     "param.grad is None after each step (keep_gradients='always' keeps them, as Lightning does)")
        else:
            log.info(f"RoundPipe keeps the whole model's gradients through each step: {reader} may read them")

    def gathers_after_backward(self) -> bool:
        """Whether the backward running now must be waited for and its gradients gathered into ``param.grad``
        before it returns: a hook before the step may read them; or a hook after it, where no step will show
        them without a wait (a batch that does not step, or async mode, whose step runs on meanwhile)."""
        if self.gradients_read(BEFORE_STEP_GRADIENT_HOOKS):
            return True
        shown_after_step = self._stepping and not self.engine_options.async_step
        return not shown_after_step and self.gradients_read(AFTER_STEP_GRADIENT_HOOKS)

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        # Lightning's Strategy.backward, with the pipeline's gradients gathered into param.grad before
        # post_backward fires on_after_backward, when user code may read them before a step shows them
        module = self.lightning_module
        assert module is not None
        fused = self._fused_backward_done and not closure_loss.requires_grad
        self._fused_backward_done = False
        if not fused:
            self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        if not fused:  # (fused: pipeline_loss already ran the backward inside training_step)
            self.precision_plugin.backward(closure_loss, module, optimizer, *args, **kwargs)
        if self.engine is not None and not self.engine.closed and self.gathers_after_backward():
            self.engine.collect_gradients()
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        if not fused:
            self.post_backward(closure_loss)
        return closure_loss

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        if isinstance(optimizer, torch.optim.LBFGS):
            raise ValueError(
                "RoundPipe steps the optimizer once per batch on its own thread and cannot re-evaluate a closure; "
                "LBFGS needs that. Use a first-order optimizer (SGD, Adam, AdamW, ...)."
            )
        module = model or self.lightning_module
        assert self.engine is not None and module is not None
        self._stepping = True  # the backward in the closure is this step's: a sync step shows its gradients
        try:
            result = closure()  # the training step and its backward, which feeds the pipeline's gradients
        finally:
            self._stepping = False
        reader = self.whole_gradients_reader()
        self._say_gradients_kept(reader)
        precision.queue_step(self.precision_plugin, self.engine, optimizer, module, result,
                             keep_gradients=reader is not None, **kwargs)
        if not self.engine_options.async_step:
            # user code that runs next sees the step done and every buffer copied back, as under Lightning's
            # default strategy: a callback may read the weights (SWA's average, EMA) or write them
            # (``param.data = ...``, ``load_state_dict``, SWA's BatchNorm reset), and ``training_step`` may read
            # them, which must not race the step on the optimizer thread. Where no hook of the user's runs before
            # the next batch reaches the strategy, the wait is there (``_wait_for_step``): Lightning's end of the
            # batch and the next batch's fetch overlap the step's tail (sync uploads wait for the step anyway)
            if reader is None and self._step_may_run_until_next_batch():
                self._step_unwaited = True
                return result
            self.engine.synchronize()
            # and param.grad holds the step's gradients until zero_grad(), as under the default strategy: a
            # step that follows no backward (SWA's BatchNorm epoch) applies them again, as Lightning's would
            self.engine.restore_gradients()
        return result

    def _step_may_run_until_next_batch(self) -> bool:
        """Whether nothing of the user's may see the weights between this sync step and the next batch's arrival
        (``weight_readers.py``); one process only: another's collectives between steps (``self.log(...,
        sync_dist=True)``, a stop decision) would interleave with this process's step."""
        reader = weights_reader_between_steps(self.lightning_module)
        if self._waits_said != (reader,):
            self._waits_said = (reader,)
            log.debug("RoundPipe waits for each sync step %s", "when the next batch arrives" if reader is None
                      else f"right after it is queued: {reader} may read the weights")
        return reader is None and self.world_size == 1

    def _wait_for_step(self) -> None:
        """Wait for a sync step left to run past ``optimizer_step`` (see there), before anything reads the weights."""
        if self._step_unwaited:
            self._step_unwaited = False
            if self.engine is not None and not self.engine.closed:
                self.engine.synchronize()

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        self._wait_for_step()  # before the module's transfer hooks and everything of the batch after them
        return super().batch_to_device(batch, device, dataloader_idx)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._wait_for_step()  # a loop fetching from `dataloader_iter` moves no batch
        return super().training_step(*args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        self._wait_for_step()
        return super().validation_step(*args, **kwargs)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        if "roundpipe" not in strategy_registry:
            strategy_registry.register("roundpipe", cls, description="RoundPipe, exact (sync) optimizer step")
        if "roundpipe_async" not in strategy_registry:
            strategy_registry.register("roundpipe_async", cls, description="RoundPipe, one-step-stale async step",
                                       async_step=True)


def register() -> None:
    """Register ``roundpipe`` and ``roundpipe_async`` with Lightning's strategy registry, and their near misses
    (:mod:`~lightning_roundpipe.strategy_names`: ``strategy="roundpip"`` asks "did you mean 'roundpipe'?")."""
    from lightning.pytorch.strategies import StrategyRegistry

    RoundPipeStrategy.register_strategies(StrategyRegistry)
    register_near_misses(StrategyRegistry)


register()  # when this module is imported before Lightning, the import hook fired while it was half-built
