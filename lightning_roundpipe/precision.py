"""Lightning's precision plugin around the engine's optimizer step.

Lightning runs each step through its precision plugin's ``optimizer_step(optimizer, model, closure)``: the
closure (the training step and its backward), then what reads the final gradients (a 16-bit ``GradScaler``'s
unscale and inf check, clipping, ``on_before_optimizer_step``), then ``optimizer.step()``. RoundPipe calls the
plugin's ``optimizer_step`` too, any plugin's (:func:`queue_step`), with two differences that let the engine
own the step. The plugin runs once the pipeline's gradients are final in ``param.grad``, inside the engine's
``before_step`` on the main thread: so Lightning's closure has run before (its backward feeds the pipeline),
and the closure the plugin gets returns its result. And ``optimizer.step()`` asks for the engine's step, which
the optimizer thread applies afterwards; a plugin that does not call it (the scaler, on inf or NaN gradients)
skips the update. No private API of Lightning's is used; of torch's, one optimizer attribute
(``_step_supports_amp_scaling``, see :func:`_steps_on_the_engine`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_roundpipe.engine.engine import RoundPipeEngine
from lightning_roundpipe.engine.options import EngineOptions, OptionError


def loss_scaler(plugin: Precision) -> torch.amp.GradScaler | None:
    """The 16-bit loss scaler of ``plugin`` (``MixedPrecision`` with ``16-mixed``), else ``None``."""
    return getattr(plugin, "scaler", None)


def autocast_dtype_name(plugin: Precision) -> Literal["bfloat16", "float16"] | None:
    """The dtype ``plugin`` runs the forward under autocast in (``"bfloat16"`` for ``bf16-mixed``,
    ``"float16"`` for ``16-mixed``), as :class:`EngineOptions` names it; ``None`` without autocast."""
    if not isinstance(plugin, MixedPrecision):
        return None
    return "bfloat16" if plugin.precision == "bf16-mixed" else "float16"


def resolve_transport(options: EngineOptions, plugin: Precision) -> EngineOptions:
    """``options`` with ``transport_dtype="auto"`` made the autocast dtype of ``plugin`` (``"off"`` without
    autocast). An explicit dtype must be that one: outside autocast in it, low-precision weights would
    change the results (async mode would widen rounded weights)."""
    autocast = autocast_dtype_name(plugin)
    chosen = options.transport_dtype
    if chosen == "auto":
        return dataclasses.replace(options, transport_dtype=autocast or "off")
    if chosen not in ("off", autocast):
        runs = f"runs autocast in {autocast}" if autocast else "runs no autocast"
        raise OptionError("transport_dtype", f"is {chosen!r} but the Trainer's precision "
                                             f"({getattr(plugin, 'precision', type(plugin).__name__)}) {runs}; use "
                                             "transport_dtype='auto' (the precision's dtype) or 'off'")
    return options


FP16_ACCUMULATION = "allow_fp16_accumulation"
"""The attribute of ``torch.backends.cuda.matmul`` the ``fp16_accumulation`` option sets."""


def enable_fp16_accumulation(plugin: Precision, device_type: str, matmul: Any = None) -> Callable[[], None]:
    """Turn fp16 accumulation on for fp16 matmuls (cuBLAS; ``matmul``: ``torch.backends.cuda.matmul``) and return
    what restores the setting found: it is process-global, so it must not outlive the run. Raises
    :class:`OptionError` where it cannot apply: a precision other than ``16-mixed`` (only fp16 matmuls accumulate
    in fp16), devices other than CUDA GPUs, or a torch without the flag."""
    precision_name = getattr(plugin, "precision", type(plugin).__name__)
    if autocast_dtype_name(plugin) != "float16":
        raise OptionError("fp16_accumulation", f"needs precision='16-mixed' (the Trainer's is {precision_name!r}): "
                                               "it changes only fp16 matmuls; use Trainer(precision='16-mixed') or "
                                               "drop the option")
    if device_type != "cuda":
        raise OptionError("fp16_accumulation", f"needs CUDA GPUs (a cuBLAS setting), and the ring's devices are "
                                               f"{device_type!r}; use accelerator='gpu' or drop the option")
    matmul = torch.backends.cuda.matmul if matmul is None else matmul
    try:
        previous = getattr(matmul, FP16_ACCUMULATION)
    except AttributeError:
        raise OptionError("fp16_accumulation", f"needs torch.backends.cuda.matmul.{FP16_ACCUMULATION}, which torch "
                                               f"{torch.__version__} does not have; upgrade torch or drop the "
                                               "option") from None
    setattr(matmul, FP16_ACCUMULATION, True)

    def restore() -> None:
        setattr(matmul, FP16_ACCUMULATION, previous)

    return restore


def backward_scale(plugin: Precision, module: LightningModule | None) -> float:
    """What Lightning would multiply a returned loss by before its backward: the 16-bit loss scale, and
    ``1 / accumulate_grad_batches`` in automatic optimization. ``pipeline_loss`` runs the backward inside
    the training step, so it applies this factor itself."""
    scale = 1.0
    scaler = loss_scaler(plugin)
    if scaler is not None:
        scale *= scaler.get_scale()
    if module is not None and module.automatic_optimization:
        scale /= module.trainer.accumulate_grad_batches
    return scale


def final_gradients_reader(plugin: Precision, model: LightningModule) -> str | None:
    """What in the plugin's ``optimizer_step`` may read this step's gradients, or ``None``: a plugin's own
    ``optimizer_step``, a loss scaler's unscale and inf check, or clipping and the hooks, which Lightning's
    runs. With none it runs before the engine's step, and the main thread does not wait for the gradients."""
    if type(plugin).optimizer_step not in (Precision.optimizer_step, MixedPrecision.optimizer_step):
        return f"the precision plugin's own optimizer_step ({type(plugin).__name__})"
    if loss_scaler(plugin) is not None:
        return "the loss scaler's unscale and inf check"
    trainer = model.trainer
    if trainer.gradient_clip_val:
        return f"gradient clipping (gradient_clip_val={trainer.gradient_clip_val})"
    if is_overridden("configure_gradient_clipping", model, LightningModule):
        return f"{type(model).__name__}.configure_gradient_clipping"
    if is_overridden("on_before_optimizer_step", model, LightningModule):
        return f"{type(model).__name__}.on_before_optimizer_step"
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if is_overridden("on_before_optimizer_step", callback, Callback):
            return f"{type(callback).__name__}.on_before_optimizer_step"
    return None


def queue_step(plugin: Precision, engine: RoundPipeEngine, optimizer: torch.optim.Optimizer,
               model: LightningModule, closure_result: Any, *, keep_gradients: bool = True, **kwargs: Any) -> None:
    """Run ``plugin.optimizer_step`` with the closure's result and queue the engine's step if it steps.

    Lightning's own plugins do what they do under Lightning's default strategy: clipping and the hooks, and
    with a loss scaler the unscale, the inf check (no step on inf or NaN) and the scale's update; a plugin's
    own ``optimizer_step`` runs with the final gradients, as Lightning's would run it. With ``keep_gradients``
    ``param.grad`` keeps what it holds until ``zero_grad()``, as in plain training (the engine steps its own
    references to those tensors); without it (nothing reads them: the strategy's choice) the engine clears it
    and gives each group's summed gradients back once applied."""
    def run_plugin() -> bool:
        with _steps_on_the_engine(optimizer) as asked:
            plugin.optimizer_step(optimizer, model=model, closure=lambda: closure_result, **kwargs)
        return bool(asked)

    if final_gradients_reader(plugin, model) is not None:
        engine.step(optimizer, before_step=run_plugin, keep_gradients=keep_gradients)
    else:  # Precision.optimizer_step without clipping or hooks: it reads no gradient, and always steps
        run_plugin()
        engine.step(optimizer, keep_gradients=keep_gradients)


@contextlib.contextmanager
def _steps_on_the_engine(optimizer: torch.optim.Optimizer) -> Iterator[list[bool]]:
    """While the plugin runs, ``optimizer.step(closure=None)`` runs the closure, as torch's optimizers do, and
    appends to the yielded list instead of updating: the engine's step, queued next, does that. The plugin
    and the hooks see the optimizer itself, as under Lightning. The optimizer says it does not unscale a
    GradScaler's gradients in its own step (a fused one would say it does), so that the plugin unscales them:
    the engine's step takes no scale. A step the optimizer had as an instance attribute (an LR scheduler's
    wrapper) is put back afterwards."""
    asked: list[bool] = []

    def step(closure: Callable[[], Any] | None = None, **_: Any) -> Any:
        asked.append(True)
        return closure() if closure is not None else None

    names = ("step", "_step_supports_amp_scaling")
    shadowed = {name: optimizer.__dict__[name] for name in names if name in optimizer.__dict__}
    optimizer.__dict__.update(step=step, _step_supports_amp_scaling=False)
    try:
        yield asked
    finally:
        for name in names:
            optimizer.__dict__.pop(name, None)
        optimizer.__dict__.update(shadowed)
