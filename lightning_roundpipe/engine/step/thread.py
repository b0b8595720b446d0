"""The optimizer thread (:class:`HostOptimizer`) and the stepping it runs.

The module's parameters are the master weights; the user's optimizer steps them directly, on this thread,
through stand-ins (:func:`step_with_groups`): only the caller's thread touches ``param.grad`` (``window.py``
says why). Hyperparameters (lr, ...) are copied when a step is queued (:func:`snapshot_param_groups`), so a
scheduler or user write that follows ``step()`` applies to the next step, as in plain training.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from lightning_roundpipe.engine.device import AbortSignal, EngineAborted, HostEvent
from lightning_roundpipe.engine.step import eight_bit
from lightning_roundpipe.engine.step.kernels import use_fused
from lightning_roundpipe.engine.step.rounding import StochasticRounding, widen_state
from lightning_roundpipe.observe.trace import Timeline


def snapshot_param_groups(optimizer: torch.optim.Optimizer) -> list[dict]:
    """A copy of every param group's hyperparameters, sharing the parameter lists."""
    groups = []
    for group in optimizer.param_groups:
        copied = {key: (value.clone() if isinstance(value, torch.Tensor) else value)
                  for key, value in group.items() if key != "params"}
        copied["params"] = group["params"]
        groups.append(copied)
    return groups


def step_with_groups(optimizer: torch.optim.Optimizer, groups: list[dict],
                     grads: Mapping[int, torch.Tensor], *, host_kernels: str | None = None,
                     rounding: StochasticRounding | None = None) -> None:
    """Run ``optimizer``'s step arithmetic with ``groups`` as its param groups and ``grads`` (by parameter id)
    as the gradients, without reading or writing any ``param.grad``.

    The step runs on a shallow twin of the optimizer that shares its hooks but has its own ``param_groups``:
    the main thread may meanwhile write ``lr`` into the real groups (a scheduler step) without changing this
    step. The twin's parameters are stand-ins (``param.detach()``: the same storage, so the update lands in
    the parameter) whose ``.grad`` is the step's gradient, and its ``state`` finds each stand-in's entry under
    its parameter, so the optimizer's state stays keyed by the module's parameters. A parameter without an
    entry in ``grads`` has no gradient in this step and is skipped, as torch skips a ``None`` gradient. The
    class's ``step`` is called directly because an LR scheduler replaces the instance's ``step`` with a
    wrapper bound to the original. ``host_kernels`` (the engine's ``host_optimizer``; ``None``: as built):
    the groups it steps with torch's fused CPU kernel get ``fused=True``, in these copies only
    (:func:`~lightning_roundpipe.engine.step.kernels.use_fused`). bitsandbytes' optimizers find their
    per-parameter settings through :func:`~lightning_roundpipe.engine.step.eight_bit.prepare_twin`.
    ``rounding`` (``stochastic_rounding=True``): a bfloat16 parameter's stand-in is a float32 copy instead, with
    its gradient and optimizer state in float32, and the result is rounded into the parameter stochastically
    (``rounding.py``).
    """
    owners: dict[int, nn.Parameter] = {}
    stand_ins: dict[int, torch.Tensor] = {}
    widened: list[tuple[nn.Parameter, torch.Tensor]] = []  # rounding: (parameter, its float32 stand-in)
    twin_groups = []
    for group in groups:
        params = []
        for param in group["params"]:
            stand_in = stand_ins.get(id(param))
            if stand_in is None:
                grad = grads.get(id(param))
                if rounding is not None and rounding.applies(param) and grad is not None:
                    stand_in = param.detach().float().requires_grad_(param.requires_grad)
                    grad = grad.float()
                    widened.append((param, stand_in))
                    if param in optimizer.state:
                        widen_state(optimizer.state[param])
                else:
                    stand_in = param.detach().requires_grad_(param.requires_grad)
                if grad is not None:
                    stand_in.grad = grad
                stand_ins[id(param)] = stand_in
                owners[id(stand_in)] = param
            params.append(stand_in)
        twin_groups.append({**group, "params": params})
    twin = object.__new__(type(optimizer))
    twin.__dict__.update(optimizer.__dict__)
    twin.param_groups = twin_groups
    twin.state = _StateOfOwners(optimizer.state, owners)  # type: ignore[assignment]
    if eight_bit.is_eight_bit(optimizer):
        eight_bit.prepare_twin(twin, optimizer, owners)
    if host_kernels is not None:
        use_fused(twin, twin_groups, host_kernels)
    type(optimizer).step(twin)
    for param, stand_in in widened:
        assert rounding is not None
        rounding.write(param, stand_in.detach())


class _StateOfOwners(MutableMapping):
    """An optimizer's ``state`` seen through stand-ins: a key that is a stand-in reads and writes its
    parameter's entry (creating it on first read, as the ``defaultdict`` of torch's optimizers does)."""

    def __init__(self, state: MutableMapping, owners: dict[int, nn.Parameter]) -> None:
        self._state = state
        self._owners = owners

    def _key(self, key: object) -> object:
        return self._owners.get(id(key), key)

    def __getitem__(self, key: object) -> Any:
        return self._state[self._key(key)]

    def __setitem__(self, key: object, value: Any) -> None:
        self._state[self._key(key)] = value

    def __delitem__(self, key: object) -> None:
        del self._state[self._key(key)]

    def __contains__(self, key: object) -> bool:
        return self._key(key) in self._state

    def get(self, key: object, default: Any = None) -> Any:
        return self._state.get(self._key(key), default)

    def __iter__(self) -> Iterator[object]:
        return iter(self._state)

    def __len__(self) -> int:
        return len(self._state)


class HostOptimizer:
    """The optimizer thread: runs queued tasks in order, one at a time."""

    def __init__(self, abort: AbortSignal, timeline: Timeline) -> None:
        self._abort = abort
        self._timeline = timeline
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self.busy_seconds = 0.0  # running total of step time, for pipeline metrics
        self._handled = 0  # tasks taken off the queue and run, skipped or failed: progress, for close()
        self.running: str | None = None  # the label of the task being run
        self._thread = threading.Thread(target=self._run, name="roundpipe-optimizer", daemon=True)
        self._thread.start()

    def submit(self, task: Callable[[], None], done: HostEvent, label: str) -> None:
        """Run ``task``, then set ``done``. The task times its arithmetic with :meth:`timed` (its waits for
        gradients are not optimizer time)."""
        self._tasks.put((task, done, label))

    @contextmanager
    def timed(self, label: str) -> Iterator[None]:
        """Optimizer time, on the timeline as ``label``; only on this thread."""
        start = self._timeline.now()
        yield
        self.busy_seconds += self._timeline.now() - start
        self._timeline.add("optimizer", label, start)

    def close(self, timeout: float) -> str | None:
        """End the thread after the queued tasks (after an abort they are dropped, but one already running
        finishes). Waits as long as the thread keeps making progress: it gives up once no task has ended
        for ``timeout`` seconds, and returns the thread's name if it is still running then (stuck inside a
        step: it ends by itself once the step returns)."""
        self._tasks.put(None)
        while True:
            handled = self._handled
            self._thread.join(timeout)
            if not self._thread.is_alive():
                return None
            if self._handled == handled:
                return self._thread.name

    def _run(self) -> None:
        while True:
            item = self._tasks.get()
            if item is None:
                return
            self.running = item[2]
            try:
                self._handle(*item)
            finally:
                self.running = None
                self._handled += 1
            item = None  # a finished step (its task) holds its gradient window

    def _handle(self, task: Callable[[], None], done: HostEvent, label: str) -> None:
        if self._abort.aborted:
            return
        try:
            task()
        except EngineAborted:
            return
        except BaseException as error:  # noqa: BLE001 - surfaced by the engine's next wait
            self._abort.fail(error)
            return
        done.set()
