"""Typed schemas for the Hydra configs, and the checks that need more than a type.

The dataclasses are registered in Hydra's ConfigStore and each yaml file extends one (its defaults
list names ``base_*``), so an unknown key or a wrong type fails when the config is composed, naming
the key. :func:`validate` then rejects impossible values before anything is built.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig

RECOMPUTE_GRAINS = ("stage", "layer")
PREFLIGHT_MODES = ("refuse", "warn", "off")
CAUSAL_LM_FAMILIES = ("llama", "qwen3")
ATTN_IMPLEMENTATIONS = ("sdpa", "eager")
DTYPES = ("float32", "bfloat16", "float16")


class ConfigError(ValueError):
    """A config value that type-checks but cannot work; the message starts with the Hydra key."""


# ---------------------------------------------------------------------------- model
@dataclass
class GPTNetConf:
    _target_: str = "lightning_roundpipe.app.model.gpt"
    width: int = 64
    depth: int = 6
    heads: int = 4
    context: int = "${data.context}"  # type: ignore[assignment]  # interpolation, resolved to an int


@dataclass
class MLPNetConf:
    _target_: str = "lightning_roundpipe.app.model.mlp"
    width: int = 64
    depth: int = 4


@dataclass
class ByteLMConf:
    """The LightningModule's options; each model option adds its own ``net``."""

    _target_: str = "lightning_roundpipe.app.model.ByteLM"
    lr: float = 3e-3
    weight_decay: float = 0.01
    fused: bool = True
    context: Optional[int] = "${data.context}"  # type: ignore[assignment]


@dataclass
class GPTModelConf(ByteLMConf):
    net: GPTNetConf = field(default_factory=GPTNetConf)


@dataclass
class MLPModelConf(ByteLMConf):
    net: MLPNetConf = field(default_factory=MLPNetConf)


@dataclass
class LoRAConf:
    """LoRA adapters (peft): ``+model/lora=default`` switches them on, then ``model.lora.r=16`` etc."""

    r: int = 8
    alpha: int = 16
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


@dataclass
class CausalLMConf:
    """A Hugging Face causal LM built from a config (random init, no download) by ``app.causal_lm.CausalLM``.

    The architecture keys are the ``transformers`` config's own (``LlamaConfig`` / ``Qwen3Config``).
    """

    _target_: str = "lightning_roundpipe.app.hf_model.CausalLM"
    _convert_: str = "all"  # `lora` arrives as a plain dict and its list as a list (peft saves them as JSON)
    family: str = "llama"
    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: Optional[int] = None     # null: hidden_size // num_attention_heads
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True
    attn_implementation: str = "sdpa"
    dtype: str = "float32"             # of the stored weights
    lora: Optional[LoRAConf] = None    # null: full fine-tuning
    lr: float = 3e-3
    weight_decay: float = 0.01
    context: Optional[int] = "${data.context}"  # type: ignore[assignment]  # the sampling window


# ---------------------------------------------------------------------------- data
@dataclass
class StdlibDataConf:
    _target_: str = "lightning_roundpipe.app.data.StdlibDataModule"
    context: int = 64
    batch_size: int = 12
    val_fraction: float = 0.05
    val_windows: int = 96
    limit_bytes: Optional[int] = None
    train_samples: int = 1_000_000
    seed: int = "${seed}"  # type: ignore[assignment]


@dataclass
class TextPathDataConf(StdlibDataConf):
    _target_: str = "lightning_roundpipe.app.data.TextPathDataModule"
    path: str = MISSING


# ---------------------------------------------------------------------------- trainer
@dataclass
class TrainerConf:
    _target_: str = "lightning.pytorch.Trainer"
    accelerator: str = "cpu"
    devices: Any = 2
    precision: str = "32-true"
    max_steps: int = 1800
    max_epochs: int = -1
    val_check_interval: Any = 300
    limit_val_batches: Any = 1.0
    log_every_n_steps: int = 10
    gradient_clip_val: Optional[float] = None
    fast_dev_run: Any = False
    enable_progress_bar: bool = True
    num_sanity_val_steps: int = 0


# ---------------------------------------------------------------------------- strategy
@dataclass
class RoundPipeConf:
    _target_: str = "lightning_roundpipe.strategy.RoundPipeStrategy"
    pipeline: Optional[str] = None     # null: the Hugging Face causal LM, else the largest nn.Sequential
    num_stages: Any = "auto"           # "auto" or the chunk count (number of forward stages)
    num_microbatches: Optional[int] = None
    async_step: bool = False
    recompute: str = "stage"
    pin_memory: bool = True
    device_memory_limit: Any = None    # bytes or "20GiB"
    timeline: bool = False             # write timeline.json (Chrome trace) and timeline.png into the run's folder
    timeline_steps: Optional[int] = 3  # the last this many optimizer steps (null: all)
    preflight: str = "refuse"          # the memory plan at setup: refuse | warn | off
    ring: Optional[list[int]] = None   # ring members as indices into the Trainer's devices, e.g. [0, 0]


@dataclass
class SingleDeviceConf:
    _target_: str = "lightning.pytorch.strategies.SingleDeviceStrategy"
    device: str = "cpu"


# ---------------------------------------------------------------------------- top level
@dataclass
class Config:
    model: Any = MISSING
    data: Any = MISSING
    trainer: TrainerConf = field(default_factory=TrainerConf)
    strategy: Any = MISSING
    seed: int = 0
    sample_tokens: int = 200
    sample_prompt: str = "def "
    torch_threads: int = 1


def register() -> None:
    """Put the schemas in Hydra's ConfigStore (idempotent)."""
    store = ConfigStore.instance()
    store.store(name="base_config", node=Config)
    store.store(group="model", name="base_gpt", node=GPTModelConf)
    store.store(group="model", name="base_mlp", node=MLPModelConf)
    store.store(group="model", name="base_causal_lm", node=CausalLMConf)
    store.store(group="model/lora", name="base_lora", node=LoRAConf)
    store.store(group="data", name="base_stdlib", node=StdlibDataConf)
    store.store(group="data", name="base_text_path", node=TextPathDataConf)
    store.store(group="trainer", name="base_trainer", node=TrainerConf)
    store.store(group="strategy", name="base_roundpipe", node=RoundPipeConf)
    store.store(group="strategy", name="base_single_device", node=SingleDeviceConf)


def _fail(key: str, message: str) -> None:
    raise ConfigError(f"`{key}` {message}")


def validate(cfg: DictConfig) -> None:
    """Reject values that type-check but cannot work, naming the Hydra key, before anything is built."""
    from lightning_roundpipe.engine.options import parse_bytes

    strategy = cfg.strategy
    if "num_microbatches" in strategy:
        m = strategy.num_microbatches
        if m is not None and m < 1:
            _fail("strategy.num_microbatches", f"must be at least 1 (or null for devices + 1), got {m}")
        if strategy.recompute not in RECOMPUTE_GRAINS:
            _fail("strategy.recompute", f"must be one of {RECOMPUTE_GRAINS}, got {strategy.recompute!r}")
        k = strategy.num_stages
        if k != "auto" and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            _fail("strategy.num_stages", f"must be 'auto' or a chunk count of at least 1, got {k!r}")
        if strategy.get("preflight", "refuse") not in PREFLIGHT_MODES:
            _fail("strategy.preflight", f"must be one of {PREFLIGHT_MODES}, got {strategy.preflight!r}")
        steps = strategy.get("timeline_steps")
        if steps is not None and steps < 1:
            _fail("strategy.timeline_steps", f"must be at least 1 (or null for every step), got {steps}")
        try:
            parse_bytes(strategy.device_memory_limit)
        except ValueError as error:
            _fail("strategy.device_memory_limit", f"is invalid: {error}")
    if "family" in cfg.model:
        _validate_causal_lm(cfg.model, cfg.data.context)
        if strategy.get("pipeline") not in (None, "model"):
            _fail("strategy.pipeline", f"must be `model` (or null) for a Hugging Face model option, got "
                  f"{strategy.pipeline!r}")
    data = cfg.data
    for key in ("context", "batch_size", "val_windows", "train_samples"):
        if data[key] < 1:
            _fail(f"data.{key}", f"must be at least 1, got {data[key]}")
    if not 0 < data.val_fraction < 1:
        _fail("data.val_fraction", f"must be between 0 and 1, got {data.val_fraction}")
    if "path" in data:
        path = pathlib.Path(data.path).expanduser()  # a missing value raises here, naming `data.path`
        if not path.exists():
            _fail("data.path", f"names no file or folder: {str(path)!r}")
    if cfg.sample_tokens < 0:
        _fail("sample_tokens", f"must be at least 0, got {cfg.sample_tokens}")


def _validate_causal_lm(model: DictConfig, context: int) -> None:
    for key, allowed in (("family", CAUSAL_LM_FAMILIES), ("attn_implementation", ATTN_IMPLEMENTATIONS),
                         ("dtype", DTYPES)):
        if model[key] not in allowed:
            _fail(f"model.{key}", f"must be one of {allowed}, got {model[key]!r}")
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads"):
        if model[key] < 1:
            _fail(f"model.{key}", f"must be at least 1, got {model[key]}")
    if model.vocab_size < 256:
        _fail("model.vocab_size", f"must be at least 256 (the data are bytes), got {model.vocab_size}")
    heads, kv_heads = model.num_attention_heads, model.num_key_value_heads
    if model.head_dim is None and model.hidden_size % heads:
        _fail("model.hidden_size", f"({model.hidden_size}) must be a multiple of `model.num_attention_heads` "
              f"({heads}), or set `model.head_dim`")
    if model.head_dim is not None and model.head_dim < 1:
        _fail("model.head_dim", f"must be at least 1 (or null), got {model.head_dim}")
    if heads % kv_heads:
        _fail("model.num_key_value_heads", f"({kv_heads}) must divide `model.num_attention_heads` ({heads})")
    if model.max_position_embeddings < context:
        _fail("model.max_position_embeddings", f"({model.max_position_embeddings}) must be at least "
              f"`data.context` ({context})")
    lora = model.lora
    if lora is not None:
        if lora.r < 1:
            _fail("model.lora.r", f"must be at least 1 (or set `model.lora=null` for full fine-tuning), got {lora.r}")
        if lora.alpha <= 0:
            _fail("model.lora.alpha", f"must be positive, got {lora.alpha}")
        if not 0 <= lora.dropout < 1:
            _fail("model.lora.dropout", f"must be in [0, 1), got {lora.dropout}")
        if not lora.target_modules:
            _fail("model.lora.target_modules", "must name at least one module, e.g. [q_proj,v_proj]")
