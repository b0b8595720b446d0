"""Calling a pipelined trunk: the transparent forward, the fused ``pipeline_loss``, and a safe ``zero_grad`` (of the
module and of its optimizers).

While a strategy drives a trunk, the trunk's ``forward`` is an instance attribute that calls the
engine, so the user's ``training_step`` runs unchanged. The engine lives outside the module tree, so
``state_dict`` keys do not change. A deep copy of the module (an EMA or SWA callback) gets the plain
``nn.Sequential.forward`` back, never a second handle on the engine.
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightning_roundpipe.engine.microbatch import LossWeight, sample_count

if TYPE_CHECKING:
    from lightning_roundpipe.engine.engine import RoundPipeEngine


class InstancePatch:
    """A callable set as an instance attribute of a module (or an optimizer), shadowing one of its methods.

    A deep copy of the module (an EMA or SWA callback) gets the class's own method bound to the copy,
    never a second handle on the engine.
    """

    method = ""

    def __init__(self, owner: Any) -> None:  # a module, an optimizer: any object with a __dict__
        self._owner = weakref.ref(owner)

    def __deepcopy__(self, memo: dict) -> Any:
        owner = self._owner()
        copied = memo.get(id(owner)) if owner is not None else None
        if copied is None:
            return self
        return types.MethodType(getattr(type(copied), self.method), copied)

    def install(self) -> None:
        owner = self._owner()
        if owner is not None:
            setattr(owner, self.method, self)

    def remove(self) -> None:
        owner = self._owner()
        if owner is not None and owner.__dict__.get(self.method) is self:
            delattr(owner, self.method)


class PipelinedForward(InstancePatch):
    """The ``forward`` of a trunk driven by an engine."""

    method = "forward"

    def __init__(self, trunk: nn.Module, engine: RoundPipeEngine, backward_scale: Callable[[], float],
                 on_fused_backward: Callable[[], None]) -> None:
        super().__init__(trunk)
        self.engine = engine
        self.backward_scale = backward_scale
        self.on_fused_backward = on_fused_backward

    def prepare(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The engine's arguments for a call of the trunk with ``args`` and ``kwargs`` (a subclass may add
        to them, or get ready for them first); here, the same."""
        return args, kwargs

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine(*args, **kwargs)


class ZeroGradGuard(InstancePatch):
    """``zero_grad`` of a module or an optimizer (or of a wrapper of one, which zeroes ``zeroes``) while an
    engine steps its parameters: the class's own, on the calling thread; zeroing in place
    (``set_to_none=False``) first lets queued optimizer steps finish, as they read the gradient tensors they
    were handed (Lightning clears gradients before validation, say; setting them to ``None`` needs no wait,
    as steps never touch ``param.grad``)."""

    method = "zero_grad"

    def __init__(self, owner: Any, engine: RoundPipeEngine, *, zeroes: Any = None) -> None:
        super().__init__(owner)
        self.engine = engine
        self._zeroes = zeroes

    def __call__(self, set_to_none: bool = True) -> None:
        if not set_to_none and not self.engine.closed:
            self.engine.wait_for_steps()
        target = self._zeroes if self._zeroes is not None else self._owner()
        if target is not None:
            type(target).zero_grad(target, set_to_none)


def pipeline_loss(trunk: nn.Module, inputs: Any, target: Any, loss_fn: Callable[[Any, Any], torch.Tensor], *,
                  loss_weight: LossWeight = sample_count) -> torch.Tensor:
    """``loss_fn(trunk(inputs), target)``, with the loss fused into the pipeline's last stage.

    Under RoundPipe the forward, the loss and the backward run per microbatch inside the pipeline (no
    whole-batch outputs), and the returned loss is detached: its backward has already run, scaled as
    Lightning would scale a returned loss (``1 / accumulate_grad_batches``, the 16-bit loss scale).
    ``loss_fn`` returns a microbatch's mean loss; ``loss_weight(target)`` weighs microbatches (samples
    by default; ``token_count()`` for token means with ignored targets). Under any other strategy, or
    without grad mode, this is exactly ``loss_fn(trunk(inputs), target)``, so the module stays portable.
    ``inputs`` is the trunk's argument; a tuple is passed as several arguments.
    """
    forward = trunk.__dict__.get("forward")
    args = inputs if isinstance(inputs, tuple) else (inputs,)
    if not isinstance(forward, PipelinedForward) or not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
        return loss_fn(trunk(*args), target)
    args, _ = forward.prepare(args, {})
    loss = forward.engine.forward_backward(args, target, loss_fn, loss_weight=loss_weight,
                                           scale=forward.backward_scale())
    forward.on_fused_backward()
    return loss
