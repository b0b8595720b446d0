"""The low-precision transport (``engine/transport.py``): under mixed precision the weights autocast casts
anyway travel already cast.

Where the tolerances come from. Autocast casts a float32 weight to bfloat16 (or float16) by IEEE
round-to-nearest-even before its matmul; the transport makes that same cast on the host, once per step.
The device then runs the same kernels on the same values, and the gradient of the low-precision weight is
the low-precision gradient autocast's cast would have received. So with one microbatch the results are
bitwise those of Lightning's own ``bf16-mixed`` (no tolerance: the spread of Lightning ``bf16-mixed``
against itself under another kernel set is not needed, the comparison is exact on every kernel set). With
several microbatches the device sums each microbatch's low-precision gradient in float32, as plain autocast
sums the cast's gradients into a float32 ``param.grad``: bitwise that sum of plain PyTorch's per-microbatch
gradients. Against Lightning's ``bf16-mixed`` on the whole batch (which sums over the batch in bfloat16
inside its matmul) the results must stay within what ``bf16-mixed`` itself changes against ``32-true``.
"""

from __future__ import annotations

import functools
import itertools

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_roundpipe import EngineOptions, RoundPipeEngine, RoundPipeStrategy
from lightning_roundpipe.engine.device import AbortSignal
from lightning_roundpipe.engine.layers import Trunk
from lightning_roundpipe.engine.options import OptionError
from lightning_roundpipe.engine.transport import GradStaging, autocast_only_weights
from tests.models import Classifier, bn_batch, bn_model, classifier_data, clone
from tests.numerics import assert_states_equal


# ---------------------------------------------------------------------------------------------- which weights
def test_only_weights_a_layer_uses_solely_as_stock_linear_or_conv_weights_travel_in_low_precision():
    class Doubled(nn.Linear):  # its own forward: autocast may never see the weight in a matmul
        def forward(self, x):
            return super().forward(x) * 2

    embedding = nn.Embedding(10, 8)
    tied_head = nn.Linear(8, 10, bias=False)
    tied_head.weight = embedding.weight          # a lookup table in layer 0, a matmul weight in layer 4
    shared = nn.Linear(8, 8)                     # a Linear in two layers: autocast-only in both
    conv = nn.Conv1d(8, 8, 3)
    norm = nn.LayerNorm(8)
    doubled = Doubled(8, 8)
    half = nn.Linear(8, 8).to(torch.bfloat16)    # already stored in the transport dtype: nothing to gain
    both = nn.Linear(8, 8)
    both_norm = nn.LayerNorm(8)
    both_norm.weight = both.weight               # within one layer a Linear's and a LayerNorm's: stays as stored
    trunk = Trunk([nn.Sequential(embedding, norm), nn.Sequential(shared, conv), nn.Sequential(shared, doubled),
                   nn.Sequential(half, both, both_norm), tied_head])
    expected = [set(), {id(shared.weight), id(shared.bias), id(conv.weight), id(conv.bias)},
                {id(shared.weight), id(shared.bias)}, {id(both.bias)}, {id(embedding.weight)}]
    assert autocast_only_weights(trunk, torch.bfloat16) == expected
    # float16 is as narrow as bfloat16: the same weights
    assert autocast_only_weights(trunk, torch.float16) == expected


# ---------------------------------------------------------------------------------------------- Lightning
def _fit(module: pl.LightningModule, strategy, precision: str, devices: int = 1) -> pl.Trainer:
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_epochs=1, precision=precision,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(module, classifier_data())
    return trainer


def _uploaded_param_bytes(trainer: pl.Trainer) -> int:
    return sum(device.counters.uploaded_param_bytes for device in trainer.strategy.engine.devices)


@pytest.mark.parametrize("fused", [False, True], ids=["transparent", "fused"])
@pytest.mark.parametrize("async_step", [False, True], ids=["sync", "async"])
def test_bf16_transport_halves_uploaded_bytes_and_equals_lightnings_bf16_mixed(fused, async_step):
    """Classifier's trunk is Linear layers only, so every uploaded byte is a transported weight or bias:
    exactly half the bytes of float32 uploads."""
    modules = {name: Classifier("adamw", fused) for name in ("reference", "on", "off")}
    _fit(modules["reference"], "auto", "bf16-mixed")
    trainers = {name: _fit(modules[name], RoundPipeStrategy(num_microbatches=1, num_stages=2, async_step=async_step,
                                                           transport_dtype="auto" if name == "on" else "off"),
                           "bf16-mixed", devices=2)
                for name in ("on", "off")}
    on, off = _uploaded_param_bytes(trainers["on"]), _uploaded_param_bytes(trainers["off"])
    assert off > 0 and on * 2 == off
    if async_step:  # one step stale: equal to each other, not to plain training
        assert modules["on"].losses == modules["off"].losses
        assert_states_equal(modules["on"], modules["off"])
        return
    for name in ("on", "off"):  # one microbatch: bitwise (module docstring)
        assert modules[name].losses == modules["reference"].losses
        assert_states_equal(modules[name], modules["reference"])


def _flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([param.detach().double().flatten() for param in module.parameters()])


def test_with_more_microbatches_bf16_transport_stays_within_bf16_mixeds_own_spread():
    """Four microbatches, each a matmul over its own rows (Lightning's one over the whole batch). The
    distance to Lightning's bf16-mixed must stay below bf16-mixed's own distance to 32-true (each over all
    the weights after 6 AdamW steps), and the transport must not move further from 32-true than bf16-mixed."""
    reference32, reference16, ours = Classifier("adamw"), Classifier("adamw"), Classifier("adamw")
    _fit(reference32, "auto", "32-true")
    _fit(reference16, "auto", "bf16-mixed")
    _fit(ours, RoundPipeStrategy(num_microbatches=4, num_stages=2), "bf16-mixed", devices=2)
    spread = (_flat(reference16) - _flat(reference32)).norm()
    assert (_flat(ours) - _flat(reference16)).norm() <= spread
    assert (_flat(ours) - _flat(reference32)).norm() <= 2 * spread


@pytest.mark.parametrize("transport,precision,message", [
    ("float16", "bf16-mixed", "runs autocast in bfloat16"),
    ("bfloat16", "32-true", "runs no autocast"),
])
def test_a_transport_dtype_that_is_not_the_precisions_is_refused(transport, precision, message):
    with pytest.raises(OptionError, match=message):
        _fit(Classifier(), RoundPipeStrategy(num_microbatches=1, transport_dtype=transport), precision)


def test_a_bad_transport_dtype_is_refused_naming_the_choices():
    with pytest.raises(OptionError, match="`transport_dtype` must be one of 'auto', 'off', 'bfloat16', 'float16'"):
        EngineOptions(transport_dtype="int8")


# ---------------------------------------------------------------------------------------------- the engine
def _train(model: nn.Module, options: EngineOptions, steps: int = 3, write=None) -> list[torch.Tensor]:
    """``steps`` SGD steps on the CPU under bf16 autocast; ``write(model)`` runs between steps, after the
    step has finished (a write outside any optimizer step)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    with RoundPipeEngine(model, 2, options) as engine:
        for step in range(steps):
            inputs, target = bn_batch(8, seed=step)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                losses.append(engine.forward_backward(inputs, target, F.cross_entropy))
            engine.step(optimizer)
            engine.wait_for_steps()
            if write is not None:
                write(model)
    return losses


def _halve_first_weight(model: nn.Module) -> None:
    with torch.no_grad():
        model[0].weight.mul_(0.5)


@pytest.mark.parametrize("async_step", [False, True], ids=["sync", "async"])
def test_engine_transport_equals_float32_uploads_under_autocast(async_step):
    """The cast the host makes once equals the cast autocast makes on the device: with one microbatch (no
    sum of low-precision gradients over microbatches) bitwise the same training, sync and async. In sync
    mode also after a write to the masters outside any step (the copy is cast again at its next upload)."""
    write = None if async_step else _halve_first_weight
    results = {}
    for transport in ("off", "bfloat16"):
        model = bn_model()
        options = EngineOptions(num_microbatches=1, num_stages=2, async_step=async_step, transport_dtype=transport)
        results[transport] = (_train(model, options, write=write), model)
    (losses_off, off), (losses_on, on) = results["off"], results["bfloat16"]
    assert torch.equal(torch.stack(losses_on), torch.stack(losses_off))
    assert_states_equal(on, off)


def test_a_call_outside_autocast_uploads_full_precision():
    """Sync mode uploads the masters, so the output is the model's own; async mode only keeps the
    published copy in bfloat16 and widens it, so the output is that of the model with those weights
    rounded to bfloat16."""
    model = bn_model().eval()
    inputs, _ = bn_batch(8, seed=0)
    rounded = clone(model)
    with torch.no_grad():
        for layer in (rounded[0], rounded[3], rounded[6]):
            for parameter in layer.parameters():
                parameter.copy_(parameter.bfloat16())
    for async_step, reference in ((False, model), (True, rounded)):
        options = EngineOptions(num_microbatches=2, num_stages=2, async_step=async_step, transport_dtype="bfloat16")
        with torch.no_grad(), RoundPipeEngine(model, 2, options) as engine:
            output = engine(inputs)
            expected = reference(inputs)
        assert output.dtype == torch.float32
        assert torch.equal(output, expected)


def test_grad_staging_views_are_shaped_aligned_and_reused():
    staging = GradStaging(pin=False)
    buffer = staging.acquire(AbortSignal(5.0))
    grads = [torch.ones(3, 5, dtype=torch.bfloat16), torch.ones(7), torch.ones(2, dtype=torch.float64)]
    views = buffer.views(grads)
    assert [(view.shape, view.dtype) for view in views] == [(grad.shape, grad.dtype) for grad in grads]
    pointers = [view.data_ptr() for view in views]
    assert all(pointer % 64 == 0 for pointer in pointers)
    for view, grad in zip(views, grads, strict=True):
        view.copy_(grad * 2)
    # the buffer's next job reuses the same memory (no overlap between a job's own views)
    assert [view.data_ptr() for view in buffer.views(grads)] == pointers
    assert all(torch.equal(view, grad * 2) for view, grad in zip(views, grads, strict=True))
    assert staging.nbytes() == 64 + 64 + 64  # exactly what the job needs, no power-of-two rounding
    other = staging.acquire(AbortSignal(5.0))  # the second buffer: its own memory
    assert other.views(grads)[0].data_ptr() not in pointers
    buffer.release()
    assert staging.acquire(AbortSignal(5.0)) is buffer


def test_grad_staging_views_follow_each_layout_and_the_memory_when_it_grows():
    # jobs of different layouts take turns on a buffer; one larger than the memory makes it grow, after which
    # every layout's views lie in the new memory, each its own non-overlapping range, shaped like its gradients
    buffer = GradStaging(pin=False).acquire(AbortSignal(5.0))
    small = [torch.ones(4, 4), torch.ones(3, dtype=torch.bfloat16)]
    other = [torch.ones(2), torch.ones(5, 2)]
    large = [torch.ones(64, 64)]
    for grads in (small, other, small, large, other, small):
        views = buffer.views(grads)
        assert buffer.memory is not None
        start = buffer.memory.data_ptr()
        ranges = sorted((view.data_ptr(), view.data_ptr() + view.numel() * view.element_size()) for view in views)
        assert all(start <= low and high <= start + buffer.memory.numel() for low, high in ranges)
        assert all(high <= low for (_, high), (low, _) in itertools.pairwise(ranges))
        assert [(view.shape, view.dtype) for view in views] == [(grad.shape, grad.dtype) for grad in grads]
        for view, grad in zip(views, grads, strict=True):
            view.copy_(grad * 3)
        assert all(torch.equal(view, grad * 3) for view, grad in zip(buffer.views(grads), grads, strict=True))


# ---------------------------------------------------------------------------------------------- pre-flight
@pytest.mark.parametrize("async_step", [False, True], ids=["sync", "async"])
def test_the_memory_plan_counts_the_low_precision_copies_and_the_smaller_device_stages(async_step):
    """Classifier's trunk is Linear layers only: under bf16-mixed its host copies are 2 bytes per parameter in
    both modes (async publishes them in bfloat16 only), and every layer's weights take half their float32
    bytes on a device; their gradients are summed over the microbatches in float32 there, 4 bytes each."""
    plans = {}
    for precision in ("32-true", "bf16-mixed"):
        strategy = RoundPipeStrategy(num_microbatches=2, async_step=async_step)
        module = Classifier("adamw")
        pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=1, precision=precision, logger=False,
                   enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False).fit(module, classifier_data())
        plans[precision] = strategy.memory_plan
    elements = sum(param.numel() for param in module.parameters())
    assert plans["bf16-mixed"].upload_copy_bytes == 2 * elements
    assert plans["32-true"].upload_copy_bytes == (4 * elements if async_step else 0)
    layer, nbytes = plans["bf16-mixed"].largest_layer
    assert plans["32-true"].largest_layer == (layer, nbytes * 4 // 3)  # weights 2 bytes, not 4; gradients 4
    assert "Linear/Conv weights in bfloat16" in plans["bf16-mixed"].table()


def test_low_precision_gradients_are_summed_over_the_microbatches_in_float32():
    """Under plain autocast each microbatch's gradient of a float32 weight is its bfloat16 gradient cast to float32,
    summed in float32. With the transport the weights are bfloat16 leaves on the device: their gradients must still
    be summed over a job's four microbatches in float32 (not in the bfloat16 leaf), bitwise as that reference."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
    reference = clone(model)
    inputs, target = torch.randn(16, 8), torch.randint(0, 4, (16,))
    per_microbatch = []
    for x, y in zip(inputs.split(4), target.split(4), strict=True):
        reference.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(reference(x), y) * 0.25  # each microbatch weighs a quarter of the batch
        loss.backward()
        per_microbatch.append([param.grad.clone() for param in reference.parameters()])
    expected = [functools.reduce(torch.add, grads) for grads in zip(*per_microbatch, strict=True)]
    assert all(grad.dtype == torch.float32 for grad in expected)
    options = EngineOptions(num_microbatches=4, num_stages=3, transport_dtype="bfloat16")
    with RoundPipeEngine(model, 2, options) as engine:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            engine.forward_backward(inputs, target, F.cross_entropy)
        engine.collect_gradients()
    for (name, param), grad in zip(model.named_parameters(), expected, strict=True):
        assert torch.equal(param.grad, grad), name
