"""Device time: how long the device ran a stream's operation, not how long the host took to enqueue it.

On a GPU, calling a layer only *enqueues* its kernels, so the host clock around the call measures Python
and launch overhead (and back-pressure from a full launch queue), not the GPU's work. The compute stream's
operations are therefore timed with pairs of CUDA events recorded on that stream around them, and resolved
later, off the critical path: when the job finishes, after its download stream has synchronized, by which
time the events are complete and ``elapsed_time`` returns at once. On a CPU stand-in the stream *is* its
host thread, so the host clock read on that thread around the operation is the device's own span, known
as soon as the operation returns. Both resolve through the same code (``feedback.Measurements.record``),
so the CPU tests run the path a GPU takes.

Spans are on the host clock (``time.perf_counter()``, the clock of the timeline) so a trace can show them
next to host events. A CUDA span is placed there by an anchor: the timer records one event on the stream and
waits for it, before the operation it times, and the host time right after that wait is the anchor's; each
event of the span is the anchor's host time plus its GPU-measured distance from the anchor. The timer renews
its anchor every :data:`ANCHOR_RENEWAL_SECONDS`: ``elapsed_time`` is a float32 of milliseconds, whose step
grows with the distance (0.25 ms an hour from the anchor, 8 ms a day), so a never-renewed anchor would blur
the placement, and the differences between two streams' spans the planner reads, as a run ages; within a
minute of its anchor an event is placed to 2 microseconds (half a float32 step at 60,000 ms). The error is
that rounding, the latency of the anchor's wait (microseconds) and the drift between the GPU's clock and the
host's since the anchor (parts per million). A span's own length, end minus start, is measured between its
two events directly. The waits sleep (blocking events, see ``device.py``): one short stall of the stream's
thread a minute.

:class:`StreamTimer` is what a device's compute stream is timed with (``Device.compute_timer``); tests
replace it with a fake device clock to show that the planner and the metrics read these spans.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch


class Span(Protocol):
    """One operation's stretch on a stream."""

    def bounds(self) -> tuple[float, float]:
        """``(start, end)`` in host-clock seconds (``time.perf_counter()``). Read it once the stream has run the
        operation (a CUDA span waits for its end event first, which costs nothing once the stream has synchronized)."""
        ...


class StreamTimer(Protocol):
    """Times operations on one stream; called only from that stream's own thread."""

    def start(self) -> Any:
        """Mark the start of an operation; the mark goes to :meth:`stop`."""
        ...

    def stop(self, started: Any) -> Span:
        """Mark the end of the operation started at ``started``."""
        ...


@dataclass(frozen=True)
class HostSpan:
    """A span read on the host clock (a CPU stand-in's device time), known when it ends."""

    start: float
    end: float

    def bounds(self) -> tuple[float, float]:
        return self.start, self.end


class HostStreamTimer:
    """CPU stand-ins: the stream's own thread runs the operation, so its host clock is device time."""

    def start(self) -> float:
        return time.perf_counter()

    def stop(self, started: float) -> HostSpan:
        return HostSpan(started, time.perf_counter())


ANCHOR_RENEWAL_SECONDS = 60.0
"""A CUDA timer's anchor is renewed at the first operation this long after it was taken (module docstring)."""


@dataclass(frozen=True)
class _Anchor:
    """An event of the stream, and the host time at which it had completed."""

    event: torch.cuda.Event
    host_time: float


@dataclass(frozen=True)
class CudaSpan:
    """Two timing events on a CUDA stream, placed on the host clock through the anchor taken before them."""

    start: torch.cuda.Event
    end: torch.cuda.Event
    anchor: _Anchor

    def bounds(self) -> tuple[float, float]:
        # a no-op where the engine resolves spans (the job's download stream has synchronized after waiting
        # for its compute on the GPU); elsewhere it makes elapsed_time valid instead of raising "not ready"
        self.end.synchronize()
        begin = self.anchor.host_time + self.anchor.event.elapsed_time(self.start) / 1000.0
        return begin, begin + self.start.elapsed_time(self.end) / 1000.0


class CudaStreamTimer:
    """CUDA devices: timing events recorded on ``stream`` around each operation (see the module docstring).
    ``clock``: the host clock spans are placed on (the timeline's)."""

    def __init__(self, stream: torch.cuda.Stream, clock: Callable[[], float] = time.perf_counter) -> None:
        self._stream = stream
        self._clock = clock
        self._anchor: _Anchor | None = None  # made by start(), on the stream's thread, and renewed there

    def start(self) -> tuple[torch.cuda.Event, _Anchor]:
        anchor = self._anchor
        if anchor is None or self._clock() - anchor.host_time >= ANCHOR_RENEWAL_SECONDS:
            event = self._record()
            event.synchronize()  # the host time at which the stream's GPU clock reading completed
            anchor = self._anchor = _Anchor(event, self._clock())
        return self._record(), anchor

    def stop(self, started: tuple[torch.cuda.Event, _Anchor]) -> CudaSpan:
        start, anchor = started
        return CudaSpan(start, self._record(), anchor)

    def _record(self) -> torch.cuda.Event:
        # timing events; blocking ones, so that the anchor's wait and a span's end.synchronize() sleep
        event = torch.cuda.Event(enable_timing=True, blocking=True)
        event.record(self._stream)
        return event
