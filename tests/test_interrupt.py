"""Ctrl-C stops the test suite, also when it lands inside ``Trainer.fit`` (see ``tests/conftest.py``)."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
STARTUP_S = 240  # bound on the child's start (imports, the first step): a guard against hanging, on 2 busy cores
STOP_S = 60      # liveness bound for the stop after Ctrl-C (it takes a few seconds); not a timing claim

# a session of two tests: a RoundPipe fit that runs until it is interrupted, then one that would keep the
# session going for minutes if the interrupt only failed the first
CHILD = '''
import pathlib
import time

import lightning.pytorch as pl
import torch
from torch import nn

READY = pathlib.Path({ready!r})


class Waits(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 1))

    def training_step(self, batch, batch_idx):
        READY.touch()
        time.sleep(0.05)
        return self.net(batch).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.zeros(64, 2), batch_size=4)


def test_fit_until_interrupted(tmp_path):
    trainer = pl.Trainer(strategy="roundpipe", accelerator="cpu", devices=2, max_steps=100_000, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=tmp_path)
    trainer.fit(Waits())


def test_after_the_interrupt():
    time.sleep(10 * {stop})
'''


def test_ctrl_c_during_a_fit_stops_the_session(tmp_path):
    ready = tmp_path / "ready"
    (tmp_path / "test_child.py").write_text(CHILD.format(ready=str(ready), stop=STOP_S))
    env = {key: value for key, value in os.environ.items()  # no launcher variables from whatever started pytest
           if key not in ("LOCAL_RANK", "NODE_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    # the suite's conftest as a plugin: the child's file lies outside tests/
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest",
               str(tmp_path / "test_child.py")]
    child = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + STARTUP_S
        while not ready.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ready.exists(), f"the child's fit did not start: {child.poll()=}"
        child.send_signal(signal.SIGINT)
        try:
            output, _ = child.communicate(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"pytest still ran {STOP_S} s after Ctrl-C")
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
    assert child.returncode == pytest.ExitCode.INTERRUPTED, output[-3000:]
    assert "KeyboardInterrupt" in output and "passed" not in output, output[-3000:]
