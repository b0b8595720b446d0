"""Timeline recording: what ran where and when, for tests now and Chrome traces and pictures later."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class TimelineEvent:
    """One operation: on ``device`` (-1 for the host optimizer), for ``job`` (its ring index and label)."""

    device: int
    job: int
    label: str
    microbatch: int
    kind: str
    start: float
    end: float


class Timeline:
    """Collects events from many threads. When disabled, ``span`` is a no-op costing one branch."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._events: list[TimelineEvent] = []
        self._lock = threading.Lock()
        self._origin = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self._origin

    def add(self, device: int, job: int, label: str, microbatch: int, kind: str, start: float) -> None:
        if self.enabled:
            event = TimelineEvent(device, job, label, microbatch, kind, start, self.now())
            with self._lock:
                self._events.append(event)

    def events(self) -> list[TimelineEvent]:
        with self._lock:
            return sorted(self._events, key=lambda event: event.start)

    def clear(self) -> None:
        with self._lock:
            self._events.clear()
