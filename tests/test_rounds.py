"""Dispatch in rounds (``round_size``) and the recompute run ahead of the output gradient.

References are independent of the engine: plain PyTorch running the same microbatches one after another
(float64, to 1e-12, see ``tests/numerics.py``), and hand-written tables of which microbatches each job runs.
Orders are shown by causality, never by timing: what a device runs after a job, or a loss that waits for
something only a recompute run ahead lets happen (an engine that recomputed after the gradient would never
let it happen, the bounded wait would run out and the test fail).
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from lightning_roundpipe import EngineOptions, Plan, RoundPipeEngine, is_recomputing
from lightning_roundpipe.planning.partition import LayerCost
from lightning_roundpipe.planning.simulate import choose_round_size
from tests.models import (
    clone,
    make_optimizer,
    microbatch_weights,
    reference_microbatch_step,
    split_sizes,
    transparency_case,
)
from tests.numerics import (
    assert_close_to_reference,
    assert_float64_equal,
    assert_states_close_to_reference,
    assert_states_float64_equal,
    double,
    state,
    to_double,
)

STEPS = 3
GUARD = 30.0  # seconds: only a guard against hanging, never reached when the engine works as claimed


def _train_reference(model, model_name, batch, samples, loss_fn, sizes, dtype, optimizer_kind):
    reference = clone(model) if dtype == torch.float32 else double(model)
    optimizer = make_optimizer(optimizer_kind, reference.parameters())
    losses = []
    for step in range(STEPS):
        inputs, target = batch(samples, seed=step)
        if dtype == torch.float64:
            inputs, target = to_double((inputs, target))
        losses.append(reference_microbatch_step(reference, inputs, target, loss_fn,
                                                microbatch_weights(model_name, target, sizes), sizes))
        optimizer.step()
        optimizer.zero_grad()
    return state(reference), losses


def _train_engine(model, batch, samples, loss_fn, weight_fn, devices, options, optimizer_kind):
    optimizer = make_optimizer(optimizer_kind, model.parameters())
    kwargs = {} if weight_fn is None else {"loss_weight": weight_fn}
    dtype = next(model.parameters()).dtype
    losses = []
    with RoundPipeEngine(model, devices, options) as engine:
        for step in range(STEPS):
            inputs, target = batch(samples, seed=step)
            if dtype == torch.float64:
                inputs, target = to_double((inputs, target))
            losses.append(engine.forward_backward(inputs, target, loss_fn, **kwargs))
            engine.step(optimizer)
        engine.synchronize()
        events = engine.events()
    return torch.stack([loss.reshape(()) for loss in losses]), events


@pytest.mark.parametrize("recompute", ["stage", "layer"])
@pytest.mark.parametrize("round_size", [1, 2, 3])
@pytest.mark.parametrize("devices", [2, 3])
@pytest.mark.parametrize("model_name", ["bn", "gpt"])
def test_rounds_equal_plain_pytorch_in_float64(model_name, devices, round_size, recompute):
    """5 microbatches in rounds of 1, 2 or 3 (the last round shorter): the BatchNorm statistics go through the
    rounds in microbatch order, and every round's gradients reach the step. SGD with momentum: rounds sum the
    microbatches' gradients in another order (round by round); the float32 test below runs AdamW, which
    scales rounding noise up, against the bound that allows for it."""
    model, batch, samples, loss_fn, weight_fn = transparency_case(model_name)
    sizes = split_sizes(samples, 5)
    reference_state, reference_losses = _train_reference(model, model_name, batch, samples, loss_fn, sizes,
                                                         torch.float64, "sgd")
    model = double(model)
    options = EngineOptions(num_microbatches=5, num_stages=2, recompute=recompute, round_size=round_size)
    losses, _ = _train_engine(model, batch, samples, loss_fn, weight_fn, devices, options, "sgd")
    assert_float64_equal(losses, torch.tensor(reference_losses, dtype=torch.float64), what="losses")
    assert_states_float64_equal(model, reference_state)


@pytest.mark.parametrize("model_name", ["bn", "gpt"])
def test_rounds_are_not_worse_than_plain_training_in_float32(model_name):
    model, batch, samples, loss_fn, weight_fn = transparency_case(model_name)
    sizes = split_sizes(samples, 5)
    references = [_train_reference(model, model_name, batch, samples, loss_fn, sizes, dtype, "adamw")
                  for dtype in (torch.float32, torch.float64)]
    options = EngineOptions(num_microbatches=5, num_stages=2, round_size=2, jitter=0.002)
    losses, _ = _train_engine(model, batch, samples, loss_fn, weight_fn, 2, options, "adamw")
    (state32, losses32), (state64, losses64) = references
    assert_close_to_reference(losses, torch.tensor(losses32), torch.tensor(losses64, dtype=torch.float64), what="losses")
    assert_states_close_to_reference(model, state32, state64)


def _layers() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(5)])


def _events(round_size, devices=2, microbatches=4, async_step=False):
    """One step of 5 layers, plan F0 [0-1] F1 [2-3] | L [4] | B0 [2-3] B1 [0-1] (5 jobs per round)."""
    model = _layers()
    plan = Plan.from_sizes([2, 2], 1, [2, 2])
    options = EngineOptions(num_microbatches=microbatches, num_stages=plan, round_size=round_size,
                            async_step=async_step, record_timeline=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with RoundPipeEngine(model, devices, options) as engine:
        x = torch.randn(8, 8)
        engine.forward_backward(x, x, nn.functional.mse_loss)
        engine.step(optimizer)
        engine.synchronize()
        return [e for e in engine.events() if e.kind in ("forward", "fused", "recompute", "backward")]


def test_each_round_runs_its_share_of_the_batch_through_every_stage():
    """4 microbatches in rounds of 2 on 2 devices. Hand-made table: jobs 0-4 (F0 F1 L B0 B1) run microbatches 0
    and 1, jobs 5-9 microbatches 2 and 3, each job on device index % 2."""
    events = _events(round_size=2)
    ran = {(e.job, e.device, e.label, e.microbatch) for e in events if e.kind != "recompute"}
    labels = ["F0", "F1", "L", "B0", "B1"]
    expected = {(job, job % 2, labels[job % 5], microbatch)
                for job in range(10) for microbatch in ((0, 1) if job < 5 else (2, 3))}
    assert ran == expected
    # device 1 runs round 1's F0 (job 5) after round 0's B0 (job 3): the first round back-propagates before the
    # second one's forward starts
    first_backward_end = min(e.end for e in events if e.kind == "backward")
    second_round_forward = min(e.start for e in events if e.kind == "forward" and e.microbatch >= 2)
    assert first_backward_end <= second_round_forward


@pytest.mark.parametrize(("round_size", "async_step"), [("whole", False), (4, False), ("auto", True)])
def test_whole_jobs_run_every_microbatch_forward_before_any_backward(round_size, async_step):
    """``"whole"``, a round as large as the batch, and ``"auto"`` in async mode: each job runs all 4 microbatches,
    so the last forward ends before the first backward starts."""
    events = _events(round_size=round_size, async_step=async_step)
    assert {e.microbatch for e in events if e.job == 0} == {0, 1, 2, 3}
    assert max(e.end for e in events if e.kind == "forward") <= min(e.start for e in events if e.kind == "backward")


class _Signal(nn.Module):
    """Identity that sets ``recomputed`` when it runs in a backward stage's recompute."""

    def __init__(self) -> None:
        super().__init__()
        self.recomputed = threading.Event()

    def __deepcopy__(self, memo: dict) -> _Signal:
        return self  # device replicas share the event with the host layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if is_recomputing():
            self.recomputed.set()
        return x


@pytest.mark.parametrize("recompute", ["stage", "layer"])
def test_a_backward_stage_recomputes_before_its_output_gradient_arrives(recompute):
    """Plan F0 [0-2] | L [3] | B0 [0-2] on 2 devices: F0 and B0 on device 0, L on device 1. The loss of
    microbatch 0 (in L) waits until B0 has recomputed microbatch 0, whose output gradient L has not produced yet:
    only a recompute run ahead of that gradient lets it happen. At layer grain the deepest layer (2) recomputes
    ahead, the others after the gradient."""
    torch.manual_seed(0)
    signal = _Signal()
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), signal, nn.Linear(4, 2))
    reference = clone(model)
    waited = []

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if not waited:
            waited.append(signal.recomputed.wait(GUARD))
        return nn.functional.mse_loss(output, target)

    options = EngineOptions(num_microbatches=2, num_stages=Plan.from_sizes([3], 1, [3]), recompute=recompute)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    with RoundPipeEngine(model, 2, options) as engine:
        engine.forward_backward(x, y, loss_fn)
        engine.step(optimizer)
        engine.synchronize()
    assert waited == [True], "the backward stage waited for its output gradient before recomputing"
    # and the results are plain training's (one step of SGD: the same float32 operations up to sum order)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    reference_microbatch_step(reference, x, y, nn.functional.mse_loss, [3.0, 3.0], [3, 3])
    reference_optimizer.step()
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


class _CallerWatch(nn.Module):
    """Identity that records, when it recomputes, whether the caller got its loss back within ``patience``
    seconds (``returned``, which the test sets as ``forward_backward`` returns)."""

    def __init__(self, patience: float) -> None:
        super().__init__()
        self.patience = patience
        self.returned = threading.Event()
        self.seen: list[bool] = []

    def __deepcopy__(self, memo: dict) -> _CallerWatch:
        return self  # device replicas share the record with the host layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if is_recomputing():
            self.seen.append(self.returned.wait(self.patience))
        return x


@pytest.mark.parametrize("microbatches", [1, 2])
def test_on_one_device_the_loss_returns_once_the_first_backward_job_has_recomputed(microbatches):
    """Plan F0 [0-1] | L [2-3] | B0 [0-1] on one device. The loss comes back only once B0 has recomputed its first
    microbatch: the caller's Python would otherwise hold the GIL the recompute needs (``Dispatcher.run_training``).
    B0's recompute gives the caller ``patience`` seconds to return first; a loss handed back as soon as L has
    computed it returns within them (then ``seen`` starts with True), one that waits for the recompute cannot.
    The results stay plain training's (float64)."""
    torch.manual_seed(0)
    watch = _CallerWatch(patience=0.5)
    model = double(nn.Sequential(nn.Linear(4, 4), watch, nn.Tanh(), nn.Linear(4, 2)))
    reference = clone(model)
    options = EngineOptions(num_microbatches=microbatches, num_stages=Plan.from_sizes([2], 2, [2]))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
    with RoundPipeEngine(model, 1, options) as engine:
        loss = engine.forward_backward(x, y, nn.functional.mse_loss)
        watch.returned.set()
        assert watch.seen[:1] == [False], "the loss came back before the first backward job had recomputed"
        engine.step(optimizer)
        engine.synchronize()
    assert len(watch.seen) == microbatches
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    sizes = split_sizes(6, microbatches)
    reference_loss = reference_microbatch_step(reference, x, y, nn.functional.mse_loss, [float(s) for s in sizes],
                                               sizes)
    reference_optimizer.step()
    assert_float64_equal(loss, torch.tensor(reference_loss, dtype=torch.float64), what="float64 loss")
    assert_states_float64_equal(state(model), state(reference))


def test_the_round_size_follows_the_cost_of_a_job():
    """8 devices, 16 microbatches, 8 equal layers (forward 1, backward 2), 3 forward and 7 backward stages: whole
    jobs start the first backward after 16 microbatches of forward (makespan 100 units), rounds of 8 after 8
    (82): rounds win while jobs are free; with jobs costing far more than a layer, the fewest jobs (whole) win."""
    costs = [LayerCost(1.0, 2.0, 1, 1)] * 8
    plan = Plan.from_sizes([2, 2, 3], 1, [1] * 7)
    assert choose_round_size(plan, costs, 8, 16, recompute_ahead=True) == 8
    assert choose_round_size(plan, costs, 8, 16, recompute_ahead=True, job_cost=100.0) is None


def test_auto_never_dispatches_in_rounds_with_the_disk_tier(tmp_path, monkeypatch):
    """``round_size="auto"`` with ``offload``: whole jobs even where the simulator predicts rounds faster (rounds
    would keep every step group's gradients until the last round, the memory the tier saves)."""
    from types import SimpleNamespace

    from lightning_roundpipe.engine import dispatch as dispatch_module

    monkeypatch.setattr(dispatch_module, "choose_round_size", lambda *args, **kwargs: 2)
    for tier, expected in (({}, 2), ({"offload": "optimizer", "offload_dir": str(tmp_path)}, None)):
        with RoundPipeEngine(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), [torch.device("cpu")] * 2,
                             EngineOptions(round_size="auto", **tier)) as engine:
            dispatcher = engine.dispatcher
            planner = dispatcher.planner
            dispatcher.planner = SimpleNamespace(estimate=[], settled=True, job_cost=0.0)  # type: ignore[assignment]
            try:
                assert dispatcher.round_size(planner.plan, 4) == expected
            finally:
                dispatcher.planner = planner
