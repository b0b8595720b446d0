"""``deferred_batchnorm``: BatchNorm running statistics of the whole batch, committed once per trunk call.

Two claims, each against an independent reference:

* Against Lightning's default strategy (the whole batch at once) on the same seeded module and data: the
  running statistics and ``num_batches_tracked`` are equal wherever a BatchNorm's inputs are, i.e. where
  nothing before it depends on how the batch is split (the BatchNorm is first, or everything before it is
  frozen and batch-independent). Normalization stays per microbatch, so weights after it differ.
* Against plain PyTorch running the same microbatches one after another (as gradient accumulation would),
  whose BatchNorms' statistics are then replaced by one torch BatchNorm forward over each BatchNorm's
  concatenated microbatch inputs: every parameter and buffer equal, for chained BatchNorms (whose inputs
  do depend on the split), 1d/2d/3d, ``momentum=None``, ``affine=False``, ``track_running_stats=False``,
  an eval-mode BatchNorm and one applied twice per call.

Tolerances (tests/numerics.py): float64 runs equal to 1e-12 (the whole batch's mean and variance combined
from microbatches differ from torch's one pass by rounding only); counters exactly.
"""

from __future__ import annotations

from functools import partial

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

import lightning_roundpipe  # noqa: F401 - registers the strategy names (editable installs have no .pth hook)
from lightning_roundpipe import EngineOptions, RoundPipeEngine, RoundPipeStrategy
from tests.models import Classifier, make_optimizer, reference_microbatch_step, reference_transparent_step, split_sizes
from tests.models import classifier_data as _data
from tests.numerics import (
    assert_close_to_reference,
    assert_float64_equal,
    assert_states_equal,
    assert_states_float64_equal,
    double,
    state,
)

RUNNING = ("running_mean", "running_var", "num_batches_tracked")


# ---------------------------------------------------------------------------- against Lightning's default
class NormClassifier(Classifier):
    """``Classifier`` whose BatchNorm sees inputs that do not depend on the microbatch split: ``first`` is a
    BatchNorm on the data itself (a forward stage's first layer); ``last`` one in the last trunk layer (the
    fused stage under ``pipeline_loss``) after frozen layers, with ``momentum=None`` (cumulative average)."""

    def __init__(self, where: str, fused: bool) -> None:
        super().__init__("sgd", fused)
        torch.manual_seed(0)
        if where == "first":
            self.net = nn.Sequential(nn.BatchNorm1d(6, affine=False), nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16),
                                     nn.Tanh(), nn.Linear(16, 3))
        else:
            self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                                     nn.Sequential(nn.BatchNorm1d(16, momentum=None), nn.Linear(16, 3)))
            for layer in list(self.net)[:4]:
                layer.requires_grad_(False)

    def norm(self) -> nn.Module:
        return self.net[0] if isinstance(self.net[0], nn.BatchNorm1d) else self.net[4][0]


def _fit(module: pl.LightningModule, strategy, devices: int = 1, precision: str = "64-true") -> pl.Trainer:
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_epochs=2,
                         accumulate_grad_batches=2, precision=precision, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, _data(), _data(16))  # 12 batches of 8, and validation (eval mode: no update)
    return trainer


def _running(module: NormClassifier) -> dict[str, torch.Tensor]:
    return {name: getattr(module.norm(), name).detach().clone() for name in RUNNING}


@pytest.mark.parametrize("devices, microbatches", [(2, 2), (2, 4), (3, 2), (3, 4)])
@pytest.mark.parametrize("fused", [False, True], ids=["transparent", "fused"])
@pytest.mark.parametrize("where", ["first", "last"])
def test_running_statistics_equal_lightnings_default_strategy(where, fused, devices, microbatches):
    reference = NormClassifier(where, fused)
    _fit(reference, "auto")
    module = NormClassifier(where, fused)
    _fit(module, RoundPipeStrategy(num_microbatches=microbatches, num_stages=2, deferred_batchnorm=True), devices)
    ours, expected = _running(module), _running(reference)
    assert expected["num_batches_tracked"].item() == 12  # once per batch
    assert torch.equal(ours["num_batches_tracked"], expected["num_batches_tracked"])
    for name in ("running_mean", "running_var"):
        assert_float64_equal(ours[name], expected[name], what=name)
    # what is not equal: the BatchNorm normalizes each microbatch, so the layers after it learn differently
    last = module.net[-1] if where == "first" else module.net[4][1]
    reference_last = reference.net[-1] if where == "first" else reference.net[4][1]
    assert (last.weight - reference_last.weight).abs().max() > 1e-6


def test_float32_running_statistics_are_as_close_as_lightnings_own():
    """In float32, no further from Lightning's float64 run than Lightning's float32 run is (4x, numerics.py)."""
    references = {}
    for precision in ("32-true", "64-true"):
        references[precision] = NormClassifier("first", fused=False)
        _fit(references[precision], "auto", precision=precision)
    module = NormClassifier("first", fused=False)
    _fit(module, RoundPipeStrategy(num_microbatches=4, num_stages=2, deferred_batchnorm=True), 2, "32-true")
    ours, ref32, ref64 = (_running(m) for m in (module, references["32-true"], references["64-true"]))
    for name in RUNNING:
        assert_close_to_reference(ours[name], ref32[name], ref64[name], what=name)


def test_off_by_default_the_statistics_are_updated_per_microbatch():
    reference = NormClassifier("first", fused=False)
    _fit(reference, "auto")
    strategy = RoundPipeStrategy(num_microbatches=2, num_stages=2)
    assert strategy.engine_options.deferred_batchnorm is False
    module = NormClassifier("first", fused=False)
    _fit(module, strategy, 2)
    ours, expected = _running(module), _running(reference)
    assert ours["num_batches_tracked"].item() == 2 * expected["num_batches_tracked"].item() == 24  # per microbatch
    assert (ours["running_mean"] - expected["running_mean"]).abs().max() > 1e-6


def test_validation_is_unaffected():
    """Eval mode normalizes with the running statistics and updates nothing, with the option or without."""
    module = NormClassifier("first", fused=False)
    _fit(module, RoundPipeStrategy(num_microbatches=2, num_stages=2, deferred_batchnorm=True), 2)
    before = {name: tensor.clone() for name, tensor in state(module).items()}
    metrics = {}
    for deferred in (True, False):
        trainer = pl.Trainer(strategy=RoundPipeStrategy(num_microbatches=2, deferred_batchnorm=deferred),
                             accelerator="cpu", devices=2, precision="64-true", logger=False,
                             enable_progress_bar=False, enable_model_summary=False)
        metrics[deferred] = trainer.validate(module, _data(16), verbose=False)[0]["val_loss"]
        assert_states_equal(module, before)
    assert metrics[True] == metrics[False]  # the same kernels on the same data: bitwise


# ---------------------------------------------------------------------------- against plain PyTorch
class TwiceNormalized(nn.Module):
    """One BatchNorm applied twice per call: two updates per call, as on the whole batch."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(torch.tanh(self.norm(x)) * 2 + 1)


def norm_model() -> nn.Sequential:
    torch.manual_seed(0)
    frozen = nn.BatchNorm1d(32)
    frozen.running_mean.uniform_(-0.5, 0.5)
    frozen.running_var.uniform_(0.5, 2.0)
    model = nn.Sequential(
        nn.BatchNorm1d(6),
        nn.Sequential(nn.Linear(6, 32), nn.Tanh()),
        nn.Sequential(nn.Unflatten(1, (2, 4, 4)), nn.BatchNorm2d(2, momentum=None), nn.Flatten()),
        nn.Sequential(nn.Unflatten(1, (2, 2, 2, 4)), nn.BatchNorm3d(2, affine=False), nn.Flatten()),
        TwiceNormalized(32),
        nn.Sequential(nn.BatchNorm1d(32, track_running_stats=False), nn.Linear(32, 32), nn.Tanh()),
        frozen,
        nn.Linear(32, 3),
    )
    return model


def _deferred_reference(model: nn.Module, run, sizes: list[int]) -> float:
    """``run()`` (the microbatches one after another), then each training-mode BatchNorm's running statistics
    replaced by what torch's own BatchNorm forward over its concatenated microbatch inputs makes, once per
    application within a microbatch."""
    norms = [m for m in model.modules() if isinstance(m, _BatchNorm) and m.training and m.track_running_stats]
    seen: dict[nn.Module, list[torch.Tensor]] = {m: [] for m in norms}
    handles = [m.register_forward_pre_hook(lambda m, args: seen[m].append(args[0].detach())) for m in norms]
    before = {m: [getattr(m, name).clone() for name in RUNNING] for m in norms}
    try:
        loss = run()
    finally:
        for handle in handles:
            handle.remove()
    with torch.no_grad():
        for m in norms:
            for name, value in zip(RUNNING, before[m], strict=True):
                getattr(m, name).copy_(value)
            applications = len(seen[m]) // len(sizes)
            for application in range(applications):
                m(torch.cat(seen[m][application::applications]))
    return loss


def _reference(model: nn.Module, batches, sizes: list[int], fused: bool) -> tuple[dict, list[float]]:
    reference = double(model)
    optimizer = make_optimizer("sgd", reference.parameters())
    losses = []
    for inputs, target in batches:
        if fused:
            weights = [float(size) for size in sizes]
            step = partial(reference_microbatch_step, reference, inputs, target, F.cross_entropy, weights, sizes)
        else:
            step = partial(reference_transparent_step, reference, inputs, target, F.cross_entropy, sizes)
        losses.append(_deferred_reference(reference, step, sizes))
        with torch.no_grad():  # a forward-only call in training mode commits once too
            _deferred_reference(reference, partial(_forward, reference, inputs, sizes), sizes)
        optimizer.step()
        optimizer.zero_grad()
    return state(reference), losses


def _forward(model: nn.Module, inputs: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    return [model(part) for part in inputs.split(sizes)]


def _batches(samples: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    return [(torch.randn(samples, 6, generator=generator, dtype=torch.float64) * 2 + 1,
             torch.randint(0, 3, (samples,), generator=generator)) for _ in range(3)]


CASES = [  # devices, microbatches, recompute, stress
    (2, 2, "stage", False), (2, 3, "layer", False), (3, 4, "stage", False), (3, 3, "layer", True),
]


@pytest.mark.parametrize("fused", [False, True], ids=["transparent", "fused"])
@pytest.mark.parametrize("devices, microbatches, recompute, stress", CASES)
def test_every_parameter_and_buffer_equals_plain_microbatches_with_whole_batch_statistics(
        devices, microbatches, recompute, stress, fused):
    model = norm_model()
    model[6].eval()  # normalizes with its running statistics, which stay as they are
    samples = 11  # uneven microbatches: the whole batch's count weighs each
    sizes = split_sizes(samples, microbatches)
    batches = _batches(samples)
    expected, expected_losses = _reference(model, batches, sizes, fused)
    ours = double(model)
    optimizer = make_optimizer("sgd", ours.parameters())
    losses = []
    options = EngineOptions(num_microbatches=microbatches, num_stages=3, recompute=recompute, stress=stress,
                            deferred_batchnorm=True)
    with RoundPipeEngine(ours, devices, options) as engine:
        for inputs, target in batches:
            if fused:
                losses.append(engine.forward_backward(inputs, target, F.cross_entropy).item())
            else:
                loss = F.cross_entropy(engine(inputs), target)
                loss.backward()
                losses.append(loss.item())
            with torch.no_grad():
                engine(inputs)
            engine.step(optimizer)
        engine.synchronize()
    assert_float64_equal(losses, expected_losses, what="losses")
    assert_states_float64_equal(ours, expected)
    assert ours[0].num_batches_tracked.item() == 6 and ours[4].norm.num_batches_tracked.item() == 12
    assert ours[6].num_batches_tracked.item() == 0 and torch.equal(ours[6].running_mean, double(model)[6].running_mean)


# ---------------------------------------------------------------------------- what is refused
class OwnForward(nn.BatchNorm1d):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return super().forward(input) * 2


class OwnCheck(nn.BatchNorm1d):
    """A subclass that keeps torch's forward: deferred like a BatchNorm1d."""

    def _check_input_dim(self, input: torch.Tensor) -> None:
        assert input.dim() == 2


@pytest.mark.parametrize("module, name", [(OwnForward(4), "OwnForward"),
                                          (nn.InstanceNorm1d(4, track_running_stats=True), "InstanceNorm1d")])
def test_modules_whose_update_cannot_be_deferred_are_refused(module, name):
    model = nn.Sequential(nn.Linear(3, 4), nn.Sequential(nn.Unflatten(1, (4, 1)), module))
    with pytest.raises(ValueError, match=rf"cannot defer .* trunk layer 1's `1` \({name}\).* "
                                         r"Set track_running_stats=False on that module, or deferred_batchnorm=False"):
        RoundPipeEngine(model, 2, EngineOptions(deferred_batchnorm=True))
    RoundPipeEngine(model, 2, EngineOptions())  # without the option: updated per microbatch, as always


def test_batchnorms_without_running_statistics_and_subclasses_keeping_torchs_forward_are_accepted():
    torch.manual_seed(0)
    model = nn.Sequential(OwnCheck(3), nn.Linear(3, 4), nn.BatchNorm1d(4, track_running_stats=False)).double()
    reference = double(model)
    x = torch.randn(8, 3, dtype=torch.float64)
    with RoundPipeEngine(model, 2, EngineOptions(num_microbatches=2, deferred_batchnorm=True)) as engine:
        with torch.no_grad():
            engine(x)
    with torch.no_grad():
        reference[0](x)  # the first layer's input is the data: the whole batch's statistics
    assert model[0].num_batches_tracked.item() == 1
    assert_states_float64_equal(model[0], reference[0])
