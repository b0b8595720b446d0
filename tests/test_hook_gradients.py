"""Gradients where Lightning users read them: ``param.grad`` in every hook equals Lightning's default strategy.

Lightning 2.x (automatic optimization) calls ``zero_grad`` after the ``training_step`` of the first batch of each
accumulation window, just before its backward. So with the default strategy ``on_after_backward`` sees the window's
gradients so far, ``on_before_optimizer_step`` the final ones, ``on_train_batch_end`` what the batch leaves (after a
step, the clipped gradients the step used), and ``on_train_batch_start`` and ``on_before_zero_grad`` what the
previous batch left (``None`` after the ``module.zero_grad()`` before validation). RoundPipe must show the same in
module and callback hooks, and only the main thread may ever read or assign ``param.grad`` (torch can crash on a
concurrent read and assignment).

Tolerances (tests/numerics.py): one microbatch per batch runs Lightning's kernels on the same data in the same order,
so every gradient is bitwise Lightning's; with several microbatches, float64 runs agree to 1e-12.
"""

from __future__ import annotations

import threading
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lightning_roundpipe  # noqa: F401 - registers the strategy names (editable installs have no .pth hook)
from lightning_roundpipe import EngineOptions, RoundPipeEngine, RoundPipeStrategy
from tests.models import Classifier, bn_batch, bn_model
from tests.models import classifier_data as _data
from tests.numerics import assert_float64_equal, assert_states_equal

HOOKS = ("on_train_batch_start", "on_before_zero_grad", "on_after_backward", "on_before_optimizer_step",
         "on_train_batch_end")
Record = list[tuple[str, int, list[torch.Tensor | None]]]


def _grads(module: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.detach().clone() for p in module.parameters()]


class _Recording:
    """What ``param.grad`` held in each hook (``None`` per parameter without a gradient), with the number of the
    batch since the fit started."""

    def __init__(self) -> None:
        self.seen: Record = []

    def note(self, hook: str, module: pl.LightningModule) -> None:
        self.seen.append((hook, module.trainer.fit_loop.epoch_loop.total_batch_idx, _grads(module)))


def _recording_module(hooks: tuple[str, ...], base: type[Classifier] = Classifier) -> type[Classifier]:
    """A ``base`` subclass that overrides exactly ``hooks`` (and records ``param.grad`` in them)."""

    def make(hook: str):
        def method(self, *args: Any) -> None:
            self.recording.note(hook, self)
        method.__name__ = hook
        return method

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        base.__init__(self, *args, **kwargs)
        self.recording = _Recording()

    return type("Recording" + base.__name__, (base,), {"__init__": __init__, **{h: make(h) for h in hooks}})


def _recording_callback(hooks: tuple[str, ...]) -> pl.Callback:
    """A callback that overrides exactly ``hooks`` (and records ``param.grad`` in them)."""

    def make(hook: str):
        def method(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
            self.recording.note(hook, module)
        method.__name__ = hook
        return method

    cls = type("RecordingCallback", (pl.Callback,), {h: make(h) for h in hooks})
    callback = cls()
    callback.recording = _Recording()
    return callback


def _fit(module: pl.LightningModule, strategy: Any, callbacks: list[pl.Callback], *, devices: int = 1,
         samples: int = 32, **trainer_kwargs: Any) -> pl.Trainer:
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_epochs=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=callbacks, **trainer_kwargs)
    trainer.fit(module, _data(samples), _data(16))
    return trainer


def _assert_same(ours: Record, reference: Record, *, bitwise: bool, hooks: tuple[str, ...] = HOOKS) -> None:
    reference = [entry for entry in reference if entry[0] in hooks]
    assert [(hook, batch) for hook, batch, _ in ours] == [(hook, batch) for hook, batch, _ in reference]
    for (hook, batch, grads), (_, _, expected) in zip(ours, reference, strict=True):
        what = f"{hook} of batch {batch}"
        assert [g is None for g in grads] == [g is None for g in expected], f"{what}: which gradients are None"
        for index, (grad, want) in enumerate(zip(grads, expected, strict=True)):
            if grad is None or want is None:
                continue
            if bitwise:
                assert torch.equal(grad, want), f"{what}, parameter {index}: {grad} != {want}"
            else:
                assert_float64_equal(grad, want, what=f"{what}, parameter {index}")


def _run(strategy: Any, devices: int, hooks: tuple[str, ...], *, fused: bool = False, owner: str = "both",
         precision: str | None = "32-true", **trainer_kwargs: Any) -> tuple[pl.LightningModule, Record, Record]:
    module = _recording_module(hooks if owner != "callback" else ())("sgd", fused)
    callback = _recording_callback(hooks if owner != "module" else ())
    _fit(module, strategy, [callback], devices=devices, precision=precision, **trainer_kwargs)
    return module, module.recording.seen, callback.recording.seen


# ---------------------------------------------------------------------------- automatic optimization
@pytest.mark.parametrize("fused", [False, True], ids=["transparent", "fused"])
@pytest.mark.parametrize("accumulate", [1, 2])
def test_every_hook_sees_the_default_strategys_gradients_bitwise(accumulate, fused):
    settings = dict(accumulate_grad_batches=accumulate, gradient_clip_val=0.5)  # clipping changes what a step leaves
    reference, module_ref, callback_ref = _run("auto", 1, HOOKS, fused=fused, **settings)
    assert any(entry[2][0] is None for entry in module_ref)  # the first batch of each epoch, and after zero_grad
    assert any(entry[2][0] is not None for entry in module_ref if entry[0] == "on_train_batch_start")
    # one microbatch: Lightning's kernels on the same data in the same order, so bitwise the same gradients
    module, seen, callback_seen = _run(RoundPipeStrategy(num_microbatches=1, num_stages=2), 2, HOOKS, fused=fused,
                                       **settings)
    assert len(callback_ref) == len(module_ref)  # the callback sees every hook too
    _assert_same(seen, module_ref, bitwise=True)
    _assert_same(callback_seen, callback_ref, bitwise=True)
    assert_states_equal(module, reference)


def test_16_bit_loss_scaling_shows_the_default_strategys_scaled_then_unscaled_gradients():
    """``16-mixed``: hooks before the step see gradients of the scaled loss, hooks after it the unscaled ones."""
    from lightning.pytorch.plugins import MixedPrecision

    def plugins() -> list[Any]:  # on CPU Lightning would turn 16-mixed into bf16-mixed; ask for the scaler
        return [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]

    settings = dict(accumulate_grad_batches=2, gradient_clip_val=0.5)
    reference, module_ref, callback_ref = _run("auto", 1, HOOKS, plugins=plugins(), precision=None, **settings)
    module, seen, callback_seen = _run(RoundPipeStrategy(num_microbatches=1, num_stages=2), 2, HOOKS,
                                       plugins=plugins(), precision=None, **settings)
    _assert_same(seen, module_ref, bitwise=True)
    _assert_same(callback_seen, callback_ref, bitwise=True)
    assert_states_equal(module, reference)


def test_several_microbatches_give_the_default_strategys_gradients_in_float64():
    settings = dict(accumulate_grad_batches=2, gradient_clip_val=0.5, precision="64-true")
    _, module_ref, callback_ref = _run("auto", 1, HOOKS, **settings)
    _, seen, callback_seen = _run(RoundPipeStrategy(num_microbatches=3, num_stages=2), 2, HOOKS, **settings)
    _assert_same(seen, module_ref, bitwise=False)
    _assert_same(callback_seen, callback_ref, bitwise=False)


@pytest.fixture(scope="module")
def accumulated_reference() -> tuple[Record, Record]:
    """The default strategy's gradients in every hook, accumulating over 2 batches, without clipping."""
    torch.manual_seed(0)
    _, module_ref, callback_ref = _run("auto", 1, HOOKS, accumulate_grad_batches=2)
    return module_ref, callback_ref


@pytest.mark.parametrize("owner", ["module", "callback"])
@pytest.mark.parametrize("hook", [h for h in HOOKS if h != "on_before_optimizer_step"])
def test_overriding_one_hook_is_enough(hook, owner, accumulated_reference):
    """Nothing else needs the final gradients here (no clipping, no on_before_optimizer_step): the one hook
    alone makes the strategy gather the pipeline's gradients where the hook can see them."""
    module_ref, callback_ref = accumulated_reference
    strategy = RoundPipeStrategy(num_microbatches=1, num_stages=2)
    _, seen, callback_seen = _run(strategy, 2, (hook,), owner=owner, accumulate_grad_batches=2)
    ours, reference = (seen, module_ref) if owner == "module" else (callback_seen, callback_ref)
    _assert_same(ours, reference, bitwise=True, hooks=(hook,))


# ---------------------------------------------------------------------------- manual optimization
class _Manual(Classifier):
    """Manual optimization that steps every second batch; records gradients after ``manual_backward`` and after
    ``opt.step()`` too (``zero_grad`` follows the step, so ``on_train_batch_end`` sees ``None`` then)."""

    def __init__(self) -> None:
        super().__init__("sgd")
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.manual_backward(loss)
        self.recording.note("after manual_backward", self)
        if batch_idx % 2 == 1:
            self.clip_gradients(optimizer, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
            optimizer.step()
            self.recording.note("after optimizer.step()", self)
            optimizer.zero_grad()


def test_manual_optimization_hooks_see_the_default_strategys_gradients():
    def run(strategy: Any, devices: int) -> tuple[Record, Record]:
        module = _recording_module(HOOKS, _Manual)()
        callback = _recording_callback(HOOKS)
        _fit(module, strategy, [callback], devices=devices)
        return module.recording.seen, callback.recording.seen

    module_ref, callback_ref = run("auto", 1)
    seen, callback_seen = run(RoundPipeStrategy(num_microbatches=1, num_stages=2), 2)
    hooks = (*HOOKS, "after manual_backward", "after optimizer.step()")
    assert {hook for hook, _, _ in module_ref} == set(hooks) - {"on_before_zero_grad"}  # Lightning's loop only
    _assert_same(seen, module_ref, bitwise=True, hooks=hooks)
    _assert_same(callback_seen, callback_ref, bitwise=True, hooks=hooks)


# ---------------------------------------------------------------------------- zero_grad
class _KeepsGradients(Classifier):
    """``optimizer_zero_grad`` overridden: zeroes in place, and only every second window (of 2 batches), so
    gradients carry over a step into the next window (plain training adds the next window's to them)."""

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        if batch_idx % 4 == 0:
            optimizer.zero_grad(set_to_none=False)
            engine = getattr(self.trainer.strategy, "engine", None)
            if engine is not None:  # zeroing in place waited for the step that reads these tensors
                self.zeroed_after_steps = getattr(self, "zeroed_after_steps", 0) + 1
                assert engine.stepping.last_step_done is None or engine.stepping.last_step_done.is_set()


@pytest.mark.parametrize("async_step", [False, True], ids=["sync", "async"])
def test_zero_grad_in_place_and_gradients_kept_across_steps_behave_as_in_plain_training(async_step):
    reference = _KeepsGradients("sgd")
    _fit(reference, "auto", [], accumulate_grad_batches=2, samples=48)  # 6 batches: zeroed at 0 and 4, kept at 2
    module = _KeepsGradients("sgd")
    strategy = RoundPipeStrategy(num_microbatches=1, num_stages=2, async_step=async_step)
    _fit(module, strategy, [], devices=2, accumulate_grad_batches=2, samples=48)
    assert module.zeroed_after_steps == 4
    if not async_step:  # one microbatch, same kernels: bitwise
        assert_states_equal(module, reference)


# ---------------------------------------------------------------------------- when the strategy waits
AFTER_STEP = ("on_train_batch_start", "on_before_zero_grad", "on_train_batch_end")


class _Waits(pl.Callback):
    """Records the batches (counted since the fit started) in which the strategy waited for the pipeline's
    backward to gather its gradients into ``param.grad`` (``RoundPipeEngine.collect_gradients``); pass it to the
    Trainer as a callback (it numbers the batches, and reads no gradient)."""

    roundpipe_reads_gradients = False

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.batches: list[int] = []
        self._batch = -1
        collect = RoundPipeEngine.collect_gradients

        def counted(engine: RoundPipeEngine) -> None:
            self.batches.append(self._batch)
            collect(engine)

        monkeypatch.setattr(RoundPipeEngine, "collect_gradients", counted)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._batch = trainer.fit_loop.epoch_loop.total_batch_idx


@pytest.fixture
def waits(monkeypatch: pytest.MonkeyPatch) -> _Waits:
    return _Waits(monkeypatch)


def _non_stepping(accumulate: int, batches_per_epoch: int = 4, epochs: int = 2) -> list[int]:
    """The batches that do not step (Lightning steps every ``accumulate`` batches and at an epoch's last)."""
    return [epoch * batches_per_epoch + index for epoch in range(epochs) for index in range(batches_per_epoch)
            if (index + 1) % accumulate and index + 1 < batches_per_epoch]


class _LogsLoss(pl.Callback):
    roundpipe_reads_gradients = False  # overrides gradient hooks, reads no gradient

    def on_after_backward(self, trainer, pl_module):
        pass

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        pass


def test_only_user_code_that_may_read_gradients_makes_the_strategy_wait(tmp_path, waits):
    from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint, TQDMProgressBar

    # Lightning's own callbacks override on_train_batch_end/start and read no gradient; nor does the strategy's
    # metrics callback; a user callback can say it reads none
    callbacks = [ModelCheckpoint(), TQDMProgressBar(), LearningRateMonitor(), _LogsLoss(), waits]
    trainer = pl.Trainer(strategy=RoundPipeStrategy(num_microbatches=2), accelerator="cpu", devices=2, max_epochs=1,
                         logger=pl.loggers.CSVLogger(tmp_path), enable_model_summary=False,
                         callbacks=callbacks, limit_train_batches=2, default_root_dir=tmp_path)
    trainer.fit(Classifier(), _data(16))
    assert waits.batches == []
    # async mode would wait for every backward for a hook after the step (below), but not for one that says
    _fit(Classifier(), RoundPipeStrategy(num_microbatches=2, async_step=True), [_LogsLoss(), waits], devices=2,
         limit_train_batches=2)
    assert waits.batches == []
    # a hook before the step may read each backward's gradients: every backward is waited for
    _fit(_recording_module(("on_after_backward",))(), RoundPipeStrategy(num_microbatches=2), [waits],
         devices=2, limit_train_batches=2)
    assert waits.batches == [0, 1, 2, 3]


@pytest.mark.parametrize("accumulate", [1, 2, 3])
@pytest.mark.parametrize("async_step", [False, True], ids=["sync", "async"])
def test_hooks_after_the_step_wait_only_where_no_step_shows_the_gradients(async_step, accumulate, waits):
    """A sync step shows its gradients after it without a wait; a batch that does not step must wait for its
    backward (its hooks see the window's gradients so far), and so does every batch in async mode, whose step
    runs on while the next batch starts."""
    strategy = RoundPipeStrategy(num_microbatches=2, num_stages=2, async_step=async_step)
    _fit(_recording_module(AFTER_STEP)(), strategy, [_recording_callback(AFTER_STEP), waits], devices=2,
         accumulate_grad_batches=accumulate)
    assert waits.batches == (list(range(8)) if async_step else _non_stepping(accumulate))


@pytest.mark.parametrize("fused", [False, True], ids=["transparent", "fused"])
@pytest.mark.parametrize("accumulate", [1, 2, 3])
def test_hooks_after_the_step_see_the_default_strategys_gradients_in_float64(accumulate, fused):
    """Several microbatches, float64, module and callback hooks after the step only (nothing before it gathers
    gradients), with and without accumulation: what Lightning shows there, to 1e-12."""
    settings = dict(accumulate_grad_batches=accumulate, precision="64-true", fused=fused)
    _, module_ref, callback_ref = _run("auto", 1, AFTER_STEP, **settings)
    _, seen, callback_seen = _run(RoundPipeStrategy(num_microbatches=3, num_stages=2), 2, AFTER_STEP, **settings)
    _assert_same(seen, module_ref, bitwise=False, hooks=AFTER_STEP)
    _assert_same(callback_seen, callback_ref, bitwise=False, hooks=AFTER_STEP)


class _KeepsReferences(pl.Callback):
    """Keeps a reference to each ``param.grad`` from ``on_train_batch_end`` to the next one and records, in every
    hook after the step, whether ``param.grad`` still is that tensor and what the tensor holds. Under the default
    strategy autograd accumulates into ``param.grad`` in place and clipping scales it in place, so the kept
    tensors show the next batches' gradients until ``zero_grad`` replaces them."""

    def __init__(self) -> None:
        self.kept: list[torch.Tensor | None] = []
        self.seen: list[tuple[str, int, list[bool], list[torch.Tensor | None]]] = []

    def _note(self, hook: str, module: pl.LightningModule) -> None:
        params = list(module.parameters())
        if not self.kept:
            return
        self.seen.append((hook, module.trainer.fit_loop.epoch_loop.total_batch_idx,
                          [kept is not None and kept is param.grad for kept, param in zip(self.kept, params, strict=True)],
                          [None if kept is None else kept.clone() for kept in self.kept]))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._note("on_train_batch_start", pl_module)

    def on_before_zero_grad(self, trainer, pl_module, optimizer):
        self._note("on_before_zero_grad", pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._note("on_train_batch_end", pl_module)
        self.kept = [param.grad for param in pl_module.parameters()]


@pytest.mark.parametrize("clip", [None, 0.5], ids=["no clipping", "clipping"])
@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_kept_reference_to_param_grad_changes_as_under_the_default_strategy(accumulate, clip):
    def run(strategy: Any, devices: int) -> _KeepsReferences:
        keeper = _KeepsReferences()
        _fit(Classifier("sgd"), strategy, [keeper], devices=devices, accumulate_grad_batches=accumulate,
             gradient_clip_val=clip, precision="64-true")
        return keeper

    reference = run("auto", 1)
    # stress: a kept tensor that were a buffer the engine releases or reuses would be poisoned (NaN) meanwhile
    ours = run(RoundPipeStrategy(num_microbatches=2, num_stages=2, stress=True, jitter=0.002), 2)
    assert [entry[:3] for entry in ours.seen] == [entry[:3] for entry in reference.seen]  # the same tensors
    if accumulate > 1:  # the accumulated step's gradients went into the tensor the hooks kept
        assert any(all(same) for hook, _, same, _ in reference.seen if hook == "on_train_batch_end")
    for (hook, batch, _, kept), (_, _, _, expected) in zip(ours.seen, reference.seen, strict=True):
        for index, (value, want) in enumerate(zip(kept, expected, strict=True)):
            assert (value is None) == (want is None), f"{hook} of batch {batch}, parameter {index}"
            if value is not None:
                assert_float64_equal(value, want, what=f"{hook} of batch {batch}, parameter {index}")


# ---------------------------------------------------------------------------- one thread on param.grad
class _GradAccess:
    """Records every Python read and assignment of ``.grad`` on the given parameters, with the thread: a
    property on ``nn.Parameter`` around torch's own attribute (autograd's C++ writes bypass it; they run on the
    thread that calls backward)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.watched: set[int] = set()
        self.threads: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()
        descriptor = torch._C.TensorBase.grad

        def note(param: nn.Parameter, what: str) -> None:
            if id(param) in self.watched:
                key = (threading.current_thread().name, what)
                with self._lock:
                    self.threads[key] = self.threads.get(key, 0) + 1

        def get(param: nn.Parameter) -> torch.Tensor | None:
            note(param, "read")
            return descriptor.__get__(param)

        def set_(param: nn.Parameter, value: torch.Tensor | None) -> None:
            note(param, "assign")
            descriptor.__set__(param, value)

        def delete(param: nn.Parameter) -> None:
            note(param, "assign")
            descriptor.__delete__(param)

        monkeypatch.setattr(nn.Parameter, "grad", property(get, set_, delete), raising=False)

    def watch(self, module: nn.Module) -> None:
        self.watched = {id(p) for p in module.parameters()}

    def others(self) -> dict[tuple[str, str], int]:
        main = threading.main_thread().name
        return {key: count for key, count in self.threads.items() if key[0] != main}


def test_the_access_recorder_sees_other_threads(monkeypatch):
    """The recorder below can fail: a read and an assignment on another thread are recorded."""
    access = _GradAccess(monkeypatch)
    param = nn.Parameter(torch.zeros(2))
    access.watch(nn.ParameterList([param]))
    thread = threading.Thread(target=lambda: (param.grad, setattr(param, "grad", torch.ones(2))), name="intruder")
    thread.start()
    thread.join()
    assert access.others() == {("intruder", "read"): 1, ("intruder", "assign"): 1}
    assert torch.equal(param.grad, torch.ones(2))


@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual"])
@pytest.mark.parametrize("async_step", [False, True], ids=["sync", "async"])
def test_only_the_main_thread_touches_param_grad_while_hooks_read_it(monkeypatch, async_step, manual):
    access = _GradAccess(monkeypatch)
    base = _Manual if manual else Classifier
    module = _recording_module(HOOKS, base)() if manual else _recording_module(HOOKS, base)("adamw")
    access.watch(module)
    strategy = RoundPipeStrategy(num_microbatches=2, num_stages=2, async_step=async_step, jitter=0.002)
    kwargs = {} if manual else dict(accumulate_grad_batches=2, gradient_clip_val=0.5)
    _fit(module, strategy, [_recording_callback(HOOKS)], devices=2, **kwargs)
    reads = sum(count for (_, what), count in access.threads.items() if what == "read")
    assert reads > 100  # the hooks read gradients all along
    assert access.others() == {}, f"param.grad touched off the main thread: {access.others()}"
    assert sum(entry[2][0] is not None for entry in module.recording.seen) > 10


# ---------------------------------------------------------------------------- the engine directly
def test_a_step_in_flight_keeps_the_gradients_it_was_handed_while_the_caller_adds_and_clears():
    """Async mode: step 1 is held in flight while iteration 2 runs; the caller adds iteration 2's gradients to the
    ones step 1 was handed (kept in ``param.grad``), then clears them. Step 1 must step exactly what it was handed,
    and the caller must see the sum."""
    model = bn_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    release, stepped = threading.Event(), []
    optimizer.register_step_pre_hook(lambda *_: release.wait(30) and None)
    optimizer.register_step_post_hook(
        lambda twin, *_: stepped.append([p.grad.clone() for group in twin.param_groups for p in group["params"]]))
    options = EngineOptions(num_microbatches=2, num_stages=2, async_step=True)
    with RoundPipeEngine(model, 2, options) as engine:
        engine.forward_backward(*bn_batch(8, 0), F.cross_entropy)
        engine.collect_gradients()
        handed = _grads(model)
        engine.step(optimizer, keep_gradients=True)
        assert stepped == [] and all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), handed, strict=True))
        engine.forward_backward(*bn_batch(8, 1), F.cross_entropy)  # runs on the published weights meanwhile
        engine.collect_gradients()
        summed = _grads(model)
        for param in model.parameters():
            param.grad = None
        release.set()
        engine.synchronize()
    assert len(stepped) == 1
    for index, (seen, grad, total) in enumerate(zip(stepped[0], handed, summed, strict=True)):
        assert torch.equal(seen, grad), f"parameter {index}: the step saw other gradients than it was handed"
        assert not torch.equal(total, grad)  # the second iteration's were added, out of place
