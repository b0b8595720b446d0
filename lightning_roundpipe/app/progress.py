"""The app's progress bar: Lightning's default one, with totals right for a run bounded by ``max_steps``.

The app trains for ``trainer.max_steps`` with ``max_epochs=-1``. Lightning's bars, under any strategy, then show
``Epoch 0/-2`` (Rich's bar prints ``max_epochs - 1``) and, after a resume in the middle of an epoch, the batch
reached in the epoch against the steps left (``1900/99``). This bar counts the same batches, against the batch
of the epoch at which ``max_steps`` is reached; the epoch has no total shown when the epochs are unbounded.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from lightning.pytorch.callbacks.progress.progress_bar import ProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import convert_inf


def _train_total(bar: ProgressBar, lightnings: int | float, epoch_start: bool) -> int | float:
    """Lightning's total (the epoch's batches, or fewer), capped at the batch of this epoch at which ``max_steps``
    is reached: the batches started in the epoch so far plus the steps left (each ``accumulate_grad_batches``
    batches). At the epoch's start none has (the loop's count still holds the last epoch's); a bar made in a
    resumed epoch, after its first batch, counts that batch as started, as the global step counts its step."""
    trainer = bar.trainer
    if trainer.max_steps is None or trainer.max_steps < 0:
        return lightnings
    started = 0 if epoch_start else trainer.fit_loop.epoch_loop.batch_progress.current.ready
    left = max(trainer.max_steps - trainer.global_step, 0) * trainer.accumulate_grad_batches
    return min(trainer.num_training_batches, started + left)


class StepBoundRichProgressBar(RichProgressBar):
    """Rich's bar (Lightning's default when ``rich`` is installed), with the totals of :func:`_train_total`."""

    _epoch_start = False

    @property
    def total_train_batches(self) -> int | float:
        return _train_total(self, super().total_train_batches, self._epoch_start)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._epoch_start = True
        try:
            super().on_train_epoch_start(trainer, pl_module)
        finally:
            self._epoch_start = False

    def _get_train_description(self, current_epoch: int) -> str:  # Lightning's: f"Epoch {n}/{max_epochs - 1}"
        if self.trainer.max_epochs is not None and self.trainer.max_epochs < 0:  # unbounded: no "/-2"
            return f"Epoch {current_epoch}".ljust(len(self.validation_description))
        return super()._get_train_description(current_epoch)


class StepBoundTQDMProgressBar(TQDMProgressBar):
    """tqdm's bar (Lightning's default without ``rich``), with the totals of :func:`_train_total`."""

    _epoch_start = False
    _epoch_described = False  # this fit's train bar has been given its epoch and total

    @property
    def total_train_batches(self) -> int | float:
        return _train_total(self, super().total_train_batches, self._epoch_start)

    def on_train_epoch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._epoch_start = True
        try:
            super().on_train_epoch_start(trainer, *args)
        finally:
            self._epoch_start = False
        self._epoch_described = True

    def on_train_start(self, trainer: pl.Trainer, *args: Any) -> None:
        super().on_train_start(trainer, *args)
        self._epoch_described = False

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        # a run resumed in the middle of an epoch gets no on_train_epoch_start: say the epoch and its total here,
        # as Rich's bar does (tqdm's would count batches under "Training" with no total)
        if not self._epoch_described and not self.is_disabled:
            self._epoch_described = True
            self.train_progress_bar.total = convert_inf(self.total_train_batches)
            self.train_progress_bar.set_description(f"Epoch {trainer.current_epoch}")
        super().on_train_batch_end(trainer, *args)


def progress_bar(**kwargs: Any) -> ProgressBar:
    """The bar Lightning would pick by default (Rich if installed, else tqdm), with the step-bound totals."""
    rich = importlib.util.find_spec("rich") is not None
    return StepBoundRichProgressBar(**kwargs) if rich else StepBoundTQDMProgressBar(**kwargs)
