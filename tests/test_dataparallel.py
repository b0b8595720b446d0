"""Data parallel over rings at the engine level: two processes, each a RoundPipe engine on its own share of the
data, against plain PyTorch averaging the two shares' gradients (float64, to 1e-12, see ``tests/numerics.py``).

The processes are started with ``torch.multiprocessing`` (no Lightning launcher is involved here: the strategy's
multi-process runs are in ``tests/test_scaleout.py``, which starts scripts). Every process joins a gloo group
over a file store in the test's temporary folder.
"""

from __future__ import annotations

import os
import threading
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from lightning_roundpipe import EngineOptions, RoundPipeEngine
from lightning_roundpipe.engine.dataparallel import DataParallel, DataParallelError, _buckets
from tests.models import (
    delayed_update_reference,
    gpt_batch,
    gpt_loss,
    microbatch_weights,
    reference_microbatch_step,
    split_sizes,
    state_bytes,
    tiny_gpt,
)
from tests.numerics import assert_states_float64_equal, double, state, to_double

WORLD, STEPS, SAMPLES = 2, 3, 6  # samples per process and step
CLIP = 0.5  # max gradient norm where a test clips (the gradients' norm is above it)
TIMEOUT = 60.0  # seconds: a guard against hanging, never reached when the processes work


class _Unused(nn.Module):
    """A block with a parameter its forward never uses: plain training leaves it alone (grad None)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block
        self.unused = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


class _Gate:
    """Shared by a layer's device replicas (deepcopy returns it): set once the process sent gradients."""

    def __init__(self) -> None:
        self.sent = threading.Event()
        self.waited: list[bool] = []

    def __deepcopy__(self, memo: dict) -> _Gate:
        return self


class _WaitForSend(torch.autograd.Function):
    """Identity whose backward waits until a gradient bucket was sent."""

    @staticmethod
    def forward(ctx, gate: _Gate, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.gate = gate
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        ctx.gate.waited.append(ctx.gate.sent.wait(TIMEOUT / 2))
        return None, grad


class _Gated(nn.Module):
    """Layer 1 (the first block): its backward, in the last backward stage, waits for a sent bucket."""

    def __init__(self, block: nn.Module, gate: _Gate) -> None:
        super().__init__()
        self.block, self.gate = block, gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(_WaitForSend.apply(self.gate, x))


def _model(gate: _Gate | None = None) -> nn.Sequential:
    """tiny_gpt with a parameter nothing uses in layer 2 and layer 1 gated by ``gate`` (open when not given)."""
    if gate is None:
        gate = _Gate()
        gate.sent.set()
    layers = list(tiny_gpt(seed=0))
    layers[2] = _Unused(layers[2])
    layers[1] = _Gated(layers[1], gate)
    return double(nn.Sequential(*layers))


def _batch(step: int, rank: int):
    return to_double(gpt_batch(SAMPLES, seed=100 * step + rank))


def _optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _train(rank: int, average: bool, lose_rank_1: bool, async_step: bool, clip: bool, shard: bool) -> dict:
    """One run of ``STEPS`` steps on this process's ring, in the process group already joined; what it ends with
    (or the error it raised, for the parent to read)."""
    gate = _Gate()
    all_reduce = dist.all_reduce

    def counted_all_reduce(*args, **kwargs):
        gate.sent.set()
        return all_reduce(*args, **kwargs)

    dist.all_reduce = counted_all_reduce
    try:
        group, weights = dist.new_group(backend="gloo"), dist.new_group(backend="gloo")
        data_parallel = DataParallel(WORLD if average else 1, rank if average else 0, gradients=group,
                                     timeout=10.0 if lose_rank_1 else TIMEOUT, shard_optimizer=shard,
                                     weights=weights)
        if not average or lose_rank_1:
            gate.sent.set()  # nothing to prove: the gate stays open
        model = _model(gate)
        optimizer = _optimizer(model.parameters())
        options = EngineOptions(num_microbatches=2, num_stages=2, seed=3, async_step=async_step)
        with RoundPipeEngine(model, 2, options, data_parallel=data_parallel) as engine:
            for step in range(STEPS):
                if lose_rank_1 and rank == 1 and step == 1:
                    os._exit(3)  # lost: no goodbye, as a killed process
                ids, target = _batch(step, rank)
                engine.forward_backward(ids, target, gpt_loss, loss_weight=lambda t: float((t != -100).sum()))
                # clipping needs every averaged gradient on this thread first (the other path: the optimizer
                # thread averages each part before stepping it)
                before_step = (lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP) and None) if clip else None
                engine.step(optimizer, before_step=before_step)
            engine.synchronize()
        params = list(model.parameters())
        result = {"state": state(model), "waited": gate.waited, "state_bytes": state_bytes(optimizer.state),
                  "owned": sorted(index for index, param in enumerate(params)
                                  if id(param) in data_parallel.owned(params)),
                  "state_of": sorted(index for index, param in enumerate(params) if param in optimizer.state)}
        if shard:  # a checkpoint's optimizer state: gathered whole on process 0, then each keeps its own
            full = data_parallel.gather_optimizer_state(optimizer.state_dict())
            result["gathered"] = full
            optimizer.load_state_dict(full)
            data_parallel.drop_unowned_state(optimizer)
            result["kept_after_load"] = sorted(index for index, param in enumerate(params) if param in optimizer.state)
        return result
    except BaseException as error:  # noqa: BLE001 - the parent reads what happened
        return {"error": f"{type(error).__name__}: {error}", "trace": traceback.format_exc()}
    finally:
        dist.all_reduce = all_reduce


def _process(rank: int, store: str, out: str, runs: dict[str, dict[str, bool]]) -> None:
    """Each of ``runs`` (name: :func:`_train`'s keywords) in turn, in one process group: starting the processes
    (importing torch in each) costs more than a run."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=TIMEOUT))
    try:
        results = {}
        for name, keywords in runs.items():
            results[name] = _train(rank, **{**RUN_DEFAULTS, **keywords})
            if "error" in results[name]:
                break  # the process group may be broken
        if rank == 0:
            torch.save(results, out)
    finally:
        dist.destroy_process_group()


RUN_DEFAULTS = {"average": True, "lose_rank_1": False, "async_step": False, "clip": False, "shard": False}


def _run_all(tmp_path: Path, runs: dict[str, dict[str, bool]]) -> dict[str, dict]:
    """Start ``WORLD`` processes that do ``runs`` one after another; each run's result (or error) by name."""
    out = tmp_path / "rank0.pt"
    context = mp.start_processes(_process, args=(str(tmp_path / "store"), str(out), runs),
                                 nprocs=WORLD, join=False, start_method="spawn")
    for process in context.processes:
        process.join(TIMEOUT * 2 * len(runs))
    alive = [process.pid for process in context.processes if process.is_alive()]
    for process in context.processes:
        if process.is_alive():
            process.kill()
    assert not alive, f"processes {alive} were still running"
    results = torch.load(out, weights_only=False)
    for name in runs:
        assert name in results, f"run {name!r} did not happen: an earlier run failed: {results}"
    return results


def _run(tmp_path: Path, **keywords: bool) -> dict:
    """One run in processes of its own (the lost process: it ends them)."""
    return _run_all(tmp_path, {"run": keywords})["run"]


def _reference(ranks: list[int], clip: bool = False, optimizer_state: list | None = None) -> dict[str, torch.Tensor]:
    """Plain PyTorch: per step, each rank's microbatches one after another (gradients accumulated), summed over
    ``ranks`` and divided by their count (then clipped, with ``clip``); then one AdamW step. ``optimizer_state``:
    a list that gets the optimizer's ``state_dict()`` at the end."""
    model = _model()
    optimizer = _optimizer(model.parameters())
    for step in range(STEPS):
        for rank in ranks:
            ids, target = _batch(step, rank)
            sizes = split_sizes(SAMPLES, 2)
            reference_microbatch_step(model, ids, target, gpt_loss, microbatch_weights("gpt", target, sizes), sizes)
        for param in model.parameters():
            if param.grad is not None:
                param.grad /= len(ranks)
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
    if optimizer_state is not None:
        optimizer_state.append(optimizer.state_dict())
    return state(model)


def _async_reference(ranks: list[int]) -> dict[str, torch.Tensor]:
    """Plain PyTorch of the async step with averaged gradients: iteration k computes each rank's gradients on
    W(k-2) and W(k) = step(W(k-1), their mean). A parameter without gradients keeps ``grad=None``."""

    def mean_gradients(compute: nn.Module, step: int) -> None:
        for rank in ranks:
            ids, target = _batch(step, rank)
            sizes = split_sizes(SAMPLES, 2)
            reference_microbatch_step(compute, ids, target, gpt_loss, microbatch_weights("gpt", target, sizes), sizes)
        for param in compute.parameters():
            if param.grad is not None:
                param.grad /= len(ranks)

    return delayed_update_reference(_model(), _optimizer, STEPS, mean_gradients)[0]


# every healthy run, started once for the module (the lost process has processes of its own)
RUNS = {"averaged": {}, "clip": {"clip": True}, "alone": {"average": False}, "async": {"async_step": True},
        **{f"sharded-{mode}": {"shard": True, "clip": mode == "clip", "async_step": mode == "async"}
           for mode in ("sync", "clip", "async")}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    return _run_all(tmp_path_factory.mktemp("runs"), RUNS)


@pytest.fixture
def averaged(runs) -> dict:
    return runs["averaged"]


def test_two_rings_average_their_gradients_as_plain_pytorch_does(averaged):
    assert "error" not in averaged, averaged.get("trace")
    ours = averaged["state"]
    assert_states_float64_equal(ours, _reference([0, 1]))
    # the first block's backward (the last backward stage) waited until a gradient bucket had been sent: the
    # communication started while the backward still ran (an engine that averaged only after the whole
    # backward would have made it wait in vain)
    assert averaged["waited"] and all(averaged["waited"]), averaged["waited"]
    # a parameter no process has a gradient for is left alone (weight decay would have moved it from 1)
    assert torch.equal(ours["2.unused"], torch.ones(3, dtype=torch.float64))


def test_clipping_sees_the_averaged_gradients(runs):
    run = runs["clip"]
    assert "error" not in run, run.get("trace")
    assert_states_float64_equal(run["state"], _reference([0, 1], clip=True))
    assert run["waited"] and all(run["waited"]), run["waited"]  # sent while the backward ran, here too


def test_without_averaging_a_ring_learns_from_its_own_share_only(averaged, runs):
    """The negative control: each process on its own gives rank 0's data only, far from the averaged run."""
    alone = runs["alone"]
    assert "error" not in alone, alone.get("trace")
    assert_states_float64_equal(alone["state"], _reference([0]))
    moved = max((averaged["state"][name] - alone["state"][name]).abs().max().item() for name in alone["state"])
    assert moved > 1e-4


def test_async_rings_equal_the_delayed_update_with_averaged_gradients(runs):
    run = runs["async"]
    assert "error" not in run, run.get("trace")
    assert_states_float64_equal(run["state"], _async_reference([0, 1]))


@pytest.mark.parametrize("mode", ["sync", "clip", "async"])
def test_a_sharded_optimizer_takes_the_same_steps_with_part_of_the_state(averaged, runs, mode):
    """shard_optimizer: each process keeps AdamW's state of the parameters it owns only and broadcasts them once
    stepped; the weights equal plain PyTorch's (the optimizer thread averaging and stepping by part; clipping,
    averaged on the caller's thread; the async delayed update). The state a checkpoint gathers on process 0 equals
    plain PyTorch's optimizer state, and a process that loads it keeps only what it owns."""
    run = runs[f"sharded-{mode}"]
    assert "error" not in run, run.get("trace")
    reference_state: list = []
    reference = (_async_reference([0, 1]) if mode == "async"
                 else _reference([0, 1], clip=mode == "clip", optimizer_state=reference_state))
    assert_states_float64_equal(run["state"], reference)
    params = list(_model().parameters())
    touched = [index for index, name in enumerate(dict(_model().named_parameters())) if name != "2.unused"]
    # process 0 holds state only for what it owns, and not nothing
    assert run["state_of"] == [index for index in run["owned"] if index in touched] and run["state_of"]
    # hand-computed: AdamW keeps exp_avg and exp_avg_sq (float64 here) and a float32 step count per parameter
    expected = sum(16 * params[index].numel() + 4 for index in run["state_of"])
    assert run["state_bytes"] == expected
    replicated = sum(16 * params[index].numel() + 4 for index in touched)
    assert averaged["state_bytes"] == replicated  # the replicated run, by the same count
    assert run["state_bytes"] < 0.6 * replicated  # about half, whole parameters each
    gathered = run["gathered"]["state"]
    assert sorted(gathered) == touched
    if reference_state:  # the gathered state is plain PyTorch's
        for index, entry in reference_state[0]["state"].items():
            for key, value in entry.items():
                torch.testing.assert_close(gathered[index][key].double(), value.double(), rtol=1e-12, atol=1e-14)
    assert run["kept_after_load"] == run["state_of"]


def test_ownership_is_balanced_and_the_same_for_the_same_parameters():
    """Hand-made: the largest parameter first to the least loaded process (the lowest rank among equals)."""
    sizes = [10, 7, 5, 4, 3, 1]
    params = [nn.Parameter(torch.zeros(n)) for n in sizes]
    owners = DataParallel(2, 0, shard_optimizer=True).owners(params)
    # 10 -> 0 (0:10), 7 -> 1 (1:7), 5 -> 1 (1:12), 4 -> 0 (0:14), 3 -> 1 (1:15), 1 -> 0 (0:15)
    assert [owners[id(param)] for param in params] == [0, 1, 1, 0, 1, 0]
    assert DataParallel(2, 1, shard_optimizer=True).owners(params) == owners
    assert DataParallel(2, 1, shard_optimizer=True).owned(params) == {id(params[i]) for i in (1, 2, 4)}
    assert DataParallel(2, 1).owned(params) == {id(param) for param in params}  # not sharded: all


def test_a_lost_process_makes_the_others_fail_with_an_error_naming_it(tmp_path):
    lost = _run(tmp_path, lose_rank_1=True)
    assert "error" in lost, "process 0 finished although process 1 was lost"
    # raised where the averaging runs (the optimizer thread, without hooks) and surfaced by the next call
    assert "DataParallelError: process 0 of 2:" in lost["error"], lost["trace"]
    assert "process 1 stopped or was lost" in lost["error"]


def _average_gradients(data_parallel: DataParallel, params: list[nn.Parameter]) -> None:
    """Test helper: replace each ``param.grad`` by its mean over the processes, all at once, the way the engine's
    caller-thread driver does (``StepQueue.average``) without step groups."""
    if data_parallel.averaging:
        data_parallel.start(params).finish()


def _average_known(rank: int, store: str, out: str, reduce_dtypes: list[str | None]) -> None:
    """Average two float32 gradients whose values each process draws from its own seed, in each reduction dtype."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=TIMEOUT))
    try:
        results = {}
        for reduce_dtype in reduce_dtypes:
            params = [nn.Parameter(torch.zeros(n)) for n in (1000, 37)]
            for index, param in enumerate(params):
                param.grad = torch.randn(param.shape, generator=torch.Generator().manual_seed(10 * rank + index))
            data_parallel = DataParallel(WORLD, rank, timeout=TIMEOUT,
                                         reduce_dtype=None if reduce_dtype is None else getattr(torch, reduce_dtype))
            _average_gradients(data_parallel, params)
            results[reduce_dtype] = {"grads": [param.grad for param in params], "sent": data_parallel.sent_bytes}
        if rank == 0:
            torch.save(results, out)
    finally:
        dist.destroy_process_group()


REDUCE_DTYPES = [None, "bfloat16"]


@pytest.fixture(scope="module")
def averaged_known(tmp_path_factory) -> dict[str | None, dict]:
    """Both reduction dtypes, averaged by one pair of processes."""
    folder = tmp_path_factory.mktemp("known")
    mp.start_processes(_average_known, args=(str(folder / "store"), str(folder / "rank0.pt"), REDUCE_DTYPES),
                       nprocs=WORLD, join=True, start_method="spawn")
    return torch.load(folder / "rank0.pt", weights_only=False)


@pytest.mark.parametrize("reduce_dtype", REDUCE_DTYPES)
def test_gradients_travel_in_the_reduction_dtype(averaged_known, reduce_dtype):
    """float32: the mean is (g0 + g1) / 2 computed in float32, bitwise. bfloat16: half the bytes, and each
    element within bfloat16's rounding of the exact mean: each gradient and the sum are rounded to nearest once
    (relative error at most 2**-8 each: bfloat16 keeps 8 significant bits), so |ours - mean| <= 2**-8 (|g0| +
    |g1|) (plus 1% for the float32 steps)."""
    result = averaged_known[reduce_dtype]
    drawn = [[torch.randn(n, generator=torch.Generator().manual_seed(10 * rank + index))
              for index, n in enumerate((1000, 37))] for rank in range(WORLD)]
    elements = 1037
    for index, ours in enumerate(result["grads"]):
        g0, g1 = drawn[0][index], drawn[1][index]
        if reduce_dtype is None:
            assert torch.equal(ours, (g0 + g1) / 2)
        else:
            assert ours.dtype == torch.float32
            bound = 2**-8 * (g0.abs() + g1.abs()) * 1.01
            assert bool(((ours - (g0.double() + g1.double()) / 2).abs() <= bound).all())
            assert not torch.equal(ours, (g0 + g1) / 2)  # it did travel in bfloat16
    flags = 2  # one per parameter, in their bucket
    assert result["sent"] == (elements + flags) * (4 if reduce_dtype is None else 2)


def test_buckets_keep_order_and_dtype_and_respect_the_cap():
    params = [nn.Parameter(torch.zeros(n, dtype=dtype)) for n, dtype in
              [(4, torch.float32), (4, torch.float32), (8, torch.float32), (2, torch.float64), (2, torch.float64)]]
    buckets = _buckets(params, bucket_bytes=32)
    # hand-made: 16 + 16 bytes fill the first; 32 alone; float64 starts its own
    position = {id(param): index for index, param in enumerate(params)}
    assert [[position[id(param)] for param in bucket] for bucket in buckets] == [[0, 1], [2], [3, 4]]


def test_one_process_averages_nothing():
    param = nn.Parameter(torch.zeros(2))
    param.grad = torch.ones(2)
    grad = param.grad
    alone = DataParallel(1, 0)
    assert not alone.averaging and not DataParallel(1, 0, shard_optimizer=True).sharded
    alone.start([param]).finish()
    assert torch.equal(param.grad, grad)
    assert alone.agree("plan") == "plan"
    with pytest.raises(ValueError, match="need 0 <= rank < world_size"):
        DataParallel(2, 2)
    assert issubclass(DataParallelError, RuntimeError)
