"""A transparent call on a one-device ring keeps its deepest stage's forward graphs for its backward instead of
recomputing them (``stage.HeldGraph``): counted layer calls, plain-PyTorch results, memory given back, and
the cases that still recompute."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_roundpipe import EngineOptions, PipelineError, RoundPipeEngine, is_recomputing
from lightning_roundpipe.engine.microbatch import microbatch_sizes
from lightning_roundpipe.planning.partition import LayerCost, Plan, Planner
from tests.models import SharedLog, reference_transparent_step
from tests.numerics import assert_float64_equal, assert_states_float64_equal, double, state


class CountedLinear(nn.Linear):
    """A linear layer that logs each call: whether it recomputes."""

    def __init__(self, width: int, log: SharedLog) -> None:
        super().__init__(width, width)
        self.log = log

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.log.append(is_recomputing())
        return torch.tanh(super().forward(x))  # tanh saves its output: a poisoned output would show


def _model(log: SharedLog, depth: int = 4, width: int = 6) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[CountedLinear(width, log) for _ in range(depth)])


def _transparent_step(engine: RoundPipeEngine, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = F.mse_loss(engine(x), y)
    loss.backward()
    engine.step(torch.optim.SGD(model.parameters(), lr=0.1))
    return loss.detach()


ALL_FUSED = Plan.from_sizes([], 4, [])
SPLIT = Plan.from_sizes([2], 2, [2])


@pytest.mark.parametrize("stress", [False, True], ids=["plain", "stress"])
@pytest.mark.parametrize(("plan", "recomputed_layers"), [(ALL_FUSED, 0), (SPLIT, 2)], ids=["one-stage", "split"])
def test_one_device_runs_the_deepest_stage_once_per_microbatch_and_equals_plain_pytorch(plan, recomputed_layers,
                                                                                        stress):
    log = SharedLog()
    model = double(_model(log))
    reference = double(_model(SharedLog()))
    x, y = torch.randn(6, 6, dtype=torch.float64), torch.randn(6, 6, dtype=torch.float64)
    options = EngineOptions(num_microbatches=3, num_stages=plan, stress=stress, seed=3)
    with RoundPipeEngine(model, 1, options) as engine:
        for _ in range(2):
            log.clear()
            loss = _transparent_step(engine, model, x, y)
            engine.synchronize()
            # every layer runs forward once per microbatch; only the layers of the backward stages recompute
            assert log.count(False) == 4 * 3 and log.count(True) == recomputed_layers * 3
            reference_loss = reference_transparent_step(reference, x, y, F.mse_loss, microbatch_sizes(6, 3))
            torch.optim.SGD(reference.parameters(), lr=0.1).step()
            reference.zero_grad()
            assert_float64_equal(loss, torch.tensor(reference_loss, dtype=torch.float64), what="float64 loss")
            assert_states_float64_equal(state(model), state(reference))
        assert engine.devices[0].residency.current == 0  # the kept stage copy was released by its backward


def test_the_same_model_on_two_devices_recomputes():
    """The counting above can fail: across two devices the backward runs elsewhere, so it recomputes."""
    log = SharedLog()
    model = _model(log)
    with RoundPipeEngine(model, 2, EngineOptions(num_microbatches=3, num_stages=SPLIT)) as engine:
        _transparent_step(engine, model, torch.randn(6, 6), torch.randn(6, 6))
        engine.synchronize()
    assert log.count(True) == 4 * 3  # every layer recomputed once per microbatch


def test_a_kept_graph_dropped_without_backward_gives_its_memory_back():
    model = _model(SharedLog())
    with RoundPipeEngine(model, 1, EngineOptions(num_microbatches=2, num_stages=ALL_FUSED)) as engine:
        output = engine(torch.randn(4, 6))
        engine.synchronize()
        residency = engine.devices[0].residency
        assert residency.current > 0 and residency.resident_stages == 1  # the stage copy, kept
        del output
        gc.collect()
        assert residency.current == 0 and residency.resident_stages == 0


def test_backward_twice_through_a_kept_graph_says_so():
    model = _model(SharedLog())
    with RoundPipeEngine(model, 1, EngineOptions(num_microbatches=2, num_stages=ALL_FUSED)) as engine:
        loss = engine(torch.randn(4, 6)).sum()
        loss.backward(retain_graph=True)
        with pytest.raises(PipelineError, match="runs backward once"):
            loss.backward()
            engine.synchronize()


def test_under_a_memory_budget_the_first_step_recomputes_until_the_activations_are_measured():
    log = SharedLog()
    model = _model(log)
    options = EngineOptions(num_microbatches=2, num_stages=ALL_FUSED, device_memory_limit="1MiB")
    counts = []
    with RoundPipeEngine(model, 1, options) as engine:
        for _ in range(4):
            log.clear()
            _transparent_step(engine, model, torch.randn(4, 6), torch.randn(4, 6))
            engine.synchronize()
            counts.append(log.count(True))
    # what a step kept for backward is learned after the next step (feedback.Measurements.replan): the first
    # two steps recompute every layer of both microbatches, the later ones nothing
    assert counts == [4 * 2, 4 * 2, 0, 0]


def test_fused_graphs_fit_within_half_the_budget_once_measured():
    costs = [LayerCost(1.0, 2.0, param_bytes=100, grad_bytes=100)] * 2
    planner = Planner(Plan.from_sizes([], 2, []), 2, 1, memory_budget=1600)
    planner.initial(costs)
    assert not planner.fused_graphs_fit(1)  # nothing measured yet
    planner.observe_activations({0: 100, 1: 100})
    # per layer 100 + 100 + M * 100, two layers: M=2 -> 800 = half the budget; M=3 -> 1000
    assert planner.fused_graphs_fit(2) and not planner.fused_graphs_fit(3)
    unlimited = Planner(Plan.from_sizes([], 2, []), 2, 1)
    unlimited.initial(costs)
    assert unlimited.fused_graphs_fit(64)


def test_two_calls_in_one_step_each_back_propagate_their_own_kept_graphs():
    """Two calls' graphs kept at once (a siamese loss), back-propagated in autograd's order: plain PyTorch's
    gradients, and every kept stage copy released."""
    model = double(_model(SharedLog()))
    reference = double(_model(SharedLog()))
    a, b = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)

    def siamese(net) -> torch.Tensor:
        return (net(a) * net(b).flip(0)).sum()

    siamese(reference).backward()
    with RoundPipeEngine(model, 1, EngineOptions(num_stages=ALL_FUSED)) as engine:
        siamese(engine).backward()
        engine.collect_gradients()
        assert engine.devices[0].residency.current == 0
    for (name, param), expected in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert_float64_equal(param.grad, expected.grad, what=f"{name}.grad")


def test_the_callers_backward_returns_once_the_kept_graph_is_back_propagating(monkeypatch):
    """``loss.backward()`` through a kept graph returns only after the backward job has started: until then the job's
    threads need the GIL, which the caller's Python (Lightning's end of the batch) would hold. Stress mode lands
    the output gradients' upload late (``STRESS_LANDING_DELAY``), long after a return that did not wait."""
    from lightning_roundpipe.engine.dispatch import Dispatcher

    dispatched: list = []
    dispatch = Dispatcher.dispatch

    def spy(self, call, jobs, first_output_grads):
        tasks = dispatch(self, call, jobs, first_output_grads)
        dispatched.extend(tasks)
        return tasks

    monkeypatch.setattr(Dispatcher, "dispatch", spy)
    model = _model(SharedLog())
    with RoundPipeEngine(model, 1, EngineOptions(num_microbatches=2, num_stages=ALL_FUSED, stress=True)) as engine:
        for _ in range(3):
            dispatched.clear()
            F.mse_loss(engine(torch.randn(4, 6)), torch.randn(4, 6)).backward()
            backward = [task for task in dispatched if task.uses_kept_graph]
            assert len(backward) == 1 and backward[0].backpropagating.is_set()
            engine.step(torch.optim.SGD(model.parameters(), lr=0.1))
