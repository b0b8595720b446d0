"""``PipelineMetrics``: the callback that logs the engine's figures (``roundpipe/*``) at Lightning's logging steps."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_roundpipe.engine.engine import RoundPipeEngine


class PipelineMetrics(Callback):
    """Logs ``engine.pipeline_metrics()`` as ``roundpipe/<name>`` from the main thread (where ``log``
    works) at the end of a batch that stepped the optimizer, every ``trainer.log_every_n_steps`` optimizer
    steps (when Lightning's loggers write), at the last batch of each epoch and at the fit's last step (so the
    final figures are there for whoever reads them after ``fit``): each figure covers the steps since the last
    report. Not every step: a ``log`` call costs about 1 ms, which on a small model is a sizeable share of the
    step, and in sync mode the figures first wait for the step (``weight_readers.py``). ``engine`` returns the
    running engine, or ``None`` between fits."""

    def __init__(self, engine: Callable[[], RoundPipeEngine | None]) -> None:
        self._engine = engine
        self._logged_step = 0  # nothing to report before the first step

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        engine = self._engine()
        if engine is None or engine.closed or trainer.global_step == self._logged_step:
            return
        every = int(getattr(trainer, "log_every_n_steps", 1))  # set by Lightning at init, not declared
        last = trainer.should_stop or trainer.is_last_batch or trainer.global_step == trainer.max_steps
        if trainer.global_step % max(every, 1) and not last:
            return  # the figures accumulate until the next logging step
        self._logged_step = trainer.global_step
        if not engine.options.async_step:  # a sync step may still run (the strategy waits at the next batch):
            engine.synchronize()            # the figures cover it whole, as they always did
        for name, value in engine.pipeline_metrics().items():
            pl_module.log(f"roundpipe/{name}", value, on_step=True, on_epoch=False, batch_size=1)


def attach(trainer: Trainer, engine: Callable[[], RoundPipeEngine | None]) -> None:
    """Add a :class:`PipelineMetrics` first among the Trainer's callbacks (so the others see fresh figures),
    unless one is there already."""
    callbacks: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]
    if not any(isinstance(callback, PipelineMetrics) for callback in callbacks):
        callbacks.insert(0, PipelineMetrics(engine))


def detach(trainer: Trainer) -> None:
    """Remove what :func:`attach` added."""
    callbacks: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]
    callbacks[:] = [callback for callback in callbacks if not isinstance(callback, PipelineMetrics)]
