"""Seeing the pipeline: Chrome traces and Gantt charts of recorded timelines and simulated schedules."""

from __future__ import annotations

import itertools
import json
import logging
import subprocess
import sys

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_roundpipe.engine.engine import RoundPipeEngine
from lightning_roundpipe.engine.options import EngineOptions
from lightning_roundpipe.observe.gantt import draw_schedule, draw_timeline
from lightning_roundpipe.observe.gantt import main as gantt_main
from lightning_roundpipe.observe.trace import STREAMS, Timeline, chrome_trace, load_chrome_trace, to_chrome_trace
from lightning_roundpipe.planning import cli as planning_cli
from lightning_roundpipe.planning.partition import LayerCost, Plan
from lightning_roundpipe.planning.simulate import simulate_roundpipe
from lightning_roundpipe.strategy import RoundPipeStrategy
from tests.models import gpt_batch, gpt_loss, tiny_gpt

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
DEVICES = 3


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE), f"{path} is not a PNG"
    from matplotlib.image import imread

    height, width = imread(str(path)).shape[:2]
    assert width > 200 and height > 100, (width, height)
    return width, height


@pytest.fixture(scope="module")
def recorded():
    """Two training steps of a real engine on three CPU devices, timeline on."""
    model = tiny_gpt(blocks=4)
    options = EngineOptions(num_microbatches=4, num_stages=3, record_timeline=True, freeze_plan=True)
    with RoundPipeEngine(model, DEVICES, options) as engine:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(2):
            ids, target = gpt_batch(8, seed=step)
            engine.forward_backward(ids, target, gpt_loss)
            engine.step(optimizer)
        engine.synchronize()
        return engine.events()


def _tracks(trace: dict) -> dict[int, str]:
    return {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}


# ---------------------------------------------------------------------------- Chrome trace
def test_chrome_trace_of_a_real_run(recorded, tmp_path):
    path = tmp_path / "timeline.json"
    to_chrome_trace(recorded, path)
    trace = json.loads(path.read_text())
    names = _tracks(trace)
    expected = {f"device {d} · {stream}" for d in range(DEVICES) for stream in STREAMS} | {"host optimizer"}
    assert set(names.values()) == expected
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == len(recorded)
    assert all(e["pid"] == 0 and e["ts"] >= 0 and e["dur"] >= 0 for e in complete)
    stamps = [e["ts"] for e in trace["traceEvents"]]
    assert stamps == sorted(stamps)  # metadata first (ts 0), then in time order
    # every track is one serial stream (or the optimizer thread): its operations never overlap
    by_track: dict[int, list[dict]] = {}
    for e in complete:
        by_track.setdefault(e["tid"], []).append(e)
    for tid, events in by_track.items():
        for before, after in itertools.pairwise(events):
            assert after["ts"] >= before["ts"] + before["dur"] - 1e-2, (names[tid], before["name"], after["name"])
    # compute tracks hold compute kinds only, on their own device
    for e in complete:
        track = names[e["tid"]]
        if track.endswith("compute"):
            assert e["cat"] in ("forward", "fused", "recompute", "backward") and track == f"device {e['args']['device']} · compute"
    kinds = {e["cat"] for e in complete}
    assert {"forward", "fused", "backward", "upload_params", "upload_acts", "download", "release",
            "optimizer"} <= kinds
    assert any(e["name"] == "F0 mb1" and e["args"] == {"device": 0, "job": 0, "label": "F0", "microbatch": 1,
                                                        "kind": "forward"} for e in complete)
    # a step cut by stage shows once per part ("step 1 [2-3]")
    assert {"step 1", "step 2"} <= {e["name"].split(" [")[0] for e in complete if e["cat"] == "optimizer"}
    assert "F0 params" in {e["name"] for e in complete}
    # what an event has not (the host's device and job, a whole job's microbatch) is -1 in the file
    host = [e["args"] for e in complete if e["cat"] == "optimizer"]
    assert host and all(args["device"] == args["job"] == args["microbatch"] == -1 for args in host)
    assert all(e["args"]["microbatch"] == -1 and e["args"]["device"] >= 0 for e in complete if e["cat"] == "release")
    idle = trace["otherData"]["compute_idle_share"]
    assert set(idle) == {f"device {d} · compute" for d in range(DEVICES)} and all(0 <= v < 1 for v in idle.values())
    # read back: the same operations, times relative to the first one
    loaded = load_chrome_trace(path)
    assert [(e.device, e.job, e.label, e.microbatch, e.kind) for e in loaded] == \
        [(e.device, e.job, e.label, e.microbatch, e.kind) for e in sorted(recorded, key=lambda e: e.start)]
    assert loaded[0].start == 0.0
    assert all(e.device is None and e.job is None and e.microbatch is None for e in loaded if e.kind == "optimizer")


def test_chrome_trace_to_an_open_file_lists_idle_devices_and_unknown_kinds(tmp_path):
    timeline = Timeline(True)
    start = timeline.now()
    timeline.add("forward", "F0", start, device=0, job=0, microbatch=0)
    timeline.add("prefetch_hint", "F0", start, device=0, job=0)
    timeline.add("allreduce", "average step 1 [0-1]", start)  # on the host
    with open(tmp_path / "t.json", "w") as file:
        to_chrome_trace(timeline.events(), file, process_name="demo", num_devices=2)
    trace = json.loads((tmp_path / "t.json").read_text())
    names = set(_tracks(trace).values())
    assert {"device 1 · compute", "device 0 · prefetch_hint", "host optimizer", "communication"} <= names
    communication = next(e for e in trace["traceEvents"] if e.get("cat") == "allreduce")
    assert _tracks(trace)[communication["tid"]] == "communication" and communication["name"] == "average step 1 [0-1]"
    assert trace["traceEvents"][0]["args"] == {"name": "demo"}
    empty = chrome_trace([])
    assert set(_tracks(empty).values()) == {"host optimizer"}


# ---------------------------------------------------------------------------- recording
def test_a_disabled_timeline_records_nothing():
    timeline = Timeline(False, keep_steps=1)
    timeline.add("forward", "F0", 0.0, device=0, job=0, microbatch=0)
    timeline.mark_step()
    assert timeline.events() == []


def test_the_timeline_keeps_the_last_steps_and_at_most_max_events():
    timeline = Timeline(True, keep_steps=2)
    for step in range(5):
        timeline.add("forward", f"F{step}", timeline.now(), device=0, job=step, microbatch=0)
        timeline.mark_step()
    timeline.add("forward", "F5", timeline.now(), device=0, job=5, microbatch=0)  # after the last step: kept
    assert [e.label for e in timeline.events()] == ["F3", "F4", "F5"]
    capped = Timeline(True, max_events=3)
    for job in range(5):
        capped.add("forward", f"F{job}", capped.now(), device=0, job=job, microbatch=0)
    assert [e.label for e in capped.events()] == ["F2", "F3", "F4"]
    with pytest.raises(ValueError, match="keep_steps"):
        Timeline(True, keep_steps=0)


# ---------------------------------------------------------------------------- pictures
def test_draw_timeline_of_a_real_run(recorded, tmp_path):
    draw_timeline(recorded, tmp_path / "timeline.png")
    _png_size(tmp_path / "timeline.png")


def test_draw_schedule_of_a_simulation(tmp_path):
    plan = Plan.from_sizes([2, 2], 1, [1, 1, 1, 1])
    result = simulate_roundpipe(plan, [LayerCost(1.0, 2.0)] * 5, 2, 3, iterations=2)
    draw_schedule(result, tmp_path / "schedule.png", unit="ms")
    draw_schedule(result.events, tmp_path / "events.png", title="events only")
    assert _png_size(tmp_path / "schedule.png")[0] > 0 and _png_size(tmp_path / "events.png")[0] > 0


def test_drawing_without_matplotlib_says_what_to_install(recorded, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    with pytest.raises(ImportError, match=r"pip install 'lightning_roundpipe\[plot\]'"):
        draw_timeline(recorded, tmp_path / "timeline.png")
    assert not (tmp_path / "timeline.png").exists()


# ---------------------------------------------------------------------------- command line
def test_gantt_schedule_command_writes_a_png(tmp_path):
    # One real `python -m` run; it imports neither torch nor matplotlib until it draws.
    out = tmp_path / "schedule.png"
    done = subprocess.run(
        [sys.executable, "-m", "lightning_roundpipe.observe.gantt", "schedule", "--layers", "8", "--devices", "3",
         "--microbatches", "4", "--png", str(out)],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert done.returncode == 0, done.stderr
    assert f"wrote {out}" in done.stdout
    _png_size(out)


def test_gantt_draws_the_papers_schedule_and_a_trace_file(recorded, tmp_path, capsys):
    out = tmp_path / "paper.png"
    assert gantt_main(["schedule", "--paper", "Qwen3-1.7B", "--simulator", "paper", "--png", str(out)]) == 0
    assert "makespan 2,286.02 ms, bubble 19.1%" in capsys.readouterr().out  # the paper's figure
    _png_size(out)
    to_chrome_trace(recorded, tmp_path / "timeline.json")
    assert gantt_main(["trace", str(tmp_path / "timeline.json"), "--png", str(tmp_path / "trace.png")]) == 0
    _png_size(tmp_path / "trace.png")
    with pytest.raises(SystemExit):
        gantt_main(["schedule", "--paper", "GPT-5", "--png", str(out)])
    assert "is not one of Qwen3-1.7B" in capsys.readouterr().err


def test_the_schedule_command_points_to_the_drawing_command(capsys):
    with pytest.raises(SystemExit) as error:
        planning_cli.main(["--layers", "6", "--devices", "2", "--png", "out.png"])
    assert error.value.code == 2
    assert "python -m lightning_roundpipe.observe.gantt schedule" in capsys.readouterr().err


# ---------------------------------------------------------------------------- strategy
class _Tiny(pl.LightningModule):
    def __init__(self, fail_at: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
        self.fail_at = fail_at

    def training_step(self, batch, batch_idx):
        if batch_idx == self.fail_at:
            raise RuntimeError("data went bad")
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(module: pl.LightningModule, strategy: RoundPipeStrategy) -> None:
    generator = torch.Generator().manual_seed(1)
    data = DataLoader(TensorDataset(torch.randn(40, 6, generator=generator), torch.randint(0, 3, (40,), generator=generator)),
                      batch_size=8)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, data)


def test_the_strategy_writes_the_last_steps_timeline(tmp_path, roundpipe_threads):
    strategy = RoundPipeStrategy(num_microbatches=2, timeline_dir=tmp_path / "trace", timeline_steps=2,
                                 freeze_plan=True)
    _fit(_Tiny(), strategy)
    assert roundpipe_threads() == []
    assert strategy.timeline_files == [str(tmp_path / "trace" / "timeline.json"), str(tmp_path / "trace" / "timeline.png")]
    trace = json.loads((tmp_path / "trace" / "timeline.json").read_text())
    steps = {e["name"].split(" [")[0] for e in trace["traceEvents"] if e.get("cat") == "optimizer"}
    # 5 batches, the last 2 steps kept, with step 3's host update that ran while step 4 started
    assert steps == {"step 3", "step 4", "step 5"}
    jobs = {e["args"]["job"] for e in trace["traceEvents"] if e.get("cat") == "forward"}
    assert min(jobs) >= 3 * strategy.engine.plan.num_stages  # nothing of steps 1 to 3's computation
    assert {"device 0 · compute", "device 1 · compute", "host optimizer"} <= set(_tracks(trace).values())
    _png_size(tmp_path / "trace" / "timeline.png")


def test_after_an_exception_the_timeline_is_written_without_masking_it(tmp_path, monkeypatch, caplog,
                                                                       roundpipe_threads):
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)  # no matplotlib: trace only
    strategy = RoundPipeStrategy(num_microbatches=2, timeline_dir=tmp_path)
    with caplog.at_level(logging.WARNING, logger="lightning_roundpipe"):
        with pytest.raises(RuntimeError, match="data went bad"):
            _fit(_Tiny(fail_at=2), strategy)
    assert roundpipe_threads() == []
    assert (tmp_path / "timeline.json").exists() and not (tmp_path / "timeline.png").exists()
    assert "pip install 'lightning_roundpipe[plot]'" in caplog.text
    assert strategy.timeline_files == [str(tmp_path / "timeline.json")]


def test_timeline_options():
    assert RoundPipeStrategy().engine_options.record_timeline is False
    assert RoundPipeStrategy(timeline=True).engine_options.record_timeline is True
    with pytest.raises(ValueError, match="timeline_steps"):
        RoundPipeStrategy(timeline_dir="x", timeline_steps=0)


# ---------------------------------------------------------------------------- Hydra
def test_the_hydra_switch_writes_the_timeline_into_the_runs_folder(tmp_path, capsys):
    from hydra import compose, initialize_config_dir

    from lightning_roundpipe.app.schema import ConfigError, validate
    from lightning_roundpipe.app.train import CONFIG_DIR, run

    overrides = ["strategy.timeline=true", "trainer.fast_dev_run=true", "trainer.enable_progress_bar=false",
                 "sample_tokens=4", "data.limit_bytes=200000", "data.val_windows=4"]
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
        bad = compose(config_name="config", overrides=["strategy=roundpipe_async", "strategy.timeline_steps=0"])
    with pytest.raises(ConfigError, match="strategy.timeline_steps"):
        validate(bad)
    summary = run(cfg, tmp_path)
    assert summary.timeline_files == [str(tmp_path / "timeline.json"), str(tmp_path / "timeline.png")]
    assert json.loads((tmp_path / "timeline.json").read_text())["traceEvents"]
    _png_size(tmp_path / "timeline.png")
    assert f"timeline        {tmp_path / 'timeline.json'}, {tmp_path / 'timeline.png'}" in capsys.readouterr().out
