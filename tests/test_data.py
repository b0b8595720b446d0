"""Data edge cases and unsafe layers, each against an independent reference: Lightning's default strategy on
the same module and data, or plain PyTorch.

Covered elsewhere and not repeated here: uneven splits and short batches at the engine level, dict/tuple
outputs between layers, target/input size mismatch, and the engine-level empty-batch error
(``tests/test_engine.py``); batches of a Hugging Face tokenizer's dict (``tests/test_causal_lm.py``).
"""

from __future__ import annotations

import dataclasses
import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from lightning_roundpipe import (
    EngineOptions,
    PipelineError,
    RoundPipeEngine,
    RoundPipeStrategy,
    is_recomputing,
    pipeline_loss,
)
from lightning_roundpipe.engine.microbatch import sample_count, token_count
from lightning_roundpipe.engine.stage import ReplicaWriteWarning
from tests.models import SharedLog, clone, gpt_batch, gpt_loss, tiny_gpt
from tests.numerics import assert_close_to_reference, assert_states_close_to_reference, double

# Tolerances (tests/numerics.py): RoundPipe splits batches into microbatches, so its float32 sums run in
# another order than the reference's; its results must be within 4x the float32 reference's own distance from
# the same reference run in float64 (Lightning's precision="64-true", or a float64 copy in plain PyTorch).

# a trunk layer writing state in its forward is a bug these tests must not hide
pytestmark = pytest.mark.filterwarnings("error::lightning_roundpipe.engine.stage.ReplicaWriteWarning")


class Trained(pl.LightningModule):
    """``unpack(batch) -> (trunk input, target)``; the loss through the trunk (``self.net(x)``) or fused
    (``pipeline_loss``), which is the same arithmetic under Lightning's default strategy."""

    def __init__(self, net: nn.Sequential, unpack, loss_fn, fused: bool, loss_weight=sample_count) -> None:
        super().__init__()
        self.net = net
        self.unpack, self.loss_fn, self.fused, self.loss_weight = unpack, loss_fn, fused, loss_weight
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        inputs, target = self.unpack(batch)
        if self.fused:
            loss = pipeline_loss(self.net, inputs, target, self.loss_fn, loss_weight=self.loss_weight)
        else:
            loss = self.loss_fn(self.net(*inputs) if isinstance(inputs, tuple) else self.net(inputs), target)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _fit(module: pl.LightningModule, data: DataLoader, strategy="auto", devices: int = 1, epochs: int = 1,
         precision: str = "32-true"):
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_epochs=epochs, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         precision=precision)
    trainer.fit(module, data)
    return trainer


def _lightning_references(make, data: DataLoader, epochs: int = 1) -> tuple[Trained, Trained]:
    """Lightning's default strategy on ``make()``'s module: in float32 and in float64."""
    references = make(), make()
    for reference, precision in zip(references, ("32-true", "64-true"), strict=True):
        _fit(reference, data, epochs=epochs, precision=precision)
    return references


def _assert_same_training(module: Trained, reference: Trained, reference64: Trained, steps: int) -> None:
    assert len(module.losses) == len(reference.losses) == len(reference64.losses) == steps
    assert_close_to_reference(module.losses, reference.losses, reference64.losses, what="losses")
    assert_states_close_to_reference(module, reference, reference64)


def _mlp(inputs: int = 6, classes: int = 3) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(inputs, 16), nn.Tanh(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, classes))


# ---------------------------------------------------------------------------- 1. a short last batch
@pytest.mark.parametrize("fused", [False, True], ids=["transparent", "fused"])
def test_a_short_last_batch_smaller_than_num_microbatches_equals_lightnings_default_strategy(fused,
                                                                                            roundpipe_threads):
    generator = torch.Generator().manual_seed(1)
    samples = list(zip(torch.randn(19, 6, generator=generator), torch.randint(0, 3, (19,), generator=generator),
                       strict=True))
    data = DataLoader(samples, batch_size=8)  # 8, 8, 3: the last has fewer samples than 4 microbatches
    assert [len(y) for _, y in data] == [8, 8, 3]

    def make() -> Trained:
        return Trained(_mlp(), lambda batch: (batch[0], batch[1]), F.cross_entropy, fused)

    reference, reference64 = _lightning_references(make, data, epochs=2)
    module = make()
    with pytest.warns(UserWarning, match=r"a batch of 3 samples is smaller than `num_microbatches=4`"):
        _fit(module, data, RoundPipeStrategy(num_microbatches=4, num_stages=2), devices=2, epochs=2)
    _assert_same_training(module, reference, reference64, steps=6)
    assert roundpipe_threads() == []


# ---------------------------------------------------------------------------- 2. varying sequence length
VOCAB = 11


def _pad_to_longest(samples: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """A collate that pads each batch to its own longest sequence: ids with 0, labels with -100 (ignored)."""
    longest = max(len(s) for s in samples)
    ids = torch.zeros(len(samples), longest, dtype=torch.long)
    labels = torch.full((len(samples), longest), -100)
    for row, sample in enumerate(samples):
        ids[row, : len(sample)] = sample
        labels[row, : len(sample) - 1] = sample[1:]  # next-token targets; the last position has none
    return ids, labels


def _token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


@pytest.mark.parametrize("fused", [False, True], ids=["transparent", "fused"])
def test_sequence_length_varying_across_batches_equals_lightnings_default_strategy(fused, roundpipe_threads):
    generator = torch.Generator().manual_seed(2)
    lengths = [3, 9, 4, 2, 6, 5, 8, 3, 7, 2, 4, 5, 3]
    data = DataLoader([torch.randint(0, VOCAB, (n,), generator=generator) for n in lengths], batch_size=5,
                      collate_fn=_pad_to_longest)
    assert [ids.shape for ids, _ in data] == [(5, 9), (5, 8), (3, 5)]

    def make() -> Trained:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Embedding(VOCAB, 8), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, VOCAB))
        return Trained(net, lambda batch: batch, _token_loss, fused, loss_weight=token_count())

    reference, reference64 = _lightning_references(make, data, epochs=2)
    module = make()
    _fit(module, data, RoundPipeStrategy(num_microbatches=3, num_stages=2), devices=2, epochs=2)
    _assert_same_training(module, reference, reference64, steps=6)
    assert roundpipe_threads() == []


# ---------------------------------------------------------------------------- 3. dict, tuple, dataclass batches
@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    y: torch.Tensor
    ids: list[str]      # one string per sample: a list is a container, so every microbatch gets all of them
    tag: str            # a plain value: replicated
    scale: float        # a plain value the trunk computes with


def _collate(kind: str):
    def collate(samples):
        x = torch.stack([x for x, _, _ in samples])
        y = torch.stack([y for _, y, _ in samples])
        ids = [name for _, _, name in samples]
        if kind == "dict":
            return {"x": x, "y": y, "ids": ids, "tag": "train", "scale": 0.5}
        if kind == "tuple":
            return x, y, ids, "train", 0.5
        return Batch(x, y, ids, "train", 0.5)

    return collate


class Unpack(nn.Module):
    """The trunk's first layer: takes the whole batch and records the non-tensor fields it was given."""

    def __init__(self, kind: str, log: SharedLog) -> None:
        super().__init__()
        self.kind, self.log = kind, log
        self.linear = nn.Linear(6, 16)

    def forward(self, batch):
        if self.kind == "dict":
            x, y, ids, tag, scale = (batch[key] for key in ("x", "y", "ids", "tag", "scale"))
        elif self.kind == "tuple":
            x, y, ids, tag, scale = batch
        else:
            x, y, ids, tag, scale = batch.x, batch.y, batch.ids, batch.tag, batch.scale
        assert x.shape[0] == y.shape[0]
        if not is_recomputing():  # a backward stage runs the layer again
            self.log.append((type(batch), x.shape[0], list(ids), tag, scale))  # a shared list, mutated: no write
        return torch.tanh(self.linear(x)) * scale


def _target(batch):
    return batch.y if isinstance(batch, Batch) else batch["y"] if isinstance(batch, dict) else batch[1]


@pytest.mark.filterwarnings("ignore:a batch of 2 samples is smaller than `num_microbatches=3`")
@pytest.mark.parametrize("fused", [False, True], ids=["transparent", "fused"])
@pytest.mark.parametrize("kind", ["dict", "tuple", "dataclass"])
def test_dict_tuple_and_dataclass_batches_with_plain_fields_equal_lightnings_default_strategy(kind, fused,
                                                                                              roundpipe_threads):
    generator = torch.Generator().manual_seed(3)
    x, y = torch.randn(14, 6, generator=generator), torch.randint(0, 3, (14,), generator=generator)
    samples = [(x[i], y[i], f"sample-{i}") for i in range(14)]
    data = DataLoader(samples, batch_size=6, collate_fn=_collate(kind))  # 6, 6, 2
    batch_ids = [[f"sample-{i}" for i in range(start, min(start + 6, 14))] for start in range(0, 14, 6)]

    def make() -> tuple[Trained, SharedLog]:
        log = SharedLog()
        torch.manual_seed(0)
        net = nn.Sequential(Unpack(kind, log), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 3))
        # a tuple batch passed whole: pipeline_loss (like the engine) spreads a tuple over several arguments
        unpack = (lambda batch: ((batch,), _target(batch))) if kind == "tuple" else (lambda b: (b, _target(b)))
        return Trained(net, unpack, F.cross_entropy, fused), log

    (reference, reference_log), (reference64, _) = make(), make()
    _fit(reference, data)
    _fit(reference64, data, precision="64-true")
    module, log = make()
    _fit(module, data, RoundPipeStrategy(num_microbatches=3, num_stages=2), devices=2)
    _assert_same_training(module, reference, reference64, steps=3)
    assert roundpipe_threads() == []

    batch_type = {"dict": dict, "tuple": tuple, "dataclass": Batch}[kind]
    assert [(t, n, ids, tag, s) for t, n, ids, tag, s in reference_log] == [
        (batch_type, len(ids), ids, "train", 0.5) for ids in batch_ids]
    # under RoundPipe the first layer sees microbatches (2, 2, 2 / 1, 1 samples) of a batch of the same type,
    # and every plain field whole: the scalars and the batch's full list of ids
    expected = [(batch_type, size, ids, "train", 0.5) for ids in batch_ids
                for size in ([2, 2, 2] if len(ids) == 6 else [1, 1])]
    assert sorted(log, key=repr) == sorted(expected, key=repr)


@dataclasses.dataclass(frozen=True)
class Hidden:
    h: torch.Tensor
    note: str


class ToHidden(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 8)

    def forward(self, x):
        return Hidden(torch.tanh(self.linear(x)), "from layer 0")


class FromHidden(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 3)

    def forward(self, hidden: Hidden):
        assert isinstance(hidden, Hidden) and hidden.note == "from layer 0"
        return self.linear(hidden.h)


def test_a_dataclass_between_stages_carries_its_gradient_and_a_dataclass_output_is_refused(roundpipe_threads):
    torch.manual_seed(0)
    model = nn.Sequential(ToHidden(), nn.Identity(), FromHidden())
    references = {torch.float32: clone(model), torch.float64: double(model)}
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    with RoundPipeEngine(model, 2, EngineOptions(num_microbatches=2, num_stages=2)) as engine:  # a stage per layer
        loss = engine.forward_backward(x, y, F.cross_entropy)
        engine.step(torch.optim.SGD(model.parameters(), lr=0.1))
        engine.synchronize()
    expected = {}
    for dtype, reference in references.items():
        expected[dtype] = sum(F.cross_entropy(reference(part), target) / 2
                              for part, target in zip(x.to(dtype).split(3), y.split(3), strict=True))
        expected[dtype].backward()
        torch.optim.SGD(reference.parameters(), lr=0.1).step()
    assert_close_to_reference(loss, expected[torch.float32].detach(), expected[torch.float64].detach(), what="loss")
    assert_states_close_to_reference(model, references[torch.float32], references[torch.float64])

    # as the trunk's output: fine into a fused loss, refused where the engine would merge it for autograd
    trunk = nn.Sequential(nn.Linear(4, 4), ToHidden())
    with RoundPipeEngine(trunk, 2, EngineOptions(num_microbatches=2, num_stages=1)) as engine:
        engine.forward_backward(x, y, lambda out, target: F.cross_entropy(out.h[:, :3], target))
        with pytest.raises(ValueError, match="the trunk returned a dataclass instance"):
            engine(x)
    assert roundpipe_threads() == []


# ---------------------------------------------------------------------------- 4. empty batches
@pytest.mark.parametrize("fused", [False, True], ids=["transparent", "fused"])
def test_an_empty_batch_fails_fit_clearly_and_leaves_no_thread(fused, roundpipe_threads):
    batches = [(torch.randn(4, 6), torch.randint(0, 3, (4,))), (torch.randn(0, 6), torch.zeros(0, dtype=torch.long))]
    module = Trained(_mlp(), lambda batch: (batch[0], batch[1]), F.cross_entropy, fused)
    strategy = RoundPipeStrategy(num_microbatches=2, num_stages=2)
    with pytest.raises(ValueError, match=r"the batch is empty \(0 samples on dim 0\)"):
        _fit(module, DataLoader(batches, batch_size=None), strategy, devices=2)
    assert len(module.losses) == 1  # the first batch trained; the empty one was refused
    assert roundpipe_threads() == []
    assert "forward" not in module.net.__dict__  # the trunk's own forward is back


# ---------------------------------------------------------------------------- 5. unsafe layers
class RaisesDeviceMismatch(nn.Module):
    """Stands in for a layer that made a tensor on a hard-coded device: torch's own wording of the error."""

    def __init__(self, message: str) -> None:
        super().__init__()
        self.message = message

    def forward(self, x):
        raise RuntimeError(self.message)


@pytest.mark.parametrize("message, explained", [
    ("Expected all tensors to be on the same device, but found at least two devices, cuda:1 and cuda:0!", True),
    ("Expected all tensors to be on the same device, but got mat2 is on cuda:0, different from other tensors "
     "on cpu (when checking argument in method wrapper_CUDA_mm)", True),
    ("mat1 and mat2 shapes cannot be multiplied (4x3 and 5x2)", False),
])
def test_a_device_mismatch_inside_a_layer_is_explained(message, explained, roundpipe_threads):
    model = nn.Sequential(nn.Linear(3, 3), RaisesDeviceMismatch(message), nn.Linear(3, 2))
    engine = RoundPipeEngine(model, 2, EngineOptions(num_microbatches=2, num_stages=2)).start()
    with pytest.raises(PipelineError, match="trunk layer 1 raised RuntimeError") as caught:
        engine.forward_backward(torch.randn(4, 3), torch.randint(0, 2, (4,)), F.cross_entropy)
    text = str(caught.value)
    assert message in text and isinstance(caught.value.__cause__, RuntimeError)
    hints = ("run on per-device copies", "Do not hard-code a device", "device=x.device", "register_buffer")
    assert all(hint in text for hint in hints) == explained and any(hint in text for hint in hints) == explained
    assert roundpipe_threads() == []


class Counts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1  # an int: rebinds the attribute on whatever object runs the forward
        return x


class Remembers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)

    def forward(self, x):
        self.inner.last = x.detach()  # a new attribute, on a submodule
        return self.inner(x)


class RebindsBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("ema", torch.zeros(()))

    def forward(self, x):
        self.ema = 0.9 * self.ema + 0.1 * x.detach().mean()  # a new tensor, not an in-place update
        return x


def _features(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return torch.randn(4, 4, generator=generator), torch.randint(0, 4, (4,), generator=generator)


def _train_engine(model: nn.Sequential, batch=_features, loss_fn=F.cross_entropy, stages: int = 2) -> None:
    """Two training steps on two devices, each followed by a no-grad forward (a validation)."""
    with RoundPipeEngine(model, 2, EngineOptions(num_microbatches=2, num_stages=stages)) as engine:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(2):
            inputs, target = batch(step)
            engine.forward_backward(inputs, target, loss_fn)
            engine.step(optimizer)
            with torch.no_grad():
                engine(inputs)
        engine.synchronize()


def test_a_layer_writing_state_in_its_forward_is_warned_about_once_per_layer():
    model = nn.Sequential(nn.Linear(4, 4), Counts(), Remembers(), RebindsBuffer(), nn.Linear(4, 4))
    with pytest.warns(ReplicaWriteWarning) as record:
        _train_engine(model)
    messages = sorted(str(warning.message) for warning in record if warning.category is ReplicaWriteWarning)
    assert len(messages) == 3  # once per layer, over several jobs, devices and steps
    counts, remembers, rebinds = messages
    assert counts.startswith("trunk layer 1 (Counts) assigns the attribute(s) `calls` in its forward")
    assert remembers.startswith("trunk layer 2 (Remembers) assigns the attribute(s) `inner.last`")
    for message in (counts, remembers):
        assert "the host layer" in message and "never see it" in message
        assert "registered buffer updated in place" in message and "outside the trunk" in message
    assert rebinds.startswith("trunk layer 3 (RebindsBuffer) assigns new tensors to the buffer(s) `ema`")
    assert "update buffers in place" in rebinds
    # as the warning says: the host layers never saw the writes
    assert model[1].calls == 0 and not hasattr(model[2].inner, "last") and model[3].ema.item() == 0.0


class ScaledByAttribute(nn.Module):
    """Reads a plain attribute the training loop changes on the host layer between steps."""

    def __init__(self) -> None:
        super().__init__()
        self.factor = 1.0

    def forward(self, x):
        return x * self.factor


class CountsInPlace(nn.Module):
    """State kept the supported way: a buffer updated in place, and a shared list mutated."""

    def __init__(self, log: SharedLog) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.log = log

    def forward(self, x):
        self.calls += 1  # in place on a buffer: the same tensor is assigned back
        self.log.append(x.shape[0])
        return x


class LastStep(nn.Module):
    def forward(self, lstm_output):
        return lstm_output[0][:, -1]


class DeclaresItsCache(nn.Module):
    """Rebinds an attribute in its forward, declared as a cache it rebuilds: not lost state."""

    roundpipe_transient = ("cached_shape",)

    def forward(self, x):
        self.cached_shape = tuple(x.shape)
        return x


def _sequences(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return torch.randn(4, 5, 4, generator=generator), torch.randint(0, 4, (4,), generator=generator)


def test_safe_layers_raise_no_warning_and_host_attribute_changes_reach_the_devices():
    """Linear, Dropout, BatchNorm, LayerNorm, in-place ReLU, LSTM (which re-caches its weights in forward),
    a GPT block, in-place buffers, a declared cache: no write warning; and a plain attribute set on the host
    layer between steps is what the devices compute with, as in plain PyTorch."""
    log = SharedLog()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.ReLU(inplace=True), nn.Dropout(0.0),
                          nn.LayerNorm(16), ScaledByAttribute(), CountsInPlace(log), nn.Linear(16, 4))
    references = {torch.float32: clone(model), torch.float64: double(model)}  # plain PyTorch, same microbatches
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, *references.values())]
    losses, expected = [], {dtype: [] for dtype in references}
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReplicaWriteWarning)
        with RoundPipeEngine(model, 2, EngineOptions(num_microbatches=2, num_stages=3)) as engine:
            for step in range(3):
                for m in (model, *references.values()):
                    m[5].factor = 1.0 + step  # a schedule written on the host layer
                generator = torch.Generator().manual_seed(step)
                x, y = torch.randn(6, 4, generator=generator), torch.randint(0, 4, (6,), generator=generator)
                losses.append(engine.forward_backward(x, y, F.cross_entropy).item())
                engine.step(optimizers[0])
                for (dtype, reference), optimizer in zip(references.items(), optimizers[1:], strict=True):
                    loss = sum(F.cross_entropy(reference(part), target) * len(part) / 6
                               for part, target in zip(x.to(dtype).split(3), y.split(3), strict=True))
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad()
                    expected[dtype].append(loss.item())
            engine.synchronize()
        # Embed, Block (LayerNorm, attention, MLP, Dropout), Head
        _train_engine(tiny_gpt(blocks=2), lambda step: gpt_batch(4, step), gpt_loss, stages=3)
        torch.manual_seed(0)
        _train_engine(nn.Sequential(nn.LSTM(4, 8, batch_first=True), LastStep(), DeclaresItsCache(), nn.Linear(8, 4)),
                      _sequences)
    # two microbatches of 3 (BatchNorm sees each) in both: float32 within 4x the float32 reference's own error
    assert_close_to_reference(losses, expected[torch.float32], expected[torch.float64], what="losses")
    assert_states_close_to_reference(model, references[torch.float32], references[torch.float64])
    assert model[6].calls.item() == references[torch.float32][6].calls.item() == 6  # the buffer came back: once
    assert model[1].num_batches_tracked.item() == 6


def test_hugging_face_decoder_layers_write_no_state():
    transformers = pytest.importorskip("transformers")
    from lightning_roundpipe.engine.layers import build_trunk
    from lightning_roundpipe.hf.causal_lm import causal_lm_preset, summed_token_loss

    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
                                      attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    trunk = build_trunk(model, presets=(causal_lm_preset,))
    ids = torch.randint(0, 32, (4, 6))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReplicaWriteWarning)
        with RoundPipeEngine(trunk, 2, EngineOptions(num_microbatches=2, num_stages=1)) as engine:
            for _ in range(2):
                engine.forward_backward((ids, mask, None, ids), ids, summed_token_loss, loss_weight=token_count())
                engine.step(torch.optim.SGD(model.parameters(), lr=0.1))
            engine.synchronize()
