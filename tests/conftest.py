"""Fixtures and hooks shared by the test modules (pytest finds them here; test modules never import each other)."""

from __future__ import annotations

import random
import signal
import threading
from collections.abc import Callable, Generator

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed() -> None:
    """Every test starts from the same random state, whatever ran before it (the tests use no numpy)."""
    torch.manual_seed(0)
    random.seed(0)


def pytest_configure(config: pytest.Config) -> None:
    """Let Ctrl-C reach the tests that send it (``test_faults.py``, ``test_interrupt.py``). A shell without job
    control starts a background command (``make test &`` in a script) with SIGINT ignored, which Python keeps and
    every child process inherits: those tests would then see no ``KeyboardInterrupt`` and fail. Runs in each
    pytest-xdist worker too."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def _sigint_handler() -> Generator[None, None, None]:
    """Give the next test the SIGINT handler this one started with: Lightning sets SIGINT to ignored once it
    has caught a Ctrl-C in ``fit``, and without this every later Ctrl-C of the session would be lost."""
    handler = signal.getsignal(signal.SIGINT)
    yield
    if threading.current_thread() is threading.main_thread():  # signal.signal works in the main thread only
        signal.signal(signal.SIGINT, handler)


# The files that take a minute or more, most first (each launches processes: rings in several processes, the app,
# benchmarks, a wheel in a fresh venv). `make test` runs the suite on every core with pytest-xdist, a file to a
# worker (`--dist loadfile`, so a file's processes start once, in this order: `--no-loadscope-reorder`); a worker
# takes the next file when it is done, so the longest files must start first or one of them ends the run alone.
LONGEST_FIRST = ("test_scaleout.py", "test_app.py", "test_startup_hook.py", "test_readme_commands.py",
                 "test_examples.py", "test_dataparallel.py", "test_transparency.py", "test_random_streams.py",
                 "test_deferred_batchnorm.py", "test_strategy.py", "test_stress.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Order the files longest first (:data:`LONGEST_FIRST`); the tests of a file keep their order."""
    rank = {name: position for position, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    """A Ctrl-C that lands inside ``Trainer.fit`` reaches pytest as a ``SystemExit(1)``: Lightning catches the
    ``KeyboardInterrupt``, shuts down and calls ``sys.exit``. pytest would count that as one failed test and
    go on; raised again as the ``KeyboardInterrupt`` it was, it stops the session as Ctrl-C does elsewhere.
    A test that expects the ``SystemExit`` (``pytest.raises``) catches it before this sees it."""
    try:
        return (yield)
    except SystemExit as error:
        if isinstance(error.__context__, KeyboardInterrupt):
            raise KeyboardInterrupt("Ctrl-C during Trainer.fit (Lightning turned it into SystemExit)") from error
        raise


def _alive_roundpipe_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("roundpipe-"))


@pytest.fixture
def roundpipe_threads() -> Callable[[], list[str]]:
    """Call it to get the names of the engine's threads still alive (all are named ``roundpipe-...``), sorted:
    ``assert roundpipe_threads() == []`` after an engine closed."""
    return _alive_roundpipe_threads
