"""Fault matrix: every failure ends ``fit`` with an error that names it, within a bounded time, with no
thread left, and with the module (and an ``OnExceptionCheckpoint``) at the weights of the last completed
optimizer step.

Covered elsewhere and not repeated here: an exception in user code (``test_strategy.py``:
``test_an_exception_inside_fit_leaves_no_thread_and_restores_the_module``, and the ``user code`` case of
``test_on_exception_checkpoint_saves_the_last_consistent_weights``), a layer failing in a *forward* stage
(``test_engine.py``: ``test_layer_error_names_stage_and_layer_and_stops_every_thread``, and the
``pipeline`` case above), a loss function returning a non-scalar (``test_loss_function_errors_are_reported``),
a budget too small for a layer on the bare engine (``test_too_small_a_memory_budget_names_the_option``) and
the 16-bit overflow of a returned loss (``test_16_bit_overflow_skips_the_step_and_halves_the_scale_as_...``).

Every strategy here runs with a small ``wait_timeout``, so a missed wake-up fails as a timeout error
instead of hanging, and every test runs under a ``faulthandler`` guard that dumps every thread's stack and
ends the process should it hang anyway.
"""

from __future__ import annotations

import faulthandler
import io
import os
import signal
import sys
import threading
import time
import traceback

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Checkpoint, OnExceptionCheckpoint
from lightning.pytorch.plugins import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader

from lightning_roundpipe import EngineOptions, PipelineError, RoundPipeEngine, RoundPipeStrategy, is_recomputing
from lightning_roundpipe.engine import stage as stage_module
from lightning_roundpipe.engine.device import AbortSignal
from lightning_roundpipe.engine.dispatch import Dispatcher
from lightning_roundpipe.planning.partition import Plan
from tests.models import Classifier
from tests.models import classifier_data as _data
from tests.numerics import assert_close_to_reference, assert_states_close_to_reference, assert_states_equal

pytestmark = [
    pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no `val_dataloader`"),
    # OnExceptionCheckpoint is a Checkpoint callback: Lightning then looks for a "last" checkpoint to resume
    pytest.mark.filterwarnings("ignore:.*ckpt_path"),
]

HANG_GUARD_S = 60      # a test still running after this long is hung: dump every stack and exit
WAIT_TIMEOUT = 20.0    # the engine's own bound on any wait in these tests (the default is 600 s)
FAIL_AT = 3            # the batch (and optimizer step, counted from 0) that fails: 3 steps completed before it


# ---------------------------------------------------------------------------------------------- helpers
@pytest.fixture(autouse=True)
def _no_hang_and_no_leak():
    """Bound the test's time, restore the SIGINT handler (Lightning ignores Ctrl-C after it caught one), and
    fail if the test left a thread running (daemon or not)."""
    before = set(threading.enumerate())
    sigint = signal.getsignal(signal.SIGINT)
    faulthandler.dump_traceback_later(HANG_GUARD_S, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
        signal.signal(signal.SIGINT, sigint)
    assert _threads_left(before, grace=5.0) == []


def _threads_left(before: set[threading.Thread], grace: float = 0.0) -> list[str]:
    """Threads started since ``before`` still alive after joining each for up to ``grace`` seconds in all."""
    deadline = time.monotonic() + grace
    for thread in set(threading.enumerate()) - before:
        thread.join(max(0.0, deadline - time.monotonic()))
    return sorted(t.name for t in set(threading.enumerate()) - before if t.is_alive())


def _strategy(**options) -> RoundPipeStrategy:
    return RoundPipeStrategy(**{"num_microbatches": 2, "num_stages": 2, "wait_timeout": WAIT_TIMEOUT, **options})


def _trainer(strategy, devices: int = 2, callbacks=(), **kwargs) -> pl.Trainer:
    # Lightning refuses a Checkpoint callback (OnExceptionCheckpoint is one) with enable_checkpointing=False;
    # with one in the list it adds no ModelCheckpoint of its own
    settings = dict(max_epochs=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                    enable_checkpointing=any(isinstance(c, Checkpoint) for c in callbacks))
    return pl.Trainer(strategy=strategy, accelerator="cpu", devices=devices, callbacks=list(callbacks),
                      **{**settings, **kwargs})


def _sync(trainer: pl.Trainer) -> None:
    engine = getattr(trainer.strategy, "engine", None)
    if engine is not None and not engine.closed:
        engine.synchronize()


def _state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {key: value.detach().clone() for key, value in module.state_dict().items()}


class _StatesAfterEachStep(pl.Callback):
    def __init__(self) -> None:
        self.states: list[dict[str, torch.Tensor]] = []

    def on_train_start(self, trainer, pl_module):
        self.states.append(_state(pl_module))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.states.append(_state(pl_module))


@pytest.fixture(scope="module")
def reference_states() -> dict[str, list[dict[str, torch.Tensor]]]:
    """The module's state after 0, 1, 2, ... optimizer steps under Lightning's default strategy (one step per
    batch), computed independently of RoundPipe, in float32 and in float64 (keys ``"32-true"``, ``"64-true"``)."""
    states = {}
    for precision in ("32-true", "64-true"):
        recorder = _StatesAfterEachStep()
        _trainer("auto", devices=1, callbacks=[recorder], precision=precision).fit(Classifier("sgd"), _data())
        states[precision] = recorder.states
    return states


def _assert_at_step(actual: dict[str, torch.Tensor], reference_states, steps: int) -> None:
    """``actual`` holds the weights after ``steps`` optimizer steps. RoundPipe's microbatches sum in another
    order than Lightning's whole batches, so: within 4x Lightning's own float32 error of its float64 weights
    (``tests/numerics.py``). One step more or fewer is off by far more."""
    assert_states_close_to_reference(actual, reference_states["32-true"][steps], reference_states["64-true"][steps])


def _checkpoint_state(path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=False)["state_dict"]


# ------------------------------------------------------------------ 1. a worker or the optimizer thread fails
def _sample(index: int) -> torch.Tensor:
    """Sample ``index`` of ``_data()``'s inputs (batches of 8, in order)."""
    return _data().dataset.tensors[0][index]


class FailsInABackwardStage(Classifier):
    """Layer 0 (always in a backward stage) raises while recomputing microbatch 1 (samples 4..7) of batch
    ``FAIL_AT``. The batch is told by its data: a recompute may run after the main thread moved on."""

    def __init__(self, fused: bool) -> None:
        super().__init__("sgd", fused)
        self.net[0].register_forward_hook(self._maybe_fail)  # hooks fire in the device replicas too
        self.first_row = _sample(8 * FAIL_AT + 4)

    def _maybe_fail(self, module, inputs, output):
        if is_recomputing() and torch.equal(inputs[0][0], self.first_row):
            raise RuntimeError("recompute went wrong.")  # a full stop, as our own errors end: not doubled


class BrokenSGD(torch.optim.SGD):
    """SGD whose step raises (before touching anything) once ``fail_at`` steps have completed. The counter is
    a shared dict: the engine steps a shallow twin of the optimizer."""

    def __init__(self, params, fail_at: int, **kwargs) -> None:
        super().__init__(params, **kwargs)
        self.count = {"steps": 0}
        self.fail_at = fail_at

    def step(self, closure=None):
        if self.count["steps"] == self.fail_at:
            raise RuntimeError("optimizer state went bad")
        self.count["steps"] += 1
        return super().step(closure)


class FailsInTheOptimizer(Classifier):
    def __init__(self, fail_at: int) -> None:
        super().__init__("sgd")
        self.fail_at = fail_at

    def configure_optimizers(self):
        optimizer = BrokenSGD(self.parameters(), self.fail_at, lr=0.1, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class _FailUploadsFrom(pl.Callback):
    """From batch ``FAIL_AT`` on (once the previous step is done), the next parameter upload fails."""

    def __init__(self) -> None:
        self.armed = False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == FAIL_AT:
            _sync(trainer)  # every upload of earlier batches has happened: the failure is batch FAIL_AT's
            self.armed = True


FAULTS = {
    # case: (module, completed steps, error pattern, cause type)
    "backward stage, transparent": (lambda: FailsInABackwardStage(fused=False), FAIL_AT,
                                    r"trunk layer 0 raised RuntimeError in stage B\d+ .*microbatch 1\): "
                                    r"recompute went wrong", RuntimeError),
    "backward stage, fused": (lambda: FailsInABackwardStage(fused=True), FAIL_AT,
                              r"trunk layer 0 raised RuntimeError in stage B\d+ .*microbatch 1\): "
                              r"recompute went wrong", RuntimeError),
    "parameter upload": (lambda: Classifier("sgd"), FAIL_AT,
                         r"uploading the parameters of stage \w+ .*failed: OSError: copy failed", OSError),
    "optimizer step": (lambda: FailsInTheOptimizer(FAIL_AT), FAIL_AT,
                       r"optimizer step 4 \(BrokenSGD\) raised RuntimeError .*: optimizer state went bad",
                       RuntimeError),
    # the last step fails after the last batch: nothing on the main thread waits for it but the teardown
    "optimizer step, the last one": (lambda: FailsInTheOptimizer(5), 5,
                                     r"optimizer step 6 \(BrokenSGD\) raised RuntimeError", RuntimeError),
}


@pytest.mark.parametrize("case", list(FAULTS))
def test_a_failure_in_a_worker_or_the_optimizer_thread_stops_fit_cleanly(case, tmp_path, monkeypatch,
                                                                        reference_states, roundpipe_threads):
    build, completed, pattern, cause = FAULTS[case]
    module = build()
    callbacks = [OnExceptionCheckpoint(tmp_path)]
    if case == "parameter upload":
        arm = _FailUploadsFrom()
        callbacks.append(arm)
        real_copy = stage_module.copy_tensor

        def copy_tensor(tensor, device, **kwargs):
            if arm.armed:
                arm.armed = False  # one failure
                raise OSError("copy failed")
            return real_copy(tensor, device, **kwargs)

        monkeypatch.setattr(stage_module, "copy_tensor", copy_tensor)
    # whole steps: each is applied whole or not at all. A step cut by stage may be torn by a failure in the
    # backward (the next test)
    trainer = _trainer(_strategy(streaming_step="off"), devices=3, callbacks=callbacks)
    with pytest.raises(PipelineError, match=pattern) as caught:
        trainer.fit(module, _data())
    assert isinstance(caught.value.__cause__, cause)
    assert roundpipe_threads() == []
    assert trainer.strategy.engine.closed and "forward" not in module.net.__dict__
    # the checkpoint, and the module itself, hold the weights after the last completed step, which equal
    # Lightning's default strategy after the same number of steps
    _assert_at_step(_checkpoint_state(tmp_path / "on_exception.ckpt"), reference_states, completed)
    _assert_at_step(_state(module), reference_states, completed)


class FailsAfterADeeperStageStepped(Classifier):
    """Layer 0's recompute of batch ``FAIL_AT`` waits until the step cut by stage has updated the last layer (its
    gradients were final once the deeper backward stage ran), then raises: the step is torn, every time."""

    def __init__(self) -> None:
        super().__init__("sgd", fused=True)
        self.net[0].register_forward_hook(self._fail_once_deeper_stepped)
        self.first_row = _sample(8 * FAIL_AT)
        self.before: torch.Tensor | None = None

    def _fail_once_deeper_stepped(self, module, inputs, output):
        if not torch.equal(inputs[0][0], self.first_row):
            return
        if not is_recomputing():  # the batch's forward: the step it leads to is not queued yet
            self.before = self.net[6].weight.detach().clone()
        else:
            deadline = time.monotonic() + WAIT_TIMEOUT / 2
            while torch.equal(self.net[6].weight, self.before) and time.monotonic() < deadline:
                time.sleep(0.001)
            raise RuntimeError("recompute went wrong.")  # a full stop, as our own errors end: not doubled


def test_a_failure_after_part_of_a_step_cut_by_stage_names_the_torn_step_and_writes_no_checkpoint(
        tmp_path, reference_states, roundpipe_threads, caplog):
    # two backward stages: the last layer's (with the fused stage) steps before layer 0's stage recomputes
    trainer = _trainer(_strategy(num_stages=Plan.from_sizes([4], 3, [4])), devices=2,
                       callbacks=[OnExceptionCheckpoint(tmp_path)])
    module = FailsAfterADeeperStageStepped()
    with pytest.raises(PipelineError, match=rf"recompute went wrong\. Optimizer step {FAIL_AT + 1} had updated the "
                                            r"parameters of layers \[4-6\] when the pipeline stopped") as caught:
        trainer.fit(module, _data())
    assert isinstance(caught.value.__cause__, RuntimeError)
    assert roundpipe_threads() == []
    assert not (tmp_path / "on_exception.ckpt").exists()
    assert "did not write the checkpoint" in caplog.text
    # torn as the message says: layers 4-6 took step FAIL_AT + 1, layers 0-3 kept step FAIL_AT's weights
    state = _state(module)
    deep = {key: value for key, value in state.items() if int(key.split(".")[1]) >= 4}
    shallow = {key: value for key, value in state.items() if key not in deep}
    _assert_at_step(deep, {precision: [{key: steps[k][key] for key in deep} for k in range(len(steps))]
                           for precision, steps in reference_states.items()}, FAIL_AT + 1)
    _assert_at_step(shallow, {precision: [{key: steps[k][key] for key in shallow} for k in range(len(steps))]
                              for precision, steps in reference_states.items()}, FAIL_AT)


# ------------------------------------------------------------------ 2. Ctrl-C
class _CtrlCAtBatchStart(pl.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == FAIL_AT:
            raise KeyboardInterrupt


class _CtrlCWhileDispatching(pl.Callback):
    """On batch ``FAIL_AT`` the KeyboardInterrupt lands while the main thread hands jobs to the workers: the
    third job is counted in the gradient window but never queued."""

    def __init__(self, monkeypatch) -> None:
        from lightning_roundpipe.engine.worker import Worker

        self.puts = None
        real_put = Worker.put

        def put(worker, task):
            if self.puts is not None and task is not None:
                self.puts += 1
                if self.puts == 3:
                    self.puts = None
                    raise KeyboardInterrupt
            real_put(worker, task)

        monkeypatch.setattr(Worker, "put", put)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == FAIL_AT:
            self.puts = 0


def _main_thread_waits_in_the_engine() -> bool:
    """Whether the main thread is blocked in the engine's wait for the devices (``AbortSignal.wait``)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    while frame is not None:
        if frame.f_code is AbortSignal.wait.__code__:
            return True
        frame = frame.f_back
    return False


class CtrlCWhileThePipelineRuns(Classifier):
    """On batch ``FAIL_AT`` a layer, running on a device worker, waits until the main thread is blocked in the
    engine's wait, then sends the process SIGINT (what Ctrl-C does). From then on each of its calls in that
    batch (forward or recompute) takes ``SLOW`` seconds: with one sample per microbatch (8 of them), the rest
    of the batch would take 8 ``SLOW`` (the running call and 7 more forwards) and more (the recomputes)."""

    SLOW = 1.0

    def __init__(self, fused: bool) -> None:
        super().__init__("sgd", fused)
        self.signalled_at: float | None = None
        self.net[2].register_forward_hook(self._interrupt)

    def _interrupt(self, module, inputs, output):
        if self.trainer.global_step != FAIL_AT:
            return
        # a forward, not a recompute: those of the previous batch may still run once global_step moved on
        if self.signalled_at is None and not is_recomputing():
            assert threading.current_thread().name.startswith("roundpipe-")
            deadline = time.monotonic() + 5.0
            while not _main_thread_waits_in_the_engine() and time.monotonic() < deadline:
                time.sleep(0.001)
            self.signalled_at = time.monotonic()
            os.kill(os.getpid(), signal.SIGINT)
        if self.signalled_at is not None:
            time.sleep(self.SLOW)


@pytest.mark.parametrize("where", ["on_train_batch_start", "while dispatching", "inside pipeline_loss",
                                   "inside the trunk's forward"])
def test_ctrl_c_during_fit_exits_like_lightning_with_consistent_weights(where, tmp_path, monkeypatch,
                                                                         reference_states, roundpipe_threads):
    callbacks = [OnExceptionCheckpoint(tmp_path)]
    module = Classifier("sgd", fused=True)
    if where == "on_train_batch_start":
        callbacks.append(_CtrlCAtBatchStart())
    elif where == "while dispatching":
        callbacks.append(_CtrlCWhileDispatching(monkeypatch))
    else:
        module = CtrlCWhileThePipelineRuns(fused=where == "inside pipeline_loss")
    trainer = _trainer(_strategy(num_microbatches=8), devices=3, callbacks=callbacks)
    with pytest.raises(SystemExit) as caught:  # Lightning 2.6: on_exception hooks, teardown, sys.exit(1)
        trainer.fit(module, _data())
    assert caught.value.code == 1
    interrupt = caught.value.__context__
    assert isinstance(interrupt, KeyboardInterrupt)
    codes = [frame.f_code for frame, _ in traceback.walk_tb(interrupt.__traceback__)]
    frames = [code.co_name for code in codes]
    assert (Dispatcher.dispatch.__code__ in codes) == (where == "while dispatching")
    if where.startswith("inside"):
        # it landed in the engine's wait for the devices, and the shutdown (checkpoint included) did not
        # wait for the rest of the interrupted batch, only for the call running when the engine stopped. A
        # wall-clock bound is the claim here (Ctrl-C ends fit promptly). Finishing the batch would take at least
        # 8 SLOW; the bound, 4 SLOW, is half that, and leaves 3 SLOW (3 s) beyond the running call for handling
        # the interrupt (Lightning's hooks, the checkpoint, the engine's stop), over 100x what that takes on a
        # two-core machine, also with both cores saturated (at most 0.02 s measured).
        assert Dispatcher.wait.__code__ in codes and ("forward_backward" in frames) == (where == "inside pipeline_loss")
        elapsed = time.monotonic() - module.signalled_at
        assert elapsed < 4 * module.SLOW, f"the shutdown took {elapsed:.2f} s"
    assert roundpipe_threads() == []
    assert trainer.strategy.engine.closed and "forward" not in module.net.__dict__
    # every step Lightning counted was applied, and nothing of the interrupted batch
    assert trainer.global_step == FAIL_AT
    _assert_at_step(_checkpoint_state(tmp_path / "on_exception.ckpt"), reference_states, FAIL_AT)
    _assert_at_step(_state(module), reference_states, FAIL_AT)


class SlowBackwardBeforeTheFailure(Classifier):
    """The recomputes of batch ``FAIL_AT - 1`` are slow: its optimizer step is still queued, waiting for
    their gradients, when batch ``FAIL_AT`` starts (the fused path does not wait for backward stages)."""

    def __init__(self) -> None:
        super().__init__("sgd", fused=True)
        self.net[0].register_forward_hook(self._slow)
        self.first_row = _sample(8 * (FAIL_AT - 1))

    def _slow(self, module, inputs, output):
        if is_recomputing() and torch.equal(inputs[0][0], self.first_row):
            time.sleep(0.3)


def test_ctrl_c_without_a_checkpoint_callback_still_applies_every_counted_step(reference_states,
                                                                              roundpipe_threads):
    """The strategy's own ``on_exception`` stops the engine: the step Lightning already counted, queued behind
    slow backward stages, is applied, not dropped, so the module matches ``global_step``."""
    module = SlowBackwardBeforeTheFailure()
    trainer = _trainer(_strategy(), devices=3, callbacks=[_CtrlCAtBatchStart()])
    with pytest.raises(SystemExit):
        trainer.fit(module, _data())
    assert trainer.global_step == FAIL_AT
    assert roundpipe_threads() == []
    _assert_at_step(_state(module), reference_states, FAIL_AT)


# ------------------------------------------------------------------ 3. device out of memory
class _Batches(torch.utils.data.Dataset):
    """Ready-made batches of the given sizes (``batch_size=None`` loaders pass them through)."""

    def __init__(self, sizes: list[int]) -> None:
        generator = torch.Generator().manual_seed(2)
        self.batches = [(torch.randn(n, 6, generator=generator), torch.randint(0, 3, (n,), generator=generator))
                        for n in sizes]

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, index):
        return self.batches[index]


def test_a_budget_too_small_for_a_layer_names_the_layer_and_the_option(roundpipe_threads):
    """Refused at setup, before any thread starts: by the memory pre-flight (a ``MemoryError``) or, with it
    off, by the planner (a ``ValueError``)."""
    for preflight, error in [("refuse", MemoryError), ("off", ValueError)]:
        trainer = _trainer(_strategy(device_memory_limit="1KiB", preflight=preflight))
        with pytest.raises(error, match=r"(?s)layer \d+ .*`device_memory_limit`"):
            trainer.fit(Classifier(), _data())
        assert roundpipe_threads() == []


def test_activations_that_outgrow_the_budget_name_the_stage_and_the_option(roundpipe_threads):
    """The stages fit in 16 KiB, a batch of 8 samples too, but not one of 2048 (24 KiB per microbatch)."""
    trainer = _trainer(_strategy(device_memory_limit="16KiB"))
    data = DataLoader(_Batches([8, 8, 2048, 8]), batch_size=None)
    with pytest.raises(PipelineError, match=r"inputs of (stage )?F0 microbatch 0.*over its budget of 16384 bytes\. "
                                            r"Raise `device_memory_limit`") as caught:
        trainer.fit(Classifier(), data)
    assert type(caught.value.__cause__).__name__ == "OutOfDeviceMemory"
    assert trainer.global_step == 2  # the two small batches trained
    assert roundpipe_threads() == []


@pytest.mark.parametrize("recompute", ["stage", "layer"])
def test_the_out_of_memory_advice_leaves_out_what_is_already_set(recompute, roundpipe_threads):
    """The message says what is left to change: `recompute='layer'` only where it is not set already."""
    trainer = _trainer(_strategy(device_memory_limit="16KiB", recompute=recompute))
    with pytest.raises(PipelineError) as caught:
        trainer.fit(Classifier(), DataLoader(_Batches([2048]), batch_size=None))
    message = str(caught.value)
    advice = ("over its budget of 16384 bytes. Raise `device_memory_limit`, use more stages (`num_stages`, now 2, at "
              "most 6 for the trunk's 7 layers), put fewer samples in each microbatch (more than the 2 of "
              "`num_microbatches`, or a smaller batch)")
    if recompute == "stage":
        advice += (", or use `recompute='layer'` (now 'stage'; backward stages then keep every layer's input and "
                   "hold one layer's activations at a time).")
    else:
        advice = advice.replace(", put fewer", ", or put fewer") + "."
        assert "recompute" not in message
    assert message.endswith(advice), message
    assert roundpipe_threads() == []


def test_the_out_of_memory_advice_offers_more_stages_only_where_a_stage_holds_several_layers():
    from lightning_roundpipe.engine.device import memory_advice
    from lightning_roundpipe.planning.partition import Plan

    def stages(num_stages) -> list[str]:
        advice = memory_advice(recompute="layer", num_stages=num_stages, num_layers=7, num_microbatches=3)
        return [phrase for phrase in advice if "stage" in phrase]

    assert stages(6) == []  # one layer per forward stage already, beside the fused last layer
    assert stages(5) == ["use more stages (`num_stages`, now 5, at most 6 for the trunk's 7 layers)"]
    assert stages("auto") == ["use more stages (a `num_stages` above the plan's: 'auto' sizes them by parameter "
                              "bytes until the activations are measured)"]
    assert stages(Plan.from_sizes([3, 3], 1, [2, 2, 2])) == ["give `num_stages` a plan with smaller stages"]
    assert stages(Plan.from_sizes([1] * 6, 1, [1] * 6)) == []


# ------------------------------------------------------------------ 4. NaN and inf
def _data_with(value: float) -> DataLoader:
    """``_data()`` with one input of batch ``FAIL_AT`` set to ``value`` (bad data: the fault arises inside the
    trunk, on a device, in the forward and the recompute alike)."""
    data = _data()
    data.dataset.tensors[0][8 * FAIL_AT, 0] = value
    return data


class _StepWatcher(pl.Callback):
    """The weights before and after batch ``FAIL_AT``."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == FAIL_AT:
            _sync(trainer)
            self.before = _state(pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == FAIL_AT:
            _sync(trainer)
            self.after = _state(pl_module)


def _fit_16_mixed(module, strategy, devices):
    watcher = _StepWatcher()
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    trainer = _trainer(strategy, devices=devices, plugins=[plugin], callbacks=[watcher])
    trainer.fit(module, _data_with(float("inf")))
    return trainer, watcher


@pytest.mark.parametrize("fused", [False, True], ids=["transparent", "fused"])
def test_16_bit_inf_inside_the_pipeline_skips_the_step_and_lowers_the_scale(fused, roundpipe_threads):
    reference = Classifier("sgd", fused)
    reference_trainer, _ = _fit_16_mixed(reference, "auto", 1)
    module = Classifier("sgd", fused)
    trainer, watcher = _fit_16_mixed(module, _strategy(num_microbatches=1), 2)
    assert trainer.precision_plugin.scaler.get_scale() == 2.0**15  # 2**16, halved once
    assert trainer.precision_plugin.scaler.get_scale() == reference_trainer.precision_plugin.scaler.get_scale()
    assert_states_equal(watcher.after, watcher.before)  # that step changed nothing
    assert all(torch.isfinite(param).all() for param in module.parameters())
    assert_states_equal(module, reference)  # one microbatch: the same float16 kernels on the same data, bitwise
    assert roundpipe_threads() == []


@pytest.mark.parametrize("fused", [False, True], ids=["transparent", "fused"])
def test_fp32_nan_trains_on_as_lightnings_default_strategy_does(fused):
    """Lightning 2.6 does not check the loss (``check_finite_loss`` is never called): a NaN loss makes NaN
    gradients, the optimizer writes NaN weights and training carries on. RoundPipe does the same."""
    reference, reference64 = Classifier("sgd", fused), Classifier("sgd", fused)
    _trainer("auto", devices=1).fit(reference, _data_with(float("nan")))
    _trainer("auto", devices=1, precision="64-true").fit(reference64, _data_with(float("nan")))
    module = Classifier("sgd", fused)
    trainer = _trainer(_strategy(), devices=2)
    trainer.fit(module, _data_with(float("nan")))
    assert trainer.global_step == 6
    assert all(torch.isnan(p).any() for p in module.parameters())
    # NaN where Lightning has NaN; elsewhere, two microbatches against whole batches: within 4x Lightning's own
    # float32 error of its float64 run (tests/numerics.py)
    assert_close_to_reference(module.losses, reference.losses, reference64.losses, equal_nan=True, what="losses")
    assert_states_close_to_reference(module, reference, reference64, equal_nan=True)


@pytest.mark.filterwarnings("ignore:Error detected in")  # anomaly mode's report of the forward call
@pytest.mark.parametrize("fused", [False, True], ids=["transparent", "fused"])
def test_fp32_nan_with_detect_anomaly_fails_as_lightnings_default_strategy_does(fused, roundpipe_threads):
    """``Trainer(detect_anomaly=True)`` turns the NaN backward into an error under both strategies."""
    with pytest.raises(RuntimeError, match="returned nan values"):
        _trainer("auto", devices=1, detect_anomaly=True).fit(Classifier("sgd", fused), _data_with(float("nan")))
    with pytest.raises(RuntimeError, match="returned nan values"):
        _trainer(_strategy(), devices=2, detect_anomaly=True).fit(Classifier("sgd", fused),
                                                                  _data_with(float("nan")))
    assert roundpipe_threads() == []


# ------------------------------------------------------------------ 5. checkpoints
def test_a_crash_while_writing_a_checkpoint_keeps_the_previous_one(tmp_path, monkeypatch):
    path = tmp_path / "last.ckpt"
    real_save = torch.save
    seen = {}

    def spying_save(obj, f, *args, **kwargs):
        seen["file"] = f
        seen["name"] = getattr(f, "name", None)
        return real_save(obj, f, *args, **kwargs)

    def crashing_save(obj, f, *args, **kwargs):
        f.write(b"half a checkpoint" * 1000)
        raise OSError("No space left on device")

    class SaveTwice(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 1:
                monkeypatch.setattr(torch, "save", spying_save)
                trainer.save_checkpoint(path)
                self.saved = _state(pl_module)
                self.good_bytes = path.read_bytes()
            elif batch_idx == FAIL_AT:
                monkeypatch.setattr(torch, "save", crashing_save)
                with pytest.raises(OSError, match="No space left on device"):
                    trainer.save_checkpoint(path)
                monkeypatch.setattr(torch, "save", real_save)

    callback = SaveTwice()
    trainer = _trainer(_strategy(), callbacks=[callback])
    trainer.fit(Classifier(), _data())
    assert trainer.global_step == 6  # the failed save did not disturb training
    # streamed into a real file beside the target (no in-memory BytesIO copy of the whole state first)
    assert isinstance(seen["file"], io.BufferedWriter) and not isinstance(seen["file"], io.BytesIO)
    assert os.path.dirname(seen["name"]) == str(tmp_path) and seen["name"] != str(path)
    assert path.read_bytes() == callback.good_bytes
    assert_states_equal(_checkpoint_state(path), callback.saved)  # a checkpoint stores values exactly
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]  # no temporary file left behind
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # the permissions a plain open() would give


def test_a_custom_checkpoint_io_is_used_as_given(tmp_path):
    from lightning.fabric.plugins import TorchCheckpointIO

    class Recording(TorchCheckpointIO):
        def __init__(self):
            self.saved = []

        def save_checkpoint(self, checkpoint, path, storage_options=None):
            self.saved.append(path)
            super().save_checkpoint(checkpoint, path, storage_options)

    io_plugin = Recording()
    strategy = RoundPipeStrategy(checkpoint_io=io_plugin)
    strategy.save_checkpoint({"state_dict": {"w": torch.ones(2)}}, tmp_path / "a.ckpt")
    assert io_plugin.saved == [tmp_path / "a.ckpt"]
    assert torch.equal(torch.load(tmp_path / "a.ckpt")["state_dict"]["w"], torch.ones(2))


def _resume(strategy, devices: int, path, precision: str = "32-true") -> tuple[Classifier, pl.Trainer]:
    module = Classifier("adamw")
    trainer = _trainer(strategy, devices=devices, max_epochs=2, precision=precision)
    trainer.fit(module, _data(), ckpt_path=path)
    return module, trainer


def test_a_checkpoint_resumes_on_another_device_count_plan_and_strategy(tmp_path, roundpipe_threads):
    first = Classifier("adamw")
    trainer = _trainer(_strategy(num_stages=2), devices=3)
    trainer.fit(first, _data())
    path = tmp_path / "epoch1.ckpt"
    trainer.save_checkpoint(path)
    assert trainer.strategy.engine.plan.num_stages >= 2  # it really ran cut in stages

    # Lightning's default strategy resumes from the same checkpoint in float32 and in float64 (the checkpoint's
    # values cast up): the resumed RoundPipe run, two microbatches against whole batches, must be within 4x
    # Lightning's own float32 error of its float64 run (tests/numerics.py)
    reference, reference_trainer = _resume("auto", 1, path)
    reference64, reference64_trainer = _resume("auto", 1, path, precision="64-true")
    module, resumed_trainer = _resume(_strategy(num_stages="auto"), 2, path)
    assert resumed_trainer.global_step == reference_trainer.global_step == 12
    assert_states_close_to_reference(module, reference, reference64)
    optimizer, expected, expected64 = (t.optimizers[0].state_dict()
                                       for t in (resumed_trainer, reference_trainer, reference64_trainer))
    assert optimizer["param_groups"] == expected["param_groups"]
    assert set(optimizer["state"]) == set(expected["state"]) == set(expected64["state"])
    for index, state in expected["state"].items():
        assert set(optimizer["state"][index]) == set(state)
        for key, value in state.items():
            assert_close_to_reference(optimizer["state"][index][key], value, expected64["state"][index][key],
                                      what=f"optimizer state {index} {key}")
    assert roundpipe_threads() == []


# ------------------------------------------------------------------ 6. every wait has a timeout
class Stuck(Classifier):
    """Layer 3 gets stuck on batch 1 until the test releases it (``release``): far longer than the engine's
    ``wait_timeout``. ``returned`` is set once it has returned."""

    def __init__(self) -> None:
        super().__init__("sgd")
        self.release, self.returned = threading.Event(), threading.Event()
        self.stuck = False
        self.net[3].register_forward_hook(self._block)

    def _block(self, module, inputs, output):
        if self.trainer.global_step == 1 and not is_recomputing() and not self.stuck:
            self.stuck = True
            self.release.wait(timeout=HANG_GUARD_S / 2)  # the test releases it; the timeout only ends a hang
            self.returned.set()


def test_a_stuck_layer_fails_with_a_timeout_that_names_what_was_awaited(tmp_path, reference_states):
    before = set(threading.enumerate())
    module = Stuck()
    trainer = _trainer(_strategy(wait_timeout=1.0), callbacks=[OnExceptionCheckpoint(tmp_path)])
    with pytest.warns(RuntimeWarning, match=r"roundpipe-dev\d-compute"):
        with pytest.raises(PipelineError, match=r"waited more than 1 s for .+; the pipeline is stuck\. "
                                                r"Raise `wait_timeout`") as caught:
            trainer.fit(module, _data())
    assert isinstance(caught.value.__cause__, TimeoutError)
    # fit gave up after the timeout while the layer was still stuck (order, not time): it did not wait for the
    # stuck thread ...
    assert module.stuck and not module.returned.is_set()
    assert trainer.strategy.engine.closed
    # ... which ends on its own once the layer returns, as does every other thread
    module.release.set()
    assert _threads_left(before, grace=10.0) == []
    _assert_at_step(_checkpoint_state(tmp_path / "on_exception.ckpt"), reference_states, 1)


def test_a_timeout_names_the_waiting_thread_what_it_waited_for_and_the_option():
    signal_ = AbortSignal(timeout=0.25)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"^MainThread waited more than 0\.25 s for the output of stage F1; the "
                                           r"pipeline is stuck\. Raise `wait_timeout`"):
        signal_.wait(threading.Event(), "the output of stage F1")
    # not before the deadline, by construction; the upper bound only checks that the deadline fired at all (a
    # wait without one would hang until HANG_GUARD_S), so it is generous: 10x the timeout
    assert 0.25 <= time.monotonic() - start < 2.5
    assert isinstance(signal_.error, TimeoutError) and signal_.aborted  # every other waiter wakes up


def test_an_optimizer_step_outliving_wait_timeout_at_close_is_an_error_not_a_hang():
    """Closing waits for queued steps as long as they progress; one stuck for ``wait_timeout`` is reported
    (the module's weights may be mid-update), and its thread ends by itself once the step returns."""
    before = set(threading.enumerate())
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    release, returned = threading.Event(), threading.Event()

    def stuck_step(*_) -> None:
        release.wait(timeout=HANG_GUARD_S / 2)  # the test releases it; the timeout only ends a hang
        returned.set()

    optimizer.register_step_pre_hook(stuck_step)
    with pytest.warns(RuntimeWarning, match="roundpipe-optimizer"):
        with pytest.raises(PipelineError, match=r"roundpipe-optimizer has not finished step 1 within "
                                                r"`wait_timeout=0\.5` s while the engine closed"):
            with RoundPipeEngine(model, 2, EngineOptions(num_microbatches=2, wait_timeout=0.5)) as engine:
                engine.forward_backward(torch.randn(4, 3), torch.randint(0, 2, (4,)), F.cross_entropy)
                engine.step(optimizer)
    assert not returned.is_set()  # the engine reported the stuck step instead of waiting for it (order, not time)
    release.set()
    assert _threads_left(before, grace=10.0) == []


def test_a_step_failing_after_the_last_call_is_raised_when_the_engine_closes(roundpipe_threads):
    """The bare engine's twin of the ``optimizer step, the last one`` case: leaving the ``with`` block
    raises what no call has."""
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 2))
    optimizer = BrokenSGD(model.parameters(), fail_at=0, lr=0.1)
    with pytest.raises(PipelineError, match=r"optimizer step 1 \(BrokenSGD\) raised RuntimeError") as caught:
        with RoundPipeEngine(model, 2, EngineOptions(num_microbatches=2, wait_timeout=WAIT_TIMEOUT)) as engine:
            engine.forward_backward(torch.randn(4, 3), torch.randint(0, 2, (4,)), F.cross_entropy)
            engine.step(optimizer)
    assert isinstance(caught.value.__cause__, RuntimeError)
    assert roundpipe_threads() == []
