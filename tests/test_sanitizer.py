"""Race checks run in every engine thread (``engine/sanitizer.py``), not only on the thread that enabled them.

torch's CUDA sanitizer needs a GPU; on CPU stand-ins the same per-thread entry drives a happens-before checker
(vector clocks over the stream threads). A cross-stream read whose ordering event is waited for on the host only
(on a GPU: no ``cudaStreamWaitEvent``, so the kernel may run before the copy) is reported, naming the stream
thread that read; a correct run, sync or async, in stress mode, reports nothing; with no checker on, the stream
threads run no dispatch mode at all.
"""

from __future__ import annotations

import sys
import time
import types

import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from lightning_roundpipe import EngineOptions, RoundPipeEngine
from lightning_roundpipe.engine import sanitizer
from lightning_roundpipe.engine.device import AbortSignal, HostEvent, Stream
from lightning_roundpipe.engine.sanitizer import HappensBefore
from tests.models import gpt_batch, gpt_loss, tiny_gpt

STREAM_KINDS = ("params", "acts", "compute", "download")


def _train(options: EngineOptions, steps: int = 2) -> None:
    model = tiny_gpt()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with RoundPipeEngine(model, ["cpu", "cpu"], options) as engine:
        for step in range(steps):
            engine.forward_backward(*gpt_batch(8, step), gpt_loss)
            engine.step(optimizer)
        engine.synchronize()


@pytest.mark.parametrize("async_step", [False, True], ids=["sync", "async"])
def test_a_correct_run_reports_no_race_and_checks_every_stream_thread(async_step, roundpipe_threads):
    with HappensBefore() as checker:
        _train(EngineOptions(num_microbatches=2, num_stages=2, async_step=async_step, stress=True, jitter=0.001))
    assert checker.reports == []
    expected = {f"roundpipe-dev{device}-{kind}" for device in (0, 1) for kind in STREAM_KINDS}
    assert expected <= {name for name, count in checker.ops_by_thread.items() if count > 0}
    assert roundpipe_threads() == []


def test_a_read_ordered_on_the_host_only_is_reported_from_the_compute_thread(roundpipe_threads):
    """The injected bug: the compute streams wait for upload events on the host only. On CPU the values are still
    right (the host wait orders them); on a GPU the kernels would not wait for the copies."""
    with HappensBefore() as checker:
        ordered_wait = Stream.wait_event  # the checker's: it sees the other streams' waits

        def host_only(stream: Stream, event: HostEvent | None) -> None:
            if event is None or not stream.name.endswith("compute"):
                ordered_wait(stream, event)
            else:  # HostEvent.wait_until: the host waits; no stream-level ordering
                stream.submit(lambda: event.wait_until(time.monotonic() + 60.0))

        Stream.wait_event = host_only  # type: ignore[method-assign]
        try:
            _train(EngineOptions(num_microbatches=2, num_stages=2), steps=1)
        finally:
            Stream.wait_event = ordered_wait  # type: ignore[method-assign]
    assert checker.reports, "the unordered reads went unreported"
    assert all("thread roundpipe-dev" in report for report in checker.reports)
    uploads = [report for report in checker.reports if report.startswith(
        "possible data race: thread roundpipe-dev0-compute read a tensor")]
    assert any("thread roundpipe-dev0-params written" in report for report in uploads), checker.reports
    assert any("thread roundpipe-dev0-acts written" in report for report in uploads), checker.reports
    assert roundpipe_threads() == []


def _modes_seen_by_a_stream() -> list[object]:
    abort = AbortSignal(timeout=10.0)
    stream = Stream("probe", abort)
    seen: list[object] = []
    stream.submit(lambda: seen.append(_get_current_dispatch_mode()))
    done = stream.record("probed")
    done.wait(abort)
    stream.stop()
    assert stream.join(time.monotonic() + 10.0) is None
    return seen


def test_without_a_checker_a_stream_thread_runs_no_dispatch_mode():
    assert sanitizer.active_checker() is None
    assert _modes_seen_by_a_stream() == [None]


def test_when_the_cuda_sanitizer_is_on_each_stream_thread_forwards_its_operators_to_it(monkeypatch):
    """CSAN itself needs CUDA: a stand-in with its interface (``cuda_sanitizer.enabled`` and ``.dispatch``)
    checks that stream threads hand it their operators, counted per thread."""
    handled: list[str] = []

    class Dispatch:
        def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
            handled.append(str(func))
            return func(*args, **(kwargs or {}))

    fake = types.ModuleType("torch.cuda._sanitizer")
    fake.cuda_sanitizer = types.SimpleNamespace(enabled=True, dispatch=Dispatch())  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch.cuda._sanitizer", fake)
    monkeypatch.setattr(sanitizer, "_cuda_checker", None)
    abort = AbortSignal(timeout=10.0)
    stream = Stream("csan", abort)
    stream.submit(lambda: torch.ones(3).add_(1))
    stream.record("added").wait(abort)
    stream.stop()
    assert stream.join(time.monotonic() + 10.0) is None
    assert "aten.add_.Tensor" in handled
    checker = sanitizer.cuda_sanitizer()
    assert checker is not None and checker.ops_by_thread["roundpipe-csan"] >= 2
