"""Who may read or write the module's weights between a sync step and the next batch: the strategy then waits for
the step right after queueing it, as it always did; otherwise it lets the step run on while Lightning's own loop
ends the batch and fetches the next one, and waits when the next batch reaches the strategy (``batch_to_device``,
or the ``*_step`` hooks where a loop fetches no batch itself).

Lightning runs, between the step and the next batch's ``batch_to_device``: ``optimizer_step``'s rest, the batch's
end (``on_train_batch_end``, the LR schedulers, loggers, checkpoint saves), a validation loop's start, an epoch's
end and the next one's start, the fit's end, and the next batch's fetch and ``on_before_batch_transfer``. Of these,
user code runs only in the hooks of :data:`BETWEEN_STEPS_HOOKS`; a checkpoint save waits for the step anyway (the
strategy's state-dict hooks), and so does the end of the fit (``teardown``). ``on_train_batch_start`` and the
``*_step`` hooks run after ``batch_to_device``, so they see the step done without a wait of their own.
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks import (
    DeviceStatsMonitor,
    EarlyStopping,
    GradientAccumulationScheduler,
    LearningRateMonitor,
    ModelCheckpoint,
    ModelSummary,
    ProgressBar,
    ThroughputMonitor,
    Timer,
)

from lightning_roundpipe.gradient_readers import first_hook_of_run, first_override

BETWEEN_STEPS_HOOKS = (
    "optimizer_step", "lr_scheduler_step", "on_train_batch_end", "on_train_epoch_end", "on_train_epoch_start",
    "on_train_end", "on_fit_end", "on_validation_model_zero_grad", "on_validation_model_eval",
    "on_validation_model_train", "on_validation_start", "on_validation_epoch_start", "on_validation_epoch_end",
    "on_validation_end", "on_before_batch_transfer",
)
"""The module's and callbacks' hooks that may run after a step and before the next batch's ``batch_to_device``
(``optimizer_step``: a module's override may read the weights right after it steps; the validation hooks: a
validation loop with no batch runs them and no ``batch_to_device``). A ``LightningDataModule``'s transfer hooks do
not count: they see the batch, not the module."""

LIGHTNING_CALLBACKS_LEAVING_WEIGHTS = (
    ProgressBar, ModelCheckpoint, EarlyStopping, LearningRateMonitor, Timer, ModelSummary, ThroughputMonitor,
    DeviceStatsMonitor, GradientAccumulationScheduler,
)
"""Lightning's callbacks whose hooks in :data:`BETWEEN_STEPS_HOOKS` neither read nor write the weights (they read
logged metrics, times and hyperparameters; ``ModelCheckpoint`` saves through the strategy, which waits for the
step first). Lightning's others do (``StochasticWeightAveraging``, ``WeightAveraging``, ``ModelPruning``,
``BaseFinetuning``), or run the user's code (``LambdaCallback``)."""


def _may_touch_weights(cls: type) -> bool:
    """Whether a hook defined in ``cls`` may read or write the weights: anything of the user's, and Lightning's
    callbacks but those of :data:`LIGHTNING_CALLBACKS_LEAVING_WEIGHTS`; not this package's, nor the defaults of
    Lightning's module hooks (``ModelHooks``: ``model.eval()``, the schedulers' and optimizer's own steps)."""
    module = cls.__module__ or ""
    if module.startswith("lightning_roundpipe."):
        return False
    if module.startswith("lightning."):
        return issubclass(cls, pl.Callback) and not issubclass(cls, LIGHTNING_CALLBACKS_LEAVING_WEIGHTS)
    return True


def weights_reader_between_steps(module: pl.LightningModule | None) -> str | None:
    """What may read or write the weights after a step and before the next batch's ``batch_to_device``:
    ``"Owner.hook"`` for the first override of :data:`BETWEEN_STEPS_HOOKS` that may, ``"manual optimization"``
    (the user's ``training_step`` goes on right after its step), or ``None``."""
    return first_hook_of_run(module, lambda obj, base: first_override(obj, base, BETWEEN_STEPS_HOOKS,
                                                                      _may_touch_weights))
