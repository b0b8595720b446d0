"""Checkpoints of a RoundPipe run: :class:`CheckpointingStrategy`, the base of
:class:`~lightning_roundpipe.strategy.RoundPipeStrategy` that saves and resumes.

Beside Lightning's entries, ``checkpoint["roundpipe"]`` (:data:`CHECKPOINT_KEY`) holds the engine's state: the
plan in use, the step count and base seed that seed the random layers. ``ckpt_path`` gives it back to the next
run's engine, so that a resumed run continues the saved one exactly. Before any state is read, the steps in flight
finish (:meth:`CheckpointingStrategy._quiesce`), or, while an exception propagates, the engine stops without the
interrupted batch; a step is in a checkpoint whole or not at all.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from lightning.pytorch.trainer.states import TrainerStatus
from typing_extensions import override

from lightning_roundpipe.engine.engine import RoundPipeEngine
from lightning_roundpipe.engine.step.rounding import restore_wide_state
from lightning_roundpipe.gradient_readers import trainer_of
from lightning_roundpipe.strategy_processes import RingProcessStrategy

log = logging.getLogger(__name__)

CHECKPOINT_KEY = "roundpipe"
"""The checkpoint entry that holds the engine's state (:meth:`RoundPipeEngine.state_dict`)."""


class CheckpointingStrategy(RingProcessStrategy):
    """Lightning's checkpoint hooks around a :class:`RoundPipeEngine`: the engine quiesced before the weights or
    the optimizer state are read, its state saved beside Lightning's and handed back on resume.

    The subclass sets ``engine`` (``None`` until set up) and ``_resume_state`` (``None``) in its ``__init__``;
    its ``setup`` gives ``_resume_state`` to the engine it builds."""

    engine: RoundPipeEngine | None
    _resume_state: dict[str, Any] | None

    def _interrupted(self) -> bool:
        """Whether the run is being interrupted: Lightning handles an exception (it calls the callbacks'
        ``on_exception``, e.g. ``OnExceptionCheckpoint``'s save, then the strategy's, then teardown)."""
        trainer = trainer_of(self.lightning_module)
        return trainer is not None and trainer.state.status == TrainerStatus.INTERRUPTED

    def _quiesce(self) -> None:
        """Make the module's weights consistent before they are read (a checkpoint): let the steps in flight
        finish. While an exception propagates (``OnExceptionCheckpoint`` saves before the strategy hears of
        it) stop the engine instead, without waiting for the interrupted batch: the steps Lightning counted
        complete, unless the pipeline itself failed (then queued steps are dropped; each step is applied
        whole or not at all)."""
        engine = self.engine
        if engine is None or engine.closed:
            return
        if engine.failed:
            engine.close(finish_steps=False)
        elif self._interrupted():
            engine.close(finish_steps=True, finish_jobs=False)
        else:
            engine.synchronize()

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        self._quiesce()
        return super().lightning_module_state_dict()

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        self._quiesce()  # Lightning asks every process, before save_checkpoint
        return super().optimizer_state(optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        # the engine's own state beside Lightning's: one more top-level key, of plain values only, which
        # load_from_checkpoint without the strategy ignores. Lightning calls this on every process (each has
        # quiesced its engine while Lightning gathered the states); only global rank 0 writes, as with DDP
        if self.engine is not None:
            self._quiesce()
            if not self.is_global_zero:
                return
            torn = self.engine.torn_step
            if torn is not None:  # weights of two steps: a checkpoint would claim a state no run ever had
                log.warning(f"RoundPipe did not write the checkpoint {filepath}: {torn}")
                return
            checkpoint = {**checkpoint, CHECKPOINT_KEY: self.engine.state_dict()}
        try:
            super().save_checkpoint(checkpoint, filepath, storage_options)
        finally:
            if self.engine is not None:
                self.engine.drop_offloaded_pages()  # the save read every file's pages: out of memory again

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        super().load_optimizer_state_dict(checkpoint)
        if self.engine_options.stochastic_rounding:  # torch narrowed the float32 state of bf16 parameters
            for optimizer, saved in zip(self.optimizers, checkpoint["optimizer_states"], strict=True):
                restore_wide_state(optimizer, saved["state"])
        if self.engine is not None:
            for optimizer in self.optimizers:  # a loaded state is in memory (or the checkpoint's pages): to its files
                self.engine.offload_state(optimizer)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self._resume_state = checkpoint.get(CHECKPOINT_KEY)  # setup, which follows, gives it to the engine
        return checkpoint
