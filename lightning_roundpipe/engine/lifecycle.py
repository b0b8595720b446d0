"""The engine's lifecycle: not started, running, failed, closed, and how a failure reaches the caller.

An error on any thread of the ring (a layer, the loss, a transfer, the optimizer step) is set on the engine's
:class:`~lightning_roundpipe.engine.device.AbortSignal`, which wakes every wait. :class:`Lifecycle` turns it into
one :class:`~lightning_roundpipe.engine.errors.PipelineError` on the caller's thread: at the next call, in a
wait that the abort woke (:meth:`Lifecycle.surfaced`), or after close (:meth:`Lifecycle.unreported_failure`),
and closes the engine first, so no failure goes unnoticed and none is raised twice.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from lightning_roundpipe.engine.device import AbortSignal
from lightning_roundpipe.engine.errors import EngineAborted, PipelineError

_Part = TypeVar("_Part")


class Lifecycle:
    """The state of one engine; ``close`` closes it after a failure, ``torn_step`` says what a step stopped
    part-way had updated (appended to the error)."""

    def __init__(self, abort: AbortSignal, close: Callable[[], None], torn_step: Callable[[], str | None]) -> None:
        self.abort = abort
        self._close = close
        self._torn_step = torn_step
        self.started = False
        self.closed = False
        self._failure_reported = False

    @property
    def failed(self) -> bool:
        return self.started and self.abort.error is not None

    @property
    def unreported_failure(self) -> BaseException | None:
        """The error that stopped the pipeline if no call has raised it yet."""
        if not self.started or self._failure_reported:
            return None
        return self.abort.error

    def check_started(self, what: str) -> None:
        if not self.started:
            raise RuntimeError(f"the engine is not started, so it has no {what} yet: use `with RoundPipeEngine(...) "
                               "as engine:` or call start() first")

    def started_part(self, part: _Part | None, what: str = "threads") -> _Part:
        """``part``, one of the things the engine's start makes; before that, a clear error."""
        self.check_started(what)
        if part is None:  # started, yet not made: a bug in start()
            raise RuntimeError(f"the engine is started but has no {what}")
        return part

    def check_running(self) -> None:
        """Before a call: a clear error unless the engine runs; the pipeline's error if it failed."""
        if not self.started:
            raise RuntimeError("the engine is not started: use `with RoundPipeEngine(...) as engine:` or call start()")
        if self.closed:
            error = self.abort.error
            reason = f" after an error ({type(error).__name__}: {error})" if error is not None else ""
            raise RuntimeError(f"the engine is closed{reason}; create a new engine to continue")
        if self.abort.error is not None:
            self.raise_failure()

    def raise_failure(self) -> None:
        """Close the engine and raise its failure as a :class:`PipelineError` (with the torn step, if any)."""
        error = self.abort.error
        self._failure_reported = True
        self._close()
        torn = self._torn_step()
        suffix = (" " if str(error).endswith(".") else ". ") + torn if torn else ""  # one full stop between them
        if isinstance(error, PipelineError):  # its own type (an OffloadError stays one), with the torn step
            raise type(error)(f"{error}{suffix}") from error.__cause__
        raise PipelineError(f"the pipeline failed: {type(error).__name__}: {error}{suffix}") from error

    @contextmanager
    def surfaced(self) -> Iterator[None]:
        """A wait woken by the abort flag raises the pipeline's own error (and closes the engine)."""
        try:
            yield
        except (EngineAborted, TimeoutError):
            if self.abort.error is not None:
                self.raise_failure()
            raise
