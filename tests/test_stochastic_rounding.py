"""bf16 master weights with stochastic rounding (``stochastic_rounding=True``, issue 27 item 2).

The references: the two bfloat16 neighbours of a float32 value and its distance between them, from float64
arithmetic, for the rounding itself (its values and its mean over many draws); float32 SGD for what small updates
add up to; a plain-PyTorch run (float32 copies of bfloat16 parameters, torch's optimizer, the rounding rule
written from its definition: round the magnitude up when the 16 random bits plus the dropped 16 bits carry) for
training bitwise; the uninterrupted run for a resume.
"""

from __future__ import annotations

import pathlib

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lightning_roundpipe  # noqa: F401 - registers the strategy names (editable installs have no .pth hook)
from lightning_roundpipe import RoundPipeStrategy
from lightning_roundpipe.engine.options import OptionError
from lightning_roundpipe.engine.recompute import mixed_seed
from lightning_roundpipe.engine.step.rounding import stochastic_round
from tests.models import three_class_data
from tests.numerics import assert_states_equal

WIDTH = 64
SEED = 1234


def _neighbours(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bfloat16 values just below and above each float32 value (both the value itself when bf16 holds it), in
    float64."""
    exact = values.double()
    nearest = values.to(torch.bfloat16)
    other = torch.nextafter(nearest, torch.where(exact > nearest.double(), torch.inf, -torch.inf).to(torch.bfloat16))
    other = torch.where(nearest.double() == exact, nearest, other)
    low = torch.minimum(nearest.double(), other.double())
    high = torch.maximum(nearest.double(), other.double())
    return low, high


def test_each_rounding_is_a_neighbour_and_their_mean_is_the_float32_value():
    generator = torch.Generator().manual_seed(0)
    magnitudes = torch.tensor([1e-30, 1e-3, 0.7, 1.0, 3.0, 1e20])
    values = (torch.randn(6, 40, generator=generator) * magnitudes[:, None]).flatten()
    low, high = _neighbours(values)
    draws = 4000
    total = torch.zeros_like(values, dtype=torch.float64)
    for draw in range(draws):
        rounded = stochastic_round(values, torch.Generator().manual_seed(draw)).double()
        assert ((rounded == low) | (rounded == high)).all()
        total += rounded
    mean = total / draws
    # a draw is `high` with probability p = (x - low) / (high - low): the mean's standard deviation is
    # sqrt(p (1 - p) / draws) gaps; 6 of them bound it on every element (p-values ~1e-9 each)
    gap = high - low
    p = torch.where(gap > 0, (values.double() - low) / gap, torch.zeros_like(gap))
    bound = 6 * (p * (1 - p) / draws).sqrt() * gap + 1e-300
    assert ((mean - values.double()).abs() <= bound).all()
    # round to nearest is biased by up to half a gap; the stochastic mean is far closer on these values
    assert (mean - values.double()).abs().mean() < 0.05 * (values.to(torch.bfloat16).double()
                                                              - values.double()).abs().mean()


def test_values_bf16_holds_and_special_values_are_kept():
    values = torch.tensor([0.0, -0.0, 1.0, -2.5, float("inf"), float("-inf"), float("nan"),
                           torch.finfo(torch.bfloat16).max])
    for draw in range(50):
        rounded = stochastic_round(values, torch.Generator().manual_seed(draw))
        assert torch.equal(rounded[:6], values[:6].bfloat16()) and rounded[6].isnan()
        assert torch.signbit(rounded[1]) and rounded[7] == values[7]


class Drift(pl.LightningModule):
    """``WIDTH * WIDTH`` weights at 1.0, inputs of ones and the loss the outputs' sum (averaged over the batch):
    every weight's gradient is one; plain SGD at ``lr`` takes them to ``1 - steps * lr`` in float32."""

    def __init__(self, lr: float) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(WIDTH, WIDTH, bias=False))
        nn.init.ones_(self.net[0].weight)
        self.lr = lr

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.net(x).float().sum(dim=1).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def _strategy(**kwargs) -> RoundPipeStrategy:
    options = {"ring": [0, 0], "num_microbatches": 1, "num_stages": 1, "round_size": "whole", "freeze_plan": True,
               "seed": SEED, **kwargs}
    return RoundPipeStrategy(**options)


def _trainer(strategy, root: pathlib.Path, steps: int | None = None, epochs: int = 2, checkpointing: bool = False,
             precision: str = "bf16-true") -> pl.Trainer:
    return pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_epochs=epochs, max_steps=steps or -1,
                      logger=False, precision=precision, enable_checkpointing=checkpointing,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=root)


def test_updates_under_half_a_bf16_step_add_up_as_in_float32_and_vanish_when_rounded_to_nearest(tmp_path):
    steps, lr = 40, 1e-3  # each update is an eighth of 1.0's gap to the next bfloat16 value below (2**-8)
    runs = {}
    for rounding in (True, False):
        module = Drift(lr)
        ones = torch.utils.data.TensorDataset(torch.ones(8 * steps, WIDTH))
        _trainer(_strategy(stochastic_rounding=rounding), tmp_path, steps=steps).fit(
            module, torch.utils.data.DataLoader(ones, batch_size=8))
        assert module.net[0].weight.dtype == torch.bfloat16
        runs[rounding] = module.net[0].weight.double()
    assert torch.equal(runs[False], torch.ones_like(runs[False]))  # rounded to nearest: not one update survives
    expected = 1 - steps * lr
    # each step's rounding adds at most a quarter gap squared of variance to a weight (a gap of 2**-8 below 1.0):
    # the mean of 4096 weights lies within 6 standard deviations of the float32 value
    bound = 6 * (steps * (2**-8) ** 2 / 4 / runs[True].numel()) ** 0.5
    assert abs(runs[True].mean().item() - expected) <= bound
    assert runs[True].std() > 0  # rounded independently


class Net(pl.LightningModule):
    """Three 64-wide layers and a 3-class head, in bf16 (bf16-true), AdamW with a step schedule; ``eight_bit``:
    bitsandbytes' AdamW8bit."""

    def __init__(self, eight_bit: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(),
                                 nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 3))
        self.eight_bit = eight_bit
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x.to(self.net[0].weight.dtype)).float(), y)
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self):
        if self.eight_bit:
            import bitsandbytes

            optimizer = bitsandbytes.optim.AdamW8bit(self.parameters(), lr=1e-2)
        else:
            optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _round_by_definition(values: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """The rounding from its definition: the magnitude's dropped 16 bits plus 16 random bits carry into the kept
    ones, or not."""
    noise = torch.randint(0, 1 << 16, values.shape, dtype=torch.int32, generator=generator).long()
    bits = values.view(torch.int32).long() & 0xFFFFFFFF
    dropped = bits & 0xFFFF
    kept = bits - dropped + torch.where(dropped + noise >= 1 << 16, 1 << 16, 0)
    kept = torch.where(kept >= 1 << 31, kept - (1 << 32), kept).int()
    return kept.view(torch.float32).bfloat16()


def _plain_pytorch_run(epochs: int) -> tuple[nn.Module, list[torch.Tensor], dict]:
    """bf16 weights; float32 copies stepped by torch's AdamW (float32 state) with the same schedule; each step's
    result rounded by the definition with the seed (SEED, step, position); gradients from the bf16 forward and
    backward of one batch, as Lightning's bf16-true computes them."""
    model = Net().net.bfloat16()
    params = list(model.parameters())
    masters = [nn.Parameter(param.detach().float()) for param in params]
    optimizer = torch.optim.AdamW(masters, lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    losses, step = [], 0
    for _ in range(epochs):
        for x, y in three_class_data(WIDTH):
            loss = F.cross_entropy(model(x.bfloat16()).float(), y)
            losses.append(loss.detach().clone())
            grads = torch.autograd.grad(loss, params)
            step += 1
            for master, grad in zip(masters, grads, strict=True):
                master.grad = grad.float()
            optimizer.step()
            scheduler.step()
            with torch.no_grad():
                for position, (param, master) in enumerate(zip(params, masters, strict=True)):
                    generator = torch.Generator().manual_seed(mixed_seed(SEED, step, position))
                    param.copy_(_round_by_definition(master.detach(), generator))
                    master.copy_(param.float())  # the next step starts from the rounded weight
    return model, losses, optimizer.state_dict()["state"]


def _fit(module: Net, strategy, root: pathlib.Path, epochs: int = 2, ckpt_path=None,
         checkpointing: bool = False, precision: str = "bf16-true") -> pl.Trainer:
    trainer = _trainer(strategy, root, epochs=epochs, checkpointing=checkpointing, precision=precision)
    trainer.fit(module, three_class_data(WIDTH), ckpt_path=ckpt_path)
    return trainer


def test_training_is_the_float32_step_rounded_stochastically_bitwise(tmp_path):
    module = Net()
    strategy = _strategy(stochastic_rounding=True)
    trainer = _fit(module, strategy, tmp_path)
    model, losses, state = _plain_pytorch_run(epochs=2)
    made = sum(value.nbytes for entry in trainer.optimizers[0].state.values() for value in entry.values())
    assert strategy.memory_plan.optimizer_state_bytes == made  # the pre-flight counted float32 moments
    assert "in float32 for the bf16 weights (stochastic_rounding)" in strategy.memory_plan.table()
    assert len(module.losses) == len(losses)
    assert all(torch.equal(a, b) for a, b in zip(module.losses, losses, strict=True))
    assert_states_equal(dict(module.net.named_parameters()), dict(model.named_parameters()))
    ours = trainer.optimizers[0].state_dict()["state"]
    assert ours.keys() == state.keys()
    for key, entry in ours.items():
        assert entry["exp_avg"].dtype == torch.float32  # the moments of a bf16 weight in float32
        assert_states_equal(entry, state[key])


@pytest.mark.parametrize("tier", ["none", "optimizer"])
def test_a_resume_and_the_disk_tier_give_the_uninterrupted_run(tmp_path, tier):
    disk = {"offload": tier, "offload_dir": tmp_path / "state"} if tier != "none" else {}
    uninterrupted = Net()
    reference_trainer = _fit(uninterrupted, _strategy(stochastic_rounding=True), tmp_path)
    first = Net()
    _fit(first, _strategy(stochastic_rounding=True, **disk), tmp_path / "first", epochs=1, checkpointing=True)
    checkpoint = next((tmp_path / "first" / "checkpoints").glob("*.ckpt"))
    resumed = Net()
    trainer = _fit(resumed, _strategy(stochastic_rounding=True, **disk), tmp_path / "second", ckpt_path=checkpoint)
    assert len(resumed.losses) == len(uninterrupted.losses) // 2
    later = uninterrupted.losses[len(resumed.losses):]
    assert all(torch.equal(a, b) for a, b in zip(resumed.losses, later, strict=True))
    assert_states_equal(resumed, uninterrupted)
    reference_state = reference_trainer.optimizers[0].state_dict()["state"]
    for key, entry in trainer.optimizers[0].state_dict()["state"].items():
        assert_states_equal(entry, reference_state[key])


def test_eight_bit_state_with_bf16_weights_trains_and_keeps_its_bytes(tmp_path):
    bnb = pytest.importorskip("bitsandbytes")
    module = Net(eight_bit=True)
    trainer = _fit(module, _strategy(stochastic_rounding=True), tmp_path)
    assert isinstance(trainer.optimizers[0], bnb.optim.AdamW8bit)
    state = trainer.optimizers[0].state
    assert state[module.net[0].weight]["state1"].dtype == torch.uint8  # 4096 elements: 8-bit moments
    assert {param.dtype for param in module.parameters()} == {torch.bfloat16}
    assert all(torch.isfinite(loss) for loss in module.losses) and module.losses[-1] < module.losses[0]


def test_a_model_without_bf16_parameters_is_refused(tmp_path):
    with pytest.raises(OptionError, match="none of AdamW's parameters is bfloat16: train with precision='bf16-true'"):
        _fit(Net(), _strategy(stochastic_rounding=True), tmp_path, epochs=1, precision="32-true")
