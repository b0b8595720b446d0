"""Who may read ``param.grad`` in a Lightning run: the hooks in which Lightning's default strategy has gradients
there, which of them the module or a callback overrides with code of the user's, and what else reads a step's
gradients whole. The strategy decides from this when to wait for a backward and whether a step keeps the whole
model's gradients (``StrategyOptions.keep_gradients``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import StochasticWeightAveraging

from lightning_roundpipe import precision

BEFORE_STEP_GRADIENT_HOOKS = ("on_after_backward", "optimizer_zero_grad")
"""Hooks that run between a backward and its step and may read or keep its gradients (``optimizer_zero_grad``:
an override may keep gradients across steps, which the next backward then adds to): when the module or a
callback overrides one, the main thread waits for each backward and gathers its gradients into ``param.grad``
(``on_before_optimizer_step`` and clipping get the final gradients anyway, at the step)."""

AFTER_STEP_GRADIENT_HOOKS = ("on_train_batch_end", "on_train_batch_start", "on_before_zero_grad")
"""Hooks that run after the step (``on_train_batch_start`` and ``on_before_zero_grad`` of the next batch see
what the previous one left) and see ``param.grad`` under Lightning's default strategy: the step's gradients, or
the window's so far in a batch that did not step. Sync mode shows them without holding the step or the next
forward back (only a batch that does not step waits for its backward); async mode waits for each backward."""

GRADIENT_HOOKS = BEFORE_STEP_GRADIENT_HOOKS + AFTER_STEP_GRADIENT_HOOKS
"""Every hook, besides ``on_before_optimizer_step``, in which Lightning's default strategy has gradients in
``param.grad``. Overrides by Lightning's own callbacks do not count (they read no gradients); a module or callback
of the user's that overrides one without reading gradients can say so with ``roundpipe_reads_gradients = False``
and spare whatever wait remains (async mode, gradient accumulation, the hooks before the step)."""

_NOT_USER_CODE = ("lightning.", "pytorch_lightning.", "lightning_roundpipe.")


def trainer_of(module: pl.LightningModule | None) -> pl.Trainer | None:
    """The Trainer ``module`` is attached to, if any (its ``trainer`` property raises when there is none)."""
    try:
        return module.trainer if module is not None else None
    except RuntimeError:
        return None


def first_override(obj: Any, base: type, hooks: tuple[str, ...], counts: Callable[[type], bool]) -> str | None:
    """The first of ``hooks`` that ``obj`` (a LightningModule or a callback) overrides with code that counts: one
    set on the instance (``LambdaCallback``'s), or one defined in a class below ``base`` for which ``counts``
    is true."""
    for hook in hooks:
        if hook in vars(obj):
            return hook
        for cls in type(obj).__mro__:
            if hook in vars(cls):
                if cls is not base and counts(cls):
                    return hook
                break
    return None


def is_user_code(cls: type) -> bool:
    """Whether ``cls`` is defined outside Lightning and this package."""
    return not (cls.__module__ or "").startswith(_NOT_USER_CODE)


def _gradient_hook_override(obj: Any, base: type, hooks: tuple[str, ...] = GRADIENT_HOOKS) -> str | None:
    """The first of ``hooks`` in which ``obj`` (a LightningModule or a callback) has user code: an override
    defined outside Lightning and this package, unless ``obj`` says ``roundpipe_reads_gradients = False``."""
    if getattr(obj, "roundpipe_reads_gradients", True) is False:
        return None
    return first_override(obj, base, hooks, is_user_code)


def first_hook_of_run(module: pl.LightningModule | None, override: Callable[[Any, type], str | None]) -> str | None:
    """``"Owner.hook"`` for the first of the module and its Trainer's callbacks for which ``override(obj, base)``
    (``base``: ``LightningModule`` or ``Callback``) names a hook, ``"manual optimization"`` (the user's
    ``training_step`` then runs between backward and step, and after the step), or ``None``."""
    if module is None:
        return None
    if not module.automatic_optimization:
        return "manual optimization"
    trainer = trainer_of(module)
    callbacks = trainer.callbacks if trainer is not None else []  # type: ignore[attr-defined]
    for obj, base in [(module, pl.LightningModule), *((callback, pl.Callback) for callback in callbacks)]:
        hook = override(obj, base)
        if hook is not None:
            return f"{type(obj).__name__}.{hook}"
    return None


def gradient_hook_reader(module: pl.LightningModule | None, hooks: tuple[str, ...] = GRADIENT_HOOKS) -> str | None:
    """Who may read ``param.grad`` in ``hooks``: ``"Owner.hook"`` for the first override of the module's or a
    callback's, ``"manual optimization"`` (anywhere, right after ``manual_backward`` say), or ``None``."""
    return first_hook_of_run(module, lambda obj, base: _gradient_hook_override(obj, base, hooks))


def whole_gradients_reader(module: pl.LightningModule | None, precision_plugin: Any) -> str | None:
    """What of the user's run may read the whole model's gradients of a step (a gradient hook, gradient
    accumulation, ``StochasticWeightAveraging``, the precision plugin), or ``None``."""
    if module is None:
        return None
    reader = gradient_hook_reader(module)
    trainer = trainer_of(module)
    if reader is not None or trainer is None:
        return reader
    if trainer.accumulate_grad_batches > 1:
        return f"gradient accumulation (accumulate_grad_batches={trainer.accumulate_grad_batches})"
    if any(isinstance(callback, StochasticWeightAveraging) for callback in trainer.callbacks):  # type: ignore[attr-defined]
        return "StochasticWeightAveraging (its BatchNorm epoch steps again with the last gradients)"
    return precision.final_gradients_reader(precision_plugin, module)
