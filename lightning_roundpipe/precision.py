"""Lightning's precision plugins around the engine's optimizer step: loss scale, 16-bit inf checks, hooks.

Lightning runs clipping, ``on_before_optimizer_step`` and a 16-bit ``GradScaler``'s unscale and inf check
inside its precision plugin's ``optimizer_step``, which RoundPipe cannot call: its step runs on the
engine's thread, once the pipeline's gradients are final. This module does the same work as the engine's
``before_step`` hook, on the main thread. It is the one place that uses the private APIs this needs:
``Precision._after_closure`` (clipping and the hooks) and ``GradScaler._found_inf_per_device``.
"""

from __future__ import annotations

import dataclasses
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


def refuse_own_optimizer_step(plugin: Precision) -> None:
    """A precision plugin whose ``optimizer_step`` is not Lightning's own (``Precision``'s or
    ``MixedPrecision``'s) is refused: :func:`step` does their work, so another plugin's would be bypassed
    silently."""
    own = type(plugin).optimizer_step
    if own not in (Precision.optimizer_step, MixedPrecision.optimizer_step):
        raise TypeError(
            f"the precision plugin {type(plugin).__name__} has an optimizer_step of its own ({own.__qualname__}), "
            "which RoundPipe cannot call: it steps the optimizer on a thread of its own once the pipeline's "
            "gradients are final, and runs what Lightning's precision plugins run around a step (clipping, "
            "on_before_optimizer_step, the 16-bit loss scale's checks) itself. Use a precision of Lightning's "
            "(Trainer(precision=...)), or move that code to a callback's on_before_optimizer_step")


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


def needs_final_gradients(model: LightningModule) -> bool:
    """Whether anything must see this step's gradients before the update (clipping, hooks)."""
    trainer = model.trainer
    return bool(
        trainer.gradient_clip_val
        or is_overridden("configure_gradient_clipping", model, LightningModule)
        or is_overridden("on_before_optimizer_step", model, LightningModule)
        or any(is_overridden("on_before_optimizer_step", callback, Callback)
               for callback in trainer.callbacks)  # type: ignore[attr-defined]
    )


def step(plugin: Precision, engine: RoundPipeEngine, optimizer: torch.optim.Optimizer, model: LightningModule,
         closure_result: Any) -> None:
    """Queue the engine's optimizer step with what ``plugin`` would do around it.

    Without a loss scaler: clipping and the hooks run with the final gradients, and only when something
    needs them (gathering them on the main thread costs a wait). With one, as Lightning's ``MixedPrecision``
    does it: unscale the final gradients and check them for inf/NaN, skip the update if any, then let the
    scaler adjust its scale. Either way ``param.grad`` keeps what it holds until ``zero_grad()``, as in plain
    training (the engine steps its own references to those tensors)."""
    scaler = loss_scaler(plugin)
    if scaler is None:
        def clip_and_run_hooks() -> None:
            plugin._after_closure(model, optimizer)

        engine.step(optimizer, before_step=clip_and_run_hooks if needs_final_gradients(model) else None,
                    keep_gradients=True)
        return
    # automatic optimization skips the step when training_step returned None
    nothing_to_step = closure_result is None and model.automatic_optimization

    def unscale_and_check() -> bool:
        if not nothing_to_step:
            scaler.unscale_(optimizer)
        plugin._after_closure(model, optimizer)
        if nothing_to_step:
            return False
        found_inf = scaler._found_inf_per_device(optimizer)
        return not any(value.item() for value in found_inf.values())

    engine.step(optimizer, before_step=unscale_and_check, keep_gradients=True)
    if not nothing_to_step:
        scaler.update()
