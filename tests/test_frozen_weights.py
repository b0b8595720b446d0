"""Frozen weights at their compute width (``frozen_weights``, issue 26 item 3).

The references: Lightning's default strategy under ``bf16-mixed`` with one microbatch (there RoundPipe's sync step
is bitwise plain training: ``test_transport.py``), and RoundPipe's own run with ``frozen_weights="as_stored"``
(today's behaviour) where microbatches or the async step make plain training another computation. Weights, losses
and the optimizer state must be bitwise equal; state dicts must give float32 back, a checkpoint must resume into
either setting, and code that changes a frozen weight mid-run (unfreezing it, loading values bfloat16 does not
hold, calling the model outside autocast) must see what plain training gives.
"""

from __future__ import annotations

import pathlib

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

import lightning_roundpipe  # noqa: F401 - registers the strategy names (editable installs have no .pth hook)
from lightning_roundpipe import RoundPipeStrategy, pipeline_loss, preflight
from lightning_roundpipe.engine.frozen_weights import holds_exactly, registered_outside, select_frozen
from lightning_roundpipe.engine.layers import Trunk
from lightning_roundpipe.hostmem import HostLimits, format_bytes
from lightning_roundpipe.preflight import HostMemoryError
from tests.models import adamw_with_step_lr, three_class_data
from tests.numerics import assert_same_optimizer_state, assert_states_equal

WIDTH = 32
BLOCKS = 4


class Adapted(nn.Module):
    """A frozen Linear base and a trainable rank-4 update beside it (LoRA's shape; B starts nonzero so the
    adapters' gradients differ from step one)."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(WIDTH, WIDTH)
        self.down = nn.Linear(WIDTH, 4, bias=False)
        self.up = nn.Linear(4, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.base(x) + self.up(self.down(x)))


class LoRA(pl.LightningModule):
    """Four adapted blocks and a trained head; AdamW over ``self.parameters()`` (the frozen base included, as
    LoRA code often writes it) with a per-step StepLR. ``bf16_base``: the base holds bfloat16 values in float32
    (a bf16 checkpoint loaded into a float32 model)."""

    def __init__(self, fused: bool = False, bf16_base: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(*(Adapted() for _ in range(BLOCKS)), nn.Linear(WIDTH, 3))
        for block in self.net[:BLOCKS]:
            if bf16_base:
                with torch.no_grad():
                    for param in block.base.parameters():
                        param.copy_(param.bfloat16().float())
            block.base.requires_grad_(False)
        self.fused = fused
        self.losses: list[torch.Tensor] = []
        self.base_dtypes: set[torch.dtype] = set()  # what the training step's code sees

    def training_step(self, batch, batch_idx):
        self.base_dtypes.add(self.net[0].base.weight.dtype)
        x, y = batch
        loss = pipeline_loss(self.net, x, y, F.cross_entropy) if self.fused else F.cross_entropy(self.net(x), y)
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self):
        return adamw_with_step_lr(self.parameters())


def _data(samples: int = 24) -> DataLoader:
    return three_class_data(WIDTH, samples)


def _strategy(frozen_weights: str = "auto", **kwargs) -> RoundPipeStrategy:
    options = {"ring": [0, 0], "num_microbatches": 1, "num_stages": 3, "round_size": "whole", "freeze_plan": True,
               "jitter": 0.0005, "frozen_weights": frozen_weights, **kwargs}
    return RoundPipeStrategy(**options)


def _fit(module: pl.LightningModule, strategy, root: pathlib.Path, epochs: int = 2, callbacks=(), ckpt_path=None,
         checkpointing: bool = False) -> pl.Trainer:
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_epochs=epochs, precision="bf16-mixed",
                         logger=False, enable_checkpointing=checkpointing, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=root, callbacks=list(callbacks))
    trainer.fit(module, _data(), ckpt_path=ckpt_path)
    return trainer


def _base_params(module: LoRA) -> list[nn.Parameter]:
    return [param for block in module.net[:BLOCKS] for param in block.base.parameters()]


def _assert_same_run(ours: LoRA, reference: LoRA, ours_trainer: pl.Trainer, reference_trainer: pl.Trainer) -> None:
    assert len(ours.losses) == len(reference.losses)
    assert all(torch.equal(a, b) for a, b in zip(ours.losses, reference.losses, strict=True))
    assert_states_equal(ours, reference)
    assert_same_optimizer_state(ours_trainer, reference_trainer)


# ------------------------------------------------------------------------------------------------ exactness
def test_a_bf16_base_is_kept_in_bf16_alone_and_trains_bitwise_as_plain_lightning(tmp_path):
    module, reference = LoRA(), LoRA()
    params_before = [id(param) for param in module.parameters()]
    copies_seen: list[int] = []

    class ReadCopies(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            copies_seen.append(trainer.strategy.engine._ring.sources.nbytes())

    trainer = _fit(module, _strategy(), tmp_path, callbacks=[ReadCopies()])
    reference_trainer = _fit(reference, "auto", tmp_path)
    _assert_same_run(module, reference, trainer, reference_trainer)
    # during the run the base was its own bf16 upload copy: the host kept bf16 copies of the trained Linear
    # weights only (2 bytes each), none of the base's
    trained_linear = sum(param.numel() for layer in module.net for sub in layer.modules() if type(sub) is nn.Linear
                         for param in sub.parameters() if param.requires_grad)
    assert module.base_dtypes == {torch.bfloat16}
    assert set(copies_seen) == {2 * trained_linear}
    # and the module is given back as it came: float32, the same parameter objects, no hook left behind
    assert {param.dtype for param in module.parameters()} == {torch.float32}
    assert [id(param) for param in module.parameters()] == params_before
    assert all(not block.base._state_dict_hooks and not block.base._load_state_dict_pre_hooks
               for block in module.net[:BLOCKS])


@pytest.mark.parametrize("fused", [False, True], ids=["transparent", "fused"])
@pytest.mark.parametrize("async_step", [False, True], ids=["sync", "async"])
def test_kept_at_compute_width_equals_kept_as_stored(tmp_path, fused, async_step):
    runs = {}
    for setting in ("auto", "as_stored"):
        module = LoRA(fused)
        trainer = _fit(module, _strategy(setting, num_microbatches=2, async_step=async_step), tmp_path)
        runs[setting] = module, trainer
    assert runs["auto"][0].base_dtypes == {torch.bfloat16} and runs["as_stored"][0].base_dtypes == {torch.float32}
    _assert_same_run(*runs["auto"][:1], *runs["as_stored"][:1], runs["auto"][1], runs["as_stored"][1])


def test_host_kernels_fused_still_steps_fused_beside_a_bf16_base(tmp_path):
    """The fused CPU kernel takes float32 parameters only; the frozen bf16 base sits in the same param group but is
    never stepped, so the group keeps the fused kernel: the same results as with the base as stored."""
    runs = [(module := LoRA(), _fit(module, _strategy(setting, host_optimizer="fused"), tmp_path))
            for setting in ("auto", "as_stored")]
    _assert_same_run(runs[0][0], runs[1][0], runs[0][1], runs[1][1])


# ------------------------------------------------------------------------------------------------ state dicts
def test_state_dicts_and_checkpoints_give_float32_and_resume_into_either_setting(tmp_path):
    seen: dict[str, object] = {}

    class ReadStateDict(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            state = pl_module.state_dict()
            seen["dtype"] = state["net.0.base.weight"].dtype
            seen["equal"] = torch.equal(state["net.0.base.weight"], pl_module.net[0].base.weight.float())
            seen["kept"] = pl_module.state_dict(keep_vars=True)["net.0.base.weight"] is pl_module.net[0].base.weight

    first = LoRA()
    _fit(first, _strategy(), tmp_path, epochs=1, callbacks=[ReadStateDict()], checkpointing=True)
    assert seen == {"dtype": torch.float32, "equal": True, "kept": True}
    checkpoint = next((tmp_path / "checkpoints").glob("*.ckpt"))
    saved = torch.load(checkpoint, weights_only=True)["state_dict"]
    once = LoRA()
    _fit(once, "auto", tmp_path, epochs=1)
    assert {value.dtype for value in saved.values()} == {torch.float32}
    assert_states_equal(saved, once.state_dict())

    uninterrupted = LoRA()
    reference_trainer = _fit(uninterrupted, "auto", tmp_path)
    for setting in ("auto", "as_stored"):
        resumed = LoRA()
        trainer = _fit(resumed, _strategy(setting), tmp_path, ckpt_path=checkpoint)
        assert_states_equal(resumed, uninterrupted)
        assert_same_optimizer_state(trainer, reference_trainer)


# ------------------------------------------------------------------------------------------------ not bf16 values
def test_values_bf16_does_not_hold_stay_as_stored_unless_round_is_asked(tmp_path):
    kept = LoRA(bf16_base=False)
    strategy = _strategy("auto")
    _fit(kept, strategy, tmp_path)
    assert kept.base_dtypes == {torch.float32}
    plan = strategy.memory_plan
    assert plan.frozen_kept == 2 * BLOCKS and plan.frozen_narrowed == 0 and plan.frozen_freed_bytes == 0
    assert "frozen_weights='round'" in plan.table()

    rounded, as_stored = LoRA(bf16_base=False), LoRA(bf16_base=False)
    initial = [param.detach().clone() for param in _base_params(rounded)]
    _fit(rounded, _strategy("round"), tmp_path)
    _fit(as_stored, _strategy("as_stored"), tmp_path)
    assert rounded.base_dtypes == {torch.bfloat16}
    # autocast computed with the rounded base in both runs: every trained weight is bitwise the same
    assert all(torch.equal(a, b) for a, b in zip(rounded.losses, as_stored.losses, strict=True))
    for (name, ours), theirs in zip(rounded.named_parameters(), as_stored.parameters(), strict=True):
        if ours.requires_grad:
            assert torch.equal(ours, theirs), name
    # the base itself is given back rounded, in float32
    for param, before in zip(_base_params(rounded), initial, strict=True):
        assert param.dtype == torch.float32 and torch.equal(param, before.bfloat16().float())


def test_the_memory_plan_frees_the_masters_of_the_bf16_base(tmp_path):
    module = LoRA()
    strategy = _strategy()
    _fit(module, strategy, tmp_path, epochs=1)
    plan = strategy.memory_plan
    base = sum(param.numel() for param in _base_params(module))
    assert plan.frozen_freed_bytes == 4 * base and plan.frozen_narrowed == 2 * BLOCKS and plan.frozen_kept == 0
    as_stored = _strategy("as_stored")
    _fit(LoRA(), as_stored, tmp_path, epochs=1)
    # without it the plan counts the base's bf16 copies on top of the float32 masters: 6 bytes per parameter
    assert as_stored.memory_plan.new_bytes - plan.new_bytes == 4 * base
    assert any(item == "frozen weights" for item, _, _ in plan.rows())


def test_a_plan_that_does_not_fit_offers_to_round_the_weights_bf16_does_not_hold(tmp_path, monkeypatch):
    monkeypatch.setattr(preflight, "read_host_limits",
                        lambda: HostLimits(mem_available=10, cgroup=None, memlock=None))
    module = LoRA(bf16_base=False)
    with pytest.raises(HostMemoryError) as caught:
        _fit(module, _strategy(), tmp_path)
    masters = 4 * sum(param.numel() for param in _base_params(module))
    assert (f"frozen_weights='round', which keeps {2 * BLOCKS} frozen weights in bfloat16 alone "
            f"({format_bytes(masters)} of float32 masters less in each process" in str(caught.value))


# ------------------------------------------------------------------------------------------------ mid-run changes
class Unfreeze(pl.Callback):
    """BaseFinetuning's move: a frozen layer made trainable at the second epoch (it is in the optimizer already)."""

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == 1:
            pl_module.net[1].base.requires_grad_(True)


class LoadWide(pl.Callback):
    """A callback loading new base values mid-run: float32 values bf16 does not hold into block 2, bf16 values into
    block 3."""

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == 1:
            generator = torch.Generator().manual_seed(7)
            wide = {name: torch.randn(param.shape, generator=generator) * 0.1
                    for name, param in pl_module.net[2].base.named_parameters()}
            pl_module.net[2].base.load_state_dict(wide)
            narrow = {name: value.bfloat16().float() for name, value in wide.items()}
            pl_module.net[3].base.load_state_dict(narrow)


class CallOutsideAutocast(pl.Callback):
    """The model called in an epoch-end hook, outside the precision plugin's autocast: float32 compute."""

    def __init__(self) -> None:
        self.outputs: list[torch.Tensor] = []

    def on_train_epoch_end(self, trainer, pl_module):
        x = torch.randn(5, WIDTH, generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            self.outputs.append(pl_module.net(x))


@pytest.mark.parametrize("change", [Unfreeze, LoadWide, CallOutsideAutocast], ids=["unfreeze", "load", "eval"])
def test_changes_during_the_run_give_what_plain_lightning_gives(tmp_path, change):
    module, reference = LoRA(), LoRA()
    ours_callback, reference_callback = change(), change()
    trainer = _fit(module, _strategy(), tmp_path, callbacks=[ours_callback])
    reference_trainer = _fit(reference, "auto", tmp_path, callbacks=[reference_callback])
    _assert_same_run(module, reference, trainer, reference_trainer)
    if isinstance(ours_callback, CallOutsideAutocast):
        assert [output.dtype for output in ours_callback.outputs] == [torch.float32] * 2
        assert all(torch.equal(a, b) for a, b in zip(ours_callback.outputs, reference_callback.outputs, strict=True))
    if isinstance(ours_callback, Unfreeze):
        assert not torch.equal(module.net[1].base.weight, LoRA().net[1].base.weight)  # it did train


def test_a_failed_run_gives_the_module_its_dtypes_back(tmp_path):
    class Fails(LoRA):
        def training_step(self, batch, batch_idx):
            if batch_idx == 1:
                raise RuntimeError("the user's bug")
            return super().training_step(batch, batch_idx)

    module = Fails()
    with pytest.raises(RuntimeError, match="the user's bug"):
        _fit(module, _strategy(), tmp_path)
    assert module.base_dtypes == {torch.bfloat16}
    assert {param.dtype for param in module.parameters()} == {torch.float32}
    assert all(not block.base._state_dict_hooks for block in module.net[:BLOCKS])


# ------------------------------------------------------------------------------------------------ which weights
def test_only_frozen_autocast_only_weights_that_nothing_outside_the_trunk_holds_are_chosen():
    torch.manual_seed(0)
    frozen, trained, norm, tied = nn.Linear(8, 8), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8)
    for module in (frozen, norm, tied):
        module.requires_grad_(False)
    trunk_layers = [nn.Sequential(frozen, norm), nn.Sequential(trained, tied)]
    outside = nn.Embedding(8, 8)
    outside.weight = tied.weight  # a lookup table outside the trunk reads the tied weight as stored
    model = nn.ModuleDict({"trunk": nn.Sequential(*trunk_layers), "embed": outside})
    trunk = Trunk(trunk_layers)
    chosen = select_frozen(trunk, torch.bfloat16, "round", registered_outside(model, trunk))
    assert {id(param) for param in chosen.narrowed} == {id(frozen.weight), id(frozen.bias), id(tied.bias)}
    assert select_frozen(trunk, torch.bfloat16, "as_stored", set()).narrowed == []
    assert select_frozen(trunk, None, "round", set()).narrowed == []
    # "auto" checks the values bit for bit: float32 noise is not bf16, its bf16 rounding is
    auto = select_frozen(trunk, torch.bfloat16, "auto", set())
    assert auto.narrowed == [] and len(auto.kept) == 4
    with torch.no_grad():
        frozen.weight.copy_(frozen.weight.bfloat16().float())
    assert [id(p) for p in select_frozen(trunk, torch.bfloat16, "auto", set()).narrowed] == [id(frozen.weight)]


def test_holds_exactly_compares_bits():
    values = torch.tensor([1.0, -0.0, float("inf"), 2.0**-133, 1.0 + 2.0**-7])
    assert holds_exactly(values, torch.bfloat16)
    assert not holds_exactly(torch.tensor([1.0 + 2.0**-8]), torch.bfloat16)  # rounds to 1.0
    assert not holds_exactly(torch.tensor([2.0**-140]), torch.float16)       # flushes to zero
    assert holds_exactly(torch.tensor([65504.0]), torch.float16)
    assert not holds_exactly(torch.tensor([1e6]), torch.float16)             # overflows
