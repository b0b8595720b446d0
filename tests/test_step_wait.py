"""Where the strategy waits for a sync step (``weight_readers.py``): right after queueing it when user code may see
the weights before the next batch reaches the strategy, else when it does, so that Lightning's end of the batch
and the next batch's fetch overlap the step's tail. Either way every hook and ``training_step`` sees the weights
of Lightning's default strategy (bitwise: one microbatch runs its kernels on the same data in the same order).

The expected readers are a hand-made table. The overlap is observed, not timed: the optimizer thread's step first
waits (at most 2 s) for the data loader to fetch a sample after the batch's ``training_step``, which happens before
the step ends only if the main thread goes on without waiting for it.
"""

from __future__ import annotations

import threading
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import (
    EarlyStopping,
    EMAWeightAveraging,
    LambdaCallback,
    LearningRateMonitor,
    ModelCheckpoint,
    ModelPruning,
    StochasticWeightAveraging,
    Timer,
    TQDMProgressBar,
)
from torch.utils.data import DataLoader, Dataset

import lightning_roundpipe  # noqa: F401 - registers the strategy names (editable installs have no .pth hook)
from lightning_roundpipe import RoundPipeStrategy
from lightning_roundpipe.weight_readers import weights_reader_between_steps
from tests.models import Classifier


class _AtBatchStart(pl.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        pass


class _AtBatchEnd(pl.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        pass


class _AtValidationEnd(pl.Callback):
    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        pass


class _OwnBar(TQDMProgressBar):
    def on_train_batch_end(self, *args: Any) -> None:
        super().on_train_batch_end(*args)


class _StepsItself(Classifier):
    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        super().optimizer_step(*args, **kwargs)


class _Manual(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


# name: (module class, callback factories, expected reader)
READERS: dict[str, tuple[type[Classifier], list, str | None]] = {
    "nothing": (Classifier, [], None),
    "lightnings-leave-weights": (Classifier, [lambda: ModelCheckpoint(), lambda: TQDMProgressBar(),
                                             lambda: LearningRateMonitor(), lambda: EarlyStopping("train_loss"),
                                             lambda: Timer()], None),
    "after-batch-transfer": (Classifier, [_AtBatchStart], None),
    "batch-end": (Classifier, [_AtBatchEnd], "_AtBatchEnd.on_train_batch_end"),
    "validation": (Classifier, [_AtValidationEnd], "_AtValidationEnd.on_validation_epoch_end"),
    "users-bar": (Classifier, [_OwnBar], "_OwnBar.on_train_batch_end"),
    "lambda": (Classifier, [lambda: LambdaCallback(on_train_epoch_end=print)], "LambdaCallback.on_train_epoch_end"),
    "swa": (Classifier, [lambda: StochasticWeightAveraging(swa_lrs=0.1)], "StochasticWeightAveraging.on_train_epoch_end"),
    "ema": (Classifier, [lambda: EMAWeightAveraging()], "EMAWeightAveraging.on_train_batch_end"),
    "pruning": (Classifier, [lambda: ModelPruning("l1_unstructured")], "ModelPruning.on_train_epoch_end"),
    "module-steps": (_StepsItself, [], "_StepsItself.optimizer_step"),
    "manual": (_Manual, [], "manual optimization"),
}


@pytest.mark.parametrize("case", READERS)
def test_what_may_see_the_weights_between_a_step_and_the_next_batch(case):
    module_class, factories, expected = READERS[case]
    module = module_class()
    # Lightning's default callbacks too (a checkpoint, a progress bar, the model summary)
    module.trainer = pl.Trainer(logger=False, callbacks=[factory() for factory in factories])
    assert weights_reader_between_steps(module) == expected


class _Samples(Dataset):
    """Random samples of ``Classifier``'s data that count the fetches."""

    def __init__(self, samples: int) -> None:
        generator = torch.Generator().manual_seed(1)
        self.x = torch.randn(samples, 6, generator=generator)
        self.y = torch.randint(0, 3, (samples,), generator=generator)
        self.fetched = 0
        self.fetched_at_step = 0  # when the last training_step ran (the prefetcher had fetched its batch before)
        self.fetch = threading.Condition()

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        with self.fetch:
            self.fetched += 1
            self.fetch.notify_all()
        return self.x[index], self.y[index]


class _FetchWaitingSGD(torch.optim.SGD):
    """SGD whose step, on a thread other than the main one and while ``waits`` is positive, first waits for the
    data loader to have fetched another sample since the last ``training_step`` (2 s at most) and records whether
    it did. The step's class is not
    ``torch.optim``'s: RoundPipe steps it whole."""

    def __init__(self, params: Any, data: _Samples, waits: int) -> None:
        super().__init__(params, lr=0.1, momentum=0.9)
        # in lists: RoundPipe steps a shallow twin of the optimizer, which shares them
        self.data, self.waits, self.overlapped = data, [waits], []

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        if self.waits[0] > 0 and threading.current_thread() is not threading.main_thread():
            self.waits[0] -= 1
            with self.data.fetch:  # the step was queued after the training_step: has the main thread fetched since?
                before = self.data.fetched_at_step
                self.overlapped.append(self.data.fetch.wait_for(lambda: self.data.fetched > before, timeout=2.0))
        return super().step(closure)


class _Reads(Classifier):
    """Records the sum of its weights where user code may read them: ``training_step`` and the hooks around it."""

    roundpipe_reads_gradients = False  # its hooks read weights, no gradient (RoundPipe need not keep them)

    def __init__(self) -> None:
        super().__init__()
        self.data, self.waits = _Samples(32), 0  # the fit's data, and how many steps wait for its fetches
        self.seen: list[tuple[str, float]] = []

    def _note(self, where: str) -> None:
        self.seen.append((where, float(sum(p.detach().double().sum() for p in self.parameters()))))

    def training_step(self, batch, batch_idx):
        self._note("training_step")
        with self.data.fetch:
            self.data.fetched_at_step = self.data.fetched
        return super().training_step(batch, batch_idx)

    def on_train_batch_start(self, batch, batch_idx) -> None:
        self._note("on_train_batch_start")

    def configure_optimizers(self):
        self.optimizer = _FetchWaitingSGD(self.parameters(), self.data, self.waits)
        return self.optimizer


class _ReadsAtBatchEnd(_Reads):
    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self._note("on_train_batch_end")


def _fit(module_class: type[_Reads], strategy: Any, waits: int) -> _Reads:
    module = module_class()
    module.waits = waits
    # 8 batches an epoch and 4 steps: every step but the last is followed by a fetch
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=4, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, DataLoader(module.data, batch_size=4))
    return module


@pytest.mark.parametrize("module_class", [_Reads, _ReadsAtBatchEnd], ids=["nothing-between", "hook-between"])
def test_a_sync_step_runs_on_until_the_next_batch_unless_a_hook_may_see_it_and_every_reader_sees_its_weights(
        module_class):
    waits = 3 if module_class is _Reads else 0  # a hook between steps: the main thread waits, nothing is fetched
    reference = _fit(module_class, "auto", waits)
    ours = _fit(module_class, RoundPipeStrategy(), waits)
    assert ours.optimizer.overlapped == [True] * waits
    assert [where for where, _ in ours.seen] == [where for where, _ in reference.seen]
    assert ours.seen == reference.seen  # the same weights, bitwise, wherever user code read them
    for mine, theirs in zip(ours.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
