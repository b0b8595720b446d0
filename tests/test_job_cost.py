"""The fixed cost of a stage job: what the planner weighs it against (hand tables, and a brute-force check of
the bisection), how the stage runner measures it, and the cuts to it (replica bindings resolved once, activation
metering that stops once its figures have settled). Figures are worked out by hand in the comments."""

from __future__ import annotations

import contextlib
import gc
import math
import random
import threading
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_roundpipe import EngineOptions, RoundPipeEngine
from lightning_roundpipe.engine import feedback, replica
from lightning_roundpipe.engine.activations import ActivationMeter
from lightning_roundpipe.engine.device import Residency
from lightning_roundpipe.engine.feedback import Measurements, StepTimes
from lightning_roundpipe.engine.layers import Trunk
from lightning_roundpipe.engine.stage import StageCopy, StageRunner, UploadSpares
from lightning_roundpipe.engine.timing import HostSpan
from lightning_roundpipe.planning import search
from lightning_roundpipe.planning.partition import LayerCost, Plan, Planner, plan_auto, predicted_cost
from tests.test_primitives import Layer, binding_of


def uniform(n: int, nbytes: int = 0) -> list[LayerCost]:
    """``n`` trunk layers of forward 1, backward 2 (fwd+bwd 3), plus a head of 2 + 2 (fwd+bwd 4)."""
    return [LayerCost(1, 2, nbytes, nbytes)] * n + [LayerCost(2, 2, nbytes, nbytes)]


ALL_FUSED = Plan((), range(0, 7), ())
REFERENCE = Plan.from_sizes([3, 3], 1, [1] * 6)


# ------------------------------------------------------------------ the planner
def test_one_device_fuses_everything_without_a_budget():
    costs = uniform(6)
    # The window [4, 4.4] holds one bound, W = 4: fused = head, forward 2 stages, backward 6 -> 9 stages, 36;
    # the reference planner's plan, which several devices still get.
    assert plan_auto(costs, num_devices=2) == REFERENCE
    assert predicted_cost(REFERENCE, costs, 1) == 36
    # One device opens the bounds above the window: the fused stage alone is one job of 6 * 3 + 4 = 22, which
    # every other plan's padded work exceeds (it recomputes nothing): 22 + c, whatever the job cost c.
    for job_cost in (0.0, 0.01, 1.0, 100.0):
        assert plan_auto(costs, num_devices=1, job_cost=job_cost) == ALL_FUSED
        assert predicted_cost(ALL_FUSED, costs, 1, job_cost) == pytest.approx(22 + job_cost)
    assert predicted_cost(REFERENCE, costs, 1, 1.0) == 36 + 9


def test_one_device_with_a_budget_takes_the_fewest_stages_that_fit():
    # 10 + 10 bytes a layer, budget 100 -> 50 a stage: the fused and backward stages hold at most 2 layers,
    # forward stages 5. Without a job cost: the reference plan (it fits). With one, the fewest jobs that fit:
    # fused [5, 6] (4 + 3 = 7), one forward stage of layers 0-4 (5), and 5 layers in backward stages of at
    # most 2 -> 3, balanced under W = 7 from layer 0: 15/3 = 5 -> [0], then 12/2 = 6 -> [1, 2], [3, 4];
    # deep to shallow 2, 2, 1. 5 stages, 5 * 7 = 35 + 5c against the reference's 36 + 9c (two devices
    # keep the reference window: 9 stages there).
    costs = uniform(6, nbytes=10)
    assert plan_auto(costs, num_devices=2, memory_budget=100) == REFERENCE
    assert plan_auto(costs, num_devices=1, memory_budget=100) == Plan.from_sizes([5], 2, [2, 2, 1])
    assert plan_auto(costs, num_devices=1, memory_budget=100, job_cost=0.5) == Plan.from_sizes([5], 2, [2, 2, 1])
    assert plan_auto(costs, num_devices=1, memory_budget=100, job_cost=50.0) == Plan.from_sizes([5], 2, [2, 2, 1])


def test_several_devices_weigh_the_job_cost_within_the_window_only():
    costs = uniform(6)
    # Threshold 2, 10 devices (from test_partition): W=4 -> 9 stages, 10 * 4 = 40; W=6 -> 5 stages, 60
    # (the others cost more). With the job cost: 40 + 9c against 60 + 5c: the 5 stages win above c = 5.
    assert plan_auto(costs, num_devices=10, upper_threshold=2.0, job_cost=4.0) == REFERENCE
    assert plan_auto(costs, num_devices=10, upper_threshold=2.0, job_cost=6.0) == Plan.from_sizes([6], 1, [2, 2, 2])
    # The default window holds W = 4 alone: however large the job cost, the reference plan.
    assert plan_auto(costs, num_devices=4, job_cost=1e6) == REFERENCE


def test_job_cost_is_validated():
    with pytest.raises(ValueError, match="job_cost must be finite and >= 0"):
        plan_auto(uniform(2), num_devices=1, job_cost=-1.0)
    with pytest.raises(ValueError, match="job_cost must be finite and >= 0"):
        Planner("auto", 3, 1, job_cost=math.inf)


def _brute_force(costs, num_devices, memory_budget, upper_threshold, job_cost, every_bound):
    """:func:`plan_auto` by packing every candidate bound, ascending, as the reference planner does."""
    fwd, both, fsize, bsize = search._split(costs)
    cap = search._stage_cap(costs, memory_budget)
    wmax = max(max(fwd), max(both))
    hi = math.inf if every_bound else upper_threshold * wmax
    best = (math.inf, 0, 0.0, (0, 0, 0))
    for w in sorted({wmax} | search._run_sums(fwd, wmax, hi) | search._run_sums(both, wmax, hi)):
        shape = search._counts_for(fwd, both, fsize, bsize, w, cap)
        stages = shape[1] + 1 + shape[2]
        cost = max(stages, num_devices) * w + stages * job_cost
        if (cost, stages) < best[:2]:
            best = (cost, stages, w, shape)
    return search._balanced_plan(fwd, both, fsize, bsize, *best[3], cap, best[2])


def test_the_bisection_finds_what_packing_every_bound_finds():
    rng = random.Random(7)
    for _ in range(300):
        n = rng.randint(1, 14)
        costs = [LayerCost(rng.choice([0.5, 1.0, 1.5, 2.0, rng.uniform(0.1, 3)]), rng.uniform(0, 4),
                           rng.randint(1, 10), rng.randint(0, 10), rng.randint(0, 5)) for _ in range(n)]
        budget = rng.choice([None, 200, 80])
        if budget is not None and any(c.param_bytes + c.grad_bytes + c.activation_bytes > budget / 2 for c in costs):
            budget = None
        devices = rng.choice([1, 1, 2, 4, 8])
        threshold = rng.choice([1.1, 1.5, 3.0])
        job_cost = rng.choice([0.0, 0.0, 0.1, 1.0, 10.0])
        got = plan_auto(costs, num_devices=devices, memory_budget=budget, upper_threshold=threshold, job_cost=job_cost)
        # on several devices the reference window; on one device every bound
        expected = _brute_force(costs, devices, budget, threshold, job_cost, every_bound=devices == 1)
        assert got == expected, (costs, devices, budget, threshold, job_cost)


# 10 + 10 bytes a layer, budget 120 -> 60 a stage: fused and backward stages hold at most 3 layers. Without a
# job cost: W = 6, fused = head (4), backward [4, 5], [2, 3], [0, 1] (6 each), forward 0-5 (6): 5 stages, 30.
# With W = 9: fused [5, 6] (3 + 4 = 7), backward [2, 3, 4] (9), [0, 1] (6), forward 0-4 (5): 4 stages, 36.
FIVE_JOBS = Plan.from_sizes([6], 1, [2, 2, 2])
FOUR_JOBS = Plan.from_sizes([5], 2, [3, 2])


def test_the_planner_learns_the_job_cost_and_replans_to_fewer_jobs():
    costs = uniform(6, nbytes=10)
    planner = Planner("auto", 7, 1, memory_budget=120)
    assert planner.initial(costs) == FIVE_JOBS  # first estimates: no job cost (they are not seconds)
    assert planner.job_cost == 0.0
    planner.observe(costs, job_cost=500.0)  # warm-up: discarded, the job cost with it
    assert planner.job_cost == 0.0
    planner.observe(costs)  # a step that measured no job cost
    planner.observe(costs, job_cost=20.0)
    assert planner.job_cost == pytest.approx(20.0)  # bias-corrected: one observation is itself
    planner.observe(costs, job_cost=40.0)
    # c = (0.9 * 0.1 * 20 + 0.1 * 40) / (1 - 0.9^2) = 30.5: 36 + 4c = 158 against 30 + 5c = 183, over 10% better
    assert planner.job_cost == pytest.approx((0.9 * 0.1 * 20 + 0.1 * 40) / 0.19)
    assert planner.replan() is True and planner.plan == FOUR_JOBS

    # a checkpoint carries it; one from before job costs were measured has none, and the planner's stands
    state = planner.state_dict()
    again = Planner("auto", 7, 1, memory_budget=120)
    again.initial(costs)
    assert again.load_state_dict(state) and again.job_cost == pytest.approx(planner.job_cost)
    del state["job_ema"], state["jobs_seen"]
    old = Planner("auto", 7, 1, memory_budget=120, job_cost=0.25)
    old.initial(costs)
    assert old.load_state_dict(state) and old.job_cost == 0.25

    # a fixed job cost, given: used once times are measured (36 + 4 * 30 = 156 against 30 + 5 * 30 = 180)
    fixed = Planner("auto", 7, 1, memory_budget=120, job_cost=30.0)
    assert fixed.initial(costs) == FIVE_JOBS
    for _ in range(3):
        fixed.observe(costs)
    assert fixed.replan() is True and fixed.plan == FOUR_JOBS
    with pytest.raises(ValueError, match="job_cost must be finite and >= 0"):
        fixed.observe(uniform(6), job_cost=-1.0)


def test_step_times_job_cost_is_the_median():
    assert StepTimes().job_cost() is None
    assert StepTimes(job_seconds=[3.0, 1.0, 2.0]).job_cost() == 2.0
    assert StepTimes(job_seconds=[4.0, 1.0, 2.0, 3.0]).job_cost() == 2.5


# ------------------------------------------------------------------ the measurement
class SharedClock:
    """One fake device clock for every thread, advanced only by ``spend``: with one device its spans line up
    exactly, and no host time gets into them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.seconds = 0.0

    def spend(self, seconds: float) -> None:
        with self._lock:
            self.seconds += seconds

    def start(self) -> float:
        return self.seconds

    def stop(self, started: float) -> HostSpan:
        return HostSpan(started, self.seconds)


class Spend(nn.Module):
    def __init__(self, clock: SharedClock, seconds: float) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)
        self.clock, self.seconds = clock, seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.clock.spend(self.seconds)
        return self.linear(x)


def test_a_jobs_wait_is_what_passes_between_its_input_and_its_compute(monkeypatch):
    """One device, jobs F0 F1 L B0 B1 (one layer each). Only the layers (1 ms each call) and binding a stage
    (3 ms, standing in for a job's hand-offs and binding) move the clock. Every job but F0 reads the previous
    job's output, which is also the device's previous job: each waited exactly the 3 ms of its binding."""
    clock = SharedClock()
    taken: list[StepTimes] = []
    take, bind = Measurements.take_step_times, StageRunner.bind

    def record(self):
        times = take(self)
        taken.extend(times)
        return times

    def slow_bind(self, device, task, stage_copy):
        clock.spend(0.003)
        bind(self, device, task, stage_copy)

    monkeypatch.setattr(Measurements, "take_step_times", record)
    monkeypatch.setattr(StageRunner, "bind", slow_bind)
    torch.manual_seed(0)
    model = nn.Sequential(*[Spend(clock, 0.001) for _ in range(3)])
    plan = Plan.from_sizes([1, 1], 1, [1, 1])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with RoundPipeEngine(model, 1, EngineOptions(num_microbatches=1, num_stages=plan)) as engine:
        for device in engine.devices:
            device.compute_timer = clock
        for step in range(3):
            generator = torch.Generator().manual_seed(step)
            x, y = torch.randn(4, 16, generator=generator), torch.randn(4, 16, generator=generator)
            engine.forward_backward(x, y, F.mse_loss)
            engine.step(optimizer)
            engine.synchronize()
    assert len(taken) >= 2
    for times in taken:
        assert len(times.jobs) == 5
        assert times.job_seconds == pytest.approx([0.003] * 4, abs=1e-12)
        assert times.job_cost() == pytest.approx(0.003, abs=1e-12)


# ------------------------------------------------------------------ replica bindings
def test_a_binding_skips_the_sync_only_while_nothing_changed():
    host = Layer()
    binding = binding_of(host)
    copy = binding.replica
    first = binding.sync_attributes()
    again = binding.sync_attributes()
    assert all(a[1] is b[1] for a, b in zip(first, again, strict=True))  # the same snapshots: skipped
    assert replica.written_attributes(copy, again) == []

    host.inner.scale = 0.5  # the host changed: synced
    host.label = "new"
    synced = binding.sync_attributes()
    assert copy.inner.scale == 0.5 and copy.label == "new"
    assert synced[1][1] is not first[1][1] and synced[2][1] is first[2][1]  # only the changed modules again

    copy.inner.scale = 2.0  # a forward's write on the replica: found, and undone by the next sync
    copy.inner.calls = 1
    assert replica.written_attributes(copy, synced) == ["inner.calls", "inner.scale"]
    binding.sync_attributes()
    assert copy.inner.scale == 0.5 and "calls" not in copy.inner.__dict__

    del host.norm.eps  # deleted on the host
    binding.sync_attributes()
    assert "eps" not in copy.norm.__dict__


def test_the_runner_makes_its_bindings_again_for_recollected_layers():
    host = Layer()
    trunk = Trunk([host])
    runner = StageRunner(trunk, 1, "stage", None, 0, None)  # type: ignore[arg-type]

    class FakeDevice:
        index = 0

    device = FakeDevice()
    made = runner.replica(device, 0)  # type: ignore[arg-type]
    assert runner.replica(device, 0) is made  # type: ignore[arg-type]
    runner.follow_layers([0])
    assert runner.replica(device, 0) is not made  # type: ignore[arg-type]



def test_uploads_reuse_only_the_memory_of_released_stage_copies():
    cpu = torch.device("cpu")
    n = UploadSpares.SMALLEST // 4  # float32 elements: the smallest tensor whose memory is reused
    spares = UploadSpares()
    live, released = StageCopy(), StageCopy()
    for stage_copy in (live, released):
        copied = spares.copy_all([torch.ones(n), torch.ones(n - 1)], cpu)
        stage_copy.params[0] = copied
        spares.watch(stage_copy, copied)
    kept, freed = live.params[0][0], released.params[0][0]
    small_freed = released.params[0][1]
    released.params.clear()  # what operations.finish does once nothing reads the copy any more
    spares.collect()
    # a layer's tensors at once: the spare for the one that has one, fresh memory for the other, each its value
    reused, small_fresh = spares.copy_all([torch.full((n,), 2.0), torch.full((n - 1,), 5.0)], cpu)
    assert reused.data_ptr() == freed.data_ptr() and torch.equal(reused, torch.full((n,), 2.0))
    assert small_fresh.data_ptr() != small_freed.data_ptr() and torch.equal(small_fresh, torch.full((n - 1,), 5.0))
    (fresh,) = spares.copy_all([torch.full((n,), 3.0)], cpu)  # no spare left: new memory, never the live copy's
    assert fresh.data_ptr() not in (kept.data_ptr(), freed.data_ptr()) and torch.equal(kept, torch.ones(n))
    (small,) = spares.copy_all([torch.full((n - 1,), 4.0)], cpu)  # too small to be kept: the allocator's own
    assert small.data_ptr() != small_freed.data_ptr()  # (small_freed is alive here: not reusable by malloc)
    assert torch.equal(small, torch.full((n - 1,), 4.0)) and not small.requires_grad


# ------------------------------------------------------------------ activation metering
def test_a_meter_with_figures_charges_each_layer_once_and_installs_no_hook():
    residency = Residency(0)
    meter = ActivationMeter(residency, [torch.zeros(3)], figures={0: 100, 1: 30})
    assert not meter.measured
    with meter.saving(0):
        x = torch.ones(4, requires_grad=True)
        y = (x * x).sum()
        assert y.grad_fn is not None
    with meter.saving(1):
        pass
    with meter.saving(1):  # again (a fused stage's loss counts as its last layer's): charged once
        pass
    assert residency.current == 130 and meter.held == 130 and meter.by_layer == {}
    meter.release()
    assert residency.current == 0
    with meter.saving(1):  # after a release (layer-grain recompute): charged again
        pass
    assert residency.current == 30



@pytest.mark.parametrize("saves_its_output", [torch.exp, lambda x: torch.softmax(x, dim=-1)],
                         ids=["exp", "softmax"])
def test_a_metered_saved_output_dies_with_its_graph_dropped_without_backward(saves_its_output):
    """Review finding B2: a pack hook that keeps a saved output with its grad_fn makes a cycle nothing frees."""

    def dropped(meter: ActivationMeter | None) -> weakref.ref:
        x = torch.randn(4, 4, requires_grad=True)
        with meter.saving(0) if meter is not None else contextlib.nullcontext():
            y = saves_its_output(x)
        return weakref.ref(y)  # y and its graph go out of scope here, no backward ran

    assert dropped(None)() is None  # plain PyTorch: the reference
    gc.collect()
    assert dropped(ActivationMeter(Residency(0), []))() is None
    # and the metered graph still differentiates exactly as an unmetered one
    x = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    (expected,) = torch.autograd.grad(saves_its_output(x).square().sum(), x)
    meter = ActivationMeter(Residency(0), [x])
    with meter.saving(0):
        y = saves_its_output(x)
    assert meter.by_layer[0] == 16 * 8  # the output, once (x is accounted)
    (metered,) = torch.autograd.grad(y.square().sum(), x)
    assert torch.equal(metered, expected)
    with meter.saving(0):  # the detached copy shares the version counter: a later in-place write is caught
        y = saves_its_output(x)
    y.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(y.sum(), x)


def _fused_only(steps: int, samples=lambda step: 4):
    """test_measurements' fused-only model: Linear(4, 8), ReLU, Linear(8, 2), no biases, one device."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8, bias=False), nn.ReLU(), nn.Linear(8, 2, bias=False))
    options = EngineOptions(num_microbatches=1, num_stages=Plan((), range(0, 3), ()))
    peaks = []
    with RoundPipeEngine(model, 1, options) as engine:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(steps):
            n = samples(step)
            engine.devices[0].residency.peak = 0
            engine.forward_backward(torch.randn(n, 4), torch.randn(n, 2), lambda out, target: (out * target).sum())
            engine.step(optimizer)
            engine.synchronize()
            peaks.append(engine.devices[0].residency.peak)
        return peaks, engine.planner.activation_bytes


def _watch_metering(monkeypatch) -> list[bool]:
    """Whether each microbatch's activations were metered, in the order they finished."""
    metered: list[bool] = []
    done = Measurements.activations_done

    def watch(self, meter):
        metered.append(meter.measured)
        return done(self, meter)

    monkeypatch.setattr(Measurements, "activations_done", watch)
    return metered


def test_metering_stops_once_settled_and_the_accounting_stays_the_same(monkeypatch):
    metered = _watch_metering(monkeypatch)
    monkeypatch.setattr(feedback, "ACTIVATIONS_REMETER", 4)
    peaks, figures = _fused_only(9)
    # the first ACTIVATIONS_SETTLE microbatches are metered; then one in 4 (after 3 charged ones)
    assert metered == [True, True, True, False, False, False, True, False, False]
    # test_measurements: 384 of weights and gradients, 96 of inputs, 128 kept by the ReLU (its output)
    assert peaks == [384 + 96 + 128] * 9
    assert figures == [0, 128, 0]



def test_settled_figures_are_metered_ever_less_often(monkeypatch):
    metered = _watch_metering(monkeypatch)
    monkeypatch.setattr(feedback, "ACTIVATIONS_REMETER", 2)
    monkeypatch.setattr(feedback, "ACTIVATIONS_REMETER_MOST", 8)
    peaks, _ = _fused_only(18)
    # settled after 3; then one in 2, and each re-metering that agrees doubles that: one in 4, one in 8 (the most)
    charged = [False]
    assert metered == [True] * 3 + charged + [True] + charged * 3 + [True] + charged * 7 + [True, False]
    assert peaks == [384 + 96 + 128] * 18  # the accounting is the metered one throughout


def test_new_shapes_are_metered_again(monkeypatch):
    metered = _watch_metering(monkeypatch)
    # 4 samples for 4 steps, then 8: the ReLU keeps 8x8 floats = 256; inputs 8x4 + 8x2 floats = 192
    peaks, figures = _fused_only(6, samples=lambda step: 4 if step < 4 else 8)
    assert metered == [True, True, True, False, True, True]
    assert peaks == [384 + 96 + 128] * 4 + [384 + 192 + 256] * 2
    assert figures == [0, 256, 0]
