"""Typed schemas for the Hydra configs, and the checks that need more than a type.

The dataclasses are registered in Hydra's ConfigStore under ``schema/<group>`` and each yaml option
extends one (its defaults list names e.g. ``/schema/model@_here_: gpt``), so an unknown key or a wrong
type fails when the config is composed, naming the key. They live outside the user-facing groups so
that Hydra does not offer them as options (``model=gpt`` would be an empty shell). :func:`validate`
then rejects impossible values before anything is built.
"""

from __future__ import annotations

import pathlib
import types
from collections.abc import Sequence
from dataclasses import dataclass, field, make_dataclass
from typing import Any, Literal, Optional, Union, get_args, get_origin

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from lightning_roundpipe.app.optimizers import OPTIMIZERS
from lightning_roundpipe.engine.options import OptionError
from lightning_roundpipe.strategy_options import OptionSpec, build_options, option_specs

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
    optimizer: str = "adamw"  # adamw | adamw8bit (bitsandbytes' 8-bit moments: app/optimizers.py)


@dataclass
class GPTModelConf(ByteLMConf):
    net: GPTNetConf = field(default_factory=GPTNetConf)


@dataclass
class MLPModelConf(ByteLMConf):
    net: MLPNetConf = field(default_factory=MLPNetConf)


LORA_BASES = ("as_stored", "nf4")


@dataclass
class LoRAConf:
    """LoRA adapters (peft): ``+model/lora=default`` switches them on, then ``model.lora.r=16`` etc."""

    r: int = 8
    alpha: int = 16
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    base: str = "as_stored"  # as_stored | nf4: the frozen base's Linear weights in 4 bits (QLoRA: nf4.py)


@dataclass
class CausalLMConf:
    """A Hugging Face causal LM built from a config (random init, no download) by ``app.hf_model.CausalLM``.

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
    optimizer: str = "adamw"  # adamw | adamw8bit (bitsandbytes' 8-bit moments: app/optimizers.py)


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
    num_nodes: int = 1  # machines; each runs strategy.rings_per_node processes
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
ROUNDPIPE_TARGET = "lightning_roundpipe.strategy.RoundPipeStrategy"
_PLAIN_TYPES = (bool, int, float, str)


def hydra_type(hint: Any) -> Any:
    """The type OmegaConf checks for an option annotated ``hint``: a plain type, ``list`` of one, a choice of
    strings as ``str``, ``Optional`` of those; ``Any`` for the rest (``int | str``, a ``Plan``), which
    :func:`validate` checks when it builds the options."""
    if hint in _PLAIN_TYPES:
        return hint
    origin, args = get_origin(hint), get_args(hint)
    if origin is Literal and all(isinstance(arg, str) for arg in args):
        return str
    if origin is list and len(args) == 1 and args[0] in _PLAIN_TYPES:
        return types.GenericAlias(list, args)
    if origin in (Union, types.UnionType) and type(None) in args:
        rest = [arg for arg in args if arg is not type(None)]
        inner = hydra_type(rest[0]) if len(rest) == 1 else Any
        return Any if inner is Any else Optional[inner]
    return Any


def roundpipe_conf(specs: Sequence[OptionSpec] | None = None) -> type:
    """The schema of ``strategy=roundpipe``: ``_target_`` and one field per strategy option (default:
    :func:`~lightning_roundpipe.strategy_options.option_specs`), with the option's default and :func:`hydra_type`."""
    fields: list[tuple[str, Any, Any]] = [("_target_", str, field(default=ROUNDPIPE_TARGET))]
    for spec in option_specs() if specs is None else specs:
        fields.append((spec.name, hydra_type(spec.type), field(default=spec.default)))
    conf = make_dataclass("RoundPipeConf", fields)
    conf.__module__ = __name__
    conf.__doc__ = ("RoundPipeStrategy's options, made from StrategyOptions and EngineOptions "
                    "(lightning_roundpipe/strategy_options.py documents each)")
    return conf


RoundPipeConf = roundpipe_conf()


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
    # name -> {_target_: ..., ...}: each is instantiated; the logger and callbacks groups fill them
    logger: dict[str, Any] = field(default_factory=dict)
    callbacks: dict[str, Any] = field(default_factory=dict)
    output_dir: str = MISSING          # the run's folder; config.yaml sets it to Hydra's
    ckpt_path: Optional[str] = None    # a checkpoint to resume from (Trainer.fit's ckpt_path)
    seed: int = 0
    sample_tokens: int = 200
    sample_prompt: str = "def "
    torch_threads: Optional[int] = None  # null: 1 on CPU devices, torch's default (every core) on GPUs


def register() -> None:
    """Put the schemas in Hydra's ConfigStore (idempotent)."""
    store = ConfigStore.instance()
    store.store(name="base_config", node=Config)
    store.store(group="schema/model", name="gpt", node=GPTModelConf)
    store.store(group="schema/model", name="mlp", node=MLPModelConf)
    store.store(group="schema/model", name="causal_lm", node=CausalLMConf)
    store.store(group="schema/model/lora", name="lora", node=LoRAConf)
    store.store(group="schema/data", name="stdlib", node=StdlibDataConf)
    store.store(group="schema/data", name="text_path", node=TextPathDataConf)
    store.store(group="schema/trainer", name="trainer", node=TrainerConf)
    store.store(group="schema/strategy", name="roundpipe", node=RoundPipeConf)
    store.store(group="schema/strategy", name="single_device", node=SingleDeviceConf)


def _fail(key: str, message: str) -> None:
    raise ConfigError(f"`{key}` {message}")


def validate(cfg: DictConfig) -> None:
    """Reject values that type-check but cannot work, naming the Hydra key, before anything is built."""
    strategy = cfg.strategy
    if str(strategy.get("_target_", "")).rsplit(".", 1)[-1] == "RoundPipeStrategy":
        _validate_roundpipe(strategy)
    if "family" in cfg.model:
        _validate_causal_lm(cfg.model, cfg.data.context)
        if strategy.get("pipeline") not in (None, "model"):
            _fail("strategy.pipeline", f"must be `model` (or null) for a Hugging Face model option, got "
                  f"{strategy.pipeline!r}")
    if cfg.model.get("optimizer", "adamw") not in OPTIMIZERS:
        _fail("model.optimizer", f"must be one of {', '.join(OPTIMIZERS)}, got {cfg.model.optimizer!r}")
    data = cfg.data
    for key in ("context", "batch_size", "val_windows", "train_samples"):
        if data[key] < 1:
            _fail(f"data.{key}", f"must be at least 1, got {data[key]}")
    if not 0 < data.val_fraction < 1:
        _fail("data.val_fraction", f"must be between 0 and 1, got {data.val_fraction}")
    if "path" in data.keys():  # `in data` alone is False while the value is missing (???)
        if OmegaConf.is_missing(data, "path"):
            _fail("data.path", "is required with data=text_path: add data.path=/your/corpus.txt (a file, or a "
                  "folder whose files are read in sorted order)")
        path = pathlib.Path(data.path).expanduser()
        if not path.exists():
            _fail("data.path", f"names no file or folder: {str(path)!r}")
    ckpt_path = cfg.get("ckpt_path")
    if ckpt_path is not None and "://" not in ckpt_path and not pathlib.Path(ckpt_path).expanduser().is_file():
        _fail("ckpt_path", f"names no checkpoint file: {ckpt_path!r}; give a .ckpt a run wrote, e.g. "
              "ckpt_path=outputs/<date>/<time>/checkpoints/last.ckpt, or null to start afresh")
    if cfg.sample_tokens < 0:
        _fail("sample_tokens", f"must be at least 0, got {cfg.sample_tokens}")
    if cfg.torch_threads is not None and cfg.torch_threads < 1:
        _fail("torch_threads", f"must be at least 1 (or null for the accelerator's default), got {cfg.torch_threads}")


def _validate_roundpipe(strategy: DictConfig) -> None:
    """Build the strategy's options as the strategy will: the same checks and messages, named by Hydra key."""
    values = OmegaConf.to_container(strategy, resolve=True)
    assert isinstance(values, dict)
    options = {str(key): value for key, value in values.items()
               if not (str(key).startswith("_") and str(key).endswith("_"))}  # _target_ and the like
    try:
        build_options(options)
    except OptionError as error:
        raise ConfigError(f"`strategy.{error.option}` {error.problem}") from error
    except (ValueError, TypeError) as error:
        raise ConfigError(f"`strategy` {error}") from error


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
        if lora.base not in LORA_BASES:
            _fail("model.lora.base", f"must be one of {list(LORA_BASES)}, got {lora.base!r}")
