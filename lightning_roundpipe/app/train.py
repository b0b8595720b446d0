"""The main job: ``roundpipe-train`` (Hydra) trains a byte-level model and prints a summary.

The same entry point runs as ``python -m lightning_roundpipe.app`` and, in a clone, as
``python examples/train.py``. The configs ship inside the package (``lightning_roundpipe/app/conf``) and
Hydra finds them as package resources, so an installed copy works from any folder; ``--config-dir`` or
``hydra.searchpath`` add a folder of your own options.

:func:`run` does the work from a composed config, so tests and notebooks can call it in-process with
Hydra's compose API; :func:`main` is the ``hydra.main`` wrapper that adds the command line, run and
sweep folders and multirun.
"""

from __future__ import annotations

import copy
import math
import pathlib
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

import hydra
import lightning.pytorch as pl
import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from lightning.pytorch.callbacks import Callback, ProgressBar
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from omegaconf import DictConfig
from omegaconf.errors import MissingMandatoryValue

from lightning_roundpipe.app.progress import progress_bar
from lightning_roundpipe.app.schema import ConfigError, register, validate
from lightning_roundpipe.engine.options import OptionError

CONFIG_MODULE = "lightning_roundpipe.app.conf"  #: the shipped configs, as Hydra's package reference
CONFIG_DIR = str(pathlib.Path(__file__).resolve().with_name("conf"))  #: the same folder on disk (compose API)
register()


@dataclass
class Summary:
    """What a run reports at the end (also returned by :func:`run`)."""

    tokens_per_second: float  #: over every process of the run
    peak_device_bytes: list[int] | None
    bubble_ratio: float | None
    val_loss: float | None  #: the last validation's, also one of the run resumed from (``ckpt_path``)
    output_dir: str
    data: str
    sample: str
    timeline_files: list[str] = field(default_factory=list)  #: timeline.json / .png with strategy.timeline=true
    processes: int = 1  #: the processes that trained together (data parallel); the other figures are process 0's
    val_step: int | None = None  #: the global step of that validation

    def lines(self) -> list[str]:
        peak = "n/a (no RoundPipe engine)" if self.peak_device_bytes is None else ", ".join(
            f"{b / 2**20:.1f} MiB" for b in self.peak_device_bytes)
        bubble = "n/a" if self.bubble_ratio is None else f"{self.bubble_ratio:.1%}"
        val = "n/a" if self.val_loss is None else f"{self.val_loss:.3f} (perplexity {math.exp(self.val_loss):.2f})" + (
            "" if self.val_step is None else f" at step {self.val_step}")
        return [
            "=" * 24 + " summary " + "=" * 24,
            f"python          {sys.version.split()[0]} ({self.data})",
            f"tokens/s        {self.tokens_per_second:,.0f}"
            + (f" (all {self.processes} processes; the rest: process 0's)" if self.processes > 1 else ""),
            f"val loss        {val}",
            f"peak device mem {peak}",
            f"bubble ratio    {bubble}",
            f"outputs         {self.output_dir}",
            *([f"timeline        {', '.join(self.timeline_files)} (open the .json at ui.perfetto.dev)"]
              if self.timeline_files else []),
            *(["sample (host-side, bypassing the pipeline):"] if self.sample else []),
            *("  | " + line for line in self.sample.splitlines()[:8]),
            "=" * 57,
        ]


class _Throughput(Callback):
    """Training wall time, the tokens every process trained on and the engine's peak memory, read while the
    engine (and with several processes, their process group) is still running."""

    def __init__(self) -> None:
        self.start = self.seconds = self.tokens = 0.0
        self.peak: list[int] | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start = time.perf_counter()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.seconds = time.perf_counter() - self.start
        seen = torch.tensor(float(getattr(pl_module, "tokens_seen", 0)), dtype=torch.float64)
        self.tokens = float(trainer.strategy.reduce(seen, reduce_op="sum"))  # every process calls it here
        engine = getattr(trainer.strategy, "engine", None)
        if engine is not None:
            self.peak = list(engine.peak_resident_bytes())


class _LastValidation(Callback):
    """The last validation loss and the global step it was measured at. Its state goes into checkpoints, so a
    run resumed with ``ckpt_path`` that validates no more (or not yet) still reports the last one."""

    def __init__(self) -> None:
        self.loss: float | None = None
        self.step: int | None = None

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loss = trainer.callback_metrics.get("val/loss")
        if not trainer.sanity_checking and loss is not None:
            self.loss, self.step = float(loss), trainer.global_step

    def state_dict(self) -> dict[str, Any]:
        return {"loss": self.loss, "step": self.step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loss, self.step = state_dict["loss"], state_dict["step"]


def _instantiate_each(cfg: DictConfig, group: str) -> list[Any]:
    """Build every entry of the ``logger`` or ``callbacks`` node (name -> config with ``_target_``)."""
    built = []
    for name, entry in cfg[group].items():
        if entry is None:  # e.g. logger=many logger.tensorboard=null: drops one entry
            continue
        if "_target_" not in entry:
            raise ConfigError(f"`{group}.{name}` has no `_target_`: name the class to build, e.g. "
                              f"{group}.{name}._target_=lightning.pytorch.loggers.CSVLogger")
        try:
            built.append(instantiate(entry))
        except InstantiationException as error:
            cause = error.__cause__
            if isinstance(cause, ImportError):  # e.g. logger=tensorboard without the tensorboard package
                reason = str(cause).splitlines()[0]
                raise ConfigError(f"`{group}.{name}` needs a package that is not installed ({reason}): install "
                                  f"it, or leave the entry out with {group}.{name}=null") from None
            raise
    return built


def intra_op_threads(cfg: DictConfig) -> int:
    """``torch_threads``, or when it is null: 1 on CPU devices (each simulated device computes on its own
    thread, so more would oversubscribe the cores), else torch's default (every core: the host optimizer
    step and the gradient sums are the CPU's work, and a single thread makes the step the bottleneck)."""
    if cfg.torch_threads is not None:
        return int(cfg.torch_threads)
    accelerator = str(cfg.trainer.get("accelerator", "auto"))
    on_cpu = accelerator == "cpu" or accelerator == "auto" and not torch.cuda.is_available()
    return 1 if on_cpu else torch.get_num_threads()


def run(cfg: DictConfig, output_dir: str | pathlib.Path | None = None,
        extra_callbacks: Sequence[Callback] = ()) -> Summary:
    """Validate ``cfg``, build everything with ``instantiate``, train, sample, and return the summary.

    ``output_dir`` is the run's folder (logs, checkpoints, timelines); ``None`` keeps ``cfg.output_dir``,
    which the command line sets to Hydra's run folder. Compose-API callers pass a folder, and may add
    callbacks of their own (``extra_callbacks``: a benchmark's measurements).
    """
    if output_dir is not None:
        cfg = copy.deepcopy(cfg)  # a deep copy: interpolations such as ${output_dir} resolve in the copy
        cfg.output_dir = str(output_dir)
    validate(cfg)
    output_dir = pathlib.Path(cfg.output_dir)
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(intra_op_threads(cfg))
    try:
        datamodule = instantiate(cfg.data)
        model = instantiate(cfg.model)
        # strategy.timeline=true writes into the Trainer's default_root_dir, the run's folder (set below)
        strategy = instantiate(cfg.strategy)
        overrides: dict[str, Any] = {}
        if isinstance(strategy, pl.strategies.SingleDeviceStrategy):
            overrides["devices"] = 1  # the baseline trains on one device whatever the trainer group says
        throughput = _Throughput()
        last_validation = _LastValidation()
        callbacks: list[Callback] = [throughput, last_validation, *_instantiate_each(cfg, "callbacks"),
                                     *extra_callbacks]
        if cfg.trainer.get("enable_progress_bar", True) and not any(isinstance(c, ProgressBar) for c in callbacks):
            callbacks.append(progress_bar())  # Lightning's, with totals right for max_steps and a resume
        loggers: list[Logger] = _instantiate_each(cfg, "logger")
        try:
            # no logger chosen (logger=null): none at all, rather than Lightning's default TensorBoard one
            trainer: pl.Trainer = instantiate(cfg.trainer, strategy=strategy, callbacks=callbacks,
                                              logger=loggers or False, default_root_dir=str(output_dir), **overrides)
            trainer.fit(model, datamodule=datamodule, ckpt_path=cfg.ckpt_path)
        except (InstantiationException, OptionError) as error:
            problem = _as_config_error(error)
            if problem is None:
                raise
            raise problem from error
        metrics = trainer.callback_metrics
        bubble = metrics.get("roundpipe/bubble_ratio")
        sample = cfg.sample_tokens and trainer.is_global_zero  # the summary is process 0's to print
        text = model.sample(cfg.sample_prompt.encode(), cfg.sample_tokens, seed=cfg.seed) if sample else b""
        summary = Summary(
            tokens_per_second=throughput.tokens / max(throughput.seconds, 1e-9),
            peak_device_bytes=throughput.peak,
            bubble_ratio=None if bubble is None else float(bubble),
            val_loss=last_validation.loss,
            val_step=last_validation.step,
            output_dir=str(output_dir),
            data=datamodule.describe(),
            sample=text.decode("utf-8", errors="replace"),
            timeline_files=list(getattr(strategy, "timeline_files", [])),
            processes=trainer.world_size,
        )
    finally:
        torch.set_num_threads(threads)
    if trainer.is_global_zero:
        print("\n".join(summary.lines()), flush=True)
    return summary


@hydra.main(version_base="1.3", config_path=f"pkg://{CONFIG_MODULE}", config_name="config")
def main(cfg: DictConfig) -> float | None:
    """The Hydra entry point (``roundpipe-train``); returns the final validation loss (for sweepers)."""
    try:
        return run(cfg).val_loss
    except ConfigError as error:  # a bad value is the user's to fix: say which key, without a traceback
        _config_error(str(error))
    except MissingMandatoryValue as error:  # a `???` left unset that validate() does not name itself
        _config_error(f"`{error.full_key}` has no value: set it on the command line, {error.full_key}=...")


def _as_config_error(error: BaseException) -> ConfigError | None:
    """The config error ``error`` stands for, else ``None`` (a bug keeps its traceback): an option's value that
    only meeting the devices or the model rules out (``OptionError``, from the strategy's setup or trunk
    discovery, e.g. ``strategy.pipeline`` naming no submodule), or Trainer flags Lightning refuses when the
    Trainer is built (its ``MisconfigurationException``; Hydra's ``instantiate`` wraps both)."""
    cause = error.__cause__ if isinstance(error, InstantiationException) else error
    if isinstance(cause, OptionError):
        return ConfigError(f"`strategy.{cause.option}` {_one_line(cause.problem)}")
    if isinstance(cause, MisconfigurationException) and cause is not error:
        return ConfigError(f"`trainer`: {_one_line(cause)}")
    return None


def _one_line(message: object) -> str:
    return " ".join(str(message).split())


def _config_error(message: str) -> NoReturn:
    print(f"config error: {message}", file=sys.stderr)
    raise SystemExit(2) from None


if __name__ == "__main__":
    main()
