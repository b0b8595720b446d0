"""``RoundPipeStrategy``: the Lightning adapter. Hook overrides and validation only; the engine does the work.

One process, rank 0, world size 1, no launcher. The host is the root device: the module, batches and
``self.device`` stay on the CPU, and only the engine touches the devices Lightning hands over as
``parallel_devices``. The trunk's ``forward`` is redirected to the engine while the strategy is set up.

Optimizer contract: the module's parameters are the master weights, stepped on the engine's optimizer
thread. Lightning's ``zero_grad`` is a no-op on the strategy's optimizers (the engine clears gradients
after each step, so a main-thread ``zero_grad`` cannot wipe gradients the pipeline produced or race a
step). Anything that must see final gradients (``on_before_optimizer_step``, clipping) runs on the main
thread before the step is queued, so ``self.log`` works there.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import warnings
from collections.abc import Callable
from typing import Any

import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch import LightningModule
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn
from typing_extensions import override

from lightning_roundpipe import preflight
from lightning_roundpipe.engine.engine import RoundPipeEngine
from lightning_roundpipe.engine.layers import Trunk, build_trunk
from lightning_roundpipe.engine.options import EngineOptions
from lightning_roundpipe.engine.pipelined import InstancePatch, PipelinedForward, ZeroGradAfterSteps
from lightning_roundpipe.hf.causal_lm import FAMILIES, CausalLMForward, causal_lm_preset, find_causal_lm
from lightning_roundpipe.planning.partition import Plan
from lightning_roundpipe.preflight import PREFLIGHT_MODES, MemoryPlan

log = logging.getLogger(__name__)

TIMELINE_MAX_EVENTS = 200_000
"""The most timeline events a strategy keeps (about 40 MB), whatever ``timeline_steps`` says."""

_MOSTLY_INSIDE = 0.5  # warn when the trunk holds less than this share of the module's parameters


class RoundPipeStrategy(ParallelStrategy):
    """Train a LightningModule with RoundPipe: ``Trainer(strategy="roundpipe", accelerator=..., devices=N)``.

    Args:
        pipeline: dotted attribute path of the trunk (an ``nn.Sequential``) in the LightningModule. Default:
            the ``nn.Sequential`` holding the most parameters; the choice is logged.
        num_microbatches: microbatches per batch (default: devices + 1).
        num_stages: ``"auto"``, the chunk count (number of forward stages), or a ``Plan``.
        async_step: ``False`` (exact sync) or ``True`` (the paper's one-step-stale update).
        recompute: ``"stage"`` or ``"layer"``.
        pin_memory: pin the host weights in place for fast uploads (CUDA devices; falls back to pageable
            memory with a warning when the system refuses, e.g. a locked-memory limit).
        device_memory_limit: per-device budget in bytes or as ``"20GiB"``. Default on GPUs: 90% of what the
            process can still allocate there (free memory, capped by ``torch.cuda.set_per_process_memory_fraction``),
            split between ring members that share a GPU.
        ring: the ring's members as indices into the Trainer's devices, e.g. ``[0, 0]`` with ``devices=1``:
            two ring members on one GPU (Lightning itself refuses duplicate device ids). Default: each device
            once.
        log_pipeline_metrics: log ``roundpipe/*`` figures (bubble ratio, peak device bytes, bytes uploaded,
            host step time and the part of it the devices waited for) after each optimizer step.
        timeline_dir: a folder: record the pipeline's timeline (every upload, compute, download and host
            optimizer step, with its device, job and microbatch) and, when the strategy tears down (after
            an exception too, without masking it), write ``timeline.json``, a Chrome trace to open at
            https://ui.perfetto.dev, and ``timeline.png``, a Gantt chart (needs matplotlib:
            ``pip install 'lightning_roundpipe[plot]'``; without it a warning is logged and only the
            trace is written). ``None`` (default): nothing is recorded, at no cost.
        timeline: ``True`` records and writes those files like ``timeline_dir``, into
            ``timeline_dir`` if given, else the Trainer's ``default_root_dir``.
        timeline_steps: keep only the events of the last this many optimizer steps (and of what ran since
            the last one, e.g. a final validation), so a long run's timeline stays small; at most
            ``TIMELINE_MAX_EVENTS`` events are kept whatever happens. ``None``: keep everything.
        preflight: the memory plan made at setup, before any thread starts or training state is allocated
            (:mod:`lightning_roundpipe.preflight`): host bytes for parameters, gradients, optimizer state
            (estimated per optimizer class), async's published weights and simulated device copies against
            ``MemAvailable`` and the cgroup limit, and the largest layer and stages against
            ``device_memory_limit``. It is logged (INFO) and kept as ``strategy.memory_plan``. ``"refuse"``
            (default): raise :class:`~lightning_roundpipe.preflight.HostMemoryError` or
            :class:`~lightning_roundpipe.preflight.DeviceMemoryError` (``MemoryError`` subclasses) naming what
            does not fit, by how much, and what to change. ``"warn"``: warn and train anyway. ``"off"``: no
            plan, no log.
        **engine_options: further :class:`~lightning_roundpipe.engine.options.EngineOptions` fields.
    """

    strategy_name = "roundpipe"

    def __init__(self, pipeline: str | None = None, num_microbatches: int | None = None,
                 num_stages: str | int | Plan = "auto", async_step: bool = False, recompute: str = "stage",
                 pin_memory: bool = True, device_memory_limit: int | str | None = None, *,
                 accelerator: Any = None, parallel_devices: list[torch.device] | None = None,
                 checkpoint_io: Any = None, precision_plugin: Any = None, log_pipeline_metrics: bool = True,
                 timeline_dir: str | os.PathLike[str] | None = None, timeline: bool = False,
                 timeline_steps: int | None = 3, preflight: str = "refuse", ring: list[int] | None = None,
                 **engine_options: Any) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=None,
                         checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)
        self.pipeline = pipeline
        self.ring = ring
        self.log_pipeline_metrics = log_pipeline_metrics
        if timeline_steps is not None and (isinstance(timeline_steps, bool) or not isinstance(timeline_steps, int)
                                           or timeline_steps < 1):
            raise ValueError(f"`timeline_steps` must be a positive int or None, got {timeline_steps!r}")
        self.timeline_dir = None if timeline_dir is None else os.fspath(timeline_dir)
        self.timeline = bool(timeline) or self.timeline_dir is not None
        self.timeline_steps = timeline_steps
        if preflight not in PREFLIGHT_MODES:
            raise ValueError(f"`preflight` must be one of {', '.join(map(repr, PREFLIGHT_MODES))}, got {preflight!r}")
        self.preflight = preflight
        self.memory_plan: MemoryPlan | None = None  #: the last setup's pre-flight plan (None with preflight='off')
        self.timeline_files: list[str] = []  #: what the last teardown wrote
        self._timeline_pending = False
        if self.timeline:
            engine_options["record_timeline"] = True
        self.engine_options = EngineOptions(
            num_microbatches=num_microbatches, num_stages=num_stages, async_step=async_step, recompute=recompute,
            pin_memory=pin_memory, device_memory_limit=device_memory_limit, **engine_options)
        self.engine: RoundPipeEngine | None = None
        self._patches: list[InstancePatch] = []
        self._fused_backward_done = False
        self._silenced_zero_grad: list[torch.optim.Optimizer] = []
        self._layer_sync: Any = None  # Lightning sets this for sync_batchnorm=True; refused in setup
        self.num_nodes = 1            # Lightning sets this from Trainer(num_nodes=...); refused above 1

    # ------------------------------------------------------------------ one process, host as root
    @property
    @override
    def root_device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def is_distributed(self) -> bool:
        return False

    @property
    @override
    def global_rank(self) -> int:
        return 0

    @property
    @override
    def local_rank(self) -> int:
        return 0

    @property
    @override
    def node_rank(self) -> int:
        return 0

    @property
    @override
    def world_size(self) -> int:
        return 1

    @property
    @override
    def distributed_sampler_kwargs(self) -> None:
        return None

    @override
    def barrier(self, name: str | None = None) -> None:
        pass

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    @override
    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        return tensor

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        return tensor

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        return decision

    @override
    def model_to_device(self) -> None:
        pass  # the module is the host copy; devices get stages from the engine

    # ------------------------------------------------------------------ setup and teardown
    @override
    def setup_environment(self) -> None:
        if self.num_nodes > 1:
            raise ValueError(
                f"RoundPipe runs in one process on one machine; got Trainer(num_nodes={self.num_nodes}). Use "
                "num_nodes=1 (multi-machine data parallelism is not supported yet)"
            )
        if self._layer_sync is not None:
            raise ValueError(
                "Trainer(sync_batchnorm=True) synchronizes statistics across processes, and RoundPipe runs one "
                "process: set sync_batchnorm=False (BatchNorm sees each microbatch, as in gradient accumulation)"
            )
        devices = self.parallel_devices or [torch.device("cpu")]
        unsupported = sorted({device.type for device in devices} - {"cpu", "cuda"})
        if unsupported:
            raise ValueError(
                f"RoundPipe drives CUDA GPUs (accelerator='gpu') and simulated CPU devices (accelerator='cpu'), not "
                f"{unsupported[0]!r} devices"
            )
        if self.ring is not None:
            self.parallel_devices = self._ring_devices(devices)
        # the host stays the root device; the accelerator sets up the first ring device (current device,
        # its memory statistics), not the root, which a CUDA accelerator would refuse
        assert self.accelerator is not None
        self.accelerator.setup_device(self.parallel_devices[0] if self.parallel_devices else torch.device("cpu"))

    def _ring_devices(self, devices: list[torch.device]) -> list[torch.device]:
        """``ring=[0, 0]``: the ring's members by index into the Trainer's devices; a GPU may appear twice."""
        ring = list(self.ring)
        bad = [index for index in ring if not isinstance(index, int) or not 0 <= index < len(devices)]
        if not ring or bad:
            raise ValueError(
                f"`ring` lists indices into the Trainer's {len(devices)} device(s), each in 0..{len(devices) - 1}; "
                f"got {self.ring!r}. For two ring members on one GPU: Trainer(devices=1), ring=[0, 0]"
            )
        return [devices[index] for index in ring]

    @override
    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        module = self.lightning_module
        trunk, driven = self._build_trunk(module)
        devices = self.parallel_devices or [torch.device("cpu")]
        fitting = trainer.state.fn == TrainerFn.FITTING
        # pre-flight, before any thread starts: a layer too large for the device budget first (the planner
        # would refuse it tersely), then, with the plan and the optimizers known, the whole memory plan
        self.memory_plan = None
        options = self.engine_options
        if self.preflight != "off":
            problem = preflight.check_layers(trunk, options.device_memory_limit)
            if problem is not None and self.preflight == "refuse":
                raise preflight.DeviceMemoryError(problem)
            if problem is not None:
                warnings.warn(problem + " (preflight='warn': continuing)", UserWarning, stacklevel=2)
        engine = RoundPipeEngine(trunk, devices, options)  # plans; threads start below
        if fitting:
            self.setup_optimizers(trainer)
        if self.preflight != "off":
            self.memory_plan = preflight.plan_memory(
                module, trunk, engine.plan, self.optimizers if fitting else [], devices=devices,
                async_step=options.async_step, recompute=options.recompute,
                device_memory_limit=engine.device_budget, pin_memory=options.pin_memory, training=fitting,
                trainer_fn=str(trainer.state.fn.value))
            preflight.enforce(self.memory_plan, self.preflight, log)
        self.engine = engine.start()
        if self.timeline:
            self.engine.timeline.bound(keep_steps=self.timeline_steps, max_events=TIMELINE_MAX_EVENTS)
            self._timeline_pending = True
        forward_patch = PipelinedForward if isinstance(driven, nn.Sequential) else CausalLMForward
        self._patches = [forward_patch(driven, self.engine, self._backward_scale, self._mark_fused_backward),
                         ZeroGradAfterSteps(module, self.engine)]
        for patch in self._patches:
            patch.install()
        self.setup_precision_plugin()  # may replace the optimizers and their LightningOptimizer wrappers
        if trainer.state.fn == TrainerFn.FITTING:
            self._silence_zero_grad()
            self._attach_metrics(trainer)

    def _find_trunk(self, module: LightningModule) -> tuple[str, nn.Module]:
        """The module to pipeline: ``pipeline=``'s, else the first Hugging Face causal LM (a preset), else
        the ``nn.Sequential`` holding the most parameters."""
        sequentials = {name: m for name, m in module.named_modules() if isinstance(m, nn.Sequential) and name}
        if self.pipeline is not None:
            try:
                trunk = module.get_submodule(self.pipeline)
            except AttributeError:
                raise ValueError(
                    f"`pipeline={self.pipeline!r}` names no submodule of {type(module).__name__}; "
                    f"its nn.Sequential submodules are {sorted(sequentials) or 'none'}"
                ) from None
            _refuse_compiled(self.pipeline, trunk)
            if find_causal_lm(trunk) is None and not isinstance(trunk, nn.Sequential):
                raise TypeError(
                    f"`pipeline={self.pipeline!r}` is a {type(trunk).__name__}, not an nn.Sequential: the trunk "
                    "must be an nn.Sequential whose children are the layers, or a Hugging Face causal LM "
                    f"({', '.join(FAMILIES)})"
                )
            return self.pipeline, trunk
        for name, candidate in module.named_modules():
            if name and find_causal_lm(candidate) is not None:
                _refuse_compiled(name, candidate)
                return name, candidate
        if not sequentials:
            raise ValueError(
                f"{type(module).__name__} has no nn.Sequential submodule or Hugging Face causal LM to pipeline. Put "
                "the model's blocks in an nn.Sequential attribute (e.g. self.net = nn.Sequential(embed, *blocks, "
                "head)) and pass `pipeline='net'` to RoundPipeStrategy if there are several"
            )
        name = max(sequentials, key=lambda n: (_parameter_count(sequentials[n]), -n.count(".")))
        _refuse_compiled(name, sequentials[name])
        return name, sequentials[name]

    def _build_trunk(self, module: LightningModule) -> tuple[Trunk, nn.Module]:
        """The trunk, and the module whose ``forward`` the engine takes over."""
        name, target = self._find_trunk(module)
        trunk = build_trunk(target, presets=(causal_lm_preset,))
        total = _parameter_count(module) or 1
        share = _parameter_count(target) / total
        log.info(f"RoundPipe pipelines `{name}` ({trunk.source}: {len(trunk)} layers, {share:.0%} of the "
                 f"parameters; on the host: {trunk.describe_parameters()})")
        if share < _MOSTLY_INSIDE:
            from lightning.pytorch.utilities import rank_zero_warn

            rank_zero_warn(
                f"RoundPipe pipelines `{name}`, which holds only {share:.0%} of the parameters; the rest stays on "
                "the host and runs on the main thread. Pass `pipeline=` to choose another trunk."
            )
        model = find_causal_lm(target)
        return trunk, target if model is None else model

    def _attach_metrics(self, trainer: Any) -> None:
        if self.log_pipeline_metrics and not any(isinstance(c, _PipelineMetrics) for c in trainer.callbacks):
            trainer.callbacks.insert(0, _PipelineMetrics(self))  # first, so other callbacks see fresh figures

    def _silence_zero_grad(self) -> None:
        # The engine clears gradients after each step; Lightning's zero_grad on the main thread would
        # otherwise race a step in flight (which reads param.grad on the optimizer thread) or wipe
        # gradients the pipeline produced. Lightning calls it through its LightningOptimizer wrappers,
        # whose class inherits the optimizer's own zero_grad, so both get the no-op.
        for optimizer in [*self.optimizers, *self._lightning_optimizers]:
            if optimizer.__dict__.get("zero_grad") is not _no_zero_grad:
                optimizer.zero_grad = _no_zero_grad  # type: ignore[method-assign]
                self._silenced_zero_grad.append(optimizer)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self._silence_zero_grad()  # in case Lightning rebuilt its optimizer wrappers after setup

    def _release(self, finish_steps: bool) -> None:
        if self.engine is not None:
            self.engine.close(finish_steps=finish_steps)
            self._write_timeline()
        for patch in self._patches:
            patch.remove()
        self._patches = []
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None:
            trainer.callbacks[:] = [c for c in trainer.callbacks if not isinstance(c, _PipelineMetrics)]
        for optimizer in self._silenced_zero_grad:
            optimizer.__dict__.pop("zero_grad", None)
        self._silenced_zero_grad.clear()

    def _write_timeline(self) -> None:
        """Write the recorded timeline once per engine; a failure is logged, never raised (this runs while
        an exception may be propagating)."""
        if not self._timeline_pending or self.engine is None:
            return
        self._timeline_pending = False
        try:
            from lightning_roundpipe.observe.trace import to_chrome_trace

            folder = self.timeline_dir
            if folder is None:
                trainer = self.lightning_module.trainer if self.lightning_module is not None else None
                folder = trainer.default_root_dir if trainer is not None else os.getcwd()
            os.makedirs(folder, exist_ok=True)
            events = self.engine.events()
            devices = self.engine.num_devices
            written = [os.path.join(folder, "timeline.json")]
            to_chrome_trace(events, written[0], num_devices=devices)
            try:
                from lightning_roundpipe.observe.gantt import draw_timeline

                draw_timeline(events, os.path.join(folder, "timeline.png"), num_devices=devices)
                written.append(os.path.join(folder, "timeline.png"))
            except ImportError as error:
                log.warning(f"RoundPipe wrote {written[0]} but no timeline.png: {error}")
            self.timeline_files = written
            log.info(f"RoundPipe timeline ({len(events)} events): {', '.join(written)}")
        except Exception as error:  # noqa: BLE001 - a picture is never worth masking the run's own outcome
            log.warning(f"RoundPipe could not write its timeline: {type(error).__name__}: {error}")

    @override
    def teardown(self) -> None:
        self._release(finish_steps=True)
        super().teardown()
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
        self._release(finish_steps=self.engine is not None and not self.engine.failed)

    def _interrupted(self) -> bool:
        """Whether the run is being interrupted: Lightning handles an exception (it calls the callbacks'
        ``on_exception``, e.g. ``OnExceptionCheckpoint``'s save, then the strategy's, then teardown)."""
        trainer = getattr(self.lightning_module, "_trainer", None)
        return trainer is not None and trainer.state.status == TrainerStatus.INTERRUPTED

    # ------------------------------------------------------------------ training
    def _backward_scale(self) -> float:
        """What Lightning would multiply a returned loss by before its backward: the 16-bit loss scale, and
        ``1 / accumulate_grad_batches`` in automatic optimization."""
        module = self.lightning_module
        scale = 1.0
        scaler = self._scaler()
        if scaler is not None:
            scale *= scaler.get_scale()
        if module is not None and module.automatic_optimization:
            scale /= module.trainer.accumulate_grad_batches
        return scale

    def _mark_fused_backward(self) -> None:
        self._fused_backward_done = True

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self._fused_backward_done and not closure_loss.requires_grad:
            # pipeline_loss already ran the backward inside training_step: fire the hooks only
            self._fused_backward_done = False
            module = self.lightning_module
            closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
            return self.precision_plugin.post_backward(closure_loss, module)
        self._fused_backward_done = False
        closure_loss = super().backward(closure_loss, optimizer, *args, **kwargs)
        module = self.lightning_module
        if module is not None and not module.automatic_optimization and self.engine is not None:
            # manual optimization may read or clip param.grad right after manual_backward
            self.engine.collect_gradients()
        return closure_loss

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        if isinstance(optimizer, torch.optim.LBFGS):
            raise ValueError(
                "RoundPipe steps the optimizer once per batch on its own thread and cannot re-evaluate a closure; "
                "LBFGS needs that. Use a first-order optimizer (SGD, Adam, AdamW, ...)."
            )
        assert self.engine is not None
        model = model or self.lightning_module
        result = closure()
        scaler = self._scaler()
        if scaler is None:
            before_step = None
            if self._needs_final_gradients(model):
                before_step = lambda: self.precision_plugin._after_closure(model, optimizer)  # noqa: E731
            self.engine.step(optimizer, before_step=before_step)
            self.engine.timeline.mark_step()  # one branch unless a timeline window is kept
            return result
        # 16-bit loss scaling, as Lightning's MixedPrecision does it, around the engine's step: unscale the
        # final gradients and check them for inf/NaN on the main thread, skip the update if any, then let
        # the scaler adjust its scale
        nothing_to_step = result is None and model.automatic_optimization

        def unscale_and_check() -> bool:
            if not nothing_to_step:
                scaler.unscale_(optimizer)
            self.precision_plugin._after_closure(model, optimizer)
            if nothing_to_step:
                return False
            found_inf = scaler._found_inf_per_device(optimizer)
            return not any(value.item() for value in found_inf.values())

        self.engine.step(optimizer, before_step=unscale_and_check)
        self.engine.timeline.mark_step()
        if not nothing_to_step:
            scaler.update()
        return result

    def _scaler(self) -> torch.amp.GradScaler | None:
        return getattr(self.precision_plugin, "scaler", None)

    def _needs_final_gradients(self, model: LightningModule) -> bool:
        """Whether anything must see this step's gradients before the update (clipping, hooks)."""
        trainer = model.trainer
        return bool(
            trainer.gradient_clip_val
            or is_overridden("configure_gradient_clipping", model, LightningModule)
            or is_overridden("on_before_optimizer_step", model, LightningModule)
            or any(is_overridden("on_before_optimizer_step", callback, Callback) for callback in trainer.callbacks)
        )

    # ------------------------------------------------------------------ checkpoints
    def _quiesce(self) -> None:
        """Make the module's weights consistent before they are read (a checkpoint): let the steps in flight
        finish. While an exception propagates (``OnExceptionCheckpoint`` saves before the strategy hears of
        it) stop the engine instead, without waiting for the interrupted batch: the steps Lightning counted
        complete, unless the pipeline itself failed (then queued steps are dropped; each step is applied
        whole or not at all)."""
        engine = self.engine
        if engine is None or engine.closed:
            return
        if engine.failed:
            engine.close(finish_steps=False)
        elif self._interrupted():
            engine.close(finish_steps=True)
        else:
            engine.synchronize()

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        self._quiesce()
        return super().lightning_module_state_dict()

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        self._quiesce()
        return super().optimizer_state(optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Write a local checkpoint atomically, streaming it to disk.

        Lightning's default ``TorchCheckpointIO`` serializes the whole checkpoint into memory first (a
        second, then a third copy of a host-sized state); here ``torch.save`` streams into a temporary file
        beside the target, which is flushed to disk and then renamed over the target. A crash mid-write
        leaves the previous checkpoint intact, and an exception removes the temporary file. Remote paths,
        ``storage_options`` and a ``CheckpointIO`` plugin of the user's own go through that plugin.
        """
        path = os.fspath(filepath)
        if storage_options is not None or "://" in path or type(self.checkpoint_io) is not TorchCheckpointIO:
            super().save_checkpoint(checkpoint, filepath, storage_options)
            return
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        temporary = os.path.join(directory, f".roundpipe-{os.getpid()}-{secrets.token_hex(6)}.ckpt.tmp")
        # "x": a new file, never someone else's; its mode is open()'s (0o666 less the umask), which a
        # checkpoint should keep (tempfile.mkstemp would make it owner-only)
        file = open(temporary, "xb")
        try:
            with file:
                torch.save(checkpoint, file)
                file.flush()
                os.fsync(file.fileno())  # on disk before it replaces the previous checkpoint
            os.replace(temporary, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(temporary)
            raise
        _fsync_directory(directory)  # the rename itself survives a power loss

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        if "roundpipe" not in strategy_registry:
            strategy_registry.register("roundpipe", cls, description="RoundPipe, exact (sync) optimizer step")
        if "roundpipe_async" not in strategy_registry:
            strategy_registry.register("roundpipe_async", cls, description="RoundPipe, one-step-stale async step",
                                       async_step=True)


class _PipelineMetrics(Callback):
    """Logs the engine's figures from the main thread at the end of each batch that stepped the optimizer."""

    def __init__(self, strategy: RoundPipeStrategy) -> None:
        self._strategy = strategy
        self._logged_step = 0  # nothing to report before the first step

    @override
    def on_train_batch_end(self, trainer: Any, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        engine = self._strategy.engine
        if engine is None or engine.closed or trainer.global_step == self._logged_step:
            return
        self._logged_step = trainer.global_step
        for name, value in engine.pipeline_metrics().items():
            pl_module.log(f"roundpipe/{name}", value, on_step=True, on_epoch=False, batch_size=1)


def _refuse_compiled(name: str, trunk: nn.Module) -> None:
    # torch.compile wraps a module in an OptimizedModule whose original sits at `_orig_mod`
    compiled = "_orig_mod" in name.split(".") or any(
        type(module).__name__ == "OptimizedModule" for module in trunk.modules())
    if compiled:
        raise TypeError(
            f"the trunk `{name}` is (or contains) a torch.compile'd module, which RoundPipe does not support: it "
            "runs every layer on per-device copies of it. Pass the trunk uncompiled."
        )


def _fsync_directory(directory: str) -> None:
    try:
        handle = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(handle)
    except OSError:
        pass  # some file systems cannot sync a directory; the file itself is synced
    finally:
        os.close(handle)


def _no_zero_grad(set_to_none: bool = True) -> None:
    """The strategy's optimizers leave clearing gradients to the engine."""


def _parameter_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def register() -> None:
    """Register ``roundpipe`` and ``roundpipe_async`` with Lightning's strategy registry."""
    from lightning.pytorch.strategies import StrategyRegistry

    RoundPipeStrategy.register_strategies(StrategyRegistry)


register()  # when this module is imported before Lightning, the import hook fired while it was half-built
