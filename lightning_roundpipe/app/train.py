"""The main job: ``python examples/train.py`` (Hydra) trains a byte-level model and prints a summary.

:func:`run` does the work from a composed config, so tests and notebooks can call it in-process with
Hydra's compose API; :func:`main` is the ``hydra.main`` wrapper that adds the command line, run and
sweep folders and multirun.
"""

from __future__ import annotations

import math
import pathlib
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import hydra
import lightning.pytorch as pl
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, Logger
from omegaconf import DictConfig

from lightning_roundpipe.app.schema import ConfigError, register, validate

CONFIG_DIR = str(pathlib.Path(__file__).resolve().with_name("conf"))  # shipped inside the package
register()


@dataclass
class Summary:
    """What a run reports at the end (also returned by :func:`run`)."""

    tokens_per_second: float
    peak_device_bytes: list[int] | None
    bubble_ratio: float | None
    val_loss: float | None
    output_dir: str
    data: str
    sample: str
    timeline_files: list[str] = field(default_factory=list)  #: timeline.json / .png with strategy.timeline=true

    def lines(self) -> list[str]:
        peak = "n/a (no RoundPipe engine)" if self.peak_device_bytes is None else ", ".join(
            f"{b / 2**20:.1f} MiB" for b in self.peak_device_bytes)
        bubble = "n/a" if self.bubble_ratio is None else f"{self.bubble_ratio:.1%}"
        val = "n/a" if self.val_loss is None else f"{self.val_loss:.3f} (perplexity {math.exp(self.val_loss):.2f})"
        return [
            "=" * 24 + " summary " + "=" * 24,
            f"python          {sys.version.split()[0]} ({self.data})",
            f"tokens/s        {self.tokens_per_second:,.0f}",
            f"val loss        {val}",
            f"peak device mem {peak}",
            f"bubble ratio    {bubble}",
            f"outputs         {self.output_dir}",
            *([f"timeline        {', '.join(self.timeline_files)} (open the .json at ui.perfetto.dev)"]
              if self.timeline_files else []),
            "sample (host-side, bypassing the pipeline):",
            *("  | " + line for line in self.sample.splitlines()[:8]),
            "=" * 57,
        ]


class _Throughput(Callback):
    """Training wall time and the engine's peak memory, read while the engine is still running."""

    def __init__(self) -> None:
        self.start = self.seconds = 0.0
        self.peak: list[int] | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start = time.perf_counter()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.seconds = time.perf_counter() - self.start
        engine = getattr(trainer.strategy, "engine", None)
        if engine is not None:
            self.peak = list(engine.peak_resident_bytes())


def _tensorboard_available() -> bool:
    try:
        import tensorboard  # noqa: F401
        return True
    except ImportError:
        try:
            import tensorboardX  # noqa: F401
            return True
        except ImportError:
            return False


def run(cfg: DictConfig, output_dir: str | pathlib.Path) -> Summary:
    """Validate ``cfg``, build everything with ``instantiate``, train, sample, and return the summary."""
    validate(cfg)
    output_dir = pathlib.Path(output_dir)
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.torch_threads)
    try:
        datamodule = instantiate(cfg.data)
        model = instantiate(cfg.model)
        # strategy.timeline=true: the timeline files land in this run's folder
        timeline = {"timeline_dir": str(output_dir)} if cfg.strategy.get("timeline") else {}
        strategy = instantiate(cfg.strategy, **timeline)
        overrides: dict[str, Any] = {}
        if isinstance(strategy, pl.strategies.SingleDeviceStrategy):
            overrides["devices"] = 1  # the baseline trains on one device whatever the trainer group says
        throughput = _Throughput()
        callbacks: list[Callback] = [throughput, ModelCheckpoint(dirpath=output_dir / "checkpoints",
                                                                 monitor="val/loss", save_last=True)]
        loggers: list[Logger] = [CSVLogger(output_dir, name="logs", version="")]
        if _tensorboard_available():
            from lightning.pytorch.loggers import TensorBoardLogger
            loggers.append(TensorBoardLogger(output_dir, name="tensorboard", version=""))
        trainer: pl.Trainer = instantiate(cfg.trainer, strategy=strategy, callbacks=callbacks, logger=loggers,
                                          default_root_dir=str(output_dir), **overrides)
        trainer.fit(model, datamodule=datamodule)
        metrics = trainer.callback_metrics
        bubble = metrics.get("roundpipe/bubble_ratio")
        val = metrics.get("val/loss")
        text = model.sample(cfg.sample_prompt.encode(), cfg.sample_tokens, seed=cfg.seed) if cfg.sample_tokens else b""
        summary = Summary(
            tokens_per_second=model.tokens_seen / max(throughput.seconds, 1e-9),
            peak_device_bytes=throughput.peak,
            bubble_ratio=None if bubble is None else float(bubble),
            val_loss=None if val is None else float(val),
            output_dir=str(output_dir),
            data=datamodule.describe(),
            sample=text.decode("utf-8", errors="replace"),
            timeline_files=list(getattr(strategy, "timeline_files", [])),
        )
    finally:
        torch.set_num_threads(threads)
    print("\n".join(summary.lines()), flush=True)
    return summary


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")
def main(cfg: DictConfig) -> float | None:
    """The Hydra entry point; returns the final validation loss (for sweepers)."""
    try:
        return run(cfg, HydraConfig.get().runtime.output_dir).val_loss
    except ConfigError as error:  # a bad value is the user's to fix: say which key, without a traceback
        print(f"config error: {error}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
