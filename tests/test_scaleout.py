"""Data parallel over RoundPipe rings through Lightning: several processes, launched the Lightning way.

Every multi-process run is a separate script (``tests/scaleout/train.py``) started with ``subprocess``: never
``trainer.fit`` with several processes inside pytest, as Lightning's launcher starts the other processes by running
the main program again. The runs are module-scoped fixtures, each started once (a run takes 10 to 25 s on two
cores, most of it importing Lightning in each process).

The reference is ``strategy="ddp", devices=2`` on the same data, seed and global batch: AdamW, a StepLR schedule,
``accumulate_grad_batches=2``, gradient clipping. RoundPipe runs ``devices=4, rings_per_node=2``: 2 processes,
each a ring of 2 simulated CPU devices with 2 microbatches per batch. Both in float64, so they agree to
``tests/numerics.py``'s 1e-12 (the sums run in another order); the weights move by far more than that.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lightning_roundpipe import RoundPipeStrategy
from lightning_roundpipe.engine.options import OptionError
from tests.models import Classifier, state_bytes
from tests.numerics import assert_float64_equal, assert_states_equal, assert_states_float64_equal
from tests.scaleout import train as script

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "scaleout" / "train.py"
TIMEOUT = 300  # seconds per run: a guard against hanging, far above what a run takes
STEPS = 4      # optimizer steps: 2 epochs of 2
WORLD = 2
# variables a launcher or scheduler sets: the runs must not inherit them from whatever started pytest
LAUNCH_VARIABLES = ("LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                    "TORCHELASTIC_RUN_ID", "PL_GLOBAL_SEED")


def _script(*args: str, torchrun: bool = False) -> list[str]:
    """The command running the script with ``args`` (under torchrun with 2 processes: ``torchrun``)."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}"] \
        if torchrun else [sys.executable]
    return [*launcher, str(SCRIPT), *args]


def _start(command: list[str], **variables: str) -> subprocess.Popen:
    """Start ``command`` without the launch variables of whatever started pytest (``variables``: set these), in a
    session of its own: every process of the run, orphans included, keeps its id, so that none goes unseen and a
    run that hangs is ended with all it started."""
    env = {key: value for key, value in os.environ.items()
           if key not in LAUNCH_VARIABLES and not key.startswith("SLURM_")}
    return subprocess.Popen(command, cwd=ROOT, env={**env, **variables}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _output(process: subprocess.Popen, command: list[str], timeout: float) -> str:
    """What the run printed, once every process of it has closed the output (exited); ends the whole session and
    fails the test if that takes over ``timeout`` seconds."""
    try:
        return process.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output = process.communicate()[0]
        pytest.fail(f"{' '.join(command)} ran over {timeout} s:\n{output[-6000:]}")


def _run(out: Path, *args: str, torchrun: bool = False) -> dict[int, dict[str, Any]]:
    """Run the script (under torchrun with 2 processes: ``torchrun``); returns each rank's record."""
    command = _script(*args, "--out", str(out), torchrun=torchrun)
    with _start(command) as process:
        output = _output(process, command, TIMEOUT)
    assert process.returncode == 0, f"{' '.join(command)} failed:\n{output[-6000:]}"
    return {rank: torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(WORLD)}


def _fit_one_process(steps: int, *, resume: str | None = None, checkpoints: str | None = None,
                     async_step: bool = False, clip: bool = True) -> tuple[script.Recording, pl.Trainer]:
    """The same run in this process: one ring of 2 devices, every batch the whole global batch (its samples are
    those of one batch of all the processes of a two-process run)."""
    pl.seed_everything(0, verbose=False)
    strategy = RoundPipeStrategy(num_microbatches=2, async_step=async_step, wait_timeout=script.WAIT)
    trainer = script.make_trainer(strategy, 2, steps, True, checkpoints, clip=clip)
    module = script.Recording("adamw")
    trainer.fit(module, script.loader(1), ckpt_path=resume)
    return module, trainer


def _initial_state() -> dict[str, torch.Tensor]:
    return {name: tensor.double() for name, tensor in Classifier("adamw").state_dict().items()}


# ---------------------------------------------------------------------------- the runs
@pytest.fixture(scope="module")
def ddp(tmp_path_factory) -> dict[int, dict[str, Any]]:
    return _run(tmp_path_factory.mktemp("ddp"), "--strategy", "ddp", "--devices", "2", "--float64")


@pytest.fixture(scope="module")
def transparent(tmp_path_factory) -> tuple[dict[int, dict[str, Any]], Path]:
    """Rank 1 starts from other weights (the strategy must start it from rank 0's); timeline and checkpoints."""
    folder = tmp_path_factory.mktemp("transparent")
    records = _run(folder / "out", "--strategy", "roundpipe", "--devices", "4", "--rings-per-node", "2", "--float64",
                   "--perturb-rank", "1", "--timeline-dir", str(folder / "timeline"),
                   "--checkpoints", str(folder / "checkpoints"))
    return records, folder


@pytest.fixture(scope="module")
def fused(tmp_path_factory) -> dict[int, dict[str, Any]]:
    return _run(tmp_path_factory.mktemp("fused"), "--strategy", "roundpipe", "--devices", "4", "--rings-per-node",
                "2", "--float64", "--fused")


# ---------------------------------------------------------------------------- two processes against DDP
def _check_against_ddp(records: dict[int, dict[str, Any]], ddp: dict[int, dict[str, Any]]) -> None:
    for rank in range(WORLD):
        record, reference = records[rank], ddp[rank]
        assert record["world_size"] == WORLD and record["global_step"] == STEPS
        assert record["distributed_sampler_kwargs"] == {"num_replicas": WORLD, "rank": rank}
        assert record["seen"] == reference["seen"]  # Lightning's DistributedSampler, sharded by process
        assert_float64_equal(record["losses"], reference["losses"], what=f"rank {rank} losses")
        assert_float64_equal(record["synced_loss"], reference["synced_loss"], what="sync_dist mean")
    assert records[0]["synced_loss"] == records[1]["synced_loss"]
    for epoch in range(STEPS // 2):  # each epoch, the processes train on disjoint shares of the data
        shares = [set(records[rank]["seen"][epoch * 16:(epoch + 1) * 16]) for rank in range(WORLD)]
        assert not shares[0] & shares[1] and shares[0] | shares[1] == set(range(script.SAMPLES))
    assert_states_equal(records[0]["state"], records[1]["state"])  # every process took the same steps
    assert_states_float64_equal(records[0]["state"], ddp[0]["state"])
    moved = max((records[0]["state"][name] - value).abs().max().item() for name, value in _initial_state().items())
    assert moved > 1e-3  # a run that did not train (or one of another run) would fail the comparison


def test_two_processes_equal_ddp_transparent(transparent, ddp):
    _check_against_ddp(transparent[0], ddp)
    assert transparent[0][0]["environment"] == "LightningEnvironment"


def test_two_processes_equal_ddp_fused(fused, ddp):
    _check_against_ddp(fused, ddp)


def test_two_processes_equal_ddp_under_torchrun(tmp_path, ddp):
    """The same run with torchrun starting both processes (TorchElasticEnvironment, no Lightning launcher)."""
    records = _run(tmp_path, "--strategy", "roundpipe", "--devices", "4", "--rings-per-node", "2", "--float64",
                   torchrun=True)
    assert [records[rank]["environment"] for rank in range(WORLD)] == ["TorchElasticEnvironment"] * WORLD
    _check_against_ddp(records, ddp)


def test_two_nodes_started_by_hand_equal_ddp(tmp_path, ddp):
    """``Trainer(num_nodes=2)``, one ring of 2 devices per node, the script started once per node with NODE_RANK,
    MASTER_ADDR and MASTER_PORT set (the README's way without torchrun or SLURM; here both "nodes" on this
    machine)."""
    with socket.socket() as probe:  # a free port for the rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = _script("--strategy", "roundpipe", "--devices", "2", "--num-nodes", "2", "--float64", "--out",
                      str(tmp_path))
    nodes = [_start(command, NODE_RANK=str(node), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)) for node in range(2)]
    outputs = []
    try:
        for node in nodes:
            outputs.append(_output(node, command, TIMEOUT))
    finally:  # a node that failed early leaves the other waiting for it
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
                node.communicate()
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(output[-3000:] for output in outputs)
    records = {rank: torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in range(WORLD)}
    assert [records[rank]["environment"] for rank in range(WORLD)] == ["LightningEnvironment"] * WORLD
    _check_against_ddp(records, ddp)


def test_each_process_writes_its_own_timeline(transparent):
    folder = transparent[1] / "timeline"
    names = sorted(path.name for path in folder.iterdir())
    assert {"timeline_rank0.json", "timeline_rank1.json"} <= set(names) and "timeline.json" not in names


# ---------------------------------------------------------------------------- checkpoints
def test_only_rank_0_writes_checkpoints_that_load_without_the_strategy(transparent):
    records, folder = transparent
    assert sorted(path.name for path in (folder / "checkpoints").iterdir()) == ["epoch=0.ckpt", "epoch=1.ckpt"]
    path = folder / "checkpoints" / "epoch=1.ckpt"
    checkpoint = torch.load(path, weights_only=False)  # a plain Lightning checkpoint
    assert checkpoint["global_step"] == STEPS and "roundpipe" in checkpoint
    assert_states_equal(checkpoint["state_dict"], records[0]["state"])
    module = Classifier.load_from_checkpoint(path)  # a float32 module: the float64 weights, rounded
    assert_states_equal(module.state_dict(), {name: value.float() for name, value in records[0]["state"].items()})


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """The first epoch in this process (its checkpoint), and the second resumed from it in this process: what a
    resumed run ends with, whatever the world size of either half. (Lightning resumes from a checkpoint of an
    epoch's end with its own choice of batches, the same under its default strategy; so a resumed run is
    compared with a resumed run.)"""
    folder = tmp_path_factory.mktemp("one_process")
    _fit_one_process(STEPS // 2, checkpoints=str(folder))
    module, trainer = _fit_one_process(STEPS, resume=str(folder / "epoch=0.ckpt"))
    assert trainer.global_step == STEPS and trainer.world_size == 1
    return folder / "epoch=0.ckpt", {name: value.detach().clone() for name, value in module.state_dict().items()}


def test_a_two_process_checkpoint_resumes_on_one_process(transparent, one_process, roundpipe_threads):
    checkpoint, resumed = one_process
    first_half = torch.load(transparent[1] / "checkpoints" / "epoch=0.ckpt", weights_only=False)["state_dict"]
    assert_states_float64_equal(first_half, torch.load(checkpoint, weights_only=False)["state_dict"])
    module, trainer = _fit_one_process(STEPS, resume=str(transparent[1] / "checkpoints" / "epoch=0.ckpt"))
    assert trainer.global_step == STEPS and trainer.world_size == 1
    assert_states_float64_equal(module.state_dict(), resumed)
    assert roundpipe_threads() == []
    moved = max((resumed[name] - value).abs().max().item() for name, value in first_half.items())
    assert moved > 1e-3  # the second half trained


def test_a_one_process_checkpoint_resumes_on_two_processes_under_torchrun(tmp_path, one_process, roundpipe_threads):
    checkpoint, resumed = one_process
    records = _run(tmp_path, "--strategy", "roundpipe", "--devices", "4", "--rings-per-node", "2", "--float64",
                   "--resume", str(checkpoint), torchrun=True)
    assert [records[rank]["environment"] for rank in range(WORLD)] == ["TorchElasticEnvironment"] * WORLD
    assert records[0]["global_step"] == STEPS and records[1]["world_size"] == WORLD
    assert_states_equal(records[0]["state"], records[1]["state"])
    assert_states_float64_equal(records[0]["state"], resumed)


def test_gradients_travel_in_the_reduction_dtype_chosen(tmp_path, transparent):
    """reduce_dtype="bfloat16" reaches the averaging: a quarter of the float64 run's bytes, the same elements (the
    mean's precision in bfloat16 is checked in tests/test_dataparallel.py)."""
    records = _run(tmp_path, "--strategy", "roundpipe", "--devices", "4", "--rings-per-node", "2", "--float64",
                   "--reduce-dtype", "bfloat16")
    full = transparent[0][0]["sent_bytes"]
    assert full > 0 and records[0]["sent_bytes"] * 4 == full
    assert records[0]["global_step"] == STEPS
    assert_states_equal(records[0]["state"], records[1]["state"])  # the same means on both processes


# ---------------------------------------------------------------------------- a sharded optimizer
@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> tuple[dict[int, dict[str, Any]], Path]:
    """``shard_optimizer=True``: each process keeps and steps AdamW's state of its own parameters."""
    folder = tmp_path_factory.mktemp("sharded")
    records = _run(folder / "out", "--strategy", "roundpipe", "--devices", "4", "--rings-per-node", "2", "--float64",
                   "--shard-optimizer", "--checkpoints", str(folder / "checkpoints"))
    return records, folder


def test_a_sharded_optimizer_equals_ddp(sharded, ddp):
    _check_against_ddp(sharded[0], ddp)


def test_a_sharded_optimizer_equals_ddp_fused(tmp_path, ddp):
    _check_against_ddp(_run(tmp_path, "--strategy", "roundpipe", "--devices", "4", "--rings-per-node", "2",
                            "--float64", "--fused", "--shard-optimizer"), ddp)


def test_a_sharded_optimizer_holds_fewer_host_bytes_per_parameter(sharded, transparent):
    """Measured in each process: its parameters' bytes plus its optimizer state's, per parameter. Replicated,
    every process holds AdamW's whole state (in float64: 8 bytes a weight, 16 its two moments); sharded, the two
    processes hold disjoint parts that add up to exactly that state, so each holds less."""
    replicated = [transparent[0][rank]["host_bytes"] for rank in range(WORLD)]
    shares = [sharded[0][rank]["host_bytes"] for rank in range(WORLD)]
    assert replicated[0] == replicated[1]
    assert sum(share["optimizer_state"] for share in shares) == replicated[0]["optimizer_state"]
    per_param = [(held["params"] + held["optimizer_state"]) / held["numel"] for held in (*replicated, *shares)]
    assert per_param[0] >= 8 + 16  # the replicated figure, by the count above (plus each step count)
    assert max(per_param[2:]) < min(per_param[:2])
    assert all(share["optimizer_state"] > 0 for share in shares)  # both processes own parameters


def test_a_sharded_checkpoint_is_whole_and_resumes_on_one_process(sharded, transparent, one_process,
                                                                   roundpipe_threads):
    """Process 0 writes the whole optimizer state, gathered: the replicated run's, in a file that loads without
    the strategy and resumes on one process as a one-process checkpoint does."""
    folder = sharded[1] / "checkpoints"
    assert sorted(path.name for path in folder.iterdir()) == ["epoch=0.ckpt", "epoch=1.ckpt"]
    ours = torch.load(folder / "epoch=1.ckpt", weights_only=False)["optimizer_states"][0]
    theirs = torch.load(transparent[1] / "checkpoints" / "epoch=1.ckpt", weights_only=False)["optimizer_states"][0]
    assert sorted(ours["state"]) == sorted(theirs["state"]) == list(range(len(list(Classifier("adamw").parameters()))))
    for index, entry in theirs["state"].items():
        for key, value in entry.items():
            if value.dtype == torch.float64:  # the moments; the step count is a float32 scalar, counted exactly
                assert_float64_equal(ours["state"][index][key], value, what=f"optimizer state {index} {key}")
            else:
                assert torch.equal(ours["state"][index][key], value), f"optimizer state {index} {key}"
    Classifier.load_from_checkpoint(folder / "epoch=1.ckpt")
    _, resumed = one_process
    module, trainer = _fit_one_process(STEPS, resume=str(folder / "epoch=0.ckpt"))
    assert trainer.global_step == STEPS and roundpipe_threads() == []
    assert_states_float64_equal(module.state_dict(), resumed)


def test_a_one_process_checkpoint_resumes_sharded_on_two_processes_under_torchrun(tmp_path, one_process):
    """Each process loads the whole state and keeps what it owns: the run goes on as the one-process one does."""
    checkpoint, resumed = one_process
    records = _run(tmp_path, "--strategy", "roundpipe", "--devices", "4", "--rings-per-node", "2", "--float64",
                   "--shard-optimizer", "--resume", str(checkpoint), torchrun=True)
    assert [records[rank]["environment"] for rank in range(WORLD)] == ["TorchElasticEnvironment"] * WORLD
    assert_states_equal(records[0]["state"], records[1]["state"])
    assert_states_float64_equal(records[0]["state"], resumed)
    whole = torch.load(checkpoint, weights_only=False)["optimizer_states"][0]["state"]
    assert all(0 < records[rank]["host_bytes"]["optimizer_state"] < state_bytes(whole) for rank in range(WORLD))


# ---------------------------------------------------------------------------- async
def test_async_two_processes_equal_one_process_with_the_global_batch(tmp_path, roundpipe_threads):
    """Async data parallel is the one-step-stale update of the mean gradient: one process with the two
    processes' batches together takes the same steps (the single-process async step is checked against the
    formula itself in the engine's tests). Without clipping: the optimizer thread averages (the runs above clip,
    so the main thread does)."""
    records = _run(tmp_path, "--strategy", "roundpipe", "--devices", "4", "--rings-per-node", "2", "--float64",
                   "--async-step", "--no-clip")
    module, _ = _fit_one_process(STEPS, async_step=True, clip=False)
    assert roundpipe_threads() == []
    assert_states_equal(records[0]["state"], records[1]["state"])
    assert_states_float64_equal(records[0]["state"], module.state_dict())


# ---------------------------------------------------------------------------- settings refused in our words
def _trainer(**kwargs: Any) -> pl.Trainer:
    strategy = RoundPipeStrategy(rings_per_node=kwargs.pop("rings_per_node"))
    return pl.Trainer(strategy=strategy, accelerator="cpu", logger=False, enable_progress_bar=False,
                      enable_model_summary=False, **kwargs)


@pytest.fixture
def keep_rank(monkeypatch):
    """Building a Trainer of several processes sets Lightning's rank-zero rank: give it back afterwards."""
    monkeypatch.setattr(rank_zero_only, "rank", getattr(rank_zero_only, "rank", 0))


def test_rings_per_node_must_divide_the_devices():
    with pytest.raises(OptionError, match=r"^`rings_per_node` must divide the Trainer's devices per node: devices=3 "
                                          r"with rings_per_node=2 leaves 1 device\(s\) over.*set devices to a "
                                          r"multiple of 2, or rings_per_node to a divisor of 3$"):
        _trainer(devices=3, rings_per_node=2)


def test_torchrun_worlds_count_processes_not_devices(monkeypatch, keep_rank):
    for key, value in {"TORCHELASTIC_RUN_ID": "test", "WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1",
                       "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29555"}.items():
        monkeypatch.setenv(key, value)
    trainer = _trainer(devices=4, rings_per_node=2)  # Lightning's own check would want devices=2
    strategy = trainer.strategy
    assert type(strategy.cluster_environment).__name__ == "TorchElasticEnvironment"
    assert strategy.launcher is None  # torchrun started the processes
    assert (trainer.world_size, trainer.global_rank, trainer.local_rank, trainer.num_devices) == (2, 1, 1, 4)
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 1}
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(ValueError, match=r"rings_per_node=2 on each of num_nodes=1 node\(s\): 2 in all; but "
                                         r"TorchElasticEnvironment started 1 .*--nproc-per-node 2.*"
                                         r"Trainer\(devices=4\) stays the number of devices per node"):
        _trainer(devices=4, rings_per_node=2)


def test_slurm_worlds_count_processes_not_devices(monkeypatch, keep_rank):
    for key, value in {"SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "2", "SLURM_NNODES": "2", "SLURM_PROCID": "3",
                       "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_JOB_NAME": "train",
                       "SLURM_NODELIST": "node0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29555"}.items():
        monkeypatch.setenv(key, value)
    trainer = _trainer(devices=4, rings_per_node=2, num_nodes=2)
    assert type(trainer.strategy.cluster_environment).__name__ == "SLURMEnvironment"
    assert trainer.strategy.launcher is None
    assert (trainer.world_size, trainer.global_rank, trainer.node_rank) == (4, 3, 1)
    with pytest.raises(ValueError, match=r"rings_per_node=1 on each of num_nodes=2 node\(s\): 2 in all; but "
                                         r"SLURMEnvironment started 4 \(this one: local rank 1 on node 1\)"):
        _trainer(devices=4, rings_per_node=1, num_nodes=2)


def test_one_process_keeps_rank_0_of_1_and_no_launcher():
    trainer = _trainer(devices=2, rings_per_node=1)
    strategy = trainer.strategy
    assert strategy.launcher is None and not strategy.is_distributed
    assert (strategy.world_size, strategy.global_rank, strategy.local_rank, strategy.node_rank) == (1, 0, 0, 0)
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 1, "rank": 0}
    assert strategy.reduce(torch.tensor(3.0)) == 3.0 and strategy.broadcast("x") == "x"
    assert strategy.reduce_boolean_decision(False) is False


def test_several_processes_get_lightnings_launcher(keep_rank):
    trainer = _trainer(devices=4, rings_per_node=2)
    strategy = trainer.strategy
    assert type(strategy.launcher).__name__ == "_SubprocessScriptLauncher"
    assert (strategy.launcher.num_processes, strategy.launcher.num_nodes) == (2, 1)
    assert strategy.world_size == 2 and strategy.is_distributed and strategy.num_processes == 2


# ---------------------------------------------------------------------------- a process killed mid-training
KILL_WAIT = 30        # seconds: the strategy's wait_timeout in these runs (rank 1's start-up fits in it)
KILLED_TIMEOUT = 150  # seconds a killed run may take in all: start-up (under load) plus KILL_WAIT, with margin


def _run_killed(out: Path, kill_rank: int, *, torchrun: bool = False) -> tuple[int, str]:
    """Run 8 steps with global rank ``kill_rank`` killing itself (SIGKILL) after the first: the survivor is
    mid-training. Returns the exit code of the process started (rank 0, or torchrun) and the output of all; fails
    if the run outlasts ``KILLED_TIMEOUT`` (a survivor stuck past its wait_timeout) or leaves a process behind."""
    command = _script("--strategy", "roundpipe", "--devices", "4", "--rings-per-node", "2", "--steps", "8",
                      "--kill-rank", str(kill_rank), "--kill-at-step", "1", "--wait", str(KILL_WAIT), "--out",
                      str(out), torchrun=torchrun)
    with _start(command) as process:
        output = _output(process, command, KILLED_TIMEOUT)
    left = _session_processes(process.pid)
    if left:
        os.killpg(process.pid, signal.SIGKILL)
    assert not left, f"processes left by {' '.join(command)}: {left}\n{output[-6000:]}"
    return process.returncode, output


def _session_processes(session: int, grace: float = 10.0) -> list[str]:
    """The live processes of ``session`` (from /proc), once those still exiting have had ``grace`` seconds. A zombie
    (an exited orphan its new parent has not reaped yet) has no threads left and does not count."""
    deadline = time.monotonic() + grace
    while True:
        live = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
            except OSError:  # it ended meanwhile
                continue
            state, _, _, sid = stat[stat.rindex(")") + 2:].split()[:4]
            if int(sid) == session and state not in "ZX":
                live.append(f"{entry.name} ({state}): {stat[:stat.rindex(')') + 1]}")
        if not live or time.monotonic() > deadline:
            return live
        time.sleep(0.2)


def _exit_record(out: Path, rank: int) -> str | None:
    """What ``rank`` wrote on failing (its exit code, then its error), if it ended by failing itself."""
    path = out / f"exit_rank{rank}.txt"
    return path.read_text() if path.exists() else None


def test_killing_rank_0_makes_rank_1_exit_naming_it(tmp_path):
    """Lightning's launcher, rank 0 (the process started, parent of rank 1) killed: rank 1 fails its next gradient
    averaging at once, prints our DataParallelError naming process 0 and exits non-zero by itself; nothing is left.
    Rank 1's exit code reaches no one (its parent is the process killed), so it writes it: 1 with the error."""
    returncode, output = _run_killed(tmp_path, kill_rank=0)
    assert returncode == -signal.SIGKILL, output[-6000:]  # rank 0 killed itself
    assert _exit_record(tmp_path, 0) is None
    record = _exit_record(tmp_path, 1)
    assert record is not None, f"rank 1 did not fail by itself:\n{output[-6000:]}"
    named = r"DataParallelError: process 1 of 2: .*process 0 stopped or (was lost|is stuck)"
    assert re.match(r"1\n" + named, record), record
    assert re.search(named, output), output[-6000:]


def test_killing_rank_1_makes_rank_0_exit_non_zero(tmp_path):
    """Lightning's launcher, rank 1 (the child) killed: rank 0 exits non-zero and nothing is left. Rank 0 fails its
    next gradient averaging within about 0.1 s and exits 1 with our DataParallelError naming process 1; but
    Lightning's launcher also runs a thread in rank 0 that polls its children every 5 s and SIGKILLs rank 0 when
    one has failed, so in a few runs in a hundred that poll falls first: exit -9, without our message."""
    returncode, output = _run_killed(tmp_path, kill_rank=1)
    assert returncode in (1, -signal.SIGKILL), output[-6000:]
    if returncode == 1:  # it ended by itself: in our words
        named = r"DataParallelError: process 0 of 2: .*process 1 stopped or (was lost|is stuck)"
        record = _exit_record(tmp_path, 0)
        assert record is not None and re.match(r"1\n" + named, record), record
        assert re.search(named, output), output[-6000:]


def test_killing_a_rank_under_torchrun_fails_the_run_naming_it(tmp_path):
    """torchrun, rank 1 killed: torchrun exits non-zero naming rank 1, killed by SIGKILL, as the root cause, and
    nothing is left. The survivor's own message is not guaranteed: torchrun sends it SIGTERM within 0.1 s, and
    Lightning's SIGTERM handler then broadcasts on the default group, whose gloo error (or the default action, if
    Lightning has restored it) can end rank 0 before or instead of our DataParallelError."""
    returncode, output = _run_killed(tmp_path, kill_rank=1, torchrun=True)
    assert returncode != 0, output[-6000:]
    assert "Root Cause (first observed failure):" in output, output[-6000:]
    root_cause = output[output.index("Root Cause (first observed failure):"):]
    assert re.search(r"rank\s*: 1 \(local_rank: 1\)\s*\n\s*exitcode\s*: -9 .*\(SIGKILL\)", root_cause), root_cause
