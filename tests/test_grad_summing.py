"""Gradients summed off the ring (``engine/step/summing.py``): a job's stage is released once its gradients
are on the host, and the sum into the step's window runs on a thread no device waits for.

Each test runs a small float64 model on one CPU device, where a device's jobs run one after another: job k+2's
parameter upload waits until job k's stage is released ([1] in ``engine/worker.py``). No timing is measured:
the summation is held back until an event that only a release before the sum can produce.
"""

from __future__ import annotations

import threading
import time
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_roundpipe import EngineOptions, PipelineError, RoundPipeEngine
from lightning_roundpipe.engine.device import AbortSignal
from lightning_roundpipe.engine.operations import StageOperations
from lightning_roundpipe.engine.step.window import GradWindow, SumBuffers
from lightning_roundpipe.engine.transport import GradStaging
from lightning_roundpipe.planning.plan import Plan
from lightning_roundpipe.planning.schedule import StageKind
from tests.numerics import assert_float64_equal

HOLD_TIMEOUT = 20.0  # seconds a held sum waits for the upload it expects before the test gives up on it


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(6, 6) for _ in range(4)]).double()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return (torch.randn(8, 6, generator=generator, dtype=torch.float64),
            torch.randn(8, 6, generator=generator, dtype=torch.float64))


def _plain_gradients(model: nn.Module) -> list[torch.Tensor]:
    """The reference: plain PyTorch, the whole batch at once."""
    inputs, target = _batch()
    model.zero_grad()
    F.mse_loss(model(inputs), target).backward()
    return [param.grad.clone() for param in model.parameters()]


@pytest.mark.parametrize("stress", [False, True], ids=["plain", "stress"])
def test_a_stage_is_released_before_its_gradients_are_summed(monkeypatch, roundpipe_threads, stress):
    """The first job with gradients (the fused one) may not sum until the device has uploaded the job two
    after it, which waits for the fused job's release: were the release after the sum, the sum would wait
    in vain. The gradients are still plain PyTorch's (stress mode: reused staging buffers, poisoned once summed)."""
    uploads: list[tuple[StageKind, int]] = []
    uploaded = threading.Condition()
    upload_params = StageOperations.upload_params

    def recording_upload(self, task, stage_copy) -> None:
        with uploaded:
            uploads.append((task.job.kind, task.job.index))
            uploaded.notify_all()
        upload_params(self, task, stage_copy)

    held: list[bool] = []
    deliver = GradWindow.deliver

    def held_deliver(self, ticket, grads, **kwargs) -> None:
        if not held:  # the first sum: the fused job's
            fused = next(index for kind, index in uploads if kind is StageKind.FUSED)
            with uploaded:
                held.append(uploaded.wait_for(lambda: any(index >= fused + 2 for _, index in uploads),
                                              HOLD_TIMEOUT))
        deliver(self, ticket, grads, **kwargs)

    monkeypatch.setattr(StageOperations, "upload_params", recording_upload)
    monkeypatch.setattr(GradWindow, "deliver", held_deliver)
    model = _model()
    expected = _plain_gradients(_model())
    inputs, target = _batch()
    options = EngineOptions(num_microbatches=2, num_stages=3, stress=stress)
    with RoundPipeEngine(model, 1, options) as engine:
        engine.forward_backward(inputs, target, F.mse_loss)
        engine.collect_gradients()
    assert held == [True], "the job two after the fused one uploaded only once the fused job's sum was done"
    for param, reference in zip(model.parameters(), expected, strict=True):
        assert_float64_equal(param.grad, reference, what="gradient")
    assert roundpipe_threads() == []


def test_an_error_while_summing_stops_the_engine_saying_what_failed(monkeypatch, roundpipe_threads):
    def failing_deliver(self, ticket, grads, **kwargs) -> None:
        raise RuntimeError("no memory for the sum")

    monkeypatch.setattr(GradWindow, "deliver", failing_deliver)
    inputs, target = _batch()
    engine = RoundPipeEngine(_model(), 1, EngineOptions(num_microbatches=2, num_stages=3)).start()
    try:
        with pytest.raises(PipelineError, match=r"summing the gradients of stage \S+ \(job \d+\) from device 0 "
                                                r"into the step's gradients on the host failed: RuntimeError: "
                                                r"no memory for the sum") as caught:
            engine.forward_backward(inputs, target, F.mse_loss)
            engine.collect_gradients()
        assert isinstance(caught.value.__cause__, RuntimeError)
    finally:
        engine.close(finish_steps=False)
    assert roundpipe_threads() == []


def test_the_download_waits_for_a_staging_buffer_only_while_every_buffer_is_summed():
    staging = GradStaging(count=2)
    abort = AbortSignal(HOLD_TIMEOUT)
    first, second = staging.acquire(abort), staging.acquire(abort)
    assert first is not second
    third: list[object] = []
    waiter = threading.Thread(target=lambda: third.append(staging.acquire(abort)))
    waiter.start()
    waiter.join(0.05)
    assert waiter.is_alive() and third == []  # both buffers are out: it waits
    second.release()
    waiter.join(HOLD_TIMEOUT)
    assert third == [second]
    # an abort wakes a waiting download thread
    failed: list[BaseException] = []

    def acquire_or_fail() -> None:
        try:
            staging.acquire(abort)
        except BaseException as error:  # noqa: BLE001
            failed.append(error)

    waiter = threading.Thread(target=acquire_or_fail)
    waiter.start()
    abort.abort()
    waiter.join(HOLD_TIMEOUT)
    assert not waiter.is_alive() and "gradient staging buffer" in str(failed[0])


# ------------------------------------------------------------------ persistent sums (SumBuffers)
def _first_sums(sums: SumBuffers, params: list[nn.Parameter], value: float) -> list[torch.Tensor]:
    return [sums.first_sum(param, torch.full_like(param, value)) for param in params]


def test_a_sum_reuses_the_last_sums_memory_only_where_nothing_else_can_see_it():
    params = [nn.Parameter(torch.zeros(4, 4)) for _ in range(5)]
    sums = SumBuffers()
    first = _first_sums(sums, params, 1.0)
    addresses = [tensor.data_ptr() for tensor in first]
    # what a caller may still hold of each: nothing, a reference, a view, a weak reference, param.grad
    kept, view, weak = first[1], first[2][0], weakref.ref(first[3])
    params[4].grad = first[4]
    del first
    second = _first_sums(sums, params, 2.0)
    reused = [tensor.data_ptr() == address for tensor, address in zip(second, addresses, strict=True)]
    assert reused == [True, False, False, False, False]
    assert torch.equal(kept, torch.full((4, 4), 1.0)) and torch.equal(view, torch.full((4,), 1.0))
    assert weak() is None  # the pool let go of it; no one else held it
    assert torch.equal(params[4].grad, torch.full((4, 4), 1.0))
    assert all(torch.equal(tensor, torch.full((4, 4), 2.0)) for tensor in second)


@pytest.mark.parametrize("keep", [False, True], ids=["released", "kept-by-a-callback"])
def test_engine_sums_never_change_a_gradient_someone_kept(keep):
    """Two steps whose gradients the caller collects into param.grad. Kept between the steps (as a callback would
    keep param.grad), the first step's stay plain PyTorch's while the second step's land elsewhere; released,
    the second step's are plain PyTorch's in reused memory (which memory is the unit test's to check above: a
    freed block's address may come back from the allocator anyway)."""
    model, reference = _model(), _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    inputs, target = _batch()
    with RoundPipeEngine(model, 1, EngineOptions(num_stages=2)) as engine:
        engine.forward_backward(inputs, target, F.mse_loss)
        engine.collect_gradients()
        first = [param.grad for param in model.parameters()]
        addresses = [grad.data_ptr() for grad in first]
        engine.step(optimizer)
        engine.synchronize()
        for param in model.parameters():
            param.grad = None
        if not keep:
            del first
        engine.forward_backward(inputs, target, F.mse_loss)
        engine.collect_gradients()
        second = [param.grad.data_ptr() for param in model.parameters()]
    F.mse_loss(reference(inputs), target).backward()
    expected = [param.grad.clone() for param in reference.parameters()]
    if keep:
        assert not any(s == a for s, a in zip(second, addresses, strict=True))
        for grad, reference_grad in zip(first, expected, strict=True):
            assert_float64_equal(grad, reference_grad, what="a kept first-step gradient")
    reference_optimizer.step()
    reference.zero_grad()
    F.mse_loss(reference(inputs), target).backward()
    for param, reference_param in zip(model.parameters(), reference.parameters(), strict=True):
        assert_float64_equal(param.grad, reference_param.grad, what="a second-step gradient")


def test_a_sum_given_back_serves_any_later_sum_of_its_shape_unless_someone_kept_it():
    params = [nn.Parameter(torch.zeros(4, 4)) for _ in range(4)] + [nn.Parameter(torch.zeros(2, 8))]
    sums = SumBuffers()
    first = _first_sums(sums, params[:2], 1.0)
    addresses = [tensor.data_ptr() for tensor in first]
    kept = first[1]
    sums.give_back([(params[0], first.pop(0)), (params[1], first.pop(0))])
    assert first == [] and sums.fresh_bytes == 2 * 64
    # another parameter of the same shape takes the first; the second is seen (kept) and let go; a third
    # parameter finds nothing left, and one of another shape never takes memory of this one
    second = _first_sums(sums, params[2:], 2.0)
    assert [tensor.data_ptr() == addresses[0] for tensor in second] == [True, False, False]
    assert sums.fresh_bytes == 2 * 64 + 64 + 64
    assert torch.equal(kept, torch.full((4, 4), 1.0))
    assert all(torch.equal(tensor, torch.full_like(tensor, 2.0)) for tensor in second)


def _assert_weights_as_plain_pytorch(model: nn.Module, reference: nn.Module, optimizer: torch.optim.Optimizer,
                                     batch: tuple[torch.Tensor, torch.Tensor], steps: int) -> None:
    """The reference: ``steps`` steps of plain PyTorch on ``reference``; ``model``'s weights must equal its after."""
    inputs, target = batch
    for _ in range(steps):
        optimizer.zero_grad()
        F.mse_loss(reference(inputs), target).backward()
        optimizer.step()
    for param, reference_param in zip(model.parameters(), reference.parameters(), strict=True):
        assert_float64_equal(param, reference_param, what=f"a weight after {steps} steps")


class _Gated(nn.Module):
    """A linear layer whose backward first waits until the optimizer thread has updated the layer after it (its
    ``watched`` weight differs from ``before``): a deeper group must be stepped before this one's gradients
    exist, which bounds the groups in flight whatever the threads' timing."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width, dtype=torch.float64)
        self.watch: list[torch.Tensor] = []  # [the next layer's weight, its value before this step]: no submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _WaitInBackward.apply(self.linear(x), self.watch)


class _WaitInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, watch: list[torch.Tensor]) -> torch.Tensor:
        ctx.watch = watch
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.watch:
            weight, before = ctx.watch
            released = threading.Event()
            while torch.equal(weight, before) and not released.wait(0.001):
                pass  # the deeper group's step is on the optimizer thread: it changes the weight in place
        return grad, None


@pytest.mark.parametrize("keep", [False, True], ids=["in-flight", "kept"])
def test_gradients_the_step_does_not_keep_live_only_while_their_groups_are_in_flight(keep, roundpipe_threads):
    """Eight equal layers, a backward stage each, so the step has eight groups. Each layer's backward waits until
    the optimizer has stepped the layer after it, so at most about two groups' gradients are summed and not yet
    stepped at any time. Without ``keep_gradients`` the memory of every gradient sum the engine keeps for reuse,
    and every one it ever allocated, stays within three layers' gradients (the model's are eight); kept in
    ``param.grad`` (the control), the sums hold the whole model's. The weights equal plain PyTorch's after three
    steps either way."""
    width, depth, steps = 16, 8, 3
    torch.manual_seed(0)
    model = nn.Sequential(*[_Gated(width) for _ in range(depth)])
    reference = nn.Sequential(*[nn.Linear(width, width, dtype=torch.float64) for _ in range(depth)])
    reference.load_state_dict({key.replace("linear.", ""): value for key, value in model.state_dict().items()})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    inputs, target = (torch.randn(8, width, dtype=torch.float64), torch.randn(8, width, dtype=torch.float64))
    layer_bytes = (width * width + width) * 8
    plan = Plan((range(0, depth - 1),), range(depth - 1, depth), tuple(range(k, k + 1) for k in range(depth - 2, -1, -1)))
    with RoundPipeEngine(model, 1, EngineOptions(num_stages=plan, freeze_plan=True, wait_timeout=60.0)) as engine:
        for _ in range(steps):
            for layer, deeper in zip(model[:-1], model[1:], strict=True):
                layer.watch[:] = [deeper.linear.weight, deeper.linear.weight.detach().clone()]
            F.mse_loss(engine(inputs), target).backward()
            engine.step(optimizer, keep_gradients=keep)
            engine.synchronize()
            if keep:
                engine.restore_gradients()
                assert all(param.grad is not None for param in model.parameters())
            held = engine.dispatcher.sum_buffers.held_bytes()
            assert (held == depth * layer_bytes) if keep else (held <= 3 * layer_bytes), held
            optimizer.zero_grad()
        fresh = engine.dispatcher.sum_buffers.fresh_bytes
    assert fresh >= depth * layer_bytes if keep else fresh <= 3 * layer_bytes, fresh
    _assert_weights_as_plain_pytorch(model, reference, reference_optimizer, (inputs, target), steps)
    assert roundpipe_threads() == []


def test_after_a_step_the_pool_keeps_only_what_the_step_had_out_at_once():
    """A first step with three sums out at once keeps three buffers; a second with one at a time keeps one: the
    pool follows the groups in flight, not the largest step ever."""
    params = [nn.Parameter(torch.zeros(4, 4)) for _ in range(3)]
    sums = SumBuffers()
    taken = _first_sums(sums, params, 1.0)
    sums.give_back(list(zip(params, taken, strict=True)))
    del taken
    sums.trim()
    assert sums.held_bytes() == 3 * 64
    for param in params:  # one at a time: taken, stepped, given back
        sums.give_back([(param, sums.first_sum(param, torch.ones(4, 4)))])
    sums.trim()
    assert sums.held_bytes() == 64 and sums.fresh_bytes == 3 * 64


def test_a_summing_thread_waits_for_room_only_while_the_step_will_take_sums():
    """The back-pressure's rule, on the pool alone: over the budget a sum waits while the running step will take sums
    out of the windows, and goes on once it has; over the budget with nothing to be taken (a group that needs this
    very sum), or with no step running, it never waits."""
    params = [nn.Parameter(torch.zeros(4, 4)) for _ in range(3)]
    sums, abort = SumBuffers(), AbortSignal(timeout=HOLD_TIMEOUT)
    in_windows = _first_sums(sums, params[:2], 1.0)  # 128 bytes in windows
    sums.wait_for_room(64, abort, "no step running")  # returns: nothing limits sums between steps
    will_take = threading.Event()
    with sums.reclaiming(128, will_take.is_set):
        sums.wait_for_room(64, abort, "nothing to take")  # returns: waiting would wait for itself
        will_take.set()
        waited = threading.Event()

        def third_sum() -> None:
            sums.wait_for_room(64, abort, "a third sum")
            waited.set()

        summer = threading.Thread(target=third_sum)
        summer.start()
        assert not waited.wait(0.2)  # held back: 192 bytes would be in windows, and the step will take some
        sums.taken([in_windows[0]])  # a step took one (what it gives back later is not counted again)
        summer.join(HOLD_TIMEOUT)
        assert waited.is_set() and sums.waited_seconds > 0
        sums.wait_for_room(64, abort, "within the budget")  # 64 in windows: returns at once


class _SlowFirstStep(torch.optim.SGD):
    """SGD whose first stepped group waits until every layer's gradient sum has been started (or a second has
    passed): without back-pressure the backward, far quicker than that, sums the whole model's gradients at once."""

    def __init__(self, params, sums_started, **kwargs) -> None:
        super().__init__(params, **kwargs)
        self.sums_started = sums_started
        self.first = [True]  # shared: the engine steps a copy of this object, which shares its attributes' values

    def step(self, closure=None):
        if self.first[0]:
            self.first[0] = False
            deadline = time.monotonic() + 1.0
            while not self.sums_started() and time.monotonic() < deadline:
                time.sleep(0.005)
        return super().step(closure)


def test_a_slow_host_step_holds_the_backward_to_its_pace(roundpipe_threads):
    """Eight layers, a backward stage each, one device: the budget is one group's gradients in the window, beside the
    group being stepped. The first group's step waits until every sum has started, which back-pressure never lets
    happen: the sums the engine ever allocates stay within three layers', and the weights equal plain PyTorch's.
    Back-pressure holds the sums while a step runs, and ``backward()`` returns before the backward stages do: the
    stand-in devices' operations take some milliseconds (``jitter``), as a real device's do, so the step is queued
    before the sums pile up. Without it a loaded machine (the suite under xdist) once ran the first iteration's
    whole backward before its step was queued (five layers' sums), which the design allows (nothing is wrong, and
    nothing to hold back until a step runs)."""
    width, depth, steps = 16, 8, 3
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width, dtype=torch.float64) for _ in range(depth)])
    reference = nn.Sequential(*[nn.Linear(width, width, dtype=torch.float64) for _ in range(depth)])
    reference.load_state_dict(model.state_dict())
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    inputs, target = (torch.randn(8, width, dtype=torch.float64), torch.randn(8, width, dtype=torch.float64))
    layer_bytes = (width * width + width) * 8
    plan = Plan((range(0, depth - 1),), range(depth - 1, depth), tuple(range(k, k + 1) for k in range(depth - 2, -1, -1)))
    options = EngineOptions(num_stages=plan, freeze_plan=True, wait_timeout=60.0, streaming_step="on", jitter=0.01)
    with RoundPipeEngine(model, 1, options) as engine:
        sums = engine.dispatcher.sum_buffers
        optimizer = _SlowFirstStep(model.parameters(), lambda: sums.fresh_bytes >= depth * layer_bytes, lr=0.5)
        for _ in range(steps):
            F.mse_loss(engine(inputs), target).backward()
            engine.step(optimizer)
        engine.synchronize()
        assert sums.fresh_bytes <= 3 * layer_bytes, sums.fresh_bytes
    _assert_weights_as_plain_pytorch(model, reference, reference_optimizer, (inputs, target), steps)
    assert roundpipe_threads() == []
