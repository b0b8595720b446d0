"""Traced trunks of code no one here wrote or of shapes beyond one block list, against Lightning's default
strategy on the same seeded module and data: litgpt's ``GPT`` unchanged, buffers of the parent that every
block reads, several block lists in one forward (torchvision's ResNet-18, rebuilt here; an encoder then a
decoder). Float64, equal to ``tests/numerics.py``'s tolerances unless a docstring says why not."""

from __future__ import annotations

import logging

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_roundpipe  # noqa: F401 - registers the strategy names
from lightning_roundpipe import RoundPipeStrategy
from lightning_roundpipe.capture import CaptureError
from lightning_roundpipe.traced import TracedTrunk
from tests.numerics import (
    assert_float64_equal,
    assert_states_close_to_reference,
    assert_states_equal,
    assert_states_float64_equal,
    state,
)


def _trainer(strategy, devices: int = 1, precision: str = "64-true", **kwargs) -> pl.Trainer:
    return pl.Trainer(strategy=strategy, accelerator="cpu", devices=devices, logger=False, max_epochs=1,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      precision=precision, **kwargs)


class Fit(pl.LightningModule):
    """``make()`` (seeded) as ``self.model``, trained with SGD and momentum on ``loss(model(*inputs), target)``."""

    def __init__(self, make, loss) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = make()
        self.loss = loss
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        *inputs, target = batch
        loss = self.loss(self.model(*inputs), target)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def _fit_both(make, loss, data, devices: int = 2, microbatches: int = 3, precision: str = "64-true"):
    """The same seeded module fitted under Lightning's default strategy and under RoundPipe."""
    reference, module = Fit(make, loss), Fit(make, loss)
    _trainer("auto", precision=precision).fit(reference, data)
    strategy = RoundPipeStrategy(num_microbatches=microbatches)
    _trainer(strategy, devices, precision=precision).fit(module, data)
    return reference, module, strategy


def _max_difference(module: nn.Module, reference: nn.Module) -> float:
    ours, theirs = state(module), state(reference)
    return max(((ours[n] - theirs[n]).abs().max().item() for n in ours if ours[n].is_floating_point()), default=0.0)


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _tokens(vocab: int, samples: int = 12, length: int = 8, batch: int = 6) -> DataLoader:
    ids = torch.randint(0, vocab, (samples, length + 1), generator=torch.Generator().manual_seed(1))
    return DataLoader(TensorDataset(ids[:, :-1], ids[:, 1:]), batch_size=batch)


# ---------------------------------------------------------------------------- litgpt, unchanged
VOCAB = 40


def _litgpt_config(family: str):
    config = pytest.importorskip("litgpt.config")
    small = dict(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, padded_vocab_size=VOCAB, block_size=16)
    if family == "pythia":  # GPT-NeoX: parallel residual, partial rotary, LayerNorm, biases
        return config.Config.from_name("pythia-14m", **small)
    if family == "llama":  # grouped-query attention, RMSNorm, gated MLP
        return config.Config(name="tiny-llama", **small, n_query_groups=2, norm_class_name="RMSNorm",
                             mlp_class_name="LLaMAMLP", intermediate_size=48, bias=False, rotary_percentage=1.0,
                             parallel_residual=False)
    # Gemma-2: final logit soft-cap, attention soft-cap, sliding window, scaled embeddings, extra norms
    assert family == "gemma2"
    return config.Config.from_name("gemma-2-2b", **{**small, "n_query_groups": 2, "head_size": 8,
                                                    "intermediate_size": 48, "sliding_window_size": 4})


@pytest.mark.parametrize("family", ["pythia", "llama", "gemma2"])
def test_litgpt_gpt_trains_unchanged(family, caplog):
    """litgpt's forward makes an ``nn.Identity()`` when there is no soft-cap, registers ``lm_head`` before the
    blocks and its rotary tables ``cos``/``sin`` after them, and passes slices of those to every block.

    Pythia is equal to float64 tolerance. litgpt's ``RMSNorm`` computes in float32 whatever the input's
    dtype (``x.float()``), so the Llama and Gemma configurations are float32 computations inside a float64
    model, and the bound is the float32 one of ``tests/numerics.py``, taken from the default strategy's own
    run in float32 (measured: 2.5e-10 and 3e-10, far below what a wrong microbatch makes)."""
    model = pytest.importorskip("litgpt.model")
    config = _litgpt_config(family)
    assert (config.final_logit_softcapping is not None) == (family == "gemma2")  # else the nn.Identity() path
    assert (config.n_query_groups < config.n_head) == (family != "pythia")
    make = lambda: model.GPT(config)  # noqa: E731
    with caplog.at_level(logging.INFO, logger="lightning_roundpipe.trunk"):
        reference, module, strategy = _fit_both(make, lm_loss, _tokens(VOCAB))
    trunk = strategy.engine.trunk
    assert isinstance(trunk, TracedTrunk) and len(trunk) == 4  # prologue, 2 blocks, epilogue
    assert "`model.transformer.h`" in trunk.source
    prologue, epilogue = (dict(layer.named_parameters()) for layer in (trunk.layers[0], trunk.layers[-1]))
    assert set(prologue) == {"transformer.wte.weight"}
    assert "lm_head.weight" in epilogue  # registered first, used last
    print(f"litgpt {family}: max weight difference {_max_difference(module, reference):.2g}")
    if family == "pythia":
        assert_float64_equal(module.losses, reference.losses, what="losses")
        assert_states_float64_equal(module, reference)
    else:
        ref32 = Fit(make, lm_loss)
        _trainer("auto", precision="32-true").fit(ref32, _tokens(VOCAB))
        assert_states_close_to_reference(module, ref32, reference)


# ---------------------------------------------------------------------------- buffers of the parent
WIDTH, LENGTH = 8, 6


class MaskedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qk = nn.Linear(WIDTH, 2 * WIDTH)
        self.out = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k = self.qk(x).chunk(2, dim=-1)
        scores = (q @ k.transpose(1, 2)).masked_fill(~mask, float("-inf"))
        return x + self.out(scores.softmax(-1) @ x)


class ParentMask(nn.Module):
    """A causal mask registered on the parent (before or after the blocks) and passed to every block."""

    def __init__(self, mask_first: bool) -> None:
        super().__init__()
        if mask_first:
            self.register_buffer("mask", torch.ones(LENGTH, LENGTH, dtype=torch.bool).tril())
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList([MaskedBlock() for _ in range(3)])
        self.head = nn.Linear(WIDTH, VOCAB)
        if not mask_first:
            self.register_buffer("mask", torch.ones(LENGTH, LENGTH, dtype=torch.bool).tril())

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x, self.mask)
        return self.head(x)


@pytest.mark.parametrize("mask_first", [True, False], ids=["registered-before", "registered-after"])
def test_a_buffer_of_the_parent_reaches_every_block(mask_first):
    reference, module, strategy = _fit_both(lambda: ParentMask(mask_first), lm_loss, _tokens(VOCAB, length=LENGTH))
    print(f"parent buffer ({mask_first=}): max weight difference {_max_difference(module, reference):.2g}")
    assert_float64_equal(module.losses, reference.losses, what="losses")
    assert_states_float64_equal(module, reference)
    trunk = strategy.engine.trunk
    assert len(trunk) == 5
    # held by the prologue alone (an engine layer's buffers are written back: one owner), passed along
    assert [dict(layer.named_buffers()).keys() >= {"mask"} for layer in trunk.layers] == [True] + [False] * 4


# ---------------------------------------------------------------------------- several block lists
class BasicBlock(nn.Module):
    """torchvision's ResNet BasicBlock (rebuilt: torchvision cannot be installed next to this torch)."""

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        return self.relu(out + identity)


class ResNet18(nn.Module):
    """torchvision's ResNet-18 layout and forward, at a width of 8 to 64 channels instead of 64 to 512."""

    def __init__(self, classes: int = 10, width: int = 8) -> None:
        super().__init__()
        self.inplanes = width
        self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.layer1 = self._make_layer(width, 1)
        self.layer2 = self._make_layer(2 * width, 2)
        self.layer3 = self._make_layer(4 * width, 2)
        self.layer4 = self._make_layer(8 * width, 2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(8 * width, classes)

    def _make_layer(self, planes: int, stride: int) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes:
            downsample = nn.Sequential(nn.Conv2d(self.inplanes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes))
        layers = [BasicBlock(self.inplanes, planes, stride, downsample), BasicBlock(planes, planes)]
        self.inplanes = planes
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer1(x)
        x = self.layer2(x)
        x = self.layer3(x)
        x = self.layer4(x)
        return self.fc(torch.flatten(self.avgpool(x), 1))


def test_resnet18_pipelines_every_stage(caplog):
    """BatchNorm's statistics depend on the batch, so one microbatch: the same kernels on the same data."""
    images = torch.randn(12, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    labels = torch.randint(0, 10, (12,), generator=torch.Generator().manual_seed(4))
    data = DataLoader(TensorDataset(images, labels), batch_size=4)
    with caplog.at_level(logging.INFO, logger="lightning_roundpipe.trunk"):
        reference, module, strategy = _fit_both(ResNet18, F.cross_entropy, data, microbatches=1)
    print(f"ResNet-18: max weight difference {_max_difference(module, reference):.2g}")
    assert module.losses == reference.losses
    assert_states_equal(module, reference)  # BatchNorm's running statistics and counters included
    trunk = strategy.engine.trunk
    assert len(trunk) == 10  # prologue (the stem), 4 stages x 2 blocks, epilogue (pool and classifier)
    line = next(r.getMessage() for r in caplog.records if r.name == "lightning_roundpipe.trunk")
    assert ("8 blocks of `model.layer1` then `model.layer2` then `model.layer3` then `model.layer4`" in line
            and "10 layers, 100% of the parameters" in line), line


class EncoderLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.mix(x))


class DecoderLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Linear(WIDTH, WIDTH)
        self.cross = nn.Linear(WIDTH, WIDTH)

    def forward(self, y: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        return y + torch.tanh(self.mix(y) + self.cross(memory).mean(1, keepdim=True))


class EncoderDecoder(nn.Module):
    """Two block lists; what runs between them (the encoder's norm, the target's embedding, registered first)
    goes with the last encoder block; the decoder reads the encoder's output."""

    def __init__(self) -> None:
        super().__init__()
        self.target_embed = nn.Embedding(VOCAB, WIDTH)
        self.source_embed = nn.Embedding(VOCAB, WIDTH)
        self.encoder = nn.ModuleList([EncoderLayer() for _ in range(3)])
        self.encoder_norm = nn.LayerNorm(WIDTH)
        self.decoder = nn.ModuleList([DecoderLayer() for _ in range(2)])
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        x = self.source_embed(source)
        for layer in self.encoder:
            x = layer(x)
        memory = self.encoder_norm(x)
        y = self.target_embed(target)
        for layer in self.decoder:
            y = layer(y, memory)
        return self.head(y)


def test_an_encoder_then_a_decoder_are_both_pipelined():
    ids = torch.randint(0, VOCAB, (12, 2, LENGTH), generator=torch.Generator().manual_seed(5))
    data = DataLoader(TensorDataset(ids[:, 0], ids[:, 1, :-1], ids[:, 1, 1:]), batch_size=6)
    reference, module, strategy = _fit_both(EncoderDecoder, lm_loss, data)
    print(f"encoder-decoder: max weight difference {_max_difference(module, reference):.2g}")
    assert_float64_equal(module.losses, reference.losses, what="losses")
    assert_states_float64_equal(module, reference)
    trunk = strategy.engine.trunk
    assert len(trunk) == 7 and "`model.encoder` then `model.decoder`" in trunk.source
    held = [{name.split(".")[0] for name, _ in layer.named_parameters()} for layer in trunk.layers]
    assert held == [{"source_embed"}, {"encoder"}, {"encoder"}, {"encoder", "encoder_norm", "target_embed"},
                    {"decoder"}, {"decoder"}, {"head"}]


class MadeInForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.Identity()(x)  # made here, without state: runs as code
        for block in self.blocks:
            x = block(x)
        return nn.Linear(4, 4)(x)  # made here, with parameters no layer could hold


def test_a_module_with_parameters_made_inside_the_forward_is_refused_naming_the_line():
    module = Fit(MadeInForward, lambda out, target: out.pow(2).mean())
    data = DataLoader(TensorDataset(torch.randn(8, 4), torch.zeros(8)), batch_size=4)
    with pytest.raises(CaptureError, match=r"the forward calls a Linear that is not a submodule of it \(made inside "
                                           r"the forward, at .*test_traced_models.py:\d+: return nn.Linear\(4, 4\)\(x\).*"
                                           r"\) and holds parameters or buffers, which no layer could own; register it "
                                           r"as a submodule in __init__"):
        _trainer(RoundPipeStrategy(), devices=2).fit(module, data)


def test_a_sequential_holding_everything_stays_the_trunk_and_resnet_stages_do_not():
    from lightning_roundpipe.trunk import find_trunk

    class Net(nn.Module):  # a `self.net = nn.Sequential(...)` whose children are blocks of one type
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(*(EncoderLayer() for _ in range(3)))
            self.extra = nn.ModuleList([nn.Linear(2, 2)])

        def forward(self, x):
            return self.net(x)

    net = Net()
    assert find_trunk(net) == ("net", net.net)  # `extra`, never run, is no second block list
    resnet = ResNet18()
    assert find_trunk(resnet) == ("", resnet)  # not layer4 alone (75% of the parameters at full width)
