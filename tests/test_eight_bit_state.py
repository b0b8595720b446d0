"""8-bit optimizer state on the host: bitsandbytes' optimizers stepped by the host step (issue 27 item 1).

The references: Lightning's default strategy running the same bitsandbytes optimizer (float32, one microbatch: there
RoundPipe's sync step is bitwise plain training), so weights, losses and every state tensor (bytes, block scales,
maps) must be bitwise equal; the moments' definition, for what the bytes hold (a first step's moments are
``(1 - beta1) g`` and ``(1 - beta2) g^2``, each one of the two values of the library's map around it, times its
block's scale);
and the state a real step makes, for the pre-flight's count.
"""

from __future__ import annotations

import pathlib

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lightning_roundpipe  # noqa: F401 - registers the strategy names (editable installs have no .pth hook)
from lightning_roundpipe import preflight
from lightning_roundpipe.engine.step.groups import streaming_refusal
from lightning_roundpipe.hostmem import HostLimits, format_bytes
from lightning_roundpipe.optimizer_state import optimizer_state_bytes
from lightning_roundpipe.preflight import HostMemoryError
from tests.models import delayed_update_reference, fit_three_class, one_microbatch_strategy, three_class_data
from tests.numerics import assert_same_run, assert_states_equal

bnb = pytest.importorskip("bitsandbytes")
from bitsandbytes.optim import GlobalOptimManager  # noqa: E402 - after the skip

WIDTH = 64  # a 64 x 64 weight has 4096 elements: bitsandbytes' default min_8bit_size, so it gets 8-bit moments


@pytest.fixture(autouse=True)
def _fresh_overrides():
    """bitsandbytes keeps per-parameter overrides in a process-wide manager, by parameter id: none leaks between
    tests (a later parameter may get a dead one's id)."""
    GlobalOptimManager.get_instance().initialize()
    yield
    GlobalOptimManager.get_instance().initialize()


class Net(pl.LightningModule):
    """Three 64-wide layers (8-bit moments), biases and a 3-class head (float32 moments: under 4096 elements), and
    a per-step StepLR. ``keep_first_in_32bit``: the first weight's moments stay in float32 by a module override,
    as Hugging Face's Trainer registers for embeddings."""

    def __init__(self, optimizer: str = "AdamW8bit", keep_first_in_32bit: bool = False, scheduled: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(),
                                 nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 3))
        self.optimizer_name, self.keep_first_in_32bit, self.scheduled = optimizer, keep_first_in_32bit, scheduled
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self):
        kind = torch.optim.AdamW if self.optimizer_name == "torch.AdamW" else getattr(bnb.optim, self.optimizer_name)
        optimizer = kind(self.parameters(), lr=1e-2)
        if self.keep_first_in_32bit:
            GlobalOptimManager.get_instance().register_module_override(self.net[0], "weight", {"optim_bits": 32})
        if not self.scheduled:
            return optimizer
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _fit(module: Net, strategy, root: pathlib.Path, epochs: int = 2, ckpt_path=None,
         checkpointing: bool = False, precision: str = "32-true") -> pl.Trainer:
    return fit_three_class(module, strategy, root, WIDTH, epochs=epochs, ckpt_path=ckpt_path,
                           checkpointing=checkpointing, precision=precision)


def _states(module: Net, trainer: pl.Trainer) -> dict[str, dict]:
    """The optimizer's state by parameter name (tensors and the step count)."""
    names = {id(param): name for name, param in module.named_parameters()}
    return {names[id(param)]: dict(entry) for param, entry in trainer.optimizers[0].state.items()}


def _moment_dtypes(module: Net, trainer: pl.Trainer) -> dict[str, torch.dtype]:
    return {name: entry["state1"].dtype for name, entry in _states(module, trainer).items()}


@pytest.mark.parametrize("optimizer", ["AdamW8bit", "Lion8bit"])
def test_eight_bit_state_trains_bitwise_as_plain_lightning_and_steps_by_stage(tmp_path, optimizer):
    module, reference = Net(optimizer), Net(optimizer)
    strategy = one_microbatch_strategy()
    trainer = _fit(module, strategy, tmp_path)
    reference_trainer = _fit(reference, "auto", tmp_path)
    assert_same_run(module, reference, trainer, reference_trainer)
    # the pre-flight plan counted the state the run made, and says how it is kept
    made = sum(value.nbytes for entry in trainer.optimizers[0].state.values() for key, value in entry.items()
               if isinstance(value, torch.Tensor) and not key.startswith("qmap"))
    assert strategy.memory_plan.optimizer_state_bytes == made
    assert f"{optimizer}: " in strategy.memory_plan.table() and "8-bit blockwise" in strategy.memory_plan.table()
    # both kinds of state were stepped: 8-bit moments for the 64 x 64 weights, float32 for the rest
    dtypes = _moment_dtypes(module, trainer)
    assert dtypes["net.0.weight"] == torch.uint8 and dtypes["net.0.bias"] == torch.float32
    assert streaming_refusal(trainer.optimizers[0], "auto") is None  # cut by stage, as torch's AdamW


def test_a_module_override_keeps_its_moments_in_32_bits_as_under_plain_lightning(tmp_path):
    module, reference = Net(keep_first_in_32bit=True), Net(keep_first_in_32bit=True)
    trainer = _fit(module, one_microbatch_strategy(), tmp_path)
    reference_trainer = _fit(reference, "auto", tmp_path)
    assert _moment_dtypes(reference, reference_trainer)["net.0.weight"] == torch.float32
    assert _moment_dtypes(module, trainer)["net.0.weight"] == torch.float32
    assert _moment_dtypes(module, trainer)["net.2.weight"] == torch.uint8
    assert_same_run(module, reference, trainer, reference_trainer)


def test_a_first_step_stores_the_moments_of_their_definition_within_the_quantisation_bound(tmp_path):
    # one step: Lightning's default strategy leaves its gradient in param.grad
    module, reference = Net(), Net()
    one_batch = pl.Trainer(strategy=one_microbatch_strategy(), accelerator="cpu", devices=1, max_steps=1, logger=False,
                           enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                           default_root_dir=tmp_path)
    one_batch.fit(module, three_class_data(WIDTH))
    plain = pl.Trainer(strategy="auto", accelerator="cpu", devices=1, max_steps=1, logger=False,
                       enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                       default_root_dir=tmp_path)
    plain.fit(reference, three_class_data(WIDTH))
    gradient = reference.net[2].weight.grad
    beta1, beta2 = one_batch.optimizers[0].param_groups[0]["betas"]
    entry = one_batch.optimizers[0].state[module.net[2].weight]
    assert entry["state1"].dtype == torch.uint8
    for moment, decay, power in (("1", beta1, 1), ("2", beta2, 2)):
        factor = gradient if power == 2 else torch.ones_like(gradient)
        stored = bnb.functional.dequantize_blockwise(entry[f"state{moment}"], absmax=entry[f"absmax{moment}"],
                                                     code=entry[f"qmap{moment}"], blocksize=256)
        # the library's quantiser applied to the moment's definition, computed in float32, gives the same bytes
        definition = torch.zeros_like(gradient).mul_(decay).addcmul_(gradient, factor, value=1 - decay)
        quantised, quantisation = bnb.functional.quantize_blockwise(definition, code=entry[f"qmap{moment}"],
                                                                    blocksize=256)
        assert torch.equal(quantised, entry[f"state{moment}"]) and torch.equal(quantisation.absmax,
                                                                             entry[f"absmax{moment}"])
        # and the stored moment is within the map's widest gap (times the block's scale) of the float64 definition
        expected = (1 - decay) * gradient.double().pow(power)
        scale = entry[f"absmax{moment}"].double().repeat_interleave(256)[:expected.numel()].view_as(expected)
        widest = entry[f"qmap{moment}"].double().sort().values.diff().max()
        assert ((stored.double() - expected).abs() <= widest * scale).all(), f"moment {moment}"
        assert (stored - expected).abs().max() > 0  # really quantised


@pytest.mark.parametrize("offload,precision", [("optimizer", "32-true"), ("optimizer+masters", "bf16-mixed")])
def test_the_disk_tier_keeps_eight_bit_state_bitwise(tmp_path, offload, precision):
    module, reference = Net(), Net()
    strategy = one_microbatch_strategy(offload=offload, offload_dir=tmp_path / "state")
    trainer = _fit(module, strategy, tmp_path, precision=precision)
    reference_trainer = _fit(reference, "auto", tmp_path, precision=precision)
    assert_same_run(module, reference, trainer, reference_trainer)


def test_a_checkpoint_keeps_eight_bit_state_and_resumes_with_or_without_the_strategy(tmp_path):
    first = Net()
    _fit(first, one_microbatch_strategy(), tmp_path, epochs=1, checkpointing=True)
    checkpoint = next((tmp_path / "checkpoints").glob("*.ckpt"))
    saved = torch.load(checkpoint, weights_only=False)["optimizer_states"][0]["state"]
    saved_dtypes = {entry["__bnb_optimizer_quant_state__"]["state1"].dtype for entry in saved.values()}
    assert saved_dtypes == {torch.uint8, torch.float32}  # as kept: bytes, not dequantised

    uninterrupted = Net()
    reference_trainer = _fit(uninterrupted, "auto", tmp_path)
    for strategy in (one_microbatch_strategy(), "auto"):
        resumed = Net()
        trainer = _fit(resumed, strategy, tmp_path, ckpt_path=checkpoint)
        assert len(resumed.losses) == len(uninterrupted.losses) // 2  # the second epoch
        assert_same_run(resumed, uninterrupted, trainer, reference_trainer)


@pytest.mark.parametrize("optimizer", ["AdamW8bit", "Lion8bit", "AdamW"])
def test_the_preflight_counts_the_state_a_step_makes(tmp_path, optimizer):
    module = Net(optimizer, keep_first_in_32bit=True)
    config = module.configure_optimizers()
    bitsandbytes_optimizer = config["optimizer"]
    counted, description, known = optimizer_state_bytes(bitsandbytes_optimizer)
    for param in module.parameters():
        param.grad = torch.ones_like(param)
    bitsandbytes_optimizer.step()
    maps = {id(value) for entry in bitsandbytes_optimizer.state.values() for key, value in entry.items()
            if key.startswith("qmap")}  # shared by every parameter
    made = sum(value.nbytes for entry in bitsandbytes_optimizer.state.values() for value in entry.values()
               if isinstance(value, torch.Tensor) and id(value) not in maps)
    assert known and counted == made, description


def test_the_async_step_steps_eight_bit_state_as_the_delayed_update_reference(tmp_path):
    """``async_step=True``: iteration k computes on W(k-2) and W(k) = step(W(k-1), g(k)) (plain PyTorch, the same
    bitsandbytes optimizer on masters of its own), one microbatch: bitwise."""
    module = Net(scheduled=False)
    trainer = pl.Trainer(strategy=one_microbatch_strategy(async_step=True), accelerator="cpu", devices=1, max_epochs=2,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(module, three_class_data(WIDTH))

    def gradients(compute: nn.Module, iteration: int) -> torch.Tensor:
        x, y = batches[iteration]
        loss = F.cross_entropy(compute(x), y)
        loss.backward()
        return loss.detach()

    batches = [batch for _ in range(2) for batch in three_class_data(WIDTH)]
    expected, losses = delayed_update_reference(
        Net().net, lambda masters: bnb.optim.AdamW8bit(masters, lr=1e-2), len(batches), gradients)
    assert len(module.losses) == len(losses)
    assert all(torch.equal(a, b) for a, b in zip(module.losses, losses, strict=True))
    assert_states_equal(dict(module.net.named_parameters()), expected)


def test_the_app_keeps_embedding_moments_in_32_bits_and_takes_the_setting_back_after_the_run(tmp_path):
    """``model.optimizer=adamw8bit``: as Hugging Face's Trainer, the byte embedding (tied to the head) keeps float32
    moments, the blocks' weights 8-bit ones; the process-wide setting is gone once the run ends."""
    from lightning_roundpipe.app.model import ByteLM, gpt

    torch.manual_seed(0)
    module = ByteLM(gpt(width=WIDTH, depth=2, heads=4, context=16), context=16, optimizer="adamw8bit")
    ids = torch.randint(0, 256, (16, 17), generator=torch.Generator().manual_seed(1))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids[:, :-1], ids[:, 1:]), batch_size=8)
    trainer = pl.Trainer(strategy=one_microbatch_strategy(), accelerator="cpu", devices=1, max_steps=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=tmp_path)
    trainer.fit(module, data)
    state = trainer.optimizers[0].state
    assert state[module.net[0].tokens.weight]["state1"].dtype == torch.float32
    assert state[module.net[1].qkv.weight]["state1"].dtype == torch.uint8
    manager = GlobalOptimManager.get_instance()
    assert not any(id(param) in manager.pid2config for param in module.parameters())


def test_a_host_too_small_for_adamw_is_told_what_eight_bit_moments_would_save(tmp_path, monkeypatch):
    monkeypatch.setattr(preflight, "read_host_limits", lambda: HostLimits(mem_available=10, cgroup=None, memlock=None))
    module = Net("torch.AdamW")
    with pytest.raises(HostMemoryError) as refused:
        _fit(module, one_microbatch_strategy(), tmp_path)
    # the three 64 x 64 weights: float32 moments of 8 bytes an element against a byte and a float32 scale per 256;
    # the biases and the head (under 4096 elements) would keep float32 moments
    saving = 3 * (8 * WIDTH * WIDTH - 2 * (WIDTH * WIDTH + 4 * WIDTH * WIDTH // 256))
    assert f"AdamW8bit (pip install 'lightning_roundpipe[low-bit]') in configure_optimizers, whose moments take about " \
           f"a quarter of AdamW's: about {format_bytes(saving)} less in each process" in str(refused.value)
