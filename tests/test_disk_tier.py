"""The disk tier for the optimizer state (``offload="optimizer"``, issue 26 item 2).

The reference is the same run with the state in memory (``offload="none"``, itself bitwise Lightning's default
strategy: ``test_strategy.py``, ``test_gradients_in_flight.py``): weights and optimizer state must be bitwise equal,
sync and async, transparent and fused, with a per-step scheduler, and across a resume from a checkpoint into the
other tier. Where the state is, the kernel says: ``/proc/self/maps`` lists the mappings of the tier's files, and
every large state tensor must lie in one. What it holds in memory is read with ``mincore`` and bounded by the
groups in flight, computed here from the plan. A full disk is injected (``posix_fallocate`` raising ``ENOSPC``);
a crash is a child process that exits in the middle of a step.
"""

from __future__ import annotations

import errno
import os
import pathlib
import subprocess
import sys
import threading

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

import lightning_roundpipe  # noqa: F401 - registers the strategy names (editable installs have no .pth hook)
from lightning_roundpipe import PipelineError, RoundPipeEngine, RoundPipeStrategy, pipeline_loss, preflight
from lightning_roundpipe.engine.errors import OffloadError
from lightning_roundpipe.engine.layers import build_trunk
from lightning_roundpipe.engine.options import EngineOptions, OptionError
from lightning_roundpipe.engine.step import disk_tier
from lightning_roundpipe.engine.step.disk_tier import PAGE, QUEUED_WRITES
from lightning_roundpipe.engine.step.queued import READ_AHEAD
from lightning_roundpipe.hostmem import HostLimits, format_bytes
from lightning_roundpipe.preflight import DiskSpaceError
from tests.models import adamw_with_step_lr, three_class_data
from tests.numerics import assert_same_optimizer_state, assert_states_equal

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the disk tier is Linux only")

REPO = pathlib.Path(__file__).resolve().parent.parent
WIDTH = 64  # a Linear weight of 64 x 64 fp32 is 16 KiB: its AdamW state goes to the files; the biases' stays


class Wide(pl.LightningModule):
    """Linear layers wide enough for the tier, AdamW and a per-step StepLR; ``fused`` uses ``pipeline_loss``."""

    def __init__(self, fused: bool = False, layers: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        blocks = [module for _ in range(layers) for module in (nn.Linear(WIDTH, WIDTH), nn.Tanh())]
        self.net = nn.Sequential(*blocks, nn.Linear(WIDTH, 3))
        self.fused = fused

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.fused:
            return pipeline_loss(self.net, x, y, F.cross_entropy)
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return adamw_with_step_lr(self.parameters())


def _data(samples: int = 24) -> DataLoader:
    return three_class_data(WIDTH, samples)


def _strategy(offload_dir: pathlib.Path | None, offload: str = "optimizer", **kwargs) -> RoundPipeStrategy:
    tier = {"offload": offload, "offload_dir": offload_dir} if offload_dir is not None else {}
    # whole jobs and a frozen plan: measured times (which a checkpoint carries) would otherwise choose rounds,
    # which sum the microbatches' gradients in another order than the reference's
    options = {"ring": [0, 0], "num_microbatches": 2, "num_stages": 3, "round_size": "whole", "freeze_plan": True,
               "jitter": 0.0005, **tier, **kwargs}
    return RoundPipeStrategy(**options)


def _trainer(strategy: RoundPipeStrategy, epochs: int, root: pathlib.Path, precision: str = "32-true",
             callbacks: list[pl.Callback] | None = None) -> pl.Trainer:
    return pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_epochs=epochs, precision=precision,
                      callbacks=callbacks, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=root)


def _fit(offload_dir: pathlib.Path | None, root: pathlib.Path, *, fused: bool = False, epochs: int = 2,
         ckpt_path: pathlib.Path | None = None, offload: str = "optimizer", precision: str = "32-true",
         frozen: bool = False, callbacks: list[pl.Callback] | None = None, layers: int = 4,
         **kwargs) -> tuple[Wide, pl.Trainer]:
    module = Wide(fused, layers)
    if frozen:  # a frozen base: the first two Linear weights train no more (their masters are never read again)
        for index in (0, 2):
            module.net[index].weight.requires_grad_(False)
    trainer = _trainer(_strategy(offload_dir, offload, **kwargs), epochs, root, precision, callbacks)
    trainer.fit(module, _data(), ckpt_path=ckpt_path)
    return module, trainer


def _file_mappings(directory: pathlib.Path) -> list[tuple[int, int]]:
    """The address ranges of this process's mappings of files in ``directory`` (nameless ones included)."""
    ranges = []
    prefix = os.path.realpath(directory) + "/"
    for line in pathlib.Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith(prefix):
            start, end = (int(part, 16) for part in fields[0].split("-"))
            ranges.append((start, end))
    return ranges


def _large_state(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [value for state in optimizer.state.values() for value in state.values()
            if isinstance(value, torch.Tensor) and value.nbytes >= PAGE]


def _in_files(tensor: torch.Tensor, mappings: list[tuple[int, int]]) -> bool:
    return any(start <= tensor.data_ptr() and tensor.data_ptr() + tensor.nbytes <= end for start, end in mappings)


@pytest.mark.parametrize("fused", [False, True], ids=["transparent", "fused"])
@pytest.mark.parametrize("async_step", [False, True], ids=["sync", "async"])
def test_the_state_in_files_trains_bitwise_as_in_memory(tmp_path, fused, async_step):
    offload_dir = tmp_path / "state"
    module, trainer = _fit(offload_dir, tmp_path, fused=fused, async_step=async_step)
    reference, reference_trainer = _fit(None, tmp_path, fused=fused, async_step=async_step)
    assert_states_equal(module, reference)
    assert_same_optimizer_state(trainer, reference_trainer)
    # every large state tensor lies in a mapping of a file in offload_dir, a file with no name left there
    mappings = _file_mappings(offload_dir)
    large = _large_state(trainer.optimizers[0])
    assert len(large) == 2 * 4  # exp_avg and exp_avg_sq of the four 64 x 64 weights (the 64 x 3 head: 768 B)
    assert all(_in_files(tensor, mappings) for tensor in large), "a state tensor outside the tier's files"
    assert not any(_in_files(param, mappings) for param in module.parameters())  # the masters stay in memory
    assert os.listdir(offload_dir) == []


def test_a_file_system_that_refuses_readahead_reads_through_the_file_bitwise(tmp_path, monkeypatch):
    """readahead(2) refused (a file system without it): the reads go through the file, the results the same."""
    refused = []

    class _NoReadahead:
        def __init__(self, libc):
            self._libc = libc

        def readahead(self, *args):
            refused.append(args)
            return -1

        def __getattr__(self, name):
            return getattr(self._libc, name)

    real = disk_tier._libc
    monkeypatch.setattr(disk_tier, "_libc", lambda: _NoReadahead(real()))
    module, trainer = _fit(tmp_path / "state", tmp_path)
    reference, reference_trainer = _fit(None, tmp_path)
    assert len(refused) == 1  # asked once, then the reads go through the file
    assert_states_equal(module, reference)
    assert_same_optimizer_state(trainer, reference_trainer)


@pytest.mark.parametrize("frozen", [False, True], ids=["full", "frozen-base"])
@pytest.mark.parametrize("fused", [False, True], ids=["transparent", "fused"])
@pytest.mark.parametrize("async_step", [False, True], ids=["sync", "async"])
def test_masters_in_files_train_bitwise_as_in_memory(tmp_path, fused, async_step, frozen):
    """bf16-mixed: the Linear weights travel as bf16 copies, so their fp32 masters can live in the files too."""
    offload_dir = tmp_path / "state"
    kwargs = {"fused": fused, "async_step": async_step, "precision": "bf16-mixed", "frozen": frozen}
    module, trainer = _fit(offload_dir, tmp_path, offload="optimizer+masters", **kwargs)
    reference, reference_trainer = _fit(None, tmp_path, **kwargs)
    assert_states_equal(module, reference)
    assert_same_optimizer_state(trainer, reference_trainer)
    mappings = _file_mappings(offload_dir)
    in_files = {name for name, param in module.named_parameters() if _in_files(param, mappings)}
    # the Linear weights of at least a page (the head's 64 x 3 is 768 B); biases, a page at most, stay
    assert in_files == {f"net.{index}.weight" for index in (0, 2, 4, 6)}
    assert os.listdir(offload_dir) == []


def test_masters_in_files_need_a_low_precision_transport(tmp_path):
    with pytest.raises(OptionError, match="^`offload` 'optimizer\\+masters' keeps on disk the masters that devices upload"):
        _fit(tmp_path / "state", tmp_path, offload="optimizer+masters")


TIERS = {"memory": (False, "none"), "state": (True, "optimizer"), "masters": (True, "optimizer+masters")}


@pytest.mark.parametrize("first, then", [("memory", "state"), ("state", "memory"), ("memory", "masters"),
                                         ("masters", "memory")])
def test_a_checkpoint_resumes_into_another_tier_bitwise(tmp_path, first, then):
    def fit(tier: str, **kwargs):
        on_disk, offload = TIERS[tier]
        return _fit(tmp_path / "state" if on_disk else None, tmp_path, offload=offload, precision="bf16-mixed",
                    **kwargs)

    _, trainer = fit(first, epochs=1)
    checkpoint = tmp_path / "epoch0.ckpt"
    trainer.save_checkpoint(checkpoint)
    plain = torch.load(checkpoint, weights_only=False)
    assert all(type(value) is torch.Tensor for entry in plain["optimizer_states"][0]["state"].values()
               for value in entry.values() if isinstance(value, torch.Tensor))  # a plain checkpoint, any tier
    resumed, resumed_trainer = fit(then, ckpt_path=checkpoint)
    reference, reference_trainer = fit("memory")
    assert_states_equal(resumed, reference)
    assert_same_optimizer_state(resumed_trainer, reference_trainer)


class _Sampler:
    """The largest ``resident()`` seen, sampled on a thread of its own until stopped."""

    def __init__(self, resident) -> None:
        self.peak = 0
        self._resident = resident
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.0005):
            self.peak = max(self.peak, self._resident())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


@pytest.mark.parametrize("async_step", [False, True], ids=["sync", "async"])
def test_the_state_in_memory_follows_the_groups_in_flight_not_the_model(tmp_path, async_step):
    """16 layers in 8 forward stages: the state in memory never exceeds the groups read ahead, the one stepping
    and the writes queued, however slow the disk (they hold the step back): a fraction of 16 layers' state."""
    torch.manual_seed(0)
    width = 128  # 64 KiB weights: 128 KiB of AdamW state each
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(16)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    options = EngineOptions(num_microbatches=2, num_stages=8, async_step=async_step, offload="optimizer",
                            offload_dir=str(tmp_path), jitter=0.0005, freeze_plan=True)
    generator = torch.Generator().manual_seed(1)
    with RoundPipeEngine(model, devices=2, options=options) as engine:
        disk = engine.stepping.disk
        assert disk is not None
        sampler = _Sampler(disk.resident_bytes)
        for _ in range(4):
            x = torch.randn(8, width, generator=generator)
            engine.forward_backward(x, x, F.mse_loss)
            engine.step(optimizer)
        engine.synchronize()
        peak = sampler.stop()
        layer_state = 2 * width * width * 4
        widest = max(len(stage) for stage in (*engine.plan.backward, engine.plan.fused))  # layers a group steps
        bound = (READ_AHEAD + 1 + QUEUED_WRITES) * widest * layer_state
        assert disk.state_bytes() == 16 * layer_state  # the biases' state (512 B each) stays in memory
        assert 0 < peak <= bound < disk.state_bytes(), (peak, bound)
        disk.drop_all(wait=True)
        assert disk.resident_bytes() == 0


def test_a_full_disk_stops_the_run_with_one_clear_error_and_the_checkpoint_stays_loadable(tmp_path, monkeypatch,
                                                                                           roundpipe_threads):
    offload_dir = tmp_path / "state"
    _, trainer = _fit(offload_dir, tmp_path, epochs=1)
    checkpoint = tmp_path / "epoch0.ckpt"
    trainer.save_checkpoint(checkpoint)
    before = checkpoint.read_bytes()

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    attempts = [  # a new run's first step, a resume that moves the loaded state, masters moved at setup
        ({}, "optimizer state"), ({"ckpt_path": checkpoint}, "optimizer state"),
        ({"offload": "optimizer+masters", "precision": "bf16-mixed"}, "master weights")]
    for kwargs, what in attempts:
        with pytest.raises(OffloadError) as caught:
            _fit(offload_dir, tmp_path, **kwargs)
        message = str(caught.value)
        assert f"offload_dir {str(offload_dir)!r} has no room for" in message and f"of {what}" in message
        assert "free space there or set offload_dir to a larger disk" in message
        assert isinstance(caught.value, PipelineError)
        assert roundpipe_threads() == []  # the engine closed, its disk thread too
    monkeypatch.undo()
    assert checkpoint.read_bytes() == before
    resumed, _ = _fit(offload_dir, tmp_path, ckpt_path=checkpoint)
    reference, _ = _fit(None, tmp_path)
    assert_states_equal(resumed, reference)


CRASHING_RUN = """
import os
import pathlib
import sys

sys.path.insert(0, {repo!r})
import lightning.pytorch as pl

import tests.test_disk_tier as helpers
from lightning_roundpipe.engine.step.disk_tier import DiskTier

adopt = DiskTier.adopt
armed = []


def adopt_then_die(self, optimizer, params):
    adopt(self, optimizer, params)
    if armed:  # the first group of step 5 has stepped, the others have not: the process dies mid-step
        os._exit(17)


class SaveThenArm(pl.Callback):
    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.global_step == 3:
            trainer.save_checkpoint({checkpoint!r})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 4:
            armed.append(True)


DiskTier.adopt = adopt_then_die
helpers._fit(pathlib.Path({offload_dir!r}), pathlib.Path({root!r}), offload="optimizer+masters",
             precision="bf16-mixed", callbacks=[SaveThenArm()])
"""


def test_a_crash_mid_step_then_a_resume_gives_the_uninterrupted_weights(tmp_path):
    """State and masters in files; the process dies in step 5 with some groups stepped (their files written into),
    after a checkpoint at step 3."""
    offload_dir, checkpoint = tmp_path / "state", tmp_path / "epoch0.ckpt"
    script = CRASHING_RUN.format(repo=str(REPO), checkpoint=str(checkpoint), offload_dir=str(offload_dir),
                                 root=str(tmp_path))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                            cwd=tmp_path)
    assert result.returncode == 17, result.stderr[-3000:]
    assert checkpoint.is_file()
    assert os.listdir(offload_dir) == []  # nothing a resume could mistake for state
    resumed, _ = _fit(offload_dir, tmp_path, ckpt_path=checkpoint, offload="optimizer+masters", precision="bf16-mixed")
    reference, _ = _fit(None, tmp_path, precision="bf16-mixed")
    assert_states_equal(resumed, reference)


def test_the_pre_flight_plan_puts_the_state_on_disk_and_refuses_a_disk_too_small(tmp_path, monkeypatch):
    """12 layers, a stage each: the groups in flight are part of the state only."""
    offload_dir = tmp_path / "state"
    plans = {}
    for tier in ("memory", "state", "masters"):
        on_disk, offload = TIERS[tier]
        _, trainer = _fit(offload_dir if on_disk else None, tmp_path, offload=offload, precision="bf16-mixed",
                          epochs=1, layers=12, num_stages=12)
        plans[tier] = trainer.strategy.memory_plan
    module = Wide(layers=12)
    # AdamW: two buffers the size of each parameter, and a float32 step count each
    whole_state = sum(2 * param.nbytes + 4 for param in module.parameters())
    large_weights = sum(module.net[index].weight.nbytes for index in range(0, 24, 2))  # at least a page each
    assert plans["memory"].optimizer_state_bytes == whole_state and plans["memory"].disk_state_bytes == 0
    for tier in ("state", "masters"):
        plan = plans[tier]
        assert plan.disk_state_bytes == whole_state and plan.optimizer_state_bytes < whole_state
        assert "disk tier" in plan.table() and str(offload_dir) in plan.table()
    assert plans["state"].disk_master_bytes == 0
    assert plans["masters"].disk_master_bytes == large_weights  # the biases and the 64 x 3 head: under a page
    count = sum(param.numel() for param in module.parameters())
    (row,) = [row for row in plans["masters"].rows() if row[0] == "per parameter"]
    assert f"disk: optimizer state {whole_state / count:.2f}, masters {large_weights / count:.2f}" in row[2]
    monkeypatch.setattr(preflight, "free_bytes", lambda directory: 1000)
    with pytest.raises(DiskSpaceError, match=f"offload='optimizer' keeps .* in files in {offload_dir}.*which has "
                                             "1000 B free: free space there or set offload_dir to a larger disk"):
        _fit(offload_dir, tmp_path, epochs=1)


def test_a_plan_that_does_not_fit_in_memory_names_the_disk_tier_and_what_it_saves():
    """16 layers in 15 forward stages, AdamW, bf16 transport: the refusal names offload='optimizer' (the state
    less the groups in flight) and 'optimizer+masters' (also the 16 fp32 weights), each with its cost per step."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(128, 128) for _ in range(16)])
    trunk = build_trunk(model)
    engine = RoundPipeEngine(trunk, 2, EngineOptions(num_stages=15, transport_dtype="bfloat16"))  # plans only
    optimizer = torch.optim.AdamW(model.parameters())
    whole = sum(2 * param.nbytes + 4 for param in model.parameters())  # two buffers and a step count each
    widest = max(len(stage) for stage in (engine.plan.fused, *engine.plan.backward))
    in_flight = min(whole, (READ_AHEAD + 1 + QUEUED_WRITES) * whole * widest // 16)  # 16 equal layers
    masters = 16 * 128 * 128 * 4  # the weights (64 KiB each); the biases are under a page
    fits = preflight.plan_memory(model, trunk, engine.plan, [optimizer], devices=engine.torch_devices,
                                 transport=torch.bfloat16, limits=HostLimits(mem_available=2**40))
    tight = HostLimits(mem_available=fits.new_bytes - (whole - in_flight) // 2)  # short by half what it saves
    plan = preflight.plan_memory(model, trunk, engine.plan, [optimizer], devices=engine.torch_devices,
                                 transport=torch.bfloat16, limits=tight, host_optimizer="exact")
    message = "\n".join(problem.message for problem in plan.problems)
    # the bandwidth that moves a step's bytes within the host step measured at setup (measured though it does not
    # fit: on a scratch what is available now allows)
    (figure,) = plan.host_steps
    assert figure.params == sum(param.numel() for param in model.parameters()) and figure.step_seconds > 0
    assert (f"{format_bytes(whole)} read and written there per step ({format_bytes(int(whole / figure.step_seconds))}"
            f"/s each way keeps pace with the host step measured at setup") in message
    assert (f"offload='optimizer' with offload_dir on a local disk: about {format_bytes(whole - in_flight)} less in "
            f"each process (enough), for {format_bytes(whole)} read and written there per step") in message
    assert (f"offload='optimizer+masters' with offload_dir on a local disk: about "
            f"{format_bytes(whole - in_flight + masters)} less in each process (enough), for "
            f"{format_bytes(whole + masters)} read and written") in message


@pytest.mark.parametrize("offload", ["optimizer", "optimizer+masters"])
def test_the_pipeline_metrics_count_the_disk_tiers_bytes_per_step(tmp_path, offload):
    """Four 64 x 64 layers (16 KiB weights, a whole number of pages; the biases' state is under a page and stays in
    memory): the first step makes AdamW's state and writes it (2 x 16 KiB per layer), each later step reads and writes
    it once, and with the masters the weights too (another 16 KiB per layer), as counted by hand here."""
    torch.manual_seed(0)
    width, depth = 64, 4
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    options = EngineOptions(num_microbatches=2, num_stages=2, offload=offload, offload_dir=str(tmp_path),
                            freeze_plan=True, transport_dtype="bfloat16")
    weight = width * width * 4
    state, masters = depth * 2 * weight, depth * weight if offload == "optimizer+masters" else 0
    generator = torch.Generator().manual_seed(1)
    with RoundPipeEngine(model, devices=2, options=options) as engine, torch.autocast("cpu", torch.bfloat16):
        disk = engine.stepping.disk
        disk.wait_for_writes()  # the masters moved into files at start
        engine.pipeline_metrics()  # from here on
        figures = []
        for _ in range(3):
            x = torch.randn(8, width, generator=generator)
            engine.forward_backward(x, x, F.mse_loss)
            engine.step(optimizer)
            engine.synchronize()
            disk.wait_for_writes()  # each group's, written behind it
            figures.append(engine.pipeline_metrics())
    assert [(f["disk_read_bytes"], f["disk_written_bytes"]) for f in figures] == [
        (masters, state + masters), (state + masters, state + masters), (state + masters, state + masters)]
    assert all(f["disk_wait_seconds"] >= 0 and f["disk_bandwidth_to_hide"] > 0 for f in figures)
