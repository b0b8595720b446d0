"""The user's random streams are the user's, and a step without a backward is the default strategy's (issue 23).

1. Nothing the strategy does at setup or between steps draws from torch's global generators, Python's
   ``random`` or NumPy's: a seeded run draws the same numbers after setup as under Lightning's default
   strategy (a shuffled DataLoader's order, a dataset built in ``train_dataloader``). The pre-flight used to
   time the optimizer on scratch parameters filled from torch's global generator.
2. An optimizer step that follows no backward changes what it changes under the default strategy. Plain
   training leaves the last backward's gradients in ``param.grad`` until ``zero_grad()``, so such a step
   applies them again (SWA's BatchNorm-update epoch: Lightning skips zero_grad and backward there but still
   steps once at the epoch's end), or nothing once they were cleared (a ``training_step`` returning ``None``:
   Lightning zeroes before the backward it skips; manual optimization after ``zero_grad()``).

References: Lightning's default strategy (one CPU device) on the same seeded module and data, in float64 with
one microbatch per batch, so RoundPipe runs the same kernels on the same data in the same order: bitwise
(``assert_states_equal``, tests/numerics.py) where the issue asks for it, else the float64 tolerance.
"""

from __future__ import annotations

import random
import warnings
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, StochasticWeightAveraging
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_roundpipe  # noqa: F401 - registers the strategy names
from lightning_roundpipe import RoundPipeStrategy
from tests.models import Classifier, without_dropout
from tests.numerics import assert_states_equal, assert_states_float64_equal, state


def _roundpipe(**options: Any) -> RoundPipeStrategy:
    return RoundPipeStrategy(num_microbatches=1, num_stages=2, **options)


def _trainer(strategy: Any, callbacks: list[Callback], *, epochs: int = 2, **kwargs: Any) -> pl.Trainer:
    return pl.Trainer(strategy=strategy, accelerator="cpu", devices=1 if strategy == "auto" else 2,
                      max_epochs=epochs, precision="64-true", logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks, **kwargs)


def _fit(trainer: pl.Trainer, module: pl.LightningModule, data: Any) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r".*does not have many workers.*")
        warnings.filterwarnings("ignore", r".*training_step.*returned `None`.*")
        trainer.fit(module, data)


# ------------------------------------------------------------------------------------ the global random streams
def _generator_states() -> dict[str, Any]:
    """Every global generator's state: torch's CPU one (and each CUDA device's), Python's and NumPy's."""
    states: dict[str, Any] = {"torch": torch.get_rng_state(), "random": random.getstate(),
                              "numpy": np.random.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def _assert_same_states(ours: dict[str, Any], reference: dict[str, Any], when: str) -> None:
    assert ours.keys() == reference.keys(), when
    assert torch.equal(ours["torch"], reference["torch"]), f"{when}: torch's CPU generator differs"
    for mine, theirs in zip(ours.get("cuda", []), reference.get("cuda", []), strict=True):
        assert torch.equal(mine, theirs), f"{when}: a CUDA generator differs"
    assert ours["random"] == reference["random"], f"{when}: Python's random differs"
    numpy_mine, numpy_theirs = ours["numpy"], reference["numpy"]
    assert numpy_mine[0] == numpy_theirs[0] and np.array_equal(numpy_mine[1], numpy_theirs[1]) and \
        numpy_mine[2:] == numpy_theirs[2:], f"{when}: NumPy's generator differs"


class RecordStates(Callback):
    """The global generators' states once setup is done (``on_train_start``, after the strategy's setup and
    pre-flight), after the first step (``on_train_batch_end`` of batch 0) and at the end of training."""

    def __init__(self) -> None:
        self.states: dict[str, dict[str, Any]] = {}

    def on_train_start(self, trainer, pl_module):
        self.states["after setup"] = _generator_states()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 1 and "after a step" not in self.states:
            self.states["after a step"] = _generator_states()

    def on_train_end(self, trainer, pl_module):
        self.states["after training"] = _generator_states()


def _record(strategy: Any) -> dict[str, dict[str, Any]]:
    pl.seed_everything(7, verbose=False)
    module = Classifier(optimizer="adamw")
    data = DataLoader(TensorDataset(torch.randn(24, 6, dtype=torch.float64), torch.randint(0, 3, (24,))),
                      batch_size=8)
    recorder = RecordStates()
    states = {"before fit": _generator_states()}
    _fit(_trainer(strategy, [recorder], epochs=1), module, data)
    return {**states, **recorder.states}


@pytest.mark.parametrize("preflight", ["refuse", "off"])
def test_setup_and_steps_leave_every_global_generator_as_the_default_strategy_does(preflight):
    """The pre-flight's optimizer timing (``preflight`` other than ``"off"``) used to fill its scratch
    parameters from torch's global generator."""
    reference = _record("auto")
    ours = _record(_roundpipe(preflight=preflight))
    assert list(ours) == list(reference) == ["before fit", "after setup", "after a step", "after training"]
    for when in reference:
        _assert_same_states(ours[when], reference[when], when)


def test_measuring_the_host_step_draws_from_no_global_generator():
    """The host-step figure itself (what the pre-flight runs), for an optimizer whose own step draws too."""
    from lightning_roundpipe.engine.step.kernels import measure_step

    class NoisySGD(torch.optim.SGD):
        def step(self, closure=None):
            for group in self.param_groups:
                for param in group["params"]:
                    if param.grad is not None:
                        param.grad.add_(torch.randn_like(param.grad), alpha=1e-3)
            return super().step(closure)

    params = [nn.Parameter(torch.zeros(64, 64))]
    for optimizer in (torch.optim.AdamW(params, lr=1e-3), NoisySGD(params, lr=0.1)):
        torch.manual_seed(3)
        before = torch.get_rng_state()
        figure = measure_step(optimizer, max_elements=4096)
        assert figure.seconds_per_param is not None, figure.problem
        assert torch.equal(torch.get_rng_state(), before), type(optimizer).__name__


class RandomData(pl.LightningDataModule):
    """The LightningCLI project's pattern: the dataset is drawn from torch's global generator in
    ``train_dataloader`` (after the strategy's setup), and the loader shuffles with it every epoch."""

    def train_dataloader(self):
        features = torch.randn(40, 6, dtype=torch.float64)
        labels = torch.randint(0, 3, (40,))
        return DataLoader(TensorDataset(features, labels), batch_size=8, shuffle=True)


class NoisyInputs(Callback):
    """A callback that draws from every global generator each epoch (an augmentation's settings, say)."""

    def __init__(self) -> None:
        self.draws: list[tuple[float, float, float]] = []

    def on_train_epoch_start(self, trainer, pl_module):
        self.draws.append((torch.rand(()).item(), random.random(), float(np.random.rand())))


def _data_module_fit(strategy: Any) -> tuple[Classifier, NoisyInputs]:
    pl.seed_everything(11, verbose=False)
    module = Classifier(optimizer="adamw")
    noise = NoisyInputs()
    _fit(_trainer(strategy, [noise], epochs=3), module, RandomData())
    return module, noise


def test_a_seeded_datamodule_with_a_shuffled_loader_trains_as_under_the_default_strategy():
    """The issue's LightningCLI project: 6.6e-2 off the default strategy while setup drew random numbers."""
    reference, reference_noise = _data_module_fit("auto")
    module, noise = _data_module_fit(_roundpipe())
    assert noise.draws == reference_noise.draws
    assert module.losses == pytest.approx(reference.losses, rel=1e-12, abs=1e-12)
    assert_states_float64_equal(module.net, reference.net)


def _cli_fit(strategy: Any) -> tuple[Classifier, NoisyInputs]:
    """The project as LightningCLI builds it from a configuration: the seed, the module, the DataModule, a
    callback given by class path, and the strategy by name or with its options."""
    pytest.importorskip("jsonargparse")
    from lightning.pytorch.cli import LightningCLI

    trainer = dict(strategy=strategy, accelerator="cpu", devices=1 if strategy == "auto" else 2, max_epochs=3,
                   precision="64-true", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, callbacks=[{"class_path": f"{__name__}.NoisyInputs"}])
    cli = LightningCLI(Classifier, RandomData, run=False, save_config_callback=None,
                       args={"seed_everything": 11, "model": {"optimizer": "adamw"}, "trainer": trainer})
    _fit(cli.trainer, cli.model, cli.datamodule)
    (noise,) = [callback for callback in cli.trainer.callbacks if isinstance(callback, NoisyInputs)]
    assert isinstance(cli.model, Classifier)
    return cli.model, noise


@pytest.mark.parametrize("strategy", [
    "roundpipe",
    {"class_path": "lightning_roundpipe.RoundPipeStrategy", "init_args": {"num_microbatches": 1, "num_stages": 2}},
], ids=["by-name", "class-path"])
def test_a_lightning_cli_project_trains_as_under_the_default_strategy(strategy):
    """The same project from LightningCLI (the pattern the issue measured 6.6e-2 off the default strategy),
    with the strategy chosen by name or configured through its signature, as a CLI user writes it."""
    reference, reference_noise = _cli_fit("auto")
    module, noise = _cli_fit(strategy)
    assert noise.draws == reference_noise.draws
    assert module.losses == pytest.approx(reference.losses, rel=1e-12, abs=1e-12)
    assert_states_float64_equal(module.net, reference.net)


# --------------------------------------------------------------------------- a step without a backward
class SmallCNN(pl.LightningModule):
    """Two convolutions with BatchNorm and a linear head; SGD with momentum and weight decay (a step with
    stale gradients moves every weight)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                                 nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                                 nn.Flatten(), nn.Linear(4 * 5 * 5, 3))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)


def _images() -> DataLoader:
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(24, 2, 5, 5, generator=generator, dtype=torch.float64)
    return DataLoader(TensorDataset(x, torch.randint(0, 3, (24,), generator=generator)), batch_size=8)


class EpochEnds(Callback):
    """Parameters and buffers at the end of every epoch."""

    def __init__(self) -> None:
        self.states: list[dict[str, torch.Tensor]] = []

    def on_train_epoch_end(self, trainer, pl_module):
        self.states.append({name: value.clone() for name, value in state(pl_module).items()})


def _swa_fit(strategy: Any) -> tuple[SmallCNN, EpochEnds]:
    module, ends = SmallCNN(), EpochEnds()
    swa = StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1)
    _fit(_trainer(strategy, [swa, ends], epochs=3), module, _images())
    return module, ends


def test_swa_with_batchnorm_is_bitwise_the_default_strategy_at_every_epochs_end():
    """SWA's last epoch only recomputes the BatchNorm statistics (``fit_loop._skip_backward``: no zero_grad,
    no backward), and Lightning still steps once at its end, with what ``param.grad`` kept from the last
    real step. The engine used to step nothing there (it had dropped those gradients)."""
    reference, reference_ends = _swa_fit("auto")
    module, ends = _swa_fit(_roundpipe())
    assert len(ends.states) == len(reference_ends.states) == 4  # three epochs and SWA's BatchNorm epoch
    for epoch, (ours, theirs) in enumerate(zip(ends.states, reference_ends.states, strict=True)):
        for name, value in theirs.items():
            assert torch.equal(ours[name], value), f"epoch {epoch}: {name} differs"
    assert_states_equal(module, reference)
    assert not torch.equal(reference_ends.states[-1]["net.0.weight"], reference_ends.states[-2]["net.0.weight"])


class SkipsSomeBatches(Classifier):
    """``training_step`` returns ``None`` on every third batch: Lightning zeroes the gradients, skips the
    backward and steps nothing."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return None if batch_idx % 3 == 2 else loss


class ManualSteps(pl.LightningModule):
    """Manual optimization stepping on every batch but running ``manual_backward`` on two of three: with
    ``clear`` the step after no backward follows ``zero_grad()`` (nothing to apply), without it the step
    applies the previous backward's gradients again, as plain PyTorch does."""

    def __init__(self, clear: bool) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.clear = clear
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        if batch_idx % 3 != 2:
            optimizer.zero_grad()
            self.manual_backward(loss)
        elif self.clear:
            optimizer.zero_grad()
        optimizer.step()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)


def _plain_data() -> DataLoader:
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(48, 6, generator=generator, dtype=torch.float64)
    return DataLoader(TensorDataset(x, torch.randint(0, 3, (48,), generator=generator)), batch_size=8)


@pytest.mark.parametrize("make", [lambda: SkipsSomeBatches("adamw"), lambda: ManualSteps(clear=True),
                                  lambda: ManualSteps(clear=False)],
                         ids=["training_step-returns-None", "manual-after-zero_grad", "manual-stale-gradients"])
def test_a_step_after_no_backward_changes_what_the_default_strategy_changes(make):
    reference, module = make(), make()
    _fit(_trainer("auto", [], epochs=1), reference, _plain_data())
    _fit(_trainer(_roundpipe(), [], epochs=1), module, _plain_data())
    assert_states_equal(module.net, reference.net)


# ------------------------------------------------------------------- float32, one microbatch: bitwise
class DemoTransformerTrunk(pl.LightningModule):
    """Lightning's demo Transformer (``lightning.pytorch.demos.Transformer``, without dropout) as an
    ``nn.Sequential`` trunk: its embedding, its encoder layers and its decoder."""

    VOCAB = 33

    def __init__(self, optimizer: str) -> None:
        super().__init__()
        from lightning.pytorch.demos import Transformer

        torch.manual_seed(0)
        demo = Transformer(vocab_size=self.VOCAB, ninp=32, nhead=2, nhid=64, nlayers=2, dropout=0.0)
        self.net = nn.Sequential(demo.embedding, *demo.transformer.encoder.layers, demo.decoder)
        self.optimizer = optimizer

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.nll_loss(F.log_softmax(self.net(x), -1).flatten(0, 1), y.flatten())

    def configure_optimizers(self):
        if self.optimizer == "sgd":  # the demo's optimizer (torch's fused kernel under host_optimizer="exact")
            return torch.optim.SGD(self.parameters(), lr=0.1)
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_the_demo_transformer_in_float32_with_one_microbatch_is_bitwise_the_default_strategy(optimizer):
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, DemoTransformerTrunk.VOCAB, (32, 10), generator=generator)
    data = DataLoader(TensorDataset(ids, ids.roll(-1, 1)), batch_size=8)
    results = []
    for strategy in ("auto", _roundpipe()):
        module = DemoTransformerTrunk(optimizer)
        trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1 if strategy == "auto" else 2,
                             max_steps=4, precision="32-true", logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False)
        _fit(trainer, module, data)
        results.append(module)
    assert results[1].net[1].self_attn.in_proj_weight.dtype == torch.float32
    assert_states_equal(results[1].net, results[0].net)


def test_lightnings_demo_transformer_in_float32_with_one_microbatch_is_bitwise_the_default_strategy():
    """``LightningTransformer`` unchanged (the traced path; dropout off, as it draws from other generators here).
    A forward-only stage used to bind parameter copies that did not require grad, and nn.MultiheadAttention
    then computed its attention by another algorithm than plain training's (the recompute's): the loss, and
    so every gradient, was off by ulps (2.4e-7 in the weights after one step)."""
    from lightning.pytorch.demos.transformer import LightningTransformer

    def make() -> LightningTransformer:
        torch.manual_seed(0)
        module = LightningTransformer(vocab_size=31)
        module.prepare_data = lambda: None  # WikiText2 downloads: the data below needs no download
        return without_dropout(module)

    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 31, (16, 9), generator=generator)
    data = DataLoader(TensorDataset(ids[:, :-1], ids[:, 1:]), batch_size=4)
    results = []
    for strategy in ("auto", _roundpipe()):
        module = make()
        trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1 if strategy == "auto" else 2,
                             max_steps=4, precision="32-true", logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", r".*assigns `src_mask`.*")
            _fit(trainer, module, data)
        results.append(module)
    assert results[1].model.decoder.weight.dtype == torch.float32
    assert_states_equal(results[1].model, results[0].model)
