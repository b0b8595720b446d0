"""Modules built on the meta device (``Trainer.init_module(empty_init=True)``, issue 26 item 4).

The reference is the same module built on the CPU, trained by Lightning's default strategy (one microbatch: bitwise
RoundPipe's sync step, ``test_strategy.py``) or by RoundPipe: materialized by ``reset_parameters`` in module order
it must hold the values a CPU build draws, and resumed from a checkpoint the values the checkpoint holds; after
training, weights, losses and optimizer state must be bitwise equal. A frozen bf16-valued base loaded from a
checkpoint is kept at compute width layer by layer, so it is never float32 whole.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_roundpipe  # noqa: F401 - registers the strategy names (editable installs have no .pth hook)
from lightning_roundpipe import RoundPipeEngine, RoundPipeStrategy, preflight
from lightning_roundpipe.hostmem import HostLimits
from lightning_roundpipe.materialize import MaterializeError
from lightning_roundpipe.preflight import HostMemoryError
from tests.numerics import assert_same_optimizer_state, assert_states_equal

WIDTH = 32  # a Linear weight of a page at least: the disk tier takes it (offload="optimizer+masters")


def _layers(frozen: bool = False) -> nn.Sequential:
    net = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH),
                        nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH))
    net[6].weight = net[0].weight
    if frozen:
        for index in (2, 4):
            net[index].requires_grad_(False)
    return net


class Net(pl.LightningModule):
    """Linear and LayerNorm layers, the last Linear tied to the first (one weight in two trunk layers); AdamW.
    ``frozen``: the middle Linear layers are a frozen base holding bfloat16 values."""

    def __init__(self, frozen: bool = False) -> None:
        super().__init__()
        self.net = _layers(frozen)
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _data() -> DataLoader:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(24, WIDTH, generator=generator)
    return DataLoader(TensorDataset(x, torch.randn(24, WIDTH, generator=generator)), batch_size=8)


def _trainer(strategy, root, epochs: int = 2, precision: str = "32-true", checkpointing: bool = False) -> pl.Trainer:
    return pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_epochs=epochs, precision=precision,
                      logger=False, enable_checkpointing=checkpointing, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=root)


def _roundpipe(**kwargs) -> RoundPipeStrategy:
    return RoundPipeStrategy(ring=[0, 0], num_microbatches=1, num_stages=3, round_size="whole", freeze_plan=True,
                             **kwargs)


def _on_meta(trainer: pl.Trainer, **kwargs) -> Net:
    with trainer.init_module(empty_init=True):
        module = Net(**kwargs)
    assert module.net[0].weight.device.type == "meta"
    return module


def _assert_same_run(ours: Net, reference: Net, ours_trainer: pl.Trainer, reference_trainer: pl.Trainer) -> None:
    assert len(ours.losses) == len(reference.losses) > 0
    assert all(torch.equal(a, b) for a, b in zip(ours.losses, reference.losses, strict=True))
    assert_states_equal(ours, reference)
    assert_same_optimizer_state(ours_trainer, reference_trainer)


def test_a_module_built_on_meta_is_initialised_as_a_cpu_build_and_trains_as_plain_lightning(tmp_path, caplog):
    torch.manual_seed(0)
    reference = Net()
    reference_trainer = _trainer("auto", tmp_path)
    reference_trainer.fit(reference, _data())

    trainer = _trainer(_roundpipe(), tmp_path)
    module = _on_meta(trainer)
    torch.manual_seed(0)  # materialization draws at setup what the CPU build drew at construction
    with caplog.at_level("WARNING", logger="lightning_roundpipe"):
        trainer.fit(module, _data())
    # a load_state_dict before fit would have been lost on meta tensors: the log says so
    assert "load_state_dict(..., assign=True), or pass ckpt_path to fit" in caplog.text
    assert module.net[6].weight is module.net[0].weight  # the tie is kept
    _assert_same_run(module, reference, trainer, reference_trainer)


@pytest.mark.parametrize("precision,frozen,async_step", [("32-true", False, False), ("bf16-mixed", True, False),
                                                          ("bf16-mixed", True, True)],
                         ids=["fp32", "bf16-base", "bf16-base-async"])
def test_a_module_built_on_meta_resumes_from_a_checkpoint_as_a_cpu_build_does(tmp_path, monkeypatch, precision,
                                                                                frozen, async_step):
    torch.manual_seed(0)
    first = Net(frozen)
    if frozen:  # a base of bf16 values, as a bf16 checkpoint gives
        with torch.no_grad():
            for index in (2, 4):
                for param in first.net[index].parameters():
                    param.copy_(param.bfloat16().float())
    _trainer(_roundpipe(), tmp_path / "first", epochs=1, precision=precision, checkpointing=True).fit(first, _data())
    checkpoint = next((tmp_path / "first").rglob("*.ckpt"))

    reference = Net(frozen)
    reference_trainer = _trainer(_roundpipe(async_step=async_step), tmp_path, precision=precision)
    reference_trainer.fit(reference, _data(), ckpt_path=checkpoint)

    # at each layer's narrowing, how many float32 frozen weights exist (materialized and not yet narrowed)
    wide_frozen: list[int] = []
    narrow = RoundPipeEngine.settle

    def watched(engine, layers):
        narrow(engine, layers)
        wide_frozen.append(sum(1 for param in engine.trunk.parameters() if not param.requires_grad
                               and param.device.type == "cpu" and param.dtype == torch.float32))

    monkeypatch.setattr(RoundPipeEngine, "settle", watched)
    trainer = _trainer(_roundpipe(async_step=async_step), tmp_path, precision=precision)
    module = _on_meta(trainer, frozen=frozen)
    trainer.fit(module, _data(), ckpt_path=checkpoint)
    assert module.net[6].weight is module.net[0].weight
    _assert_same_run(module, reference, trainer, reference_trainer)
    # after each trunk layer with tensors (the Tanh layers have none) is whole, its frozen weights are narrowed:
    # no float32 frozen weight ever waits for the rest of the model
    assert wide_frozen == [0] * 5
    if frozen:
        assert {module.net[index].weight.dtype for index in (2, 4)} == {torch.float32}  # widened back at the end


def test_configure_model_may_build_on_meta_and_resume_from_a_checkpoint(tmp_path):
    """Lightning calls ``configure_model`` in the strategy's init context (not on meta, as FSDP's); a module that
    builds its layers there under ``torch.device("meta")`` is materialized from the checkpoint all the same."""
    class Configured(Net):
        def __init__(self) -> None:
            super().__init__()
            del self.net  # built in configure_model

        def configure_model(self) -> None:
            if not hasattr(self, "net"):
                with torch.device("meta"):
                    self.net = _layers()

    torch.manual_seed(0)
    first = Net()
    _trainer(_roundpipe(), tmp_path / "first", epochs=1, checkpointing=True).fit(first, _data())
    checkpoint = next((tmp_path / "first").rglob("*.ckpt"))
    reference, module = Net(), Configured()
    reference_trainer = _trainer(_roundpipe(), tmp_path)
    reference_trainer.fit(reference, _data(), ckpt_path=checkpoint)
    trainer = _trainer(_roundpipe(), tmp_path)
    trainer.fit(module, _data(), ckpt_path=checkpoint)
    _assert_same_run(module, reference, trainer, reference_trainer)


def test_a_module_built_on_meta_without_values_is_refused_naming_it(tmp_path):
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gain = nn.Parameter(torch.ones(WIDTH))

        def forward(self, x):
            return x * self.gain

    class WithScale(Net):
        def __init__(self) -> None:
            super().__init__()
            self.net.append(Scale())

    trainer = _trainer(_roundpipe(), tmp_path)
    with trainer.init_module(empty_init=True):
        module = WithScale()
    with pytest.raises(MaterializeError, match=r"net\.7 \(Scale\) was built on the meta device .* nothing gives gain "
                                               r"a value: resume from a checkpoint"):
        trainer.fit(module, _data())


def test_a_refused_setup_gives_the_narrowed_frozen_weights_their_dtype_back(tmp_path, monkeypatch):
    torch.manual_seed(0)
    first = Net(frozen=True)
    with torch.no_grad():
        for index in (2, 4):
            for param in first.net[index].parameters():
                param.copy_(param.bfloat16().float())
    _trainer(_roundpipe(), tmp_path / "first", epochs=1, precision="bf16-mixed", checkpointing=True).fit(first,
                                                                                                          _data())
    checkpoint = next((tmp_path / "first").rglob("*.ckpt"))
    monkeypatch.setattr(preflight, "read_host_limits", lambda: HostLimits(mem_available=10, cgroup=None, memlock=None))
    trainer = _trainer(_roundpipe(), tmp_path, precision="bf16-mixed")
    module = _on_meta(trainer, frozen=True)
    with pytest.raises(HostMemoryError):
        trainer.fit(module, _data(), ckpt_path=checkpoint)
    # materialized from the checkpoint, narrowed layer by layer, then widened back when setup was refused
    assert {param.dtype for param in module.parameters()} == {torch.float32}
    assert all(not module.net[index]._state_dict_hooks for index in (2, 4))
    assert_states_equal(module.state_dict(), first.state_dict())


@pytest.mark.parametrize("async_step", [False, True], ids=["sync", "async"])
def test_a_module_built_on_meta_moves_each_layers_masters_to_disk_as_the_layer_is_whole(tmp_path, monkeypatch,
                                                                                        async_step):
    """``offload="optimizer+masters"``: once a trunk layer is materialized from the checkpoint its transport copies
    are made and its masters move into the disk tier's files, so no float32 master the tier takes waits in memory
    for the rest of the model; the run is bitwise the in-memory one (a CPU build without a tier)."""
    torch.manual_seed(0)
    _trainer(_roundpipe(), tmp_path / "first", epochs=1, precision="bf16-mixed", checkpointing=True).fit(Net(), _data())
    checkpoint = next((tmp_path / "first").rglob("*.ckpt"))
    reference = Net()
    reference_trainer = _trainer(_roundpipe(async_step=async_step), tmp_path, precision="bf16-mixed")
    reference_trainer.fit(reference, _data(), ckpt_path=checkpoint)

    # at each layer's settling, the Linear weights materialized whose masters are still in memory
    waiting: list[int] = []
    settle = RoundPipeEngine.settle

    def watched(engine, layers):
        settle(engine, layers)
        moved = engine.master_files.disk._masters if engine.master_files.disk is not None else {}
        waiting.append(sum(1 for param in engine.trunk.parameters() if param.dim() == 2 and param.device.type == "cpu"
                           and id(param) not in moved))

    monkeypatch.setattr(RoundPipeEngine, "settle", watched)
    strategy = _roundpipe(async_step=async_step, offload="optimizer+masters", offload_dir=str(tmp_path / "tier"))
    trainer = _trainer(strategy, tmp_path, precision="bf16-mixed")
    module = _on_meta(trainer)
    (tmp_path / "tier").mkdir()
    trainer.fit(module, _data(), ckpt_path=checkpoint)
    assert waiting == [0] * 5
    assert module.net[6].weight is module.net[0].weight
    _assert_same_run(module, reference, trainer, reference_trainer)
