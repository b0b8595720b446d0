"""Stress mode (``EngineOptions.stress``): CPU stand-ins with strict CUDA semantics.

Copies land late and released buffers are poisoned (see ``engine/device.py``). A correct engine still
equals plain PyTorch exactly (float64, as in ``test_transparency.py``); an engine with a removed event
wait or a buffer released too early gives NaN or raises.
"""

from __future__ import annotations

import pytest
import torch

from lightning_roundpipe import EngineOptions, RoundPipeEngine
from lightning_roundpipe.engine import device as device_module
from lightning_roundpipe.engine.device import Stream, poison
from lightning_roundpipe.engine.step.window import GradWindow
from tests.models import (
    async_reference,
    bn_model,
    gpt_batch,
    make_optimizer,
    microbatch_weights,
    reference_microbatch_step,
    reference_transparent_step,
    split_sizes,
    tiny_gpt,
    transparency_case,
)
from tests.numerics import assert_float64_equal, assert_states_float64_equal, double, state, to_double

STEPS = 3


def _batches(batch, samples: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return to_double([batch(samples, seed=step) for step in range(STEPS)])


def _sync_reference(model, model_name, batch, samples, loss_fn, sizes):
    reference = double(model)
    optimizer = make_optimizer("sgd", reference.parameters())
    losses = []
    for inputs, target in _batches(batch, samples):
        losses.append(reference_microbatch_step(reference, inputs, target, loss_fn,
                                                microbatch_weights(model_name, target, sizes), sizes))
        optimizer.step()
        optimizer.zero_grad()
    return state(reference), losses


def _transparent_reference(model, batch, samples, loss_fn, sizes):
    reference = double(model)
    optimizer = make_optimizer("sgd", reference.parameters())
    losses = []
    for inputs, target in _batches(batch, samples):
        losses.append(reference_transparent_step(reference, inputs, target, loss_fn, sizes))
        optimizer.step()
        optimizer.zero_grad()
    return state(reference), losses


def _run(model, devices: int, batch, samples, loss_fn, weight_fn, options: EngineOptions, transparent: bool):
    """The engine in float64 (the model is trained in place): the losses per step, stacked."""
    optimizer = make_optimizer("sgd", model.parameters())
    kwargs = {} if weight_fn is None else {"loss_weight": weight_fn}
    losses = []
    with RoundPipeEngine(model, devices, options) as engine:
        for inputs, target in _batches(batch, samples):
            if transparent:
                loss = loss_fn(engine(inputs), target)
                loss.backward()
            else:
                loss = engine.forward_backward(inputs, target, loss_fn, **kwargs)
            engine.step(optimizer)
            losses.append(loss.detach().reshape(()))
        engine.synchronize()
    return torch.stack(losses)


def _assert_equal(losses: torch.Tensor, model, reference) -> None:
    state64, losses64 = reference
    assert_float64_equal(losses, losses64, what="losses")
    assert_states_float64_equal(model, state64)


# ---------------------------------------------------------------------------------------------- no defect
@pytest.mark.parametrize("jitter", [0.0, 0.001])
@pytest.mark.parametrize("model_name,devices,microbatches,recompute",
                         [("gpt", 2, 2, "stage"), ("gpt", 3, 4, "layer"), ("bn", 2, 4, "layer"), ("bn", 3, 3, "stage")])
def test_sync_fused_path_under_stress_equals_plain_pytorch(model_name, devices, microbatches, recompute, jitter):
    model, batch, samples, loss_fn, weight_fn = transparency_case(model_name)
    sizes = split_sizes(samples, microbatches)
    reference = _sync_reference(model, model_name, batch, samples, loss_fn, sizes)
    model = double(model)
    options = EngineOptions(num_microbatches=microbatches, recompute=recompute, num_stages=2, jitter=jitter,
                            stress=True)
    losses = _run(model, devices, batch, samples, loss_fn, weight_fn, options, transparent=False)
    _assert_equal(losses, model, reference)


@pytest.mark.parametrize("model_name,devices,microbatches,recompute",
                         [("gpt", 2, 4, "layer"), ("bn", 3, 3, "stage")])
def test_transparent_path_under_stress_equals_plain_pytorch(model_name, devices, microbatches, recompute):
    model, batch, samples, loss_fn, _ = transparency_case(model_name)
    sizes = split_sizes(samples, microbatches)
    reference = _transparent_reference(model, batch, samples, loss_fn, sizes)
    model = double(model)
    options = EngineOptions(num_microbatches=microbatches, recompute=recompute, num_stages="auto", stress=True)
    losses = _run(model, devices, batch, samples, loss_fn, None, options, transparent=True)
    _assert_equal(losses, model, reference)


@pytest.mark.parametrize("model_name,devices,microbatches,recompute",
                         [("gpt", 2, 3, "layer"), ("bn", 3, 4, "stage")])
def test_async_under_stress_equals_one_step_delayed_reference(model_name, devices, microbatches, recompute):
    model, batch, samples, loss_fn, weight_fn = transparency_case(model_name)
    sizes = split_sizes(samples, microbatches)
    reference = async_reference(double(model), _batches(batch, samples), loss_fn, sizes, "sgd",
                                weights=lambda target: microbatch_weights(model_name, target, sizes))
    model = double(model)
    options = EngineOptions(num_microbatches=microbatches, recompute=recompute, num_stages=2, async_step=True,
                            stress=True)
    losses = _run(model, devices, batch, samples, loss_fn, weight_fn, options, transparent=False)
    _assert_equal(losses, model, reference)


def test_inference_mode_under_stress_equals_plain_pytorch():
    """Under the caller's ``torch.inference_mode`` the device tensors are inference tensors: the late copies
    and the poisoning write them in inference mode."""
    model = double(tiny_gpt()).eval()
    inputs, _ = gpt_batch(7, seed=0)
    with torch.inference_mode():
        expected = model(inputs)
    with RoundPipeEngine(model, 2, EngineOptions(num_microbatches=3, num_stages=2, stress=True)) as engine:
        for _ in range(2):
            with torch.inference_mode():
                output = engine(inputs)
            assert_float64_equal(output, expected, what="output")


def test_poison_fills_every_dtype():
    floats, ints, flags = torch.ones(3, dtype=torch.float64), torch.ones(3, dtype=torch.int64), torch.zeros(2).bool()
    leaf = torch.ones(2, requires_grad=True)
    poison([floats, ints, flags, leaf])
    assert floats.isnan().all() and leaf.isnan().all() and flags.all()
    assert (ints == torch.iinfo(torch.int64).min).all()


def test_stress_is_off_by_default_and_ignored_without_it():
    assert EngineOptions().stress is False
    with RoundPipeEngine(double(bn_model()), 2, EngineOptions(num_microbatches=2)) as engine:
        assert not any(device.stress for device in engine.devices)
        assert not any(stream.stress for device in engine.devices for stream in device.streams)


# ---------------------------------------------------------------------------------------------- defects
def _defective_outcome(stress: bool) -> tuple[bool, torch.Tensor | None]:
    """Train the gpt model on 2 devices, 4 microbatches, fused path, under whatever defect the caller
    patched in. Returns whether it raised nothing and equals plain PyTorch, and the losses if it ran."""
    model, batch, samples, loss_fn, weight_fn = transparency_case("gpt")
    sizes = split_sizes(samples, 4)
    reference = _sync_reference(model, "gpt", batch, samples, loss_fn, sizes)
    model = double(model)
    options = EngineOptions(num_microbatches=4, num_stages=2, stress=stress, wait_timeout=60.0)
    try:
        losses = _run(model, 2, batch, samples, loss_fn, weight_fn, options, transparent=False)
    except Exception:  # noqa: BLE001 - any failure is a detection
        return False, None
    try:
        _assert_equal(losses, model, reference)
    except AssertionError:
        return False, losses
    return True, losses


def test_a_compute_that_skips_its_input_wait_fails_under_stress(monkeypatch):
    """The compute stream no longer waits for ``inputs_uploaded[m]`` ([6]).

    Not certain by construction, but overwhelmingly likely: every copy lands 50 ms after it starts, so
    microbatch m+1's inputs reach the device 50 ms after microbatch m's, while the compute, which no
    longer waits, takes a few milliseconds per microbatch of this tiny model. To pass, each of the
    3 x 4 x 2 computes would have to be held back by 50 ms; the first one that is not reads an input that
    has not arrived (the engine raises) or has not landed (NaN)."""
    original = Stream.wait_event

    def wait_event(self, event):
        if event is not None and self.name.endswith("-compute") and event.name.startswith("the inputs of"):
            return  # the defect
        original(self, event)

    monkeypatch.setattr(Stream, "wait_event", wait_event)
    monkeypatch.setattr(device_module, "STRESS_LANDING_DELAY", 0.05)
    correct, _ = _defective_outcome(stress=True)
    assert not correct


@pytest.mark.parametrize("stream", ["-acts", "-download"])
def test_a_buffer_released_before_its_copy_landed_fails_under_stress(monkeypatch, stream):
    """The activation upload (``-acts``) consumes its host cells, or the download (``-download``)
    releases the device outputs, without first synchronizing its stream: the buffer is released while
    the copy that reads it is still in flight.

    Certain: in stress mode the release poisons the buffer at once, on the same thread, before the copy
    lands at the stream's next event; the landed copy is NaN, and so is every loss after it. Without
    stress a CPU copy is complete when it returns, so the same defect goes unseen."""
    original = Stream.synchronize

    def synchronize(self):
        if self.name.endswith(stream):
            return  # the defect
        original(self)

    monkeypatch.setattr(Stream, "synchronize", synchronize)
    correct, losses = _defective_outcome(stress=True)
    assert not correct
    assert losses is not None and not torch.isfinite(losses).any(), "the engine should run on, on poison"
    correct, _ = _defective_outcome(stress=False)
    assert correct, "without stress, the defect should go unseen on CPU"


def test_a_gradient_window_that_keeps_the_staging_buffer_fails_under_stress(monkeypatch):
    """The gradient window adopts the reused download buffer instead of copying out of it: the next job's
    gradients would overwrite it. Certain: in stress mode the summing thread poisons the staging buffer once the
    window has added it, so the adopted gradients are NaN, and so is every weight they step. (Without stress
    it shows only where a later job of the step reuses the buffer.)"""
    original = GradWindow.deliver

    def deliver(self, ticket, grads, *, borrowed=False):
        original(self, ticket, grads, borrowed=False)  # the defect: a borrowed buffer kept as the window's own

    monkeypatch.setattr(GradWindow, "deliver", deliver)
    correct, _ = _defective_outcome(stress=True)
    assert not correct
