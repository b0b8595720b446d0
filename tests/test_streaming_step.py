"""The host step cut by stage (``streaming_step``): the same weights as the whole step, and the overlap it buys.

References are independent of the cutting: the whole step (``streaming_step="off"``, itself checked against plain
training elsewhere) and hand-written tables for the grouping. The overlaps are shown by order, never by timing: a
layer hook or an optimizer waits for something that only a cut step lets happen; an engine that stepped whole would
never let it happen, the bounded wait would run out and the test fail.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_roundpipe import EngineOptions, Plan, RoundPipeEngine, is_recomputing
from lightning_roundpipe.engine.layers import build_trunk
from lightning_roundpipe.engine.step.groups import stage_groups, streaming_refusal
from tests.models import bn_batch, gpt_batch, gpt_loss, tiny_gpt
from tests.numerics import assert_states_equal, state

GUARD = 30.0  # seconds: only a guard against hanging, never reached when the engine overlaps as claimed


# ------------------------------------------------------------------ which parameters step together
def test_each_parameter_steps_with_the_shallowest_backward_stage_holding_it():
    """tiny_gpt: layer 0 the embedding, 1-3 blocks, 4 the head (its weight is the embedding's). Plan: fused [3-4],
    backward [1-2] and [0]. Hand-made table: the tied weight goes with layer 0; the head's norm with [3-4]."""
    model = tiny_gpt(blocks=3)
    trunk = build_trunk(model)
    groups = stage_groups(trunk, Plan.from_sizes([2, 1], 2, [2, 1]))
    assert [group.layers for group in groups] == [range(0, 1), range(1, 3), range(3, 5)]
    tied = model[0].tokens.weight
    owned = [{id(param) for param in group.params} for group in groups]
    assert owned[0] == {id(param) for param in model[0].parameters()}
    assert owned[1] == {id(param) for layer in (1, 2) for param in model[layer].parameters()}
    assert owned[2] == {id(param) for layer in (3, 4) for param in model[layer].parameters() if param is not tied}
    # the uploads that read a group's copies: the head's upload reads the tied weight too
    assert [set(group.readers) for group in groups] == [{0, 4}, {1, 2}, {3, 4}]
    assert stage_groups(trunk, Plan.from_sizes([2, 1], 2, [2, 1]), whole=True)[0].layers == range(0, 5)


class _Coupled(torch.optim.SGD):
    """Not a torch.optim class (as far as the engine can tell)."""


@pytest.mark.parametrize(("make", "mode", "refused"), [
    (lambda params: torch.optim.AdamW(params), "auto", None),
    (lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9), "auto", None),
    (lambda params: torch.optim.AdamW(params), "off", "streaming_step='off'"),
    (lambda params: torch.optim.LBFGS(params), "on", "LBFGS couples every parameter"),
    (lambda params: _Coupled(params, lr=0.1), "auto", "_Coupled is not a torch.optim optimizer"),
    (lambda params: _Coupled(params, lr=0.1), "on", None),
])
def test_which_optimizers_step_by_stage(make, mode, refused):
    optimizer = make([nn.Parameter(torch.zeros(2))])
    reason = streaming_refusal(optimizer, mode)
    assert (reason is None) == (refused is None) and (refused is None or reason.startswith(refused))
    optimizer.register_step_post_hook(lambda *_: None)
    assert streaming_refusal(optimizer, mode) is not None  # a hook would run once per stage


# ------------------------------------------------------------------ the same weights as the whole step
def _train(streaming: str, *, async_step: bool, fused: bool, before_step: bool, devices: int = 2,
           plan: Plan | None = None) -> dict[str, torch.Tensor]:
    """tiny_gpt with dropout, AdamW, two calls per step (gradient accumulation), three steps."""
    model = tiny_gpt(blocks=3, dropout=0.1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    options = EngineOptions(num_microbatches=3, num_stages=plan or Plan.from_sizes([2, 1], 2, [2, 1]),
                            async_step=async_step, streaming_step=streaming, seed=5)  # type: ignore[arg-type]
    hook = (lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5) and None) if before_step else None
    with RoundPipeEngine(model, devices, options) as engine:
        for step in range(3):
            for call in range(2):
                ids, target = gpt_batch(6, seed=10 * step + call)
                if fused:
                    engine.forward_backward(ids, target, gpt_loss, scale=0.5)
                else:
                    (gpt_loss(engine(ids), target) * 0.5).backward()
            engine.step(optimizer, before_step=hook)
        engine.synchronize()
    return {name: tensor.clone() for name, tensor in state(model).items()}


@pytest.mark.parametrize("async_step", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "transparent"])
@pytest.mark.parametrize("before_step", [False, True], ids=["streamed", "after-clipping"])
def test_cutting_the_step_by_stage_changes_no_weight(async_step, fused, before_step):
    whole = _train("off", async_step=async_step, fused=fused, before_step=before_step)
    assert_states_equal(_train("auto", async_step=async_step, fused=fused, before_step=before_step), whole)


# ------------------------------------------------------------------ the overlaps
def test_a_stage_steps_while_a_shallower_backward_stage_still_runs():
    """Layer 0's recompute (in the last backward stage) waits until the head's norm (fused stage) has been stepped:
    the deeper stage's step runs during the rest of the backward."""
    model = tiny_gpt(blocks=3)
    deep = model[4].norm.weight
    before: list[torch.Tensor] = []
    changed_before_layer0_backward = []

    def record(module, inputs, output):
        if is_recomputing():
            changed_before_layer0_backward.append(_wait_until_changed(deep, before[-1]))

    model[0].register_forward_hook(record)  # hooks run in the device replicas too
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    options = EngineOptions(num_microbatches=1, num_stages=Plan.from_sizes([2, 1], 2, [2, 1]), freeze_plan=True,
                            wait_timeout=2 * GUARD)
    with RoundPipeEngine(model, 2, options) as engine:
        for step in range(2):
            before.append(deep.detach().clone())
            ids, target = gpt_batch(4, seed=step)
            engine.forward_backward(ids, target, gpt_loss)
            engine.step(optimizer)
            engine.synchronize()
    assert changed_before_layer0_backward == [True, True]


def _wait_until_changed(tensor: torch.Tensor, old: torch.Tensor) -> bool:
    done = threading.Event()
    for _ in range(int(GUARD / 0.002)):
        if not torch.equal(tensor, old):
            return True
        done.wait(0.002)
    return False


class _HoldsTheDeepestStage(torch.optim.SGD):
    """SGD that, stepping the head's parameters of step 1, waits until the next iteration's first forward stage has
    run: that stage's upload must not wait for the rest of the step."""

    def __init__(self, params, head: set[int], next_forward: threading.Event) -> None:
        super().__init__(params, lr=0.1)
        self.head, self.next_forward = head, next_forward
        self.waited: list[bool] = []

    @torch.no_grad()
    def step(self, closure=None):
        # the engine steps stand-ins sharing the parameters' memory: told apart by where their data lies
        stepping = {param.data_ptr() for group in self.param_groups for param in group["params"]
                    if param.grad is not None}
        if stepping and stepping <= self.head and not self.waited:
            self.waited.append(self.next_forward.wait(GUARD))
        return super().step(closure)


def test_after_clipping_the_shallowest_stage_steps_first_and_the_next_forward_starts_before_the_step_ends():
    model = tiny_gpt(blocks=3)
    next_forward = threading.Event()
    forwards = []

    def count(module, inputs, output):
        if not is_recomputing():
            forwards.append(None)
            if len(forwards) > 2:  # two microbatches per iteration: the third is the second iteration's
                next_forward.set()

    model[0].register_forward_hook(count)
    head = {param.data_ptr() for param in model[3:].parameters()} - {model[0].tokens.weight.data_ptr()}
    optimizer = _HoldsTheDeepestStage(model.parameters(), head, next_forward)
    options = EngineOptions(num_microbatches=2, num_stages=Plan.from_sizes([2, 1], 2, [2, 1]), freeze_plan=True,
                            streaming_step="on", record_timeline=True, wait_timeout=2 * GUARD)
    with RoundPipeEngine(model, 2, options) as engine:
        for step in range(2):
            ids, target = gpt_batch(4, seed=step)
            engine.forward_backward(ids, target, gpt_loss)
            engine.step(optimizer, before_step=lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0) and None)
        engine.synchronize()
        events = engine.events()
    assert optimizer.waited == [True], "the next iteration's first stage waited for the whole step"
    # the timeline agrees: the first step's parts ran shallowest first, and the second iteration's first upload
    # started before the first step's last part ended
    parts = sorted((e for e in events if e.kind == "optimizer" and e.label.startswith("step 1 ")), key=lambda e: e.start)
    assert [part.label for part in parts] == ["step 1 [0]", "step 1 [1-2]", "step 1 [3-4]"]
    jobs_per_iteration = engine.plan.num_stages
    next_upload = min(e.start for e in events if e.kind == "upload_params" and e.job == jobs_per_iteration)
    assert next_upload < parts[-1].end


def test_a_batchnorm_model_without_before_step_matches_the_whole_step_on_three_devices():
    """Buffers, a plan the planner picks, and more devices than backward stages: still the whole step's weights."""
    def run(streaming: str) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                              nn.Linear(16, 4))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
        options = EngineOptions(num_microbatches=4, num_stages=3, streaming_step=streaming)  # type: ignore[arg-type]
        with RoundPipeEngine(model, 3, options) as engine:
            for step in range(4):
                x, y = bn_batch(8, step)
                engine.forward_backward(x, y, F.cross_entropy)
                engine.step(optimizer)
            engine.synchronize()
        return {name: tensor.clone() for name, tensor in state(model).items()}

    assert_states_equal(run("auto"), run("off"))
