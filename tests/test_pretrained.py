"""Pretrained weights from safetensors files (``weights_from``, issue 26 item 4): a Hugging Face model built on the meta
device in ``configure_model`` and materialized tensor by tensor from ``save_pretrained``'s shards trains bitwise as
the same model loaded with ``from_pretrained`` (float32) and trained by the same strategy; what cannot be right is
refused with a message that says what to change."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import lightning_roundpipe  # noqa: E402,F401 - registers the strategy names
from lightning_roundpipe import RoundPipeStrategy  # noqa: E402
from lightning_roundpipe.engine import master_files  # noqa: E402
from lightning_roundpipe.engine.step.disk_tier import DiskTier  # noqa: E402
from lightning_roundpipe.materialize import MaterializeError  # noqa: E402
from lightning_roundpipe.nf4 import NF4Linear, to_nf4  # noqa: E402
from lightning_roundpipe.pretrained import INDEX, WeightsError  # noqa: E402
from tests.numerics import assert_same_optimizer_state, assert_states_equal  # noqa: E402
from tests.test_causal_lm import CausalLMModule, PaddedTokens, tiny_llama  # noqa: E402


class BuiltInConfigureModel(CausalLMModule):
    """The model built from its config in ``configure_model``, as the app builds its Hugging Face models."""

    def __init__(self, config, lora: bool = False, nf4: bool = False, **lora_options) -> None:
        super().__init__(None)
        self.config, self.lora, self.nf4, self.lora_options = config, lora, nf4, lora_options

    def configure_model(self) -> None:
        if self.model is None:
            self.model = with_adapters(transformers.AutoModelForCausalLM.from_config(self.config), self.lora,
                                       self.nf4, **self.lora_options)


def with_adapters(model, lora: bool, nf4: bool, **options):
    """LoRA on the last layer's q and v projections (``options``: more of ``LoraConfig``); ``nf4``: then every
    frozen projection in NF4."""
    if lora:
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                           layers_to_transform=[2], **options))
    if nf4:
        to_nf4(model)
    return model


def _save(tmp_path, tied: bool = True):
    """A tiny Llama saved as Hugging Face shards: several files and their index."""
    model = tiny_llama(tied=tied, seed=5)
    directory = tmp_path / "pretrained"
    model.save_pretrained(directory, max_shard_size="20KB")
    assert (directory / INDEX).is_file() and len(list(directory.glob("*.safetensors"))) > 2
    return model.config, directory


def _trainer(strategy, precision: str) -> pl.Trainer:
    return pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_epochs=1, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      limit_val_batches=0, num_sanity_val_steps=0, precision=precision)


def _data() -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(PaddedTokens(), batch_size=8)


def _roundpipe(**kwargs) -> RoundPipeStrategy:
    return RoundPipeStrategy(ring=[0, 0], num_microbatches=2, freeze_plan=True, **kwargs)


@pytest.mark.parametrize("precision,tier", [("32-true", {}), ("bf16-mixed", {"offload": "optimizer+masters"})],
                         ids=["fp32", "bf16-masters-on-disk"])
def test_a_meta_built_hugging_face_model_takes_its_weights_from_shards_as_from_pretrained(tmp_path, precision, tier):
    config, directory = _save(tmp_path)
    if tier:
        tier = {**tier, "offload_dir": str(tmp_path / "tier")}
        (tmp_path / "tier").mkdir()
    reference = CausalLMModule(transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32))
    reference_trainer = _trainer(_roundpipe(**tier), precision)
    reference_trainer.fit(reference, _data())

    module = BuiltInConfigureModel(config)
    trainer = _trainer(_roundpipe(weights_from=str(directory), **tier), precision)
    trainer.fit(module, _data())
    assert module.model.lm_head.weight is module.model.model.embed_tokens.weight  # still tied
    # the rotary tables no file holds: what the model's own initialisation computes
    assert torch.equal(module.model.model.rotary_emb.inv_freq, reference.model.model.rotary_emb.inv_freq)
    assert module.losses == reference.losses and len(module.losses) == 3
    assert_states_equal(module, reference)
    assert_same_optimizer_state(trainer, reference_trainer)


def test_weights_from_refuses_a_module_built_in_memory_and_another_models_files(tmp_path):
    config, directory = _save(tmp_path)
    built = CausalLMModule(tiny_llama())  # in memory: it would train from its own random weights
    with pytest.raises(WeightsError, match="was built in memory, not on the meta device"):
        _trainer(_roundpipe(weights_from=str(directory)), "32-true").fit(built, _data())
    other = tmp_path / "other"  # one layer more: the last layer's tensors have no place in this model
    deeper = config.to_dict() | {"num_hidden_layers": config.num_hidden_layers + 1}
    transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**deeper)).save_pretrained(other)
    with pytest.raises(WeightsError, match=r"holds 9 tensors this module has no place for, e.g. \['model.layers.3."):
        _trainer(_roundpipe(weights_from=str(other)), "32-true").fit(BuiltInConfigureModel(config), _data())
    with pytest.raises(WeightsError, match="neither a .safetensors file nor a directory"):
        _trainer(_roundpipe(weights_from=str(tmp_path)), "32-true").fit(BuiltInConfigureModel(config), _data())


class InitialAdapters(pl.Callback):
    """The adapters' values once setup has given them (materialized on the meta device), before any step."""

    def __init__(self) -> None:
        self.values: dict[str, torch.Tensor] = {}

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.values = {name: param.detach().clone() for name, param in pl_module.named_parameters()
                       if "lora_" in name}


@pytest.mark.parametrize("nf4", [False, True], ids=["lora", "qlora"])
def test_adapters_on_a_meta_built_model_take_peft_initialisation_and_the_base_its_shards(tmp_path, nf4):
    """LoRA (and QLoRA: the frozen projections NF4, quantised as each loads from the shards) built on the meta device
    in configure_model with weights_from: A drawn as peft draws it (kaiming uniform, nn.Linear's bound), B zero;
    the base (its NF4 bytes) what from_pretrained (then to_nf4) gives; training bitwise the in-memory model's given
    the same initial adapters."""
    pytest.importorskip("bitsandbytes")
    config, directory = _save(tmp_path)
    initial = InitialAdapters()
    module = BuiltInConfigureModel(config, lora=True, nf4=nf4)
    trainer = _trainer(_roundpipe(weights_from=str(directory)), "32-true")
    trainer.callbacks.append(initial)
    trainer.fit(module, _data())

    reference = CausalLMModule(with_adapters(
        transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32), True, nf4))
    assert {name for name, _ in reference.named_parameters() if "lora_" in name} == set(initial.values)
    for name, value in initial.values.items():
        if "lora_B" in name:
            assert torch.equal(value, torch.zeros_like(value)), name
        else:
            bound = 1 / value.shape[1] ** 0.5  # kaiming_uniform_(a=sqrt(5)): nn.Linear's weight bound
            assert value.abs().max() <= bound and value.std() > bound / 4, name
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if name in initial.values:
                param.copy_(initial.values[name])
    reference_trainer = _trainer(_roundpipe(), "32-true")
    reference_trainer.fit(reference, _data())
    assert module.losses == reference.losses and len(module.losses) == 3
    assert_states_equal(module, reference)
    assert_same_optimizer_state(trainer, reference_trainer)
    assert sum(isinstance(layer, NF4Linear) for layer in module.modules()) == (3 * 7 if nf4 else 0)


def test_an_nf4_layer_built_on_meta_without_a_source_is_refused(tmp_path):
    pytest.importorskip("bitsandbytes")
    config, _ = _save(tmp_path)
    trainer = _trainer(_roundpipe(), "32-true")
    with trainer.init_module(empty_init=True):
        base = transformers.AutoModelForCausalLM.from_config(config).requires_grad_(False)
        module = CausalLMModule(with_adapters(base, False, True))
    with pytest.raises(MaterializeError, match=r"\(NF4Linear\) was built on the meta device and nothing gives its "
                                               r"weight_nf4, weight_absmax a value: .*weights_from"):
        trainer.fit(module, _data())


def test_peft_adapters_built_on_meta_without_values_are_refused(tmp_path, roundpipe_threads, monkeypatch):
    """An adapter initialised from the base weights (DoRA's magnitudes, PiSSA, ...) is not replayed on a meta build:
    initialising it as a plain Linear would start training from another function, so the meta build is refused,
    naming the adapter and what to do. The layers settled before it had moved their masters into files
    (``offload="optimizer+masters"``): the disk tier's thread ends with the refused setup."""
    config, directory = _save(tmp_path)
    made: list[DiskTier] = []

    class Recorded(DiskTier):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(master_files, "DiskTier", Recorded)
    strategy = _roundpipe(weights_from=str(directory), offload="optimizer+masters", offload_dir=str(tmp_path / "tier"))
    with pytest.raises(MaterializeError,
                       match=r"a peft adapter, was built on the meta device .*from_pretrained, then get_peft_model"):
        _trainer(strategy, "bf16-mixed").fit(BuiltInConfigureModel(config, lora=True, use_dora=True), _data())
    assert len(made) == 1 and made[0].master_bytes() > 0  # layers 0 and 1 had moved their masters
    assert roundpipe_threads() == []
