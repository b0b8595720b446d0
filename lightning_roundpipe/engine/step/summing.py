"""The gradient summing thread: jobs' downloaded gradients summed into their step's window off the ring.

A backward job's finish ([8] in ``worker.py``) used to sum its gradients into the window on the device's
download thread before it released the stage, so the device's next-but-one upload and the next job's
downloads waited for a host sum (a memory-bound pass over every gradient: on a large stage longer than
the device's compute). Now the download thread copies the gradients to the host, releases the stage, and
hands the host copies here. One thread per device, as the download threads were: each device's sums run in
its jobs' order, and two devices' jobs reach the window as independently as before. The window sums under
its own lock, in slot order whichever job arrives first (``window.py``), so the result is the same bits
whatever the arrival order. Each job's window counts it in flight until its sum is done
(``GradWindow.job_finished`` runs here), so everything that reads gradients waits for the sums as before.

An error here fails the engine like any other engine thread's (:class:`AbortSignal`), saying which job's
gradients it was summing.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from lightning_roundpipe.engine.device import AbortSignal, join_until
from lightning_roundpipe.engine.errors import EngineAborted, PipelineError

_STOP = object()


class GradSummer:
    """The gradient summing thread of device ``index`` (see the module docstring): runs the sums it is given, in
    order."""

    def __init__(self, index: int, abort: AbortSignal) -> None:
        self._abort = abort
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"roundpipe-dev{index}-grad-sum", daemon=True)
        self._thread.start()

    def submit(self, what: str, work: Callable[[], None]) -> None:
        """Run ``work`` (summing ``what``: "the gradients of stage 1b (job 6)") after the sums submitted
        before it."""
        self._queue.put((what, work))

    def close(self, deadline: float) -> str | None:
        """Let the thread end after what is queued (after an abort: after the sum it is running); wait until
        ``deadline`` at most and return its name if it is still running then."""
        self._queue.put(_STOP)
        return join_until(self._thread, deadline)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            if self._abort.aborted:
                continue  # drained without running: whoever waits for these sums is woken by the abort
            what, work = item
            try:
                work()
            except EngineAborted:
                pass
            except BaseException as error:  # noqa: BLE001 - reported to the caller through the abort signal
                failure = PipelineError(f"summing {what} into the step's gradients on the host failed: "
                                        f"{type(error).__name__}: {error}")
                failure.__cause__ = error
                self._abort.fail(failure)
            item = work = None  # hold no job's gradients while idle
