"""Hugging Face causal LMs, unchanged, under RoundPipe: the same LightningModule and data as Lightning's
default strategy, full fine-tuning and LoRA, with padded batches and ignored labels."""

from __future__ import annotations

import copy
import sys

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import lightning_roundpipe  # noqa: E402,F401 - registers the strategy names
from lightning_roundpipe import RoundPipeStrategy  # noqa: E402
from lightning_roundpipe.nf4 import to_nf4  # noqa: E402
from tests.numerics import assert_close_to_reference, assert_states_close_to_reference, assert_states_equal  # noqa: E402

VOCAB = 64
# Tolerances (tests/numerics.py): RoundPipe's microbatches sum in another order than Lightning's whole batches,
# so its float32 results must be within 4x Lightning's own float32 distance from Lightning's float64 run
# (precision="64-true") of the same module and data.


def tiny_llama(tied: bool = True, seed: int = 0) -> torch.nn.Module:
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=tied, attn_implementation="sdpa")
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config)


def tiny_qwen3(tied: bool = False, seed: int = 0) -> torch.nn.Module:
    config = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      max_position_embeddings=64, tie_word_embeddings=tied,
                                      attn_implementation="eager")
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config)


def tiny_qwen2(seed: int = 0) -> torch.nn.Module:
    config = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=True, attn_implementation="sdpa")
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config)


def with_lora(model: torch.nn.Module, seed: int = 1) -> torch.nn.Module:
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, task_type="CAUSAL_LM",
                             target_modules=["q_proj", "v_proj", "up_proj"])
    torch.manual_seed(seed)
    lora = peft.get_peft_model(model, config)
    for name, param in lora.named_parameters():  # LoRA's B starts at zero: make the first steps see A too
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.02)
    return lora


class PaddedTokens(Dataset):
    """Right- and left-padded sequences with some labels ignored (-100) besides the padding."""

    def __init__(self, samples: int = 24, length: int = 12, seed: int = 3) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (samples, length), generator=generator)
        self.mask = torch.ones(samples, length, dtype=torch.long)
        for index in range(samples):
            pad = int(torch.randint(0, length // 2, (), generator=generator))
            if index % 3 == 1:
                self.mask[index, length - pad:] = 0   # right padding
            elif index % 3 == 2:
                self.mask[index, :pad] = 0            # left padding
        self.labels = self.ids.masked_fill(self.mask == 0, -100)
        ignored = torch.rand(samples, length, generator=generator) < 0.15
        self.labels = self.labels.masked_fill(ignored, -100)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int):
        return {"input_ids": self.ids[index], "attention_mask": self.mask[index], "labels": self.labels[index]}


class CausalLMModule(pl.LightningModule):
    """How a user writes it: the Hugging Face model's own loss, nothing RoundPipe-specific."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.losses: list[float] = []
        self.val_losses: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = self.model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
                          labels=batch["labels"]).loss
        self.losses.append(loss.item())
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.val_losses.append(loss.item())
        self.log("val_loss", loss)

    def configure_optimizers(self):
        params = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def _fit(module: pl.LightningModule, strategy, devices: int = 1, precision: str = "32-true",
         padding: str = "padded") -> pl.Trainer:
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=1, num_sanity_val_steps=0, precision=precision)
    train, val = PaddedTokens(), PaddedTokens(6, seed=4)
    if padding != "padded":
        train, val = Unpadded(train, with_mask=padding == "ones"), Unpadded(val, with_mask=padding == "ones")
    trainer.fit(module, DataLoader(train, batch_size=6), DataLoader(val, batch_size=6))
    return trainer


class Unpadded(Dataset):
    """``PaddedTokens`` with every token attended: an attention mask of ones, or none at all."""

    def __init__(self, padded: PaddedTokens, with_mask: bool) -> None:
        self.padded, self.with_mask = padded, with_mask

    def __len__(self) -> int:
        return len(self.padded)

    def __getitem__(self, index: int):
        item = dict(self.padded[index])
        mask = item.pop("attention_mask")
        if self.with_mask:
            item["attention_mask"] = torch.ones_like(mask)
        return item


def _eager_attention_in_the_inputs_dtype(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Hugging Face's eager attention, but with the softmax in the inputs' dtype. Its own takes the softmax in
    float32: in float64 that is not a float64 computation, and the additive mask of a row with no key to attend
    to (left padding) becomes -inf there, which gives NaN."""
    groups = module.num_key_value_groups
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        weights = weights + attention_mask
    weights = torch.nn.functional.dropout(weights.softmax(dim=-1), p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


EAGER_FLOAT64 = "roundpipe_tests_eager_float64"
transformers.AttentionInterface.register(EAGER_FLOAT64, _eager_attention_in_the_inputs_dtype)
transformers.masking_utils.AttentionMaskInterface.register(EAGER_FLOAT64, transformers.masking_utils.eager_mask)


class Float64Reference(CausalLMModule):
    """The float64 reference of ``CausalLMModule`` (and ``LogitsModule``), run with ``precision="64-true"``.
    Two things Hugging Face does would keep it from being one: its loss casts the logits to float32, so this
    takes the same token mean (labels shifted by one, -100 ignored) of the float64 logits; and its eager
    attention takes the softmax in float32, so an eager model runs the same attention with a float64 softmax."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        base = model.get_base_model() if isinstance(model, peft.PeftModel) else model
        if base.config._attn_implementation == "eager":
            base.set_attn_implementation(EAGER_FLOAT64)

    def _loss(self, batch) -> torch.Tensor:
        logits = self.model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask")).logits
        shifted = torch.nn.functional.pad(batch["labels"], (0, 1), value=-100)[:, 1:]
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), shifted.flatten(), ignore_index=-100)

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch, batch_idx):
        self.val_losses.append(self._loss(batch).item())


def _references(model: torch.nn.Module, module_type=None, padding: str = "padded"
                ) -> tuple[CausalLMModule, CausalLMModule]:
    """Lightning's default strategy on copies of ``model``: ``module_type`` in float32, and its float64
    counterpart in float64."""
    reference, reference64 = (module_type or CausalLMModule)(copy.deepcopy(model)), Float64Reference(copy.deepcopy(model))
    _fit(reference, "auto", padding=padding)
    _fit(reference64, "auto", precision="64-true", padding=padding)
    assert next(reference64.parameters()).dtype == torch.float64
    return reference, reference64


def _assert_same_training(module: CausalLMModule, reference: CausalLMModule, reference64: CausalLMModule) -> None:
    assert len(module.losses) == len(reference.losses) == len(reference64.losses) == 4
    assert_close_to_reference(module.losses, reference.losses, reference64.losses, what="losses")
    assert_close_to_reference(module.val_losses, reference.val_losses, reference64.val_losses, what="val_losses")
    assert_states_close_to_reference(module, reference, reference64)


MODELS = {"llama_tied": lambda: tiny_llama(tied=True), "qwen3_untied": lambda: tiny_qwen3(tied=False),
          "qwen2_tied": tiny_qwen2}


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("family", sorted(MODELS))
def test_training_equals_the_unmodified_model_under_lightnings_default_strategy(family, lora):
    model = MODELS[family]()
    if lora:
        model = with_lora(model)
    reference, reference64 = _references(model)
    module = CausalLMModule(model)
    initial = {name: param.detach().clone() for name, param in module.named_parameters()}
    trainer = _fit(module, RoundPipeStrategy(num_microbatches=3, num_stages=3), devices=2)
    _assert_same_training(module, reference, reference64)
    inner = model.get_base_model() if lora else model
    assert "forward" not in inner.__dict__  # the model's own forward is back after fit
    if lora:
        optimizer = trainer.optimizers[0]
        stepped = {id(p) for p in optimizer.state}
        for name, param in module.named_parameters():
            if "lora_" in name:
                assert param.requires_grad and id(param) in stepped, name
                assert not torch.equal(param, initial[name]), f"adapter {name} did not train"
            else:
                assert param.grad is None and id(param) not in stepped, f"frozen {name} got a gradient or state"
                assert torch.equal(param, initial[name]), f"frozen {name} changed"


def test_qlora_trains_as_under_lightnings_default_strategy():
    """peft's LoRA on a base whose frozen Linears are NF4 (``lightning_roundpipe.nf4``): the references, float32
    and float64, compute with the same 4-bit weights (dequantised in float32, widened exactly)."""
    model = with_lora(tiny_llama(tied=False))
    assert to_nf4(model) == 3 * 7  # every projection of the 3 layers; the LM head kept
    reference, reference64 = _references(model)
    module = CausalLMModule(model)
    _fit(module, RoundPipeStrategy(num_microbatches=3, num_stages=3), devices=2)
    _assert_same_training(module, reference, reference64)
    assert sum(type(layer).__name__ == "NF4Linear" for layer in module.model.modules()) == 3 * 7  # handed back


def test_tied_embedding_is_one_parameter_stepped_once():
    model = tiny_llama(tied=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    reference, reference64 = _references(model)
    module = CausalLMModule(model)
    _fit(module, RoundPipeStrategy(num_microbatches=2), devices=2)
    assert module.model.lm_head.weight is module.model.model.embed_tokens.weight
    assert_close_to_reference(module.model.lm_head.weight, reference.model.lm_head.weight,
                              reference64.model.lm_head.weight, what="lm_head.weight")


def test_state_dict_keys_and_save_pretrained_are_unchanged(tmp_path):
    model = tiny_qwen3()
    keys = list(model.state_dict())
    module = CausalLMModule(model)
    _fit(module, RoundPipeStrategy(num_microbatches=2), devices=2)
    assert list(module.model.state_dict()) == keys
    module.model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    for name, param in loaded.named_parameters():
        torch.testing.assert_close(param, dict(module.model.named_parameters())[name], rtol=0, atol=0)


class LogitsModule(CausalLMModule):
    """The transparent path: the model returns logits and the module computes its own loss."""

    def training_step(self, batch, batch_idx):
        logits = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        shifted = torch.nn.functional.pad(batch["labels"], (0, 1), value=-100)[:, 1:]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), shifted.flatten(), ignore_index=-100)
        self.losses.append(loss.item())
        return loss


def test_logits_without_labels_take_the_transparent_path():
    model = tiny_llama(tied=False)
    reference, reference64 = _references(model, LogitsModule)
    module = LogitsModule(model)
    _fit(module, RoundPipeStrategy(num_microbatches=3), devices=2)
    _assert_same_training(module, reference, reference64)


def test_lora_base_stays_in_its_stored_dtype_on_the_host_and_the_devices(caplog):
    model = tiny_llama().to(torch.bfloat16)
    model = with_lora(model)  # peft keeps the adapters in float32 (autocast_adapter_dtype)
    seen: dict[str, tuple[torch.dtype, bool]] = {}
    attention = model.get_base_model().model.layers[1].self_attn
    attention.q_proj.base_layer.register_forward_hook(
        lambda m, i, o: seen.__setitem__("base", (m.weight.dtype, m.weight.requires_grad)))
    attention.q_proj.lora_A.default.register_forward_hook(
        lambda m, i, o: seen.__setitem__("adapter", (m.weight.dtype, m.weight.requires_grad)) if torch.is_grad_enabled()
        else None)
    module = CausalLMModule(model)
    trainer = pl.Trainer(strategy=RoundPipeStrategy(num_microbatches=2), accelerator="cpu", devices=2,
                         precision="bf16-mixed", max_steps=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    with caplog.at_level("INFO", logger="lightning_roundpipe"):
        trainer.fit(module, DataLoader(PaddedTokens(), batch_size=6))
    # hooks fire in the device replicas: the weights they computed with are the uploaded copies; the float32
    # adapters are Linear weights that autocast casts anyway, so they travel in bfloat16 (transport_dtype)
    assert seen["base"] == (torch.bfloat16, False)
    assert seen["adapter"] == (torch.bfloat16, True)
    frozen = [p for p in model.parameters() if not p.requires_grad]
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert all(p.dtype == torch.bfloat16 for p in frozen) and all(p.dtype == torch.float32 for p in trainable)
    # the setup log states what the host holds, by dtype
    frozen_count, trainable_count = sum(p.numel() for p in frozen), sum(p.numel() for p in trainable)
    assert f"trainable {trainable_count:,} float32" in caplog.text
    assert f"frozen {frozen_count:,} bfloat16" in caplog.text
    assert all(torch.isfinite(torch.tensor(loss)) for loss in module.losses)


def test_a_lora_base_from_a_bf16_checkpoint_is_kept_in_bf16_alone_with_the_same_results():
    """A float32 model holding bfloat16 values (a bf16 checkpoint loaded into float32): under bf16-mixed the base's
    Linear weights are kept in bf16 alone (``frozen_weights="auto"``); the norms (float32 compute) and the tied
    embedding (read as stored by the lookup outside the trunk) stay float32. Bitwise the run with every weight
    as stored, and the module comes back in float32."""
    runs = {}
    for setting in ("auto", "as_stored"):
        model = with_lora(tiny_llama().to(torch.bfloat16).float())
        module = CausalLMModule(model)
        strategy = RoundPipeStrategy(num_microbatches=2, frozen_weights=setting)
        trainer = _fit(module, strategy, devices=2, precision="bf16-mixed")
        runs[setting] = module, trainer, strategy.memory_plan
    (ours, ours_trainer, plan), (reference, reference_trainer, _) = runs["auto"], runs["as_stored"]
    decoder = ours.model.get_base_model().model.layers
    expected = [param for layer in decoder for module in layer.modules() if type(module) is torch.nn.Linear
                for param in module.parameters() if not param.requires_grad]
    assert plan.frozen_narrowed == len(expected) and plan.frozen_freed_bytes == 4 * sum(p.numel() for p in expected)
    assert ours.losses == reference.losses
    assert_states_equal(ours, reference)
    assert_states_equal(ours_trainer.optimizers[0].state_dict()["state"],
                        reference_trainer.optimizers[0].state_dict()["state"])
    assert {param.dtype for param in ours.parameters()} == {torch.float32}


def test_unsupported_calls_and_models_are_refused_with_a_clear_message():
    module = CausalLMModule(tiny_llama())

    class Probe(pl.Callback):
        errors: list[str] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            model = pl_module.model
            for call in (lambda: model.generate(batch["input_ids"][:1], max_new_tokens=2),
                         lambda: model(inputs_embeds=torch.zeros(2, 4, 32)),
                         lambda: model(input_ids=batch["input_ids"], output_attentions=True)):
                with pytest.raises(ValueError) as error:
                    call()
                self.errors.append(str(error.value))
            raise KeyboardInterrupt  # stop after the checks; Lightning tears down gracefully

    probe = Probe()
    trainer = pl.Trainer(strategy=RoundPipeStrategy(), accelerator="cpu", devices=2, max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[probe])
    with pytest.raises(SystemExit):
        trainer.fit(module, DataLoader(PaddedTokens(), batch_size=6))
    assert "use_cache" in probe.errors[0] and "after trainer.fit" in probe.errors[0]
    assert "inputs_embeds" in probe.errors[1]
    assert "output_attentions" in probe.errors[2]
    # models without a preset (GPT-2, ...) take the generic path: tests/test_hf_models.py


def test_an_unsupported_transformers_version_is_refused(monkeypatch):
    from lightning_roundpipe.hf.causal_lm import SUPPORTED_TRANSFORMERS, find_causal_lm

    model = tiny_llama()
    assert find_causal_lm(model) is model
    installed = sys.modules["transformers"]  # transformers may replace its lazy module object on first use
    monkeypatch.setattr(installed, "__version__", "4.30.0")
    with pytest.raises(RuntimeError, match=f"transformers >={SUPPORTED_TRANSFORMERS[0]},<{SUPPORTED_TRANSFORMERS[1]}"):
        find_causal_lm(model)
    monkeypatch.setattr(installed, "__version__", SUPPORTED_TRANSFORMERS[1])
    with pytest.raises(RuntimeError, match="found " + SUPPORTED_TRANSFORMERS[1]):
        find_causal_lm(model)


def test_lora_dropout_does_not_depend_on_the_device_count():
    """Dropout masks are seeded per (step, call, layer, microbatch) and replayed when backward stages
    recompute, so one device and three train the same adapters."""
    results = []
    for devices in (1, 3):
        model = tiny_llama(tied=False)
        config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.3, task_type="CAUSAL_LM",
                                 target_modules=["q_proj", "v_proj", "up_proj"])
        torch.manual_seed(1)
        module = CausalLMModule(peft.get_peft_model(model, config))
        _fit(module, RoundPipeStrategy(num_microbatches=3, seed=7), devices=devices)
        results.append(({n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad},
                        module.losses))
    (params_one, losses_one), (params_three, losses_three) = results
    # the same microbatches, masks and kernels, gradients accumulated in the same order: bitwise
    assert losses_three == losses_one
    assert_states_equal(params_three, params_one)


def test_hugging_face_gradient_checkpointing_is_flagged_as_redundant():
    from lightning_roundpipe.hf.causal_lm import causal_lm_preset

    model = tiny_llama()
    assert len(causal_lm_preset(model)) == 3 + 2  # embedding, three blocks, head
    model.gradient_checkpointing_enable()
    with pytest.warns(UserWarning, match="gradient_checkpointing_disable"):
        causal_lm_preset(model)


# ---------------------------------------------------------------------------- masks without host reads (C5)
def _positions(batch: int, length: int, restart: int | None = None) -> torch.Tensor:
    positions = torch.arange(length).repeat(batch, 1)
    if restart is not None:  # two sequences packed into each row
        positions[:, restart:] -= restart
    return positions


def test_mask_facts_are_found_on_the_host():
    from lightning_roundpipe.hf.causal_lm import MaskFacts, mask_facts

    ones, padded = torch.ones(3, 8, dtype=torch.long), torch.ones(3, 8, dtype=torch.long)
    padded[1, :2] = 0
    four_d = torch.ones(3, 1, 8, 8, dtype=torch.bool)
    assert mask_facts(ones, None) == (None, MaskFacts(padded=False, packed=False))  # ones: transformers' None
    assert mask_facts(ones, _positions(3, 8, restart=4)) == (None, MaskFacts(padded=False, packed=False))
    mask, facts = mask_facts(padded, _positions(3, 8, restart=4))
    assert mask is padded and facts == MaskFacts(padded=True, packed=False)
    assert mask_facts(None, None) == (None, MaskFacts(padded=False, packed=False))
    assert mask_facts(None, _positions(3, 8)) == (None, MaskFacts(padded=False, packed=False))
    assert mask_facts(None, _positions(3, 8) + 5) == (None, MaskFacts(padded=False, packed=False))  # an offset
    assert mask_facts(None, _positions(3, 8, restart=4)) == (None, MaskFacts(padded=False, packed=True))
    mask, facts = mask_facts(four_d, None)
    assert mask is four_d and facts == MaskFacts()  # a prepared mask is transformers' to read


def tiny_qwen3_sliding() -> torch.nn.Module:
    config = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      max_position_embeddings=64, use_sliding_window=True, sliding_window=4,
                                      max_window_layers=1, attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


def _refuse_host_reads(monkeypatch) -> None:
    """Make every read of a tensor's value into Python fail, and transformers' two readers of masks."""
    def refuse(*args, **kwargs):
        raise AssertionError("a tensor was read on the host (a device sync on an accelerator)")

    for name in ("__bool__", "item", "tolist", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    monkeypatch.setattr(transformers.masking_utils, "find_packed_sequence_indices", refuse)
    monkeypatch.setattr(transformers.masking_utils, "fast_all", refuse)


MASK_MODELS = {"llama_sdpa": lambda: tiny_llama(tied=False), "qwen3_eager": tiny_qwen3,
               "qwen3_sdpa_sliding": tiny_qwen3_sliding}


@pytest.mark.parametrize("inputs", ["none", "mask_padded", "mask_ones", "positions", "mask_ones_packed_positions"])
@pytest.mark.parametrize("family", sorted(MASK_MODELS))
def test_the_preset_reads_no_tensor_on_the_host_and_equals_the_model(family, inputs, monkeypatch):
    """The embedding layer builds the masks (and the rest of the layers run) without reading a tensor into
    Python, given the facts the model's call finds on the host; the logits equal the model's own, bitwise."""
    from lightning_roundpipe.hf.causal_lm import causal_lm_preset, mask_facts

    model = MASK_MODELS[family]().eval()
    layers = causal_lm_preset(model)
    ids = torch.randint(0, VOCAB, (3, 10), generator=torch.Generator().manual_seed(0))
    mask = position_ids = None
    if inputs.startswith("mask"):
        mask = torch.ones_like(ids)
        if inputs == "mask_padded":
            mask[1, :3] = 0  # left padding
            mask[2, 7:] = 0  # right padding
    if inputs == "positions":
        position_ids = _positions(3, 10) + 2
    if inputs == "mask_ones_packed_positions":  # with a mask, transformers does not look for packing
        position_ids = _positions(3, 10, restart=6)
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=False).logits
        dispatched, facts = mask_facts(mask, position_ids)
        with monkeypatch.context() as patch:
            _refuse_host_reads(patch)
            state = layers[0](ids, dispatched, position_ids, None, facts)
            for layer in layers[1:]:
                state = layer(state)
    assert torch.equal(state, expected)


@pytest.mark.parametrize("family", sorted(MASK_MODELS))
def test_without_facts_no_position_ids_are_read(family, monkeypatch):
    """Called without facts (the engine used directly) and without position ids, the embedding layer passes
    none to transformers' mask builder: an arange would make it look for packed sequences on the device."""
    from lightning_roundpipe.hf.causal_lm import causal_lm_preset

    model = MASK_MODELS[family]().eval()
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(input_ids=ids, use_cache=False).logits
        embedding, *rest = causal_lm_preset(model)
        with monkeypatch.context() as patch:
            _refuse_host_reads(patch)
            state = embedding(ids)
        for layer in rest:
            state = layer(state)
    assert torch.equal(state, expected)


def test_packed_sequences_are_left_to_transformers():
    """Position ids that restart within a row (packed sequences, no attention mask) reach transformers' mask
    builder, which keeps the sequences apart: the logits equal the model's, not those of one long sequence."""
    from lightning_roundpipe.hf.causal_lm import causal_lm_preset, mask_facts

    model = tiny_llama(tied=False).eval()
    layers = causal_lm_preset(model)
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(2))
    packed = _positions(2, 10, restart=6)
    with torch.no_grad():
        expected = model(input_ids=ids, position_ids=packed, use_cache=False).logits
        dispatched, facts = mask_facts(None, packed)
        assert dispatched is None and facts.packed
        state = layers[0](ids, None, packed, None, facts)
        for layer in layers[1:]:
            state = layer(state)
        unpacked = model(input_ids=ids, position_ids=packed, attention_mask=torch.ones_like(ids), use_cache=False).logits
    assert torch.equal(state, expected)
    assert not torch.allclose(expected[:, 6:], unpacked[:, 6:])  # packing did change the second sequence


@pytest.mark.parametrize("padding", ["padded", "ones", "none"])
def test_training_builds_masks_without_transformers_host_reads(padding, monkeypatch):
    """Through the strategy, the microbatches' masks are built (forward and the backward stages' recomputes)
    without transformers' readers of the mask and the position ids, and training equals Lightning's."""
    model = tiny_llama(tied=True)
    reference, reference64 = _references(model, padding=padding)
    calls: list[str] = []
    masking = transformers.masking_utils
    for name in ("find_packed_sequence_indices", "fast_all"):
        original = getattr(masking, name)
        monkeypatch.setattr(masking, name, lambda *a, _name=name, _original=original, **k: (
            calls.append(_name), _original(*a, **k))[1])
    module = CausalLMModule(model)
    _fit(module, RoundPipeStrategy(num_microbatches=3, num_stages=2), devices=2, padding=padding)
    monkeypatch.undo()
    assert calls == []
    _assert_same_training(module, reference, reference64)
