"""The engine's results equal plain PyTorch running the same microbatches one after another.

Two checks per case (see ``tests/numerics.py`` for where their tolerances come from):

* ``f64``: the engine runs a float64 copy of the model and must equal the float64 reference to 1e-12. This
  checks the algorithm (schedule, accumulation, loss weights, BatchNorm statistics, optimizer timing), with
  and without ``jitter`` (random delays that shake how the threads interleave).
* ``f32``: the engine runs the model as given, in float32, and may differ from the float64 reference by at
  most 4 times what the float32 reference itself differs by (plus 4 ulps of the tensor's norm): nothing is
  numerically worse than plain training, on whatever kernels this CPU has. Steady only: jitter changes the
  timing, not the arithmetic, and the float64 check covers it.
"""

from __future__ import annotations

import pytest
import torch

from lightning_roundpipe import EngineOptions, RoundPipeEngine
from tests.models import (
    async_reference,
    clone,
    make_optimizer,
    microbatch_weights,
    reference_microbatch_step,
    reference_transparent_step,
    split_sizes,
    transparency_case,
)
from tests.numerics import (
    assert_close_to_reference,
    assert_float64_equal,
    assert_states_close_to_reference,
    assert_states_float64_equal,
    double,
    state,
    to_double,
)

STEPS = 5
CHECKS = [pytest.param("float64", 0.0, id="f64-steady"), pytest.param("float64", 0.002, id="f64-jitter"),
          pytest.param("float32", 0.0, id="f32")]


def _batches(batch, samples: int, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The steps' batches; float features in ``dtype`` (token ids stay ids)."""
    batches = [batch(samples, seed=step) for step in range(STEPS)]
    return batches if dtype == torch.float32 else to_double(batches)


def _assert_equals_reference(precision: str, losses: list[torch.Tensor], model, references) -> None:
    """``references`` maps a dtype to the reference's ``(state, losses)`` computed in it."""
    ours = torch.stack([loss.detach().reshape(()) for loss in losses])
    if precision == "float64":
        state64, losses64 = references[torch.float64]
        assert_float64_equal(ours, losses64, what="losses")
        assert_states_float64_equal(model, state64)
    else:
        (state32, losses32), (state64, losses64) = references[torch.float32], references[torch.float64]
        assert_close_to_reference(ours, losses32, losses64, what="losses")
        assert_states_close_to_reference(model, state32, state64)


def _in(precision: str, model):
    return double(model) if precision == "float64" else model


def _sync_reference(model, model_name, batch, samples, loss_fn, sizes, optimizer_kind, dtype):
    """Plain PyTorch, in ``dtype``: the microbatches one after another, gradients accumulated, one step."""
    reference = clone(model) if dtype == torch.float32 else double(model)
    optimizer = make_optimizer(optimizer_kind, reference.parameters())
    losses = []
    for inputs, target in _batches(batch, samples, dtype):
        losses.append(reference_microbatch_step(reference, inputs, target, loss_fn,
                                                microbatch_weights(model_name, target, sizes), sizes))
        optimizer.step()
        optimizer.zero_grad()
    return state(reference), losses


@pytest.mark.parametrize("precision,jitter", CHECKS)
@pytest.mark.parametrize("optimizer_kind", ["sgd", "adamw"])
@pytest.mark.parametrize("recompute", ["stage", "layer"])
@pytest.mark.parametrize("microbatches", [1, 2, 4, 5])
@pytest.mark.parametrize("devices", [1, 2, 3])
@pytest.mark.parametrize("model_name", ["bn", "gpt"])
def test_sync_fused_path_equals_plain_pytorch(model_name, devices, microbatches, recompute, optimizer_kind,
                                              precision, jitter):
    model, batch, samples, loss_fn, weight_fn = transparency_case(model_name)
    sizes = split_sizes(samples, microbatches)
    dtypes = [torch.float64] if precision == "float64" else [torch.float32, torch.float64]
    references = {dtype: _sync_reference(model, model_name, batch, samples, loss_fn, sizes, optimizer_kind, dtype)
                  for dtype in dtypes}
    model = _in(precision, model)
    optimizer = make_optimizer(optimizer_kind, model.parameters())
    options = EngineOptions(num_microbatches=microbatches, recompute=recompute, num_stages=2, jitter=jitter)
    kwargs = {} if weight_fn is None else {"loss_weight": weight_fn}
    losses = []
    with RoundPipeEngine(model, devices, options) as engine:
        for inputs, target in _batches(batch, samples, next(model.parameters()).dtype):
            losses.append(engine.forward_backward(inputs, target, loss_fn, **kwargs))
            engine.step(optimizer)
        engine.synchronize()
    _assert_equals_reference(precision, losses, model, references)


def _transparent_reference(model, batch, samples, loss_fn, sizes, dtype):
    """Plain PyTorch, in ``dtype``: the loss is the whole batch's, taken on the merged output; the
    microbatches are then back-propagated one after another, accumulating gradients in the same order."""
    reference = clone(model) if dtype == torch.float32 else double(model)
    optimizer = make_optimizer("sgd", reference.parameters())
    losses = []
    for inputs, target in _batches(batch, samples, dtype):
        losses.append(reference_transparent_step(reference, inputs, target, loss_fn, sizes))
        optimizer.step()
        optimizer.zero_grad()
    return state(reference), losses


@pytest.mark.parametrize("precision,jitter", CHECKS)
@pytest.mark.parametrize("devices,microbatches,recompute", [(1, 1, "stage"), (2, 4, "layer"), (3, 5, "stage")])
@pytest.mark.parametrize("model_name", ["bn", "gpt"])
def test_transparent_path_equals_plain_pytorch(model_name, devices, microbatches, recompute, precision, jitter):
    """Calling the trunk and then ``loss.backward()`` gives the whole-batch gradients."""
    model, batch, samples, loss_fn, _ = transparency_case(model_name)
    sizes = split_sizes(samples, microbatches)
    dtypes = [torch.float64] if precision == "float64" else [torch.float32, torch.float64]
    references = {dtype: _transparent_reference(model, batch, samples, loss_fn, sizes, dtype) for dtype in dtypes}
    model = _in(precision, model)
    optimizer = make_optimizer("sgd", model.parameters())
    options = EngineOptions(num_microbatches=microbatches, recompute=recompute, num_stages="auto", jitter=jitter)
    losses = []
    with RoundPipeEngine(model, devices, options) as engine:
        for inputs, target in _batches(batch, samples, next(model.parameters()).dtype):
            loss = loss_fn(engine(inputs), target)
            loss.backward()
            engine.step(optimizer)
            losses.append(loss)
        engine.synchronize()
    _assert_equals_reference(precision, losses, model, references)


@pytest.mark.parametrize("precision,jitter", CHECKS)
@pytest.mark.parametrize("optimizer_kind", ["sgd", "adamw"])
@pytest.mark.parametrize("devices,microbatches,recompute", [(1, 2, "stage"), (2, 3, "layer"), (3, 4, "stage")])
@pytest.mark.parametrize("model_name", ["bn", "gpt"])
def test_async_equals_one_step_delayed_reference(model_name, devices, microbatches, recompute, optimizer_kind,
                                                 precision, jitter):
    model, batch, samples, loss_fn, weight_fn = transparency_case(model_name)
    sizes = split_sizes(samples, microbatches)
    dtypes = [torch.float64] if precision == "float64" else [torch.float32, torch.float64]
    references = {dtype: async_reference(clone(model) if dtype == torch.float32 else double(model),
                                         _batches(batch, samples, dtype), loss_fn, sizes, optimizer_kind,
                                         weights=lambda target: microbatch_weights(model_name, target, sizes))
                  for dtype in dtypes}
    model = _in(precision, model)
    optimizer = make_optimizer(optimizer_kind, model.parameters())
    options = EngineOptions(num_microbatches=microbatches, recompute=recompute, num_stages=2, async_step=True,
                            jitter=jitter)
    kwargs = {} if weight_fn is None else {"loss_weight": weight_fn}
    losses = []
    with RoundPipeEngine(model, devices, options) as engine:
        for inputs, target in _batches(batch, samples, next(model.parameters()).dtype):
            losses.append(engine.forward_backward(inputs, target, loss_fn, **kwargs))
            engine.step(optimizer)
        engine.synchronize()
    _assert_equals_reference(precision, losses, model, references)
