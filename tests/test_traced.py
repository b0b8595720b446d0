"""Trunks beyond nn.Sequential: forwards that loop over an nn.ModuleList of blocks, recorded with torch.fx and
cut at the block calls (``lightning_roundpipe/traced.py``), against Lightning's default strategy on the same
seeded module and data. Float64 with several microbatches: equal to 1e-12 (``tests/numerics.py``)."""

from __future__ import annotations

import copy
import logging
import math

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.demos.boring_classes import BoringModel, DemoModel, RandomDataset
from lightning.pytorch.demos.transformer import LightningTransformer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_roundpipe  # noqa: F401 - registers the strategy names
from lightning_roundpipe import RoundPipeStrategy, pipeline_loss
from lightning_roundpipe.capture import CaptureError
from lightning_roundpipe.traced import TracedForward, TracedTrunk
from lightning_roundpipe.trunk import build_module_trunk
from tests.models import without_dropout
from tests.numerics import assert_float64_equal, assert_states_float64_equal

VOCAB, WIDTH, CONTEXT = 23, 16, 12


# ---------------------------------------------------------------------------- a nanoGPT-style module
class Block(nn.Module):
    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attn = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, c = x.size()
        q, k, v = self.attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, 2, c // 2).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.drop(self.proj(y.transpose(1, 2).contiguous().view(b, t, c)))
        return x + self.drop(self.mlp(self.ln_2(x)))


class GPT(nn.Module):
    """Embeddings, a ModuleList of blocks called in a Python loop with a mask every block reads, a final norm
    and a head tied to the token embedding."""

    def __init__(self, blocks: int = 3, dropout: float = 0.0) -> None:
        super().__init__()
        self.block_size = CONTEXT
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(VOCAB, WIDTH), wpe=nn.Embedding(CONTEXT, WIDTH), drop=nn.Dropout(dropout),
            h=nn.ModuleList([Block(dropout) for _ in range(blocks)]), ln_f=nn.LayerNorm(WIDTH)))
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b, t = idx.size()
        assert t <= self.block_size, f"Cannot forward sequence of length {t}, block size is only {self.block_size}"
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        mask = torch.ones(t, t, dtype=torch.bool, device=idx.device).tril()
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x, mask)
        return self.lm_head(self.transformer.ln_f(x))


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


class GPTModule(pl.LightningModule):
    def __init__(self, fused: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.model = GPT()
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        idx, target = batch
        if self.hparams.fused:
            loss = pipeline_loss(self.model, idx, target, lm_loss)
        else:
            loss = lm_loss(self.model(idx), target)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        # not Adam: the key bias's true gradient is 0 (softmax ignores a per-query constant), and Adam would
        # turn its float64 rounding noise into lr-sized steps
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def tokens(samples: int = 18, length: int = 8, batch: int = 6, seed: int = 1) -> list[list[torch.Tensor]]:
    """Batches of random token ids (inputs, next-token targets); fit them with :func:`batches`."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (samples, length + 1), generator=generator)
    return list(DataLoader(TensorDataset(ids[:, :-1], ids[:, 1:]), batch_size=batch))


def batches(data: list) -> DataLoader:
    return DataLoader(data, batch_size=None)  # each item is a whole batch


def _trainer(strategy, devices: int = 1, **kwargs) -> pl.Trainer:
    return pl.Trainer(strategy=strategy, accelerator="cpu", devices=devices, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      **{"max_epochs": 1, "precision": "64-true", **kwargs})


def _fit_both(make, data, devices: int, callbacks=None, **strategy_kwargs):
    """The same seeded module fitted under Lightning's default strategy and under RoundPipe."""
    reference, module = make(), make()
    _trainer("auto").fit(reference, data)
    strategy = RoundPipeStrategy(num_microbatches=3, **strategy_kwargs)
    _trainer(strategy, devices).fit(module, data)
    return reference, module, strategy


@pytest.mark.parametrize("devices", [2, 3])
@pytest.mark.parametrize("fused", [False, True], ids=["transparent", "fused"])
def test_nanogpt_style_module_equals_the_default_strategy(fused, devices, roundpipe_threads):
    reference, module, strategy = _fit_both(lambda: GPTModule(fused), batches(tokens()), devices)
    assert_float64_equal(module.losses, reference.losses, what="losses")
    assert_states_float64_equal(module, reference)
    trunk = strategy.engine.trunk
    assert isinstance(trunk, TracedTrunk) and len(trunk) == 5  # prologue, 3 blocks, epilogue
    assert len(trunk.registry.captured) == 1  # one signature: recorded once for all steps
    assert module.model.transformer.wte.weight is module.model.lm_head.weight  # still tied
    assert list(module.state_dict()) == list(reference.state_dict())
    assert "forward" not in module.model.__dict__  # the module's own forward is back
    assert roundpipe_threads() == []


class ScaledBlock(Block):
    def forward(self, x: torch.Tensor, mask: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x * scale[None, :, None], mask)


class TableGPT(GPT):
    """A rotary-table-like buffer of the root, sliced in the forward before the blocks and passed to each (as
    litgpt's ``cos``/``sin``): fx does not proxy buffers, so the slice is taken eagerly while recording."""

    def __init__(self) -> None:
        super().__init__()
        self.transformer.h = nn.ModuleList([ScaledBlock() for _ in range(3)])
        self.register_buffer("table", torch.linspace(0.5, 1.5, CONTEXT))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        mask = torch.ones(t, t, dtype=torch.bool, device=idx.device).tril()
        scale = self.table[:t]
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x, mask, scale)
        return self.lm_head(self.transformer.ln_f(x))


class TableModule(GPTModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = TableGPT()


def test_a_view_of_a_buffer_taken_in_the_forward_is_read_from_each_layers_own_copy(roundpipe_threads):
    """The slice of the root's table reaches every block as a view of the copy bound where the layer runs, never
    as a constant holding the host's buffer (which a GPU could not read, and which a CPU device's forward job
    writes back while another device's backward job has saved a view of it)."""
    reference, module, strategy = _fit_both(TableModule, batches(tokens()), devices=2)
    assert_float64_equal(module.losses, reference.losses, what="losses")
    assert_states_float64_equal(module, reference)
    table = module.model.table.untyped_storage().data_ptr()
    held = [name for layer in strategy.engine.trunk.layers for name, value in vars(layer).items()
            if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() == table]
    assert held == []
    assert roundpipe_threads() == []


def test_a_new_sequence_length_is_recorded_once_and_trains():
    data = [batch for length in (8, 5) for batch in tokens(samples=12, length=length)]  # 8, 8, 5, 5
    data = [data[0], data[2], data[1], data[3]]  # lengths 8, 5, 8, 5
    reference, module, strategy = _fit_both(GPTModule, batches(data), devices=2)
    assert_float64_equal(module.losses, reference.losses, what="losses")
    assert_states_float64_equal(module, reference)
    assert len(strategy.engine.trunk.registry.captured) == 2


def test_the_parameters_and_checkpoints_are_the_modules_own(tmp_path):
    module = GPTModule()
    parameters = list(module.parameters())
    keys = list(module.state_dict())
    optimizers = []

    class Check(pl.Callback):
        def on_train_end(self, trainer, pl_module):
            optimizers.append(trainer.optimizers[0])

    trainer = _trainer(RoundPipeStrategy(num_microbatches=2), devices=2, callbacks=[Check()], precision="32-true")
    trainer.fit(module, batches(tokens()))
    assert list(module.parameters()) == parameters  # the same nn.Parameter objects, stepped in place
    assert {id(p) for group in optimizers[0].param_groups for p in group["params"]} == {id(p) for p in parameters}
    assert list(module.state_dict()) == keys
    trainer.save_checkpoint(tmp_path / "gpt.ckpt")
    plain = GPTModule.load_from_checkpoint(tmp_path / "gpt.ckpt", map_location="cpu")  # no strategy at all
    assert list(plain.state_dict()) == keys
    for (name, value), loaded in zip(module.state_dict().items(), plain.state_dict().values(), strict=True):
        assert torch.equal(value, loaded), name
    idx = tokens()[0][0]
    assert torch.equal(plain.model(idx), module.model(idx))


# ---------------------------------------------------------------------------- Lightning's own demo modules
class Losses(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].item())


def _fit_demo(make, data, devices: int):
    reference, module = make(), make()
    losses = Losses(), Losses()
    _trainer("auto", callbacks=[losses[0]]).fit(reference, data)
    strategy = RoundPipeStrategy(num_microbatches=3)
    _trainer(strategy, devices, callbacks=[losses[1]]).fit(module, data)
    assert_float64_equal(losses[1].losses, losses[0].losses, what="losses")
    assert_states_float64_equal(module, reference)
    return module, strategy


@pytest.mark.parametrize("devices", [2, 3])
def test_lightning_demo_transformer_trains_unchanged(devices):
    def make() -> LightningTransformer:
        torch.manual_seed(0)
        module = without_dropout(LightningTransformer(vocab_size=31))
        module.prepare_data = lambda: None  # WikiText2 downloads: the data below needs no download
        return module

    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 31, (12, 7), generator=generator)
    data = DataLoader(TensorDataset(ids[:, :-1], ids[:, 1:]), batch_size=4)
    with pytest.warns(UserWarning, match=r"the forward of `model` assigns `src_mask`"):
        module, strategy = _fit_demo(make, data, devices)
    trunk = strategy.engine.trunk
    # nn.Transformer's encoder layers then its decoder layers are the blocks; the encoder's output (memory) and
    # the causal mask flow from block to block
    assert "`model.transformer.encoder.layers` then `model.transformer.decoder.layers`" in trunk.source
    assert len(trunk) == 6
    assert module.model.src_mask is None and module.model.pos_encoder.pe is None  # no proxy or cache left behind


@pytest.mark.parametrize("devices", [2, 3])
@pytest.mark.parametrize("make", [BoringModel, DemoModel])
def test_lightning_demo_modules_without_blocks_train_as_one_stage(make, devices, caplog):
    dataset = RandomDataset(32, 48)
    data = DataLoader(dataset, batch_size=8)
    with caplog.at_level(logging.INFO, logger="lightning_roundpipe.trunk"):
        module, strategy = _fit_demo(lambda: (torch.manual_seed(0), make())[1], data, devices)
    lines = [r.getMessage() for r in caplog.records if r.name == "lightning_roundpipe.trunk"]
    assert len(lines) == 1 and "nothing was partitioned" in lines[0] and "single stage" in lines[0]
    assert len(strategy.engine.trunk) == 1


# ---------------------------------------------------------------------------- what cannot be recorded
class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        if x.mean() > 0:  # decided on the values
            x = -x
        for block in self.blocks:
            x = block(x)
        return x


class Wrapper(pl.LightningModule):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = net

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _features(samples: int = 8) -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(samples, 4)), batch_size=4)


def test_data_dependent_control_flow_fails_with_an_error_that_says_where_and_what_to_do(roundpipe_threads):
    module = Wrapper(DataDependent())
    before = {name: value.clone() for name, value in module.state_dict().items()}
    with pytest.raises(CaptureError) as error:  # at the first call: recording needs the inputs
        _trainer(RoundPipeStrategy(), devices=2).fit(module, _features())
    assert roundpipe_threads() == [] and "forward" not in module.net.__dict__
    assert all(torch.equal(value, before[name]) for name, value in module.state_dict().items())
    message = str(error.value)
    assert "could not record the forward of `net` (DataDependent)" in message
    assert "a Python condition depends on the values of tensors" in message
    assert "test_traced.py" in message and "if x.mean() > 0:" in message
    assert "pipeline=" in message and "nn.Sequential" in message


class Reused(nn.Module):
    """Calls its blocks twice: there is no one place to cut at each block."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(2):
            for block in self.blocks:
                x = block(x)
        return x


class UsedOnBothSides(nn.Module):
    """``norm`` is used before and after the blocks: its parameters would be in two layers."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])
        self.norm = nn.LayerNorm(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x)
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


class IntOfData(nn.Module):
    """Turns a value computed from the data into a Python int."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x * int(x.sum())


@pytest.mark.parametrize(("net", "match"), [
    (IntOfData, r"`int\(\)` of a value computed from the values of tensors, not only their shapes, at "
                r".*test_traced.py:\d+: return x \* int\(x.sum\(\)\); one graph cannot stand for every batch"),
    (Reused, r"calls the blocks of `net.blocks` in the order \[0, 1, 0, 1\]; .* each of the 2 blocks must be called "
             r"once, in order"),
    (UsedOnBothSides, r"the epilogue layer uses `net.norm`, which belongs to the prologue layer\. RoundPipe gives each "
                      r"module outside the blocks to the layer where the forward's own code first uses it .*use it in "
                      r"one place only"),
])
def test_forwards_that_cannot_be_cut_are_refused_clearly(net, match):
    with pytest.raises(CaptureError, match=match):
        _trainer(RoundPipeStrategy(), devices=2).fit(Wrapper(net()), _features())


def test_a_module_without_a_forward_of_its_own_is_refused_at_setup():
    class NoForward(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])

    with pytest.raises(ValueError, match=r"NoForward has no nn.Sequential submodule or Hugging Face causal LM to "
                                         r"pipeline, and NoForward \(NoForward\) has no forward of its own to record "
                                         r"around the blocks `blocks`\. Name the trunk with RoundPipeStrategy\(pipeline"):
        build_module_trunk(NoForward())


def test_pipeline_naming_an_empty_list_is_refused():
    class Empty(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList()

        def forward(self, x):
            return x

    with pytest.raises(ValueError, match=r"^`blocks` is an empty nn.ModuleList: there are no blocks to pipeline$"):
        build_module_trunk(Empty(), "blocks")


# ---------------------------------------------------------------------------- discovery
def test_blocks_are_preferred_to_a_smaller_sequential_and_pipeline_names_them():
    module = GPTModule()  # each block holds an nn.Sequential (its MLP): the block list holds more
    trunk, driven, forward_patch = build_module_trunk(module)
    assert isinstance(trunk, TracedTrunk) and driven is module.model and len(trunk) == 5
    assert forward_patch is TracedForward
    trunk, driven, _ = build_module_trunk(module, "model.transformer.h")
    assert driven is module.model and len(trunk) == 5
    trunk, driven, _ = build_module_trunk(module, "model")
    assert driven is module.model and len(trunk) == 5
    # the prologue holds the embeddings, the epilogue the final norm and the (tied) head: one parameter, two layers
    prologue, epilogue = (dict(layer.named_parameters()) for layer in (trunk.layers[0], trunk.layers[-1]))
    assert set(prologue) == {"transformer.wte.weight", "transformer.wpe.weight"}
    assert set(epilogue) == {"transformer.ln_f.weight", "transformer.ln_f.bias", "lm_head.weight"}
    assert prologue["transformer.wte.weight"] is epilogue["lm_head.weight"] is module.model.lm_head.weight
    assert not any(name.startswith("_roundpipe") or "layers" in name for name in module.state_dict())


def test_blocks_of_the_lightning_module_itself_make_it_the_root():
    class Flat(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.tensor(math.pi))
            self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])

        def forward(self, x):
            x = x * self.scale
            for block in self.blocks:
                x = block(x)
            return x

    module = Flat()
    trunk, driven, _ = build_module_trunk(module)
    assert driven is module and len(trunk) == 5
    copy.deepcopy(module)  # the layers are outside the module tree
