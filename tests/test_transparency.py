"""The engine's results equal plain PyTorch running the same microbatches one after another."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_roundpipe import EngineOptions, RoundPipeEngine, token_count
from tests.models import (
    bn_batch,
    bn_model,
    clone,
    gpt_batch,
    gpt_loss,
    make_optimizer,
    reference_microbatch_step,
    split_sizes,
    tiny_gpt,
)

STEPS = 5
TOLERANCE = {"sgd": dict(rtol=1e-5, atol=1e-7), "adamw": dict(rtol=1e-4, atol=1e-6)}


def _case(model_name: str):
    if model_name == "bn":
        return bn_model(), bn_batch, 11, F.cross_entropy, None
    return tiny_gpt(), gpt_batch, 7, gpt_loss, token_count(-100)


def _weights(model_name: str, target: torch.Tensor, sizes: list[int]) -> list[float]:
    if model_name == "bn":
        return [float(s) for s in sizes]
    return [float((chunk != -100).sum()) for chunk in torch.split(target, sizes)]


def _assert_same_state(model, reference, tolerance) -> None:
    for (name, param), ref in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(param, ref, **tolerance, msg=lambda m, n=name: f"parameter {n}: {m}")
    for (name, buffer), ref in zip(model.named_buffers(), reference.buffers()):
        torch.testing.assert_close(buffer, ref, **tolerance, msg=lambda m, n=name: f"buffer {n}: {m}")


@pytest.mark.parametrize("jitter", [0.0, 0.002], ids=["steady", "jitter"])
@pytest.mark.parametrize("optimizer_kind", ["sgd", "adamw"])
@pytest.mark.parametrize("recompute", ["stage", "layer"])
@pytest.mark.parametrize("microbatches", [1, 2, 4, 5])
@pytest.mark.parametrize("devices", [1, 2, 3])
@pytest.mark.parametrize("model_name", ["bn", "gpt"])
def test_sync_fused_path_equals_plain_pytorch(model_name, devices, microbatches, recompute, optimizer_kind, jitter):
    model, batch, samples, loss_fn, weight_fn = _case(model_name)
    reference = clone(model)
    optimizer = make_optimizer(optimizer_kind, model.parameters())
    reference_optimizer = make_optimizer(optimizer_kind, reference.parameters())
    options = EngineOptions(num_microbatches=microbatches, recompute=recompute, num_stages=2, jitter=jitter)
    sizes = split_sizes(samples, microbatches)
    with RoundPipeEngine(model, devices, options) as engine:
        for step in range(STEPS):
            inputs, target = batch(samples, seed=step)
            kwargs = {} if weight_fn is None else {"loss_weight": weight_fn}
            loss = engine.forward_backward(inputs, target, loss_fn, **kwargs)
            engine.step(optimizer)
            expected = reference_microbatch_step(reference, inputs, target, loss_fn,
                                                 _weights(model_name, target, sizes), sizes)
            reference_optimizer.step()
            reference_optimizer.zero_grad()
            torch.testing.assert_close(loss.item(), expected, **TOLERANCE[optimizer_kind])
        engine.synchronize()
    _assert_same_state(model, reference, TOLERANCE[optimizer_kind])


@pytest.mark.parametrize("jitter", [0.0, 0.002], ids=["steady", "jitter"])
@pytest.mark.parametrize("devices,microbatches,recompute", [(1, 1, "stage"), (2, 4, "layer"), (3, 5, "stage")])
@pytest.mark.parametrize("model_name", ["bn", "gpt"])
def test_transparent_path_equals_plain_pytorch(model_name, devices, microbatches, recompute, jitter):
    """Calling the trunk and then ``loss.backward()`` gives the whole-batch gradients."""
    model, batch, samples, loss_fn, _ = _case(model_name)
    reference = clone(model)
    optimizer = make_optimizer("sgd", model.parameters())
    reference_optimizer = make_optimizer("sgd", reference.parameters())
    options = EngineOptions(num_microbatches=microbatches, recompute=recompute, num_stages="auto", jitter=jitter)
    sizes = split_sizes(samples, microbatches)
    with RoundPipeEngine(model, devices, options) as engine:
        for step in range(STEPS):
            inputs, target = batch(samples, seed=step)
            loss = loss_fn(engine(inputs), target)
            loss.backward()
            engine.step(optimizer)
            # the loss is the whole batch's, taken on the merged output; the reference then back-propagates
            # the microbatches one after another, accumulating gradients in the same order
            outputs = [reference(x) for x in torch.split(inputs, sizes)]
            detached = [output.detach().requires_grad_(True) for output in outputs]
            expected = loss_fn(torch.cat(detached), target)
            expected.backward()
            for output, leaf in zip(outputs, detached):
                output.backward(leaf.grad)
            reference_optimizer.step()
            reference_optimizer.zero_grad()
            torch.testing.assert_close(loss, expected, **TOLERANCE["sgd"])
        engine.synchronize()
    _assert_same_state(model, reference, TOLERANCE["sgd"])


def _async_reference(model, batch, samples, loss_fn, weight_fn_name, sizes, optimizer_kind):
    """Independent reference of the async formula: iteration k computes g(k) on W(k-2), and
    W(k) = step(W(k-1), g(k)). ``compute`` holds the weights gradients are taken on (and the live
    buffers); ``masters`` are what the optimizer steps."""
    compute = clone(model)
    masters = [p.detach().clone().requires_grad_(True) for p in compute.parameters()]
    optimizer = make_optimizer(optimizer_kind, masters)
    losses = []
    for step in range(STEPS):
        inputs, target = batch(samples, seed=step)
        weights = _weights(weight_fn_name, target, sizes)
        losses.append(reference_microbatch_step(compute, inputs, target, loss_fn, weights, sizes))
        published = [m.detach().clone() for m in masters]  # W(k-1): what iteration k+1 will run on
        for master, param in zip(masters, compute.parameters()):
            master.grad = param.grad.clone()
            param.grad = None
        optimizer.step()
        with torch.no_grad():
            for param, value in zip(compute.parameters(), published):
                param.copy_(value)
    return masters, list(compute.buffers()), losses


@pytest.mark.parametrize("jitter", [0.0, 0.002], ids=["steady", "jitter"])
@pytest.mark.parametrize("optimizer_kind", ["sgd", "adamw"])
@pytest.mark.parametrize("devices,microbatches,recompute", [(1, 2, "stage"), (2, 3, "layer"), (3, 4, "stage")])
@pytest.mark.parametrize("model_name", ["bn", "gpt"])
def test_async_equals_one_step_delayed_reference(model_name, devices, microbatches, recompute, optimizer_kind,
                                                 jitter):
    model, batch, samples, loss_fn, weight_fn = _case(model_name)
    sizes = split_sizes(samples, microbatches)
    masters, buffers, expected_losses = _async_reference(model, batch, samples, loss_fn, model_name, sizes,
                                                         optimizer_kind)
    optimizer = make_optimizer(optimizer_kind, model.parameters())
    options = EngineOptions(num_microbatches=microbatches, recompute=recompute, num_stages=2, async_step=True,
                            jitter=jitter)
    losses = []
    with RoundPipeEngine(model, devices, options) as engine:
        for step in range(STEPS):
            inputs, target = batch(samples, seed=step)
            kwargs = {} if weight_fn is None else {"loss_weight": weight_fn}
            losses.append(engine.forward_backward(inputs, target, loss_fn, **kwargs).item())
            engine.step(optimizer)
        engine.synchronize()
    tolerance = TOLERANCE[optimizer_kind]
    torch.testing.assert_close(losses, expected_losses, **tolerance)
    for param, master in zip(model.parameters(), masters):
        torch.testing.assert_close(param, master.detach(), **tolerance)
    for buffer, expected in zip(model.buffers(), buffers):
        torch.testing.assert_close(buffer, expected, **tolerance)
