"""The autograd bridge: a pipelined call recorded as one function in the caller's autograd graph.

:func:`differentiable_call` runs a call's forward through :class:`_PipelineFunction`, whose backward dispatches
the call's backward stages; both go through the public :class:`~lightning_roundpipe.engine.dispatch.Dispatcher`
calls. A function can hand autograd only tensors, so the forward returns the output's structure (and its leaves
that are not floating-point tensors) as one more, non-tensor, output, from which the whole output is rebuilt
around the tensors autograd returned.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from lightning_roundpipe.engine.call import Call
from lightning_roundpipe.engine.dispatch import Dispatcher
from lightning_roundpipe.engine.microbatch import merge
from lightning_roundpipe.engine.transfer import differentiable_leaves


@dataclass(frozen=True)
class _OutputStructure:
    """A merged output without its floating-point tensors: the leaves with ``None`` in their places, and the
    pytree spec. Keeps nothing autograd returns, so it never holds a second reference to an output tensor."""

    leaves: list[Any]
    is_differentiable: list[bool]
    spec: pytree.TreeSpec

    @staticmethod
    def of(leaves: list[Any], spec: pytree.TreeSpec) -> _OutputStructure:
        differentiable = [_is_differentiable(leaf) for leaf in leaves]
        kept = [None if flag else leaf for leaf, flag in zip(leaves, differentiable, strict=True)]
        return _OutputStructure(kept, differentiable, spec)

    def rebuild(self, tensors: tuple[torch.Tensor, ...]) -> Any:
        """The output with ``tensors`` (autograd's, in order) in the places of the floating-point tensors."""
        given = iter(tensors)
        leaves = [next(given) if flag else leaf
                  for leaf, flag in zip(self.leaves, self.is_differentiable, strict=True)]
        return pytree.tree_unflatten(leaves, self.spec)


def _is_differentiable(leaf: Any) -> bool:
    return isinstance(leaf, torch.Tensor) and leaf.is_floating_point()


def differentiable_call(dispatcher: Dispatcher, call: Call, inputs: tuple[Any, dict[str, Any]]) -> Any:
    """Run ``call`` (made with checkpoints) wired into autograd: ``.backward()`` on anything computed from the
    result runs the pipelined backward. Returns the call's output."""
    # autograd records the function (and so runs its backward, which computes the trunk's parameter
    # gradients) only if an input requires grad; the inputs may not (token ids, a frozen embedding),
    # so this scalar always does. Its own gradient is None.
    anchor = torch.zeros((), requires_grad=True)
    *tensors, structure = _PipelineFunction.apply(dispatcher, call, anchor, *differentiable_leaves(inputs))
    return structure.rebuild(tuple(tensors))


class _PipelineFunction(torch.autograd.Function):
    """Wires a pipelined forward into autograd; its backward dispatches the backward stages."""

    @staticmethod
    def forward(ctx, dispatcher: Dispatcher, call: Call, anchor: torch.Tensor, *inputs: torch.Tensor):
        outputs = dispatcher.run_forward(call)
        leaves, spec = pytree.tree_flatten(merge(outputs))
        per_microbatch = [differentiable_leaves(output) for output in outputs]
        ctx.dispatcher, ctx.call = dispatcher, call
        # merge() checked that every microbatch's output has the same structure
        ctx.split_sizes = [[leaf.shape[0] for leaf in column] for column in zip(*per_microbatch, strict=True)]
        ctx.num_inputs = len(inputs)
        # the last output is no tensor: autograd passes it through, and its gradient is None
        return (*(leaf for leaf in leaves if _is_differentiable(leaf)), _OutputStructure.of(leaves, spec))

    @staticmethod
    def backward(ctx, *grad_outputs: torch.Tensor | None):
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError(
                "the pipelined trunk supports only `.backward()`: torch.autograd.grad and backward(inputs=...) "
                "would need gradients the pipeline adds into the optimizer's window instead. Call "
                "loss.backward() and read param.grad after engine.step(..., before_step=...)."
            )
        if torch.is_grad_enabled():
            raise RuntimeError(
                "double backward (create_graph=True) through the pipelined trunk is not supported: backward "
                "stages recompute and back-propagate on other threads and devices"
            )
        dispatcher, call = ctx.dispatcher, ctx.call
        per_leaf = [
            torch.split(grad, sizes) if grad is not None else [None] * len(sizes)
            for grad, sizes in zip(grad_outputs[:-1], ctx.split_sizes, strict=True)  # the last: the structure's
        ]
        output_grads = [[column[m] for column in per_leaf] for m in range(call.num_microbatches)]
        cells = dispatcher.run_backward(call, output_grads)
        if not any(call.input_requires_grad):
            return (None, None, None) + (None,) * ctx.num_inputs
        grads_per_microbatch = []
        for cell in cells:
            dispatcher.wait(cell.event)
            grads_per_microbatch.append(cell.value)
        input_grads: list[torch.Tensor | None] = []
        for position in range(ctx.num_inputs):
            pieces = [g[position] for g in grads_per_microbatch if g is not None and g[position] is not None]
            if len(pieces) < len(grads_per_microbatch) or not call.input_requires_grad[position]:
                input_grads.append(None)
            else:
                input_grads.append(_whole_batch_grad(pieces, sum(call.sizes)))
        return (None, None, None) + tuple(input_grads)


def _whole_batch_grad(pieces: list[torch.Tensor], samples: int) -> torch.Tensor:
    """The gradient of one call input from its microbatches' gradients of it.

    The split rule (``microbatch.py``) decides: a tensor with a dim 0 was split into the microbatches,
    so its gradient is theirs concatenated; any other input (a 0-dim tensor) was replicated whole into
    every microbatch, and each used it, so its gradient is their sum."""
    if len(pieces) == 1:
        return pieces[0]
    if pieces[0].dim() > 0 and sum(piece.shape[0] for piece in pieces) == samples:
        return torch.cat(pieces)
    return torch.stack(pieces).sum(0)
