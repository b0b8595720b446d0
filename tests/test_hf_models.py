"""Any Hugging Face transformer with a list of layers (``lightning_roundpipe/hf/base_model.py``): decoder-only
LMs and encoders from tiny random configs, trained in a LightningModule as a user writes it, against Lightning's
default strategy on the same seeded model and data. Float64 with several microbatches: equal to 1e-12
(``tests/numerics.py``), except Gemma, whose RMSNorm computes in float32 whatever the model's dtype (see
:func:`test_every_architecture_trains_as_under_the_default_strategy`)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

transformers = pytest.importorskip("transformers")

import lightning_roundpipe  # noqa: E402,F401 - registers the strategy names
from lightning_roundpipe import RoundPipeStrategy  # noqa: E402
from lightning_roundpipe.traced import TracedTrunk  # noqa: E402
from lightning_roundpipe.trunk import find_trunk  # noqa: E402
from tests.models import RecordsLosses  # noqa: E402
from tests.numerics import (  # noqa: E402
    assert_float64_equal,
    assert_states_close_to_reference,
    assert_states_equal,
    assert_states_float64_equal,
)

VOCAB, WIDTH, LENGTH, CLASSES = 64, 32, 10, 3
SIZES = dict(num_hidden_layers=2, hidden_size=WIDTH, intermediate_size=64, num_attention_heads=4)
DECODER = dict(**SIZES, vocab_size=VOCAB, num_key_value_heads=2, max_position_embeddings=32)


def _configs() -> dict:
    t = transformers
    return {  # dropout off everywhere: both strategies would draw it, but not in the same order
        "gpt2": (t.GPT2LMHeadModel, t.GPT2Config(n_layer=2, n_embd=WIDTH, n_head=2, vocab_size=VOCAB, n_positions=32,
                                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
        "llama": (t.LlamaForCausalLM, t.LlamaConfig(**DECODER)),
        "mistral": (t.MistralForCausalLM, t.MistralConfig(**DECODER)),
        "qwen3": (t.Qwen3ForCausalLM, t.Qwen3Config(**DECODER, head_dim=8)),
        "gemma": (t.GemmaForCausalLM, t.GemmaConfig(**DECODER, head_dim=8)),
        "phi": (t.PhiForCausalLM, t.PhiConfig(**DECODER)),
        "bert": (t.BertForSequenceClassification, t.BertConfig(**SIZES, vocab_size=VOCAB, num_labels=CLASSES,
                                                                hidden_dropout_prob=0.0,
                                                                attention_probs_dropout_prob=0.0)),
        "vit": (t.ViTForImageClassification, t.ViTConfig(**SIZES, image_size=16, patch_size=4, num_labels=CLASSES)),
    }


ARCHITECTURES = ["gpt2", "llama", "mistral", "qwen3", "gemma", "phi", "bert", "vit"]
VARIANTS = ["gpt2+labels", "mistral+lora"]  # Hugging Face's own LM loss from labels; LoRA adapters (peft)
PRESETS = {"llama", "qwen3"}  # causal LMs with RoundPipe's own preset: their logits take its transparent path
# computed partly in float32 whatever the model's dtype: GemmaRMSNorm, and Hugging Face's LM loss (logits.float())
FLOAT32_INSIDE = {"gemma", "gpt2+labels"}


class Model(RecordsLosses):
    """A user's module: the LMs' next-token loss from the logits (padding ignored), or their own ``.loss``
    from labels (``+labels``); the classifiers' own ``.loss`` from their labels; ``+lora``: LoRA adapters."""

    def __init__(self, variant: str) -> None:
        super().__init__()
        architecture, _, self.extra = variant.partition("+")
        model_class, config = _configs()[architecture]
        torch.manual_seed(0)
        self.model = model_class(config)
        if self.extra == "lora":
            peft = pytest.importorskip("peft")
            self.model = peft.get_peft_model(self.model, peft.LoraConfig(r=4, lora_alpha=8,
                                                                         target_modules=["q_proj", "v_proj"]))
            for name, param in self.model.named_parameters():  # B starts at zero: let the first steps see A
                if "lora_B" in name:
                    torch.nn.init.normal_(param, std=0.02)
        self.architecture = architecture

    def loss(self, batch) -> torch.Tensor:
        if self.architecture == "vit":
            return self.model(pixel_values=batch["pixels"], labels=batch["labels"]).loss
        mask = batch.get("mask")
        if self.architecture == "bert":
            return self.model(input_ids=batch["ids"], attention_mask=mask, labels=batch["labels"]).loss
        targets = batch["ids"] if mask is None else batch["ids"].masked_fill(mask == 0, -100)
        if self.extra == "labels":
            return self.model(input_ids=batch["ids"], attention_mask=mask, labels=targets).loss
        logits = self.model(input_ids=batch["ids"], attention_mask=mask).logits
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), targets[:, 1:].flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)


def _batches(steps: int = 2, samples: int = 6, seed: int = 1) -> DataLoader:
    """Token batches (right padding in some rows of the first; no attention mask in the others), class labels,
    and images."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for step in range(steps):
        batch = {"ids": torch.randint(0, VOCAB, (samples, LENGTH), generator=generator),
                 "labels": torch.randint(0, CLASSES, (samples,), generator=generator),
                 "pixels": torch.randn(samples, 3, 16, 16, generator=generator)}
        if step == 0:
            batch["mask"] = torch.ones(samples, LENGTH, dtype=torch.long)
            batch["mask"][1, 6:] = batch["mask"][4, 8:] = 0
        batches.append(batch)
    return DataLoader(batches, batch_size=None)


def _fit(module: Model, strategy, devices: int = 1, precision: str = "64-true") -> Model:
    pl.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_epochs=1, logger=False,
               enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
               num_sanity_val_steps=0, limit_val_batches=1, precision=precision).fit(module, _batches(), _batches(1))
    return module


@pytest.mark.parametrize("architecture", ARCHITECTURES + VARIANTS)
def test_every_architecture_trains_as_under_the_default_strategy(architecture, roundpipe_threads):
    reference = _fit(Model(architecture), "auto")
    strategy = RoundPipeStrategy(num_microbatches=3)
    module = _fit(Model(architecture), strategy, devices=2)
    trunk = strategy.engine.trunk
    assert len(trunk) == 4  # the layers and what comes before and after them
    assert isinstance(trunk, TracedTrunk) == (architecture not in PRESETS)
    if architecture in FLOAT32_INSIDE:
        # a float64 run of a model that computes partly in float32 is not a float64 computation: bound by the
        # reference's own float32 error instead (tests/numerics.py, case 3)
        reference32 = _fit(Model(architecture), "auto", precision="32-true")
        assert_states_close_to_reference(module, reference32, reference)
    else:
        assert len(module.losses) == 2 and len(module.val_losses) == 1
        assert_float64_equal(module.losses, reference.losses, what="losses")
        assert_float64_equal(module.val_losses, reference.val_losses, what="validation losses")
        assert_states_float64_equal(module, reference)
    assert list(module.state_dict()) == list(reference.state_dict())
    assert roundpipe_threads() == []


@pytest.mark.parametrize("pipeline", [None, "model", "model.transformer", "model.transformer.h"])
def test_the_base_model_is_the_trunk_whichever_part_pipeline_names(pipeline):
    module = Model("gpt2")
    assert find_trunk(module, pipeline) == ("model.transformer", module.model.transformer)
    assert find_trunk(module, "model.lm_head") == ("model.lm_head", module.model.lm_head)  # the head is no base


class DropoutMistral(Model):
    """Mistral with attention dropout, which its attention applies as a function (no nn.Dropout module)."""

    def __init__(self) -> None:
        super().__init__("mistral")
        torch.manual_seed(0)
        self.model = transformers.MistralForCausalLM(transformers.MistralConfig(**DECODER, attention_dropout=0.3))


def test_functional_attention_dropout_is_seeded_and_replayed():
    # seeded per (step, call, layer, microbatch) and replayed in recomputation, the masks do not depend on the
    # device count; drawn unseeded, they would (and recomputation would draw other masks than the forward)
    strategy = RoundPipeStrategy(num_microbatches=3)
    two = _fit(DropoutMistral(), strategy, devices=2)
    three = _fit(DropoutMistral(), RoundPipeStrategy(num_microbatches=3), devices=3)
    assert_states_equal(two, three)
    layers = strategy.engine.trunk.layers
    assert [layer.roundpipe_random for layer in layers] == [False, True, True, False]  # the blocks, in training
    assert two.losses != _fit(Model("mistral"), "auto").losses  # the dropout did draw


def test_a_larger_trunk_of_the_module_itself_wins_over_a_small_hugging_face_model():
    module = Model("bert")  # ~37,000 parameters
    module.net = nn.Sequential(nn.Linear(WIDTH, 1024), nn.Linear(1024, WIDTH))  # ~66,000
    assert find_trunk(module) == ("net", module.net)
    module.net = nn.Sequential(nn.Linear(WIDTH, 8), nn.Linear(8, WIDTH))
    assert find_trunk(module) == ("model.bert", module.model.bert)


def _refusal(module: pl.LightningModule) -> str:
    trainer = pl.Trainer(strategy=RoundPipeStrategy(), accelerator="cpu", devices=2, max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises((TypeError, ValueError)) as error:
        trainer.fit(module, _batches(steps=1))
    return str(error.value)


class Seq2Seq(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = transformers.T5ForConditionalGeneration(transformers.T5Config(
            vocab_size=VOCAB, d_model=WIDTH, d_kv=8, d_ff=64, num_layers=1, num_heads=2))

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch["ids"], labels=batch["ids"]).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_an_encoder_decoder_model_is_refused_saying_what_to_do():
    message = _refusal(Seq2Seq())
    assert "`model` is a T5ForConditionalGeneration, a Hugging Face encoder-decoder model" in message
    assert "Train it under another strategy (strategy='auto')" in message


class Asking(Model):
    """GPT-2 called with an option whose result the layers would have to fill in on the devices."""

    validation_step = pl.LightningModule.validation_step  # the call is refused before any validation

    def __init__(self, option: dict) -> None:
        super().__init__("gpt2")
        self.option = option

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch["ids"], labels=batch["ids"], **self.option).loss


@pytest.mark.parametrize("option, expected", [
    ({"use_cache": True}, "GPT2Model runs without a KV cache (use_cache=True was passed"),
    ({"output_attentions": True}, "GPT2Model is called with output_attentions=...: the model collects those"),
    ({"output_hidden_states": True}, "GPT2Model is called with output_hidden_states=...: the model collects"),
])
def test_options_the_layers_cannot_serve_are_refused(option, expected):
    assert expected in _refusal(Asking(option))


def test_flex_attention_is_refused():
    module = Model("mistral")
    module.model.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match="`model` \\(MistralForCausalLM\\) uses attn_implementation='flex_attention'"):
        find_trunk(module)


# ---------------------------------------------------------------------------- what the traced path needs for them
class Rotary(nn.Module):
    """A table computed from the configuration (a non-persistent buffer), as Hugging Face's rotary embeddings."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("frequencies", torch.linspace(0.1, 1.0, WIDTH), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cos(torch.arange(x.shape[1], dtype=x.dtype)[:, None] * self.frequencies)


class TableAfterBlocks(nn.Module):
    """Registers its table module after the blocks (as ``LlamaModel.rotary_emb``) and uses it before them."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList([nn.Linear(WIDTH, WIDTH) for _ in range(2)])
        self.head = nn.Linear(WIDTH, VOCAB)
        self.rotary = Rotary()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        table = self.rotary(x)
        for block in self.blocks:
            x = torch.tanh(block(x) * table)
        return self.head(x)


class TableModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = TableAfterBlocks()

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.net(batch["ids"]).flatten(0, 1), batch["ids"].flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def test_a_table_module_registered_after_the_blocks_feeds_them():
    reference = TableModule()
    pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False, precision="64-true").fit(reference, _batches())
    module = TableModule()
    strategy = RoundPipeStrategy(num_microbatches=3)
    pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_epochs=1, logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False, precision="64-true").fit(module, _batches())
    assert_states_float64_equal(module, reference)
    prologue = strategy.engine.trunk.layers[0]
    assert prologue.get_submodule("rotary") is module.net.rotary  # the prologue's, though registered last
