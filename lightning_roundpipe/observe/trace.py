"""Timeline recording: what ran where and when, as events, Chrome traces (Perfetto) and pictures.

:class:`Timeline` collects :class:`TimelineEvent` s from the engine's threads (``record_timeline``);
:func:`to_chrome_trace` writes them in the Chrome trace event format, which https://ui.perfetto.dev
and ``chrome://tracing`` open; :func:`load_chrome_trace` reads such a file back (to draw it later
with :func:`lightning_roundpipe.observe.gantt.draw_timeline`); :func:`write_timeline` writes both the
trace and the picture into a folder. Standard library only (matplotlib for pictures, imported then).

Kinds of events, and the stream of their device that runs them (each stream runs one operation at
a time, so events of one track never overlap)::

    upload_params                 parameter uploads     (device d, "params upload")
    upload_acts                   activation uploads    (device d, "activations upload")
    forward, fused, backward      compute               (device d, "compute")
    download, release             downloads, gradients  (device d, "download")
    optimizer                     the host optimizer step (on the host: no device, "host optimizer")

Compute events are device time (``engine/timing.py``): on a GPU the span the GPU ran the microbatch, measured
with CUDA events and placed on the host clock, added once the job has finished; other events are the host
thread's span of the operation (uploads and downloads include their wait for the copy to complete).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import IO, Any

log = logging.getLogger(__name__)

COMPUTE_KINDS = ("forward", "fused", "recompute", "backward")
"""Event kinds that occupy a device's compute stream (``recompute``: a backward stage's recompute, which runs
ahead of its output gradient)."""

STREAMS = ("compute", "params upload", "activations upload", "download")
"""A device's tracks in a Chrome trace, in display order."""

_STREAM_OF_KIND = {
    "forward": "compute", "fused": "compute", "recompute": "compute", "backward": "compute",
    "upload_params": "params upload", "upload_acts": "activations upload",
    "download": "download", "release": "download",
}
HOST_OPTIMIZER = "host optimizer"
"""The track of the host's optimizer steps (events without a device)."""
COMMUNICATION = "communication"
"""The host track of the data-parallel collectives: events of kind ``allreduce`` (the step's gradients averaged
across processes) and ``broadcast`` (a sharded optimizer's updated weights sent by their owners)."""
COMMUNICATION_KINDS = frozenset({"allreduce", "broadcast"})


@dataclass(frozen=True, kw_only=True)
class TimelineEvent:
    """One operation of ``kind``, named ``label`` (a job's label, ``"step 4"``), from ``start`` to ``end``
    (seconds since the timeline's origin): on ``device`` (``None``: on the host), for ``job`` (its ring index;
    ``None``: no job, a host event), for ``microbatch`` (``None``: the whole job, a parameter upload or a
    release, or a host event)."""

    kind: str
    label: str
    start: float
    end: float
    device: int | None = None
    job: int | None = None
    microbatch: int | None = None


def stream_of(kind: str) -> str:
    """The device stream (track) that runs events of ``kind``: one of :data:`STREAMS`, or the kind itself
    for a kind this module does not know."""
    return _STREAM_OF_KIND.get(kind, kind)


def event_name(event: TimelineEvent) -> str:
    """``"F3 mb1"`` for a microbatch's operation, ``"F3 params"`` / ``"F3 release"`` for a job's, and
    the label itself (``"step 4"``, ``"average step 4 [0-1]"``) for a host event."""
    if event.device is None or event.kind == "optimizer":
        return event.label
    if event.microbatch is not None:
        return f"{event.label} mb{event.microbatch}"
    return f"{event.label} {'params' if event.kind == 'upload_params' else event.kind}"


class Timeline:
    """Collects events from many threads. When disabled, ``add`` and ``mark_step`` are no-ops costing
    one branch.

    Memory stays bounded when asked: with ``keep_steps=K``, :meth:`mark_step` (called once per optimizer
    step) drops the events that ended before the K-th last mark, so the timeline holds the last K steps
    (and whatever ran since the last mark); ``max_events`` caps the count whatever happens (the oldest go
    first). Both default to ``None``: keep everything."""

    def __init__(self, enabled: bool, *, keep_steps: int | None = None, max_events: int | None = None) -> None:
        self.enabled = enabled
        self.keep_steps: int | None = None
        self._events: deque[TimelineEvent] = deque()
        self._marks: deque[float] = deque()
        self._lock = threading.Lock()
        self._origin = time.perf_counter()
        self.bound(keep_steps=keep_steps, max_events=max_events)

    def bound(self, *, keep_steps: int | None, max_events: int | None) -> None:
        """Change the memory bounds (see the class docstring) of a running timeline."""
        if keep_steps is not None and keep_steps < 1:
            raise ValueError(f"`keep_steps` must be >= 1 or None, got {keep_steps}")
        if max_events is not None and max_events < 1:
            raise ValueError(f"`max_events` must be >= 1 or None, got {max_events}")
        with self._lock:
            self.keep_steps = keep_steps
            self._events = deque(self._events, maxlen=max_events)

    def now(self) -> float:
        return time.perf_counter() - self._origin

    def add(self, kind: str, label: str, start: float, *, device: int | None = None, job: int | None = None,
            microbatch: int | None = None) -> None:
        """An operation from ``start`` (:meth:`now` when it began) until now (see :class:`TimelineEvent`)."""
        if self.enabled:
            event = TimelineEvent(kind=kind, label=label, start=start, end=self.now(), device=device, job=job,
                                  microbatch=microbatch)
            with self._lock:
                self._events.append(event)

    def add_span(self, kind: str, label: str, start: float, end: float, *, device: int | None = None,
                 job: int | None = None, microbatch: int | None = None) -> None:
        """An event measured elsewhere and added later (a device-time span, ``engine/timing.py``): ``start``
        and ``end`` on the host clock, ``time.perf_counter()`` seconds."""
        if self.enabled:
            event = TimelineEvent(kind=kind, label=label, start=start - self._origin, end=end - self._origin,
                                  device=device, job=job, microbatch=microbatch)
            with self._lock:
                self._events.append(event)

    def mark_step(self) -> None:
        """An optimizer step was queued: with ``keep_steps`` set, forget what ended before the window."""
        if self.enabled and self.keep_steps is not None:
            now = self.now()
            with self._lock:
                self._marks.append(now)
                keep = self.keep_steps
                while len(self._marks) > keep + 1:
                    self._marks.popleft()
                if len(self._marks) == keep + 1:
                    cutoff = self._marks[0]
                    # events arrive in (nearly) end order: trimming from the left is enough
                    while self._events and self._events[0].end < cutoff:
                        self._events.popleft()

    def events(self) -> list[TimelineEvent]:
        with self._lock:
            return sorted(self._events, key=lambda event: event.start)


# ---------------------------------------------------------------------------- Chrome trace format
def _tracks(events: Sequence[TimelineEvent], num_devices: int | None) -> dict[tuple[int | None, str], int]:
    """``(device, stream) -> tid`` for every device (all of ``range(num_devices)`` if given), every
    stream of :data:`STREAMS`, any unknown kinds' tracks, and the host's (device ``None``): the host
    optimizer (tid 0, last), and the communication track if there are such events."""
    devices = {e.device for e in events if e.device is not None}
    if num_devices is not None:
        devices |= set(range(num_devices))
    extra = sorted({stream_of(e.kind) for e in events if e.device is not None} - set(STREAMS))
    tracks: dict[tuple[int | None, str], int] = {}
    for device in sorted(devices):
        for stream in (*STREAMS, *extra):
            tracks[(device, stream)] = len(tracks) + 1
    tracks[(None, HOST_OPTIMIZER)] = 0
    if any(e.device is None and e.kind in COMMUNICATION_KINDS for e in events):
        tracks[(None, COMMUNICATION)] = len(tracks)
    return tracks


def host_stream(kind: str) -> str:
    """The host track of an event of ``kind`` (one without a device)."""
    return COMMUNICATION if kind in COMMUNICATION_KINDS else HOST_OPTIMIZER


def track_name(device: int | None, stream: str) -> str:
    """``"device 0 · compute"``, ``"host optimizer"``, ``"communication"``."""
    return stream if device is None else f"device {device} · {stream}"


_ABSENT = -1
"""How a Chrome trace's ``args`` write an event's ``device``, ``job`` or ``microbatch`` of ``None``."""


def chrome_trace(events: Iterable[TimelineEvent], *, process_name: str = "roundpipe",
                 num_devices: int | None = None) -> dict[str, Any]:
    """The Chrome trace (JSON object format) of ``events``: one ``"X"`` (complete) event per operation,
    ``ts`` and ``dur`` in microseconds from the earliest event, pid 0, one tid (track) per device stream
    and one for the host optimizer, named by ``"M"`` (metadata) events. Idle time shows as gaps;
    ``otherData`` holds each device's compute-idle share of the trace's span."""
    events = sorted(events, key=lambda e: (e.start, e.end))
    origin = events[0].start if events else 0.0
    span = max((e.end for e in events), default=origin) - origin
    tracks = _tracks(events, num_devices)
    trace: list[dict[str, Any]] = [
        {"ph": "M", "pid": 0, "tid": 0, "ts": 0, "name": "process_name", "args": {"name": process_name}}]
    for (device, stream), tid in sorted(tracks.items(), key=lambda item: item[1]):
        trace.append({"ph": "M", "pid": 0, "tid": tid, "ts": 0, "name": "thread_name",
                      "args": {"name": track_name(device, stream)}})
        sort_index = tid if device is not None else len(tracks) + tid  # the host tracks below the devices
        trace.append({"ph": "M", "pid": 0, "tid": tid, "ts": 0, "name": "thread_sort_index",
                      "args": {"sort_index": sort_index}})
    busy: dict[int, float] = {}
    for e in events:
        stream = host_stream(e.kind) if e.device is None else stream_of(e.kind)
        start = round((e.start - origin) * 1e6, 3)
        end = round((e.end - origin) * 1e6, 3)
        trace.append({
            "ph": "X", "pid": 0, "tid": tracks[(e.device, stream)],
            "ts": start, "dur": max(0.0, round(end - start, 3)), "name": event_name(e), "cat": e.kind,
            "args": {"device": _written(e.device), "job": _written(e.job), "label": e.label,
                     "microbatch": _written(e.microbatch), "kind": e.kind},
        })
        if e.kind in COMPUTE_KINDS and e.device is not None:
            busy[e.device] = busy.get(e.device, 0.0) + (e.end - e.start)
    idle = {track_name(d, "compute"): round(1.0 - busy.get(d, 0.0) / span, 4) if span > 0 else 0.0
            for d, _ in sorted((d, s) for d, s in tracks if d is not None and s == "compute")}
    return {
        "traceEvents": trace,
        "displayTimeUnit": "ms",
        "otherData": {
            "producer": "lightning_roundpipe",
            "origin_seconds": origin,
            "span_ms": round(span * 1e3, 3),
            "compute_idle_share": idle,
        },
    }


def to_chrome_trace(events: Iterable[TimelineEvent], path_or_file: str | os.PathLike[str] | IO[str], *,
                    process_name: str = "roundpipe", num_devices: int | None = None) -> None:
    """Write :func:`chrome_trace` of ``events`` as JSON to a path or an open text file. Open the file at
    https://ui.perfetto.dev (or ``chrome://tracing``): one track per device stream ("device 0 ·
    compute", "device 0 · params upload", ...) and one for the host optimizer; ``num_devices`` also
    lists devices that recorded nothing."""
    data = chrome_trace(events, process_name=process_name, num_devices=num_devices)
    if hasattr(path_or_file, "write"):
        json.dump(data, path_or_file)  # type: ignore[arg-type]
        return
    with open(path_or_file, "w", encoding="utf-8") as file:
        json.dump(data, file)


def write_timeline(events: Sequence[TimelineEvent], folder: str | os.PathLike[str], num_devices: int, *,
                   name: str = "timeline") -> list[str]:
    """Write ``<name>.json`` (:func:`to_chrome_trace`) and ``<name>.png`` (a Gantt chart) into ``folder``,
    creating it; returns the paths written. Without matplotlib the picture is skipped with a warning that
    says what to install; any other error propagates."""
    folder = os.fspath(folder)
    os.makedirs(folder, exist_ok=True)
    written = [os.path.join(folder, f"{name}.json")]
    to_chrome_trace(events, written[0], num_devices=num_devices)
    try:
        from lightning_roundpipe.observe.gantt import draw_timeline  # matplotlib, only when a picture is wanted

        draw_timeline(events, os.path.join(folder, f"{name}.png"), num_devices=num_devices)
        written.append(os.path.join(folder, f"{name}.png"))
    except ImportError as error:
        log.warning(f"RoundPipe wrote {written[0]} but no timeline.png: {error}")
    return written


def load_chrome_trace(path_or_file: str | os.PathLike[str] | IO[str]) -> list[TimelineEvent]:
    """The events of a trace written by :func:`to_chrome_trace` (times in seconds from its first event)."""
    if hasattr(path_or_file, "read"):
        data = json.load(path_or_file)  # type: ignore[arg-type]
    else:
        with open(path_or_file, encoding="utf-8") as file:
            data = json.load(file)
    events = []
    for item in data.get("traceEvents", []) if isinstance(data, dict) else data:
        args = item.get("args", {})
        if item.get("ph") != "X" or "kind" not in args:
            continue
        start = item["ts"] / 1e6
        events.append(TimelineEvent(kind=str(args["kind"]), label=str(args["label"]), start=start,
                                    end=start + item.get("dur", 0.0) / 1e6, device=_read(args["device"]),
                                    job=_read(args["job"]), microbatch=_read(args["microbatch"])))
    return sorted(events, key=lambda e: e.start)


def _written(value: int | None) -> int:
    return _ABSENT if value is None else value


def _read(value: Any) -> int | None:
    """A trace's ``args`` value back: ``None`` for :data:`_ABSENT` (or a ``null``)."""
    return None if value is None or int(value) == _ABSENT else int(value)
