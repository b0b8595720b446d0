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
    pipeline: Optional[str] = "net"
    num_stages: Any = "auto"           # "auto" or the chunk count (number of forward stages)
    num_microbatches: Optional[int] = None
    async_step: bool = False
    recompute: str = "stage"
    pin_memory: bool = True
    device_memory_limit: Any = None    # bytes or "20GiB"


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
    store.store(group="data", name="base_stdlib", node=StdlibDataConf)
    store.store(group="data", name="base_text_path", node=TextPathDataConf)
    store.store(group="trainer", name="base_trainer", node=TrainerConf)
    store.store(group="strategy", name="base_roundpipe", node=RoundPipeConf)
    store.store(group="strategy", name="base_single_device", node=SingleDeviceConf)


def _fail(key: str, message: str) -> None:
    raise ConfigError(f"`{key}` {message}")


def validate(cfg: DictConfig) -> None:
    """Reject values that type-check but cannot work, naming the Hydra key, before anything is built."""
    from lightning_roundpipe.config import parse_bytes

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
        try:
            parse_bytes(strategy.device_memory_limit)
        except ValueError as error:
            _fail("strategy.device_memory_limit", f"is invalid: {error}")
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
