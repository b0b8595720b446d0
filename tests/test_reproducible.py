"""Reproducible runs: identical seeded runs give bitwise identical weights, whatever the timing, and resuming from
a checkpoint continues the run exactly.

Where results could depend on timing, and what each test pins down:

* the host's gradient sums (a tied weight read by two stages, every call of a step under gradient accumulation:
  several contributions per parameter, from jobs that finish in any order): summed in a fixed order;
* the plan (``num_stages="auto"`` re-plans from measured times): under ``Trainer(deterministic=True)`` it never
  follows times, and it follows measured memory at a fixed step; on CPU stand-ins different plans give bitwise
  the same results anyway;
* randomness on CPU stand-ins: the main thread draws from torch's CPU generator (a ``DataLoader`` does at every
  epoch) while workers run dropout, so random layers draw from private generators;
* resuming: the checkpoint keeps the engine's step count, base seed and plan.

All comparisons are bitwise (``torch.equal``, tests/numerics.py kind 1): the same kernels on the same data in the
same order.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_roundpipe  # noqa: F401 - registers the strategy names (editable installs have no .pth hook)
from lightning_roundpipe import EngineOptions, Plan, RoundPipeEngine, RoundPipeStrategy, pipeline_loss, token_count
from lightning_roundpipe.engine.device import AbortSignal
from lightning_roundpipe.engine.recompute import seeded
from lightning_roundpipe.engine.step.window import GradWindow
from lightning_roundpipe.planning.partition import Planner, costs_from_bytes
from lightning_roundpipe.strategy_checkpoints import CHECKPOINT_KEY
from tests.models import gpt_batch, gpt_loss, tiny_gpt
from tests.numerics import assert_states_equal, state

WAIT = 30.0


@pytest.fixture
def deterministic(monkeypatch) -> Iterator[None]:
    """torch's deterministic-algorithms flag (which ``Trainer(deterministic=True)`` sets, process-wide, and never
    resets) on for the test and as it was afterwards, with what Lightning sets beside it."""
    flags = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    benchmark = torch.backends.cudnn.benchmark
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)  # restored by monkeypatch afterwards
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(flags[0], warn_only=flags[1])
    torch.backends.cudnn.benchmark = benchmark


# ------------------------------------------------------------------ the gradient window
def test_the_window_sums_each_parameter_in_slot_order_whatever_order_the_jobs_deliver_in():
    # float addition is not associative: (1 + 1e-8) - 1 == 0 in float32, but (1 - 1) + 1e-8 == 1e-8
    values = [torch.tensor([1.0]), torch.tensor([1e-8]), torch.tensor([-1.0])]
    in_order = (values[0] + values[1]) + values[2]
    arrival_order = (values[2] + values[0]) + values[1]
    assert not torch.equal(in_order, arrival_order)
    tied, other = nn.Parameter(torch.zeros(1)), nn.Parameter(torch.zeros(1))
    window = GradWindow(AbortSignal(WAIT))
    tickets = [window.job_started(None, [tied]), window.job_started(None, [other, tied]),
               window.job_started(None, [tied, tied])]  # a parameter two layers of one job read: two slots
    staging = torch.tensor([-1.0])
    window.deliver(tickets[2], [staging, None], borrowed=True)  # held, as a copy; its second slot got no gradient
    staging.fill_(99.0)  # the caller reuses its staging buffer at once
    window.deliver(tickets[0], [values[0]])
    window.deliver(tickets[1], [torch.tensor([5.0]), values[1]])
    for _ in tickets:
        window.job_finished()
    window.close()
    window.wait_complete()
    window.publish()
    assert torch.equal(tied.grad, in_order) and torch.equal(other.grad, torch.tensor([5.0]))


def _deliveries_forced(monkeypatch, backward_first: bool, arrival_order: bool = False) -> None:
    """Make every call's backward job deliver its gradients before (or after) its fused job, whatever the timing:
    with the plan of :func:`_fused_then_backward` each call gives one step's window two tickets, the fused job's
    (even) and the backward job's (odd), on different devices. ``arrival_order``: the defect the window prevents,
    summing as deliveries come."""
    original = GradWindow.deliver
    lock = threading.Lock()

    def summed_as_they_come(window: GradWindow, ticket: int, grads, *, borrowed: bool = False) -> None:
        with window._lock:
            for position, (param, grad) in enumerate(zip(window._slots.pop(ticket), grads, strict=True)):
                window._order[id(param)].remove((ticket, position))
                if grad is not None:
                    window._sum(id(param), param, grad, borrowed)
                if not window._order[id(param)] and window._closed:
                    window._resolved(id(param))  # its gradient is final: a step cut by stage may take it

    inner = summed_as_they_come if arrival_order else original

    def forced(window: GradWindow, ticket: int, grads, *, borrowed: bool = False) -> None:
        with lock:  # per window (one per step), per call
            gate = window.__dict__.setdefault("forced_gates", {}).setdefault(ticket // 2, threading.Event())
        first = ticket % 2 == (1 if backward_first else 0)
        if not first:
            assert gate.wait(WAIT), "the other job of the call never delivered"
        inner(window, ticket, grads, borrowed=borrowed)
        if first:
            gate.set()

    monkeypatch.setattr(GradWindow, "deliver", forced)


def _fused_then_backward(layers: int) -> Plan:
    """Layer 0 (the embedding) forward, then the rest fused (the head, which shares the embedding's weight), then
    layer 0 backward: on two devices the fused and the backward job of a call run on different devices."""
    return Plan((range(0, 1),), range(1, layers), (range(0, 1),))


def _train_tied(devices: int = 2, steps: int = 2, plan: Plan | int | str | None = None, async_step: bool = False,
                recompute: str = "stage", jitter: float = 0.0) -> dict[str, torch.Tensor]:
    """tiny_gpt (its head's weight is the embedding's) with dropout, two calls per step (gradient accumulation):
    every step the tied weight gets four contributions, two per call."""
    model = tiny_gpt(dropout=0.1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    options = EngineOptions(num_microbatches=3, num_stages=plan if plan is not None else _fused_then_backward(5),
                            async_step=async_step, recompute=recompute, jitter=jitter, seed=11)
    with RoundPipeEngine(model, devices, options) as engine:
        for step in range(steps):
            for call in range(2):
                ids, target = gpt_batch(9, seed=10 * step + call)
                engine.forward_backward(ids, target, gpt_loss, loss_weight=token_count(-100), scale=0.5)
            engine.step(optimizer)
        engine.synchronize()
    return {name: tensor.clone() for name, tensor in state(model).items()}


def test_the_order_jobs_finish_in_does_not_change_the_weights(monkeypatch):
    results = {}
    for backward_first in (False, True):
        with monkeypatch.context() as patch:
            _deliveries_forced(patch, backward_first)
            results[backward_first] = _train_tied()
    assert_states_equal(results[True], results[False])
    # the check can see the defect: summed as they arrive, the two orders differ (the same forced orders every
    # run, so this is certain, not a matter of timing)
    for backward_first in (False, True):
        with monkeypatch.context() as patch:
            _deliveries_forced(patch, backward_first, arrival_order=True)
            results[backward_first] = _train_tied()
    assert not torch.equal(results[True]["0.tokens.weight"], results[False]["0.tokens.weight"])


@pytest.mark.parametrize("async_step", [False, True], ids=["sync", "async"])
def test_repeated_runs_under_jitter_are_bitwise_equal(async_step):
    first = _train_tied(devices=3, steps=3, async_step=async_step, jitter=0.002)
    assert_states_equal(_train_tied(devices=3, steps=3, async_step=async_step, jitter=0.002), first)


@pytest.mark.parametrize("async_step", [False, True], ids=["sync", "async"])
def test_on_cpu_stand_ins_every_plan_gives_bitwise_the_same_weights(async_step):
    """With the window's fixed order, a stage boundary changes no floating-point operation on CPU: a layer computes
    the same values in a forward stage (no autograd), a fused stage or a recompute, and gradients cross a boundary
    as exact copies. So re-planning from measured times cannot change results here (on GPUs a kernel may depend on
    autograd being on, hence the deterministic mode's frozen timing)."""
    plans = [Plan((), range(0, 5), ()),  # everything fused: the tied layers 0 and 4 in one job
             _fused_then_backward(5), Plan.from_sizes([2, 2], 1, [1, 1, 1, 1]), Plan.from_sizes([4], 1, [2, 2]),
             Plan.from_sizes([1, 3], 1, [3, 1])]
    reference = _train_tied(devices=1, plan=plans[0], async_step=async_step)
    for devices, plan, recompute in [(2, plans[1], "stage"), (2, plans[2], "layer"), (3, plans[3], "stage"),
                                     (3, plans[4], "layer"), (2, "auto", "stage")]:
        assert_states_equal(_train_tied(devices, plan=plan, async_step=async_step, recompute=recompute), reference)


# ------------------------------------------------------------------ randomness on CPU stand-ins
def test_a_worker_s_random_layer_and_the_main_thread_do_not_share_a_generator():
    """The main thread draws from torch's CPU generator between a random layer's two draws (forced, not timed):
    the layer's masks are those of its seed, and the main thread's numbers those it would draw anyway."""
    x = torch.ones(1000)
    torch.manual_seed(123)
    expected_masks = [F.dropout(x, 0.5) == 0, F.dropout(x, 0.5) == 0]
    torch.manual_seed(5)
    expected_main = torch.rand(4)
    torch.manual_seed(5)
    masks, drew, main_drew = [], threading.Event(), threading.Event()

    def layer() -> None:
        with seeded(123, torch.device("cpu")):
            masks.append(F.dropout(x, 0.5) == 0)
            drew.set()
            assert main_drew.wait(WAIT)
            masks.append(F.dropout(x, 0.5) == 0)

    worker = threading.Thread(target=layer)
    worker.start()
    assert drew.wait(WAIT)
    main = torch.rand(4)
    main_drew.set()
    worker.join(WAIT)
    assert len(masks) == 2 and all(torch.equal(a, b) for a, b in zip(masks, expected_masks, strict=True))
    assert torch.equal(main, expected_main)
    following = torch.rand(4)  # the main thread's stream goes on undisturbed
    torch.manual_seed(5)
    assert torch.equal(torch.cat([main, following]), torch.rand(8))


# ------------------------------------------------------------------ memory re-planning
class _Wide(nn.Module):
    """Few parameters, much kept for backward: a plan made from bytes alone fits, one with activations does not."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x).repeat(1, 32)).view(x.shape[0], 32, 8).mean(1)


def _train_wide(jitter: float) -> tuple[list[Plan], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(*[_Wide() for _ in range(6)], nn.Linear(8, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    options = EngineOptions(num_microbatches=2, num_stages=1, device_memory_limit=24000, jitter=jitter)
    plans = []
    with RoundPipeEngine(model, 2, options) as engine:
        plans.append(engine.plan)
        for step in range(4):
            generator = torch.Generator().manual_seed(step)
            x, y = torch.randn(8, 8, generator=generator), torch.randint(0, 3, (8,), generator=generator)
            engine.forward_backward(x, y, F.cross_entropy)
            engine.step(optimizer)
            plans.append(engine.plan)
        engine.synchronize()
    return plans, {name: tensor.clone() for name, tensor in state(model).items()}


def test_a_plan_changes_for_memory_at_the_same_step_in_every_run(deterministic):
    plans, weights = _train_wide(jitter=0.002)
    # what the first step's layers kept for backward reaches the planner at the second step, once every job of
    # the first has finished: the plan changes there, whatever the timing
    assert plans[0] == plans[1] != plans[2] == plans[3] == plans[4]
    assert len(plans[2].backward) > len(plans[0].backward)
    again, weights_again = _train_wide(jitter=0.002)
    assert again == plans
    assert_states_equal(weights_again, weights)


# ------------------------------------------------------------------ Lightning: deterministic runs and resuming
class TinyGPT(pl.LightningModule):
    """tiny_gpt with dropout, trained with the fused path (its head shares the embedding's weight)."""

    def __init__(self) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = tiny_gpt(dropout=0.1)
        self.plans: list[Plan] = []

    def training_step(self, batch, batch_idx):
        ids, target = batch
        return pipeline_loss(self.net, ids, target, gpt_loss, loss_weight=token_count(-100))

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        strategy = self.trainer.strategy
        if isinstance(strategy, RoundPipeStrategy) and strategy.engine is not None:
            self.plans.append(strategy.engine.plan)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


BATCHES, BATCH = 6, 9  # with accumulate_grad_batches=2: 3 optimizer steps per epoch


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    ids, target = gpt_batch(BATCHES * BATCH, seed=5)
    return [(ids[i:i + BATCH], target[i:i + BATCH]) for i in range(0, len(ids), BATCH)]


class ResumableBatches:
    """The batches in order, and where the epoch is: Lightning saves ``state_dict`` in checkpoints and restores it,
    so a run resumed mid-epoch goes on with the next batch (a plain DataLoader would start the epoch over)."""

    def __init__(self) -> None:
        self.batches = _batches()
        self.position = 0
        self._resume_at = 0

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        start, self._resume_at = self._resume_at, 0
        for index in range(start, len(self.batches)):
            self.position = index + 1
            yield self.batches[index]
        self.position = 0

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self._resume_at = state_dict["position"]


def _fit(data, *, max_steps: int = 6, ckpt_path: str | None = None, callbacks: list | None = None,
         root: str | os.PathLike[str] | None = None, devices: int = 2) -> TinyGPT:
    pl.seed_everything(7, verbose=False)  # the base seed of the dropout masks is torch's initial seed
    module = TinyGPT()
    trainer = pl.Trainer(strategy=RoundPipeStrategy(num_microbatches=3, jitter=0.001), accelerator="cpu",
                         devices=devices, max_steps=max_steps, accumulate_grad_batches=2, deterministic=True,
                         logger=False, callbacks=callbacks, enable_checkpointing=bool(callbacks),
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=root)
    trainer.fit(module, data, ckpt_path=ckpt_path)
    return module


def test_two_seeded_runs_with_deterministic_true_and_auto_stages_are_bitwise_equal(deterministic):
    # two epochs of a plain DataLoader: its iterator draws a seed from torch's CPU generator at each epoch's start,
    # while the last step's backward stages run dropout
    def loader() -> DataLoader:
        ids, target = gpt_batch(BATCHES * BATCH, seed=5)
        return DataLoader(TensorDataset(ids, target), batch_size=BATCH)

    first = _fit(loader())
    second = _fit(loader(), devices=3)  # num_microbatches is set: the device count changes nothing either
    assert len(first.plans) == 12 and len(set(first.plans)) == 1  # timing never changed the plan
    assert_states_equal(second, first)
    assert any(not torch.equal(a, b) for a, b in zip(first.parameters(), TinyGPT().parameters(), strict=True))


@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")  # the resumed runs need no checkpoints
def test_resuming_from_a_mid_run_checkpoint_equals_the_uninterrupted_run(deterministic, tmp_path, monkeypatch):
    saved = ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=2, save_top_k=-1)
    uninterrupted = _fit(ResumableBatches(), callbacks=[saved], root=tmp_path)
    middle = tmp_path / "step=4.ckpt"  # saved while the run went on, mid-epoch (3 steps per epoch)
    checkpoint = torch.load(middle, weights_only=True)  # plain values only
    engine_state = checkpoint[CHECKPOINT_KEY]
    assert engine_state["step"] == 4 and Plan.from_sizes(**engine_state["planner"]["plan"]) == uninterrupted.plans[-1]
    resumed = _fit(ResumableBatches(), ckpt_path=str(middle), root=tmp_path)
    assert_states_equal(resumed, uninterrupted)
    # the module loads without the strategy; the engine's entry is ignored there
    loaded = TinyGPT.load_from_checkpoint(middle)
    assert set(loaded.state_dict()) == set(uninterrupted.state_dict())
    # without the engine's state the resumed run would seed its random layers as from step 0 again
    monkeypatch.setattr(RoundPipeEngine, "load_state_dict", lambda engine, state: None)
    restarted = _fit(ResumableBatches(), ckpt_path=str(middle), root=tmp_path)
    assert not torch.equal(restarted.net[1].qkv.weight, uninterrupted.net[1].qkv.weight)


# ------------------------------------------------------------------ state round trips
def test_the_planner_state_round_trips_and_is_refused_for_another_setup():
    costs = costs_from_bytes([4, 4, 4, 4, 4])
    planner = Planner("auto", 5, 2)
    planner.initial(costs)
    planner.observe_activations({1: 7})
    changed = Plan.from_sizes([4], 1, [1, 1, 1, 1])
    planner._plan = changed  # as a replan would have left it
    saved = planner.state_dict()
    assert Plan.from_sizes(**changed.sizes()) == changed
    again = Planner("auto", 5, 2)
    again.initial(costs)
    assert again.load_state_dict(saved) and again.plan == changed and again.activation_bytes == [0, 7, 0, 0, 0]
    for other in (Planner(2, 5, 2), Planner("auto", 5, 3)):
        first = other.initial(costs)
        assert not other.load_state_dict(saved) and other.plan == first
    # a restored plan that no longer fits this budget is replaced at once
    tight = Planner("auto", 5, 2, memory_budget=30)
    tight.initial(costs_from_bytes([4, 4, 4, 4, 4]))
    saved["plan"] = Plan((), range(0, 5), ()).sizes()
    assert tight.load_state_dict(saved) and tight.plan != Plan((), range(0, 5), ())


def test_the_engine_state_is_loaded_before_start_only():
    engine = RoundPipeEngine(tiny_gpt(), 2)
    saved = engine.state_dict()
    assert saved["step"] == 0 and saved["version"] == 1
    with pytest.raises(ValueError, match="engine state of version 9"):
        engine.load_state_dict({**saved, "version": 9})
    with engine:
        with pytest.raises(RuntimeError, match="load_state_dict must come before start"):
            engine.load_state_dict(saved)
