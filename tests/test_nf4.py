"""A 4-bit (NF4) frozen base (issue 27 item 3): ``lightning_roundpipe.nf4``.

The references: bitsandbytes' own dequantiser for the values NF4 bytes stand for (and, where its CPU kernel does
not apply, NF4's definition computed element by element); ``F.linear`` on the dequantised weight for a layer's
output; Lightning's default strategy on the same module (float32, one microbatch: RoundPipe's sync step is then
bitwise plain training) for training, the disk tier and resuming.
"""

from __future__ import annotations

import pathlib

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lightning_roundpipe  # noqa: F401 - registers the strategy names (editable installs have no .pth hook)
from lightning_roundpipe.nf4 import BLOCK, NF4_LEVELS, NF4Linear, from_nf4, to_nf4
from tests.models import fit_three_class, one_microbatch_strategy
from tests.numerics import assert_same_run

bnb_functional = pytest.importorskip("bitsandbytes.functional")

WIDTH = 64


def _definition(packed: torch.Tensor, absmax: torch.Tensor, numel: int) -> torch.Tensor:
    """NF4's definition element by element: the high half of byte ``i // 2`` for even ``i``, the low half for odd,
    names a level; times the absmax of block ``i // 64``."""
    codes, scales = packed.tolist(), absmax.tolist()
    values = [NF4_LEVELS[(codes[i // 2] >> 4) if i % 2 == 0 else (codes[i // 2] & 15)] * scales[i // BLOCK]
              for i in range(numel)]
    return torch.tensor(values, dtype=torch.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(64, 64), (96, 128), (30, 7), (64, 96)])
def test_the_weight_is_what_bitsandbytes_dequantises(shape, dtype):
    torch.manual_seed(0)
    linear = nn.Linear(shape[1], shape[0], dtype=dtype).requires_grad_(False)
    layer = NF4Linear.from_linear(linear)
    packed, state = bnb_functional.quantize_4bit(linear.weight, blocksize=BLOCK, quant_type="nf4")
    assert torch.equal(layer.weight_nf4, packed.view(-1)) and torch.equal(layer.weight_absmax, state.absmax)
    assert layer.weight_nf4.numel() == -(-linear.weight.numel() // 2)  # half a byte a weight
    # bitsandbytes' CPU kernel (0.50) reads the blocks row by row where a row is not a multiple of 64 (what its own
    # quantiser does not do); there NF4's definition is the reference
    if shape[1] % BLOCK == 0:
        expected = bnb_functional.dequantize_4bit(packed, state).float()
        assert torch.equal(layer.dequantized_weight(dtype), expected.to(dtype))
        expected32 = bnb_functional.dequantize_4bit(packed, bnb_functional.QuantState(
            absmax=state.absmax, shape=state.shape, code=state.code, blocksize=BLOCK, quant_type="nf4",
            dtype=torch.float32))
        assert torch.equal(layer.dequantized_weight(), expected32)
    definition = _definition(packed.view(-1), state.absmax, linear.weight.numel()).view(shape)
    assert torch.equal(layer.dequantized_weight().double(), definition.float().double())


def test_the_weight_is_within_half_a_level_gap_of_the_dense_one():
    torch.manual_seed(0)
    linear = nn.Linear(256, 96).requires_grad_(False)
    layer = NF4Linear.from_linear(linear)
    scale = layer.weight_absmax.repeat_interleave(BLOCK)[:linear.weight.numel()].view_as(linear.weight)
    widest = torch.tensor(NF4_LEVELS).diff().max()
    error = (layer.dequantized_weight() - linear.weight).abs()
    assert (error <= scale * widest / 2 * (1 + 1e-6)).all()
    assert error.max() > 0  # really quantised


def test_the_layer_computes_what_a_linear_on_the_dequantised_weight_computes():
    torch.manual_seed(0)
    linear = nn.Linear(128, 64).requires_grad_(False)
    linear.bias.requires_grad_(True)
    layer = NF4Linear.from_linear(linear)
    dense = nn.Linear(128, 64)
    with torch.no_grad():
        dense.weight.copy_(layer.dequantized_weight())
        dense.bias.copy_(linear.bias)
    x = torch.randn(5, 128)
    assert torch.equal(layer(x), dense(x))
    assert torch.equal(layer.double()(x.double()), dense.double()(x.double()))  # float64: exact widening
    layer.float(), dense.float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, expected = layer(x), dense(x)
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)
    # the input and bias get gradients; the 4-bit weight is frozen
    x.requires_grad_(True)
    layer(x).square().sum().backward()
    assert x.grad is not None and layer.bias.grad is not None
    assert not layer.weight_nf4.requires_grad and not layer.weight_absmax.requires_grad


def test_to_nf4_swaps_the_frozen_untied_linears_and_from_nf4_gives_dense_ones_back():
    torch.manual_seed(0)
    embedding = nn.Embedding(10, 64)
    model = nn.ModuleDict({"embed": embedding, "frozen": nn.Linear(64, 64), "trained": nn.Linear(64, 64),
                           "lm_head": nn.Linear(64, 64), "tied": nn.Linear(64, 10, bias=False)})
    model["tied"].weight = embedding.weight
    for name in ("frozen", "lm_head", "tied", "embed"):
        model[name].requires_grad_(False)
    dense_frozen = model["frozen"].weight.detach().clone()
    assert to_nf4(model) == 1
    assert type(model["frozen"]) is NF4Linear
    assert [type(model[name]) for name in ("trained", "lm_head", "tied")] == [nn.Linear] * 3
    assert model["tied"].weight is embedding.weight
    quantised = model["frozen"].dequantized_weight()
    assert from_nf4(model, torch.bfloat16) == 1
    restored = model["frozen"]
    assert type(restored) is nn.Linear and restored.weight.dtype == torch.bfloat16
    assert not restored.weight.requires_grad
    assert torch.equal(restored.weight, quantised.bfloat16())
    assert not torch.equal(quantised, dense_frozen)


def test_on_the_meta_device_to_nf4_shapes_the_layer_for_materializing():
    """(Its values come from ``weights_from`` or a checkpoint as RoundPipe materializes it: test_pretrained.py.)"""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(96, 64)).requires_grad_(False)
    assert to_nf4(model) == 1
    layer = model[0]
    assert layer.weight_nf4.is_meta and layer.weight_nf4.shape == (96 * 64 // 2,)
    assert layer.weight_absmax.shape == (96 * 64 // BLOCK,) and layer.weight_absmax.dtype == torch.float32


def test_a_dense_state_dict_loads_quantised():
    torch.manual_seed(0)
    dense = nn.Sequential(nn.Linear(64, 64), nn.Tanh()).requires_grad_(False)
    quantised = nn.Sequential(nn.Linear(64, 64), nn.Tanh()).requires_grad_(False)
    to_nf4(quantised)
    quantised.load_state_dict(dense.state_dict())
    expected = NF4Linear.from_linear(dense[0])
    assert torch.equal(quantised[0].weight_nf4, expected.weight_nf4)
    assert torch.equal(quantised[0].weight_absmax, expected.weight_absmax)
    assert torch.equal(quantised[0].bias, dense[0].bias)
    assert set(quantised.state_dict()) == {"0.weight_nf4", "0.weight_absmax", "0.bias"}
    with pytest.raises(ValueError, match=r"0.weight has shape \(64, 32\); NF4Linear\(64, 64\) expects \(64, 64\)"):
        quantised.load_state_dict({"0.weight": torch.zeros(64, 32), "0.bias": torch.zeros(64)})


class Adapted(nn.Module):
    """A frozen base Linear plus a trainable low-rank update, as LoRA adds it."""

    def __init__(self, width: int, rank: int = 4) -> None:
        super().__init__()
        self.base = nn.Linear(width, width).requires_grad_(False)
        self.down, self.up = nn.Linear(width, rank, bias=False), nn.Linear(rank, width, bias=False)
        nn.init.normal_(self.up.weight, std=0.05)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.up(self.down(x))


class QLoRANet(pl.LightningModule):
    """Three adapted 64-wide layers whose bases are NF4 and a trainable 3-class head; AdamW with a step schedule."""

    def __init__(self, quantised: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(Adapted(WIDTH), nn.Tanh(), Adapted(WIDTH), nn.Tanh(), Adapted(WIDTH), nn.Tanh(),
                                 nn.Linear(WIDTH, 3))
        if quantised:
            assert to_nf4(self) == 3
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _fit(module: QLoRANet, strategy, root: pathlib.Path, epochs: int = 2, ckpt_path=None,
         checkpointing: bool = False, precision: str = "32-true") -> pl.Trainer:
    return fit_three_class(module, strategy, root, WIDTH, epochs=epochs, ckpt_path=ckpt_path,
                           checkpointing=checkpointing, precision=precision)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_qlora_trains_bitwise_as_plain_lightning_with_the_base_uploaded_in_four_bits(tmp_path, precision):
    module, reference = QLoRANet(), QLoRANet()
    initial = {name: value.clone() for name, value in module.state_dict().items() if "base" in name}
    strategy = one_microbatch_strategy()
    trainer = _fit(module, strategy, tmp_path, precision=precision)
    reference_trainer = _fit(reference, "auto", tmp_path, precision=precision)
    assert_same_run(module, reference, trainer, reference_trainer)
    for name, value in module.state_dict().items():
        if "base.weight" in name:
            assert torch.equal(value, initial[name]), f"frozen {name} changed"
            assert value.dtype == (torch.uint8 if name.endswith("nf4") else torch.float32)
    # the plan counts the bases as stored, half a byte a weight and a float32 scale per 64, and as weights
    # the devices upload each base as its NF4 bytes, scales, levels table and float32 bias instead of its dense
    # weight and bias (float32, or bf16 under bf16-mixed: a stock Linear's travel in autocast's dtype): the same
    # whole number of uploads of each of the three, in fewer bytes
    dense = one_microbatch_strategy()
    dense_trainer = _fit(QLoRANet(quantised=False), dense, tmp_path, precision=precision)
    uploads = (float(dense_trainer.callback_metrics["roundpipe/uploaded_bytes"])
               - float(trainer.callback_metrics["roundpipe/uploaded_bytes"]))
    dense_bytes = (WIDTH * WIDTH + WIDTH) * (4 if precision == "32-true" else 2)
    nf4_bytes = WIDTH * WIDTH // 2 + 4 * WIDTH * WIDTH // BLOCK + 256 * 2 * 4 + 4 * WIDTH
    per_base = uploads / 3 / (dense_bytes - nf4_bytes)
    assert per_base >= 2 and per_base == int(per_base), per_base  # at least a forward and a backward stage
    plan, weights = strategy.memory_plan, 3 * WIDTH * WIDTH
    assert plan.parameter_bytes_by_dtype["nf4"] == weights // 2 + 4 * weights // BLOCK
    assert plan.parameter_count == sum(p.numel() for p in QLoRANet(quantised=False).parameters())
    assert "nf4 6.8 KiB (frozen 4-bit weights" in plan.table()


@pytest.mark.parametrize("offload,precision", [("optimizer", "32-true"), ("optimizer+masters", "bf16-mixed")])
def test_the_disk_tier_takes_a_qlora_run_unchanged(tmp_path, offload, precision):
    module, reference = QLoRANet(), QLoRANet()
    strategy = one_microbatch_strategy(offload=offload, offload_dir=tmp_path / "state")
    trainer = _fit(module, strategy, tmp_path, precision=precision)
    reference_trainer = _fit(reference, "auto", tmp_path, precision=precision)
    assert_same_run(module, reference, trainer, reference_trainer)


def test_a_qlora_checkpoint_resumes_with_or_without_the_strategy_and_keeps_the_base_in_four_bits(tmp_path):
    first = QLoRANet()
    _fit(first, one_microbatch_strategy(), tmp_path, epochs=1, checkpointing=True)
    checkpoint = next((tmp_path / "checkpoints").glob("*.ckpt"))
    saved = torch.load(checkpoint, weights_only=True)["state_dict"]
    assert saved["net.0.base.weight_nf4"].dtype == torch.uint8 and "net.0.base.weight" not in saved

    uninterrupted = QLoRANet()
    reference_trainer = _fit(uninterrupted, "auto", tmp_path)
    for strategy in (one_microbatch_strategy(), "auto"):
        resumed = QLoRANet()
        trainer = _fit(resumed, strategy, tmp_path, ckpt_path=checkpoint)
        assert len(resumed.losses) == len(uninterrupted.losses) // 2  # the second epoch
        assert_same_run(resumed, uninterrupted, trainer, reference_trainer)
