"""What the engine measures and accounts: device time for the planner and the metrics (a fake device clock
stands in for CUDA events), trusted measurements only, and memory that includes what a stage's compute keeps
for backward and, on GPUs, the workspace reserve. Figures are computed by hand in the comments."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_roundpipe import EngineOptions, RoundPipeEngine
from lightning_roundpipe.engine.layers import build_trunk
from lightning_roundpipe.engine.timing import HostSpan
from lightning_roundpipe.planning.partition import (
    CUDA_WORKSPACE_RESERVE,
    LayerCost,
    Plan,
    Planner,
    autocast_copy_bytes,
    costs_from_bytes,
    plan_fits,
    stage_memory_budget,
)
from lightning_roundpipe.preflight import check_layers, plan_memory
from tests.models import bn_batch


class FakeDeviceClock:
    """A device clock that advances only when a layer says it spent device time (per compute thread), so its
    spans are exact and unrelated to the host's clock. Injected as every device's ``compute_timer``."""

    def __init__(self) -> None:
        self._local = threading.local()

    def now(self) -> float:
        return getattr(self._local, "seconds", 0.0)

    def spend(self, seconds: float) -> None:
        self._local.seconds = self.now() + seconds

    def start(self) -> float:
        return self.now()

    def stop(self, started: float) -> HostSpan:
        return HostSpan(started, self.now())


class Work(nn.Module):
    """A Linear that takes ``seconds`` of (fake) device time, whatever the host does; ``seconds`` may be a
    callable read at each call."""

    def __init__(self, clock: FakeDeviceClock, seconds, host_sleep: float = 0.0) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)
        self.clock, self.seconds, self.host_sleep = clock, seconds, host_sleep

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.host_sleep)
        self.clock.spend(self.seconds() if callable(self.seconds) else self.seconds)
        return self.linear(x)


def _train(model: nn.Module, clock: FakeDeviceClock, steps: int, before_step=lambda step: None):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    plans = []
    with RoundPipeEngine(model, 2, EngineOptions(num_microbatches=2, num_stages="auto")) as engine:
        for device in engine.devices:
            device.compute_timer = clock
        for step in range(steps):
            before_step(step)
            plans.append(engine.plan)
            x, y = bn_batch(8, step)
            engine.forward_backward(torch.cat([x, x, x[:, :4]], 1), y % 2, F.cross_entropy)
            engine.step(optimizer)
            engine.synchronize()  # a layer's declared time changes between steps only
        busy = sum(device.counters.compute_seconds for device in engine.devices)
        return engine.planner, plans, busy


def test_the_planner_and_the_metrics_read_device_spans_not_the_host_clock():
    clock = FakeDeviceClock()
    # layer 2 keeps the host busy 20 ms but the device only 1 ms; layer 4 the device 40 ms, and 10 s in the
    # first step (warm-up: an autotuning first call, say)
    seconds = [0.001, 0.001, 0.001, 0.001, 0.040, 0.001]
    warm_up = {"on": True}
    layers = [Work(clock, s, host_sleep=0.02 if i == 2 else 0.0) for i, s in enumerate(seconds)]
    layers[4].seconds = lambda: 10.0 if warm_up["on"] else 0.040

    def after_the_first_step(step: int) -> None:
        warm_up["on"] = step == 0

    model = nn.Sequential(*layers, nn.Linear(16, 2))
    planner, plans, busy = _train(model, clock, 5, after_the_first_step)
    estimate = planner.estimate
    assert estimate is not None
    # per microbatch, exactly what each layer declared after the warm-up step, which is discarded (the last
    # Linear declares nothing: clamped to 1e-9)
    assert [cost.forward for cost in estimate] == pytest.approx([*seconds, 1e-9], abs=1e-12)
    # the devices' compute seconds are the spans too: per microbatch (2 a step) a layer before the fused stage
    # runs twice (its forward stage, its backward stage's recompute), a fused layer once
    per_step = [[10.0 if step == 0 and i == 4 else s for i, s in enumerate(seconds)] for step in range(len(plans))]
    expected = sum(2 * (2 * sum(times[:plan.fused.start]) + sum(times[plan.fused.start:]))
                   for plan, times in zip(plans, per_step, strict=True))
    assert busy == pytest.approx(expected)


def test_the_plan_moves_only_once_two_steps_agree():
    clock = FakeDeviceClock()
    script = {"seconds": 0.0}
    layers = [Work(clock, 0.001) for _ in range(5)]
    model = nn.Sequential(*layers, Work(clock, lambda: script["seconds"]), nn.Linear(16, 2))
    # step 0: warm-up, 10 s (an autotuning first call); then 0.05 s and 0.5 s alternate, which never agree
    # within 25%; from step 7 on, 0.5 s every step
    schedule = [10.0, 0.05, 0.5, 0.05, 0.5, 0.05, 0.5] + [0.5] * 5

    def set_time(step: int) -> None:
        script["seconds"] = schedule[step]

    _, plans, _ = _train(model, clock, len(schedule), set_time)
    assert all(plan == plans[0] for plan in plans[:8]), "the plan moved before two steps agreed"
    assert plans[-1] != plans[0], "the plan never followed the settled times"


def test_the_first_observation_is_discarded_exactly():
    planner = Planner("auto", 3, 1)
    planner.initial(costs_from_bytes([4, 4, 4]))
    planner.observe([LayerCost(100.0, 100.0)] * 3)  # warm-up
    planner.observe([LayerCost(2.0, 4.0)] * 3)
    planner.observe([LayerCost(2.0, 4.0)] * 3)
    assert planner.estimate is not None
    assert [c.forward for c in planner.estimate] == pytest.approx([2.0] * 3)
    assert [c.backward for c in planner.estimate] == pytest.approx([4.0] * 3)
    assert planner.settled


# ---------------------------------------------------------------------------------------------- memory
class _Relu(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x)


def _fused_only(autocast: bool, steps: int):
    """One device, one microbatch of 4 samples, every layer in the fused stage: Linear(4, 8), ReLU, Linear(8, 2),
    no biases; the loss saves nothing new (it multiplies by the target, which is an input)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8, bias=False), _Relu(), nn.Linear(8, 2, bias=False))
    options = EngineOptions(num_microbatches=1, num_stages=Plan((), range(0, 3), ()))
    estimates = []
    with RoundPipeEngine(model, 1, options) as engine:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(steps):
            x, y = torch.randn(4, 4), torch.randn(4, 2)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                engine.forward_backward(x, y, lambda out, target: (out * target).sum())
            estimates.append(engine.planner.activation_bytes)
            engine.step(optimizer)
            engine.synchronize()
        return engine.peak_resident_bytes()[0], estimates, engine.planner.activation_bytes


def test_what_the_compute_keeps_for_backward_is_accounted():
    peak, _, _ = _fused_only(autocast=False, steps=1)
    # stage: weights 32 + 16 floats with their gradients = 2 * 48 * 4 = 384; inputs x (4x4) and target (4x2)
    # = 24 * 4 = 96; kept for backward: the first Linear saves x (an input, already counted), the ReLU its
    # output (4x8 floats = 128), the second Linear that same output and its weight (counted): 128
    assert peak == 384 + 96 + 128


def test_autocast_weight_copies_are_estimated_then_measured():
    _, estimates, measured = _fused_only(autocast=True, steps=2)
    # before anything ran: autocast_copy_bytes of each layer's float32 weights: 128 -> 64, none, 64 -> 32
    assert estimates[0] == [64, 0, 32] == [autocast_copy_bytes(128), 0, autocast_copy_bytes(64)]
    # measured: the first Linear saves its input's bf16 copy (4x4x2 = 32; its weight's copy is not saved, as
    # the input needs no gradient), the ReLU its bf16 output (4x8x2 = 64), the second Linear its weight's
    # bf16 copy (2x8x2 = 32 = autocast_copy_bytes of its 64 float32 bytes); a measurement replaces the estimate
    assert measured == [32, 64, 32]


def test_a_plan_that_fit_before_its_activations_were_known_is_replaced_at_once():
    # 4 layers of 10 parameter and 10 gradient bytes, time 10 forward and 0 backward; one forward stage
    # [0-2] (time 30), so a backward stage may take up to 30 too: [0-2], 3 x 20 = 60 bytes, within the 80 a
    # stage may use of a 160-byte budget. With 10 bytes of activations per layer it would hold 90: two
    # backward stages are needed, of at most 2 layers (60 bytes)
    costs = costs_from_bytes([10, 10, 10, 10], backward_ratio=0.0)
    planner = Planner(1, 4, 1, memory_budget=160)
    plan = planner.initial(costs)
    assert plan == Plan.from_sizes([3], 1, [3])
    changed = planner.observe_activations({layer: 10 for layer in range(4)})
    assert changed and len(planner.plan.backward) == 2 and max(len(stage) for stage in planner.plan.backward) == 2
    with_activations = [LayerCost(c.forward, c.backward, c.param_bytes, c.grad_bytes, 10) for c in costs]
    assert not plan_fits(plan, with_activations, 160) and plan_fits(planner.plan, with_activations, 160)
    # an estimate never overrides a measurement, and measurements only grow
    assert planner.observe_activations({0: 5}) is False and planner.activation_bytes == [10, 10, 10, 10]
    assert planner.observe_activations({0: 99}, measured=False) is False and planner.activation_bytes[0] == 10


def test_the_workspace_reserve_comes_off_a_gpu_budget():
    assert CUDA_WORKSPACE_RESERVE == 136 * 2**20  # 2 threads x (32 MiB cuBLAS + 32 MiB cuBLASLt) + 4 x 2 MiB
    limit = 200 * 2**20
    assert stage_memory_budget(limit) == 150 * 2**20
    assert stage_memory_budget(limit, CUDA_WORKSPACE_RESERVE) == 48 * 2**20  # (200 - 136) MiB x 3/4
    model = nn.Sequential(nn.Linear(2048, 2048), nn.Linear(2048, 2048), nn.Linear(2048, 2))  # 16 MiB each
    trunk = build_trunk(model)
    # a layer with its gradients needs 32 MiB: within 200 MiB's stage half (75 MiB) on CPU, not on a GPU (24 MiB)
    assert check_layers(trunk, limit, "cpu") is None
    problem = check_layers(trunk, limit, "cuda")
    assert problem is not None and "136.0 MiB of the limit is kept for kernel workspaces" in problem
    plan = RoundPipeEngine(trunk, 1, EngineOptions(device_memory_limit=400 * 2**20)).plan
    memory = plan_memory(model, trunk, plan, [], devices=[torch.device("cuda", 0)],
                         device_memory_limit=400 * 2**20, pin_memory=False)
    assert memory.workspace_bytes == CUDA_WORKSPACE_RESERVE
    assert memory.stage_budget == (400 - 136) * 2**20 * 3 // 4
    assert any(row[0] == "kernel workspaces" and row[1] == "136.0 MiB" for row in memory.rows())
