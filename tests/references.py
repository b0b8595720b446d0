"""Plain-PyTorch references of the transparency cases (``tests.models.transparency_case``), each computed once.

A reference depends only on its inputs: the model (``bn`` or ``gpt``, built from a fixed seed), the microbatch
sizes, the optimizer, the dtype and the number of steps. The device count, the recompute grain and jitter
are engine settings the reference never sees, so test cases that differ only in those share one reference;
:func:`functools.cache` keeps it for the session. Each call returns fresh copies (:func:`_copied`), so that a
test cannot change what the next one compares against. The references stay independent of the package:
they are built from ``tests/models.py`` only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from tests.models import (
    async_reference,
    clone,
    make_optimizer,
    microbatch_weights,
    reference_microbatch_step,
    reference_transparent_step,
    transparency_case,
)
from tests.numerics import double, state, to_double

Reference = tuple[dict[str, torch.Tensor], list[float]]
"""The parameters and buffers by name after the last step, and each step's loss."""


def case_batches(model_name: str, steps: int, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The steps' ``(inputs, target)`` of a transparency case; float features in ``dtype`` (ids stay ids)."""
    _, batch, samples, _, _ = transparency_case(model_name)
    batches = [batch(samples, seed=step) for step in range(steps)]
    return batches if dtype == torch.float32 else to_double(batches)


def _copied(reference: Reference) -> Reference:
    states, losses = reference
    return {name: tensor.clone() for name, tensor in states.items()}, list(losses)


def _in(dtype: torch.dtype, model: torch.nn.Module) -> torch.nn.Module:
    return clone(model) if dtype == torch.float32 else double(model)


def _train(model_name: str, dtype: torch.dtype, optimizer_kind: str, steps: int,
           one_step: Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], float]) -> Reference:
    """``steps`` optimizer steps of the case's model in ``dtype``, each after ``one_step`` left the gradients."""
    reference = _in(dtype, transparency_case(model_name)[0])
    optimizer = make_optimizer(optimizer_kind, reference.parameters())
    losses = []
    for inputs, target in case_batches(model_name, steps, dtype):
        losses.append(one_step(reference, inputs, target))
        optimizer.step()
        optimizer.zero_grad()
    return state(reference), losses


@functools.cache
def _sync(model_name: str, sizes: tuple[int, ...], optimizer_kind: str, dtype: torch.dtype, steps: int) -> Reference:
    loss_fn = transparency_case(model_name)[3]
    return _train(model_name, dtype, optimizer_kind, steps, lambda model, inputs, target: reference_microbatch_step(
        model, inputs, target, loss_fn, microbatch_weights(model_name, target, list(sizes)), list(sizes)))


def sync_reference(model_name: str, sizes: list[int], optimizer_kind: str, dtype: torch.dtype,
                   steps: int) -> Reference:
    """The microbatches of ``sizes`` one after another, gradients accumulated with their loss weights, one
    optimizer step per batch (what ``forward_backward`` + ``step`` must equal)."""
    return _copied(_sync(model_name, tuple(sizes), optimizer_kind, dtype, steps))


@functools.cache
def _transparent(model_name: str, sizes: tuple[int, ...], dtype: torch.dtype, steps: int) -> Reference:
    loss_fn = transparency_case(model_name)[3]
    return _train(model_name, dtype, "sgd", steps, lambda model, inputs, target: reference_transparent_step(
        model, inputs, target, loss_fn, list(sizes)))


def transparent_reference(model_name: str, sizes: list[int], dtype: torch.dtype, steps: int) -> Reference:
    """The loss of the whole batch, taken on the merged microbatch outputs; the microbatches then
    back-propagated one after another; SGD (what calling the trunk + ``loss.backward()`` must equal)."""
    return _copied(_transparent(model_name, tuple(sizes), dtype, steps))


@functools.cache
def _delayed(model_name: str, sizes: tuple[int, ...], optimizer_kind: str, dtype: torch.dtype,
             steps: int) -> Reference:
    model, _, _, loss_fn, _ = transparency_case(model_name)
    return async_reference(_in(dtype, model), case_batches(model_name, steps, dtype), loss_fn, list(sizes),
                           optimizer_kind, weights=lambda target: microbatch_weights(model_name, target, list(sizes)))


def delayed_reference(model_name: str, sizes: list[int], optimizer_kind: str, dtype: torch.dtype,
                      steps: int) -> Reference:
    """``async_step``'s formula (``tests.models.delayed_update_reference``): iteration k's gradients on the
    weights of two steps before."""
    return _copied(_delayed(model_name, tuple(sizes), optimizer_kind, dtype, steps))
