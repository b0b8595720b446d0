"""One optimizer step, cut into step groups, run on the optimizer thread.

:class:`~lightning_roundpipe.engine.step.caller.StepQueue` decides on the caller's thread what a step is (its
groups, the hyperparameters as they are at that call, the gradients lent from ``param.grad``) and queues a
:class:`QueuedStep`, built from one :class:`StepRequest`; the optimizer thread
(:class:`~lightning_roundpipe.engine.step.thread.HostOptimizer`) runs it, group by group as their
gradients become final (``groups.py``), with what data parallel adds to each group: the averaging over
the processes, and the sharded optimizer's broadcasts of the updated weights. In async mode it also publishes
each group's weights for the next uploads (``__init__.py`` says when).

It lives apart from the engine because it is the part of a step that runs on the optimizer thread: it reads
nothing of the engine's, only what it was handed when the step was queued, and what the engine learns from it
(the time each layer's parameters took, a step stopped part-way) goes back through the two callbacks of its
request.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from lightning_roundpipe.engine.dataparallel import Averaging, Broadcast, DataParallel
from lightning_roundpipe.engine.errors import PipelineError
from lightning_roundpipe.engine.layers import Trunk
from lightning_roundpipe.engine.step.disk_tier import DiskTier
from lightning_roundpipe.engine.step.groups import StepGroup
from lightning_roundpipe.engine.step.rounding import StochasticRounding
from lightning_roundpipe.engine.step.thread import HostOptimizer, step_with_groups
from lightning_roundpipe.engine.step.window import GradWindow
from lightning_roundpipe.engine.transport import UploadSources
from lightning_roundpipe.observe.trace import Timeline

SENT_AHEAD = 1
"""Data parallel: groups whose gradients may be on their way to be averaged beyond the one stepped next."""

READ_AHEAD = 2
"""Offload: groups whose optimizer state may be asked for before they step (the one stepped next among them)."""


def sums_budget(groups: Sequence[StepGroup], num_devices: int) -> int:
    """The bytes of gradient sums the windows may hold while a step that gives them back runs (``window.py``'s
    back-pressure): the largest group's on every device being summed. The group being stepped makes it devices + 1,
    as the pre-flight plan counts them; a device's staging buffer is on top."""
    largest = max((sum(param.numel() * param.element_size() for param in group.params) for group in groups), default=0)
    return num_devices * largest


@dataclass(frozen=True)
class StepRequest:
    """What the caller's thread hands a :class:`QueuedStep` (``caller.py`` builds it; the fields are described
    there and in :class:`QueuedStep`)."""

    # the step: what it steps, with which gradients and hyperparameters, and how
    optimizer: torch.optim.Optimizer
    number: int
    params: Sequence[nn.Parameter]
    groups: list[StepGroup]
    window: GradWindow
    lent: Mapping[int, torch.Tensor]
    hyperparameters: list[dict]
    proceed: bool
    averaging: Averaging | None
    keep_gradients: bool
    # the engine's parts it works with
    trunk: Trunk
    sources: UploadSources
    host: HostOptimizer
    timeline: Timeline
    host_kernels: str
    async_step: bool
    num_devices: int
    sharding: DataParallel | None
    disk: DiskTier | None
    rounding: StochasticRounding | None  # stochastic_rounding=True: this step's rounding of bf16 parameters
    # where what it learns goes (on the optimizer thread)
    on_whole: Callable[[list[float]], None]
    on_torn: Callable[[int, list[str]], None]


class QueuedStep:
    """Optimizer step ``number`` of ``optimizer``, cut into ``groups`` (shallowest first); :meth:`run` runs it on
    the optimizer thread.

    The step's gradients: ``lent`` (the tensors ``param.grad`` held when the step was queued, read on the caller's
    thread, by parameter id), plus what ``window`` holds once each group's are final (taken on the optimizer
    thread). Whenever the thread is free it steps the shallowest group whose gradients are final: while the
    backward still runs that is the one that became final last, and once all are final (after ``before_step``,
    say) the next iteration's first stages go first. Async mode first publishes a group's masters (they still
    hold the previous step) once this iteration's uploads of them are done, as early as it can. ``proceed=False``
    skips the update (the copies are still published). ``averaging`` (data parallel, no hook): each group's
    gradients are averaged over the processes before it steps, the groups deepest first (the same order on every
    process), so one group's communication overlaps the rest of the backward, and the next group's
    communication the step of this one. With a sharded optimizer
    (``sharding``, a :class:`DataParallel` whose ``sharded`` is true) this process steps the parameters of a group
    it owns and then takes the others' from their owners (:meth:`DataParallel.start_broadcast`) before the
    group's event is set; the broadcast stays in flight while the next group steps.

    What the engine learns: ``on_whole`` gets, once every group has stepped (not with ``proceed=False``), the
    seconds the step spent per layer of ``trunk``; ``on_torn`` gets the step's number and the labels of the groups
    it had stepped when it stopped part-way (the pipeline failed, or the optimizer on a later group).
    """

    def __init__(self, request: StepRequest) -> None:
        self.optimizer = request.optimizer
        self.number = request.number
        self.groups = request.groups
        self.window = request.window
        self.lent = request.lent
        self.hyperparameters = request.hyperparameters
        self.host_kernels = request.host_kernels
        self.sources = request.sources
        self.host = request.host
        self.timeline = request.timeline
        self.async_step = request.async_step
        self.proceed = request.proceed
        self.averaging = request.averaging
        self.on_whole = request.on_whole
        self.on_torn = request.on_torn
        self.disk = request.disk
        self.rounding = request.rounding
        self._sums_budget = sums_budget(self.groups, request.num_devices)
        self._pending: list[int] = []  # the groups not stepped yet
        self._taking = False  # a group left pending and its gradients are not yet taken
        # offload: the groups whose state was asked for and not stepped yet, each with the event of its arrival
        self._read_ahead_asked: dict[int, threading.Event] = {}
        # keep_gradients: the gradients each parameter was stepped with, by id, for the caller's thread to put
        # into param.grad once the step is done (RoundPipeEngine.restore_gradients)
        self.keep_gradients = request.keep_gradients
        self.stepped_with: dict[int, torch.Tensor] = {}
        self._sent_at: dict[int, float] = {}  # averaging: per group sent, when (its timeline event starts there)
        # sharded: the stepped group whose other owners' updates are in flight, and when they were sent
        self._broadcasting: tuple[int, Broadcast, float] | None = None
        # sharded optimizer: this process steps the parameters it owns, then every owner broadcasts its own
        sharding, params, trunk = request.sharding, request.params, request.trunk
        self.sharding = sharding
        self.owners = sharding.owners(params) if sharding is not None else {}
        self.optimized = {id(param) for param in params}
        self.stepped = sharding.owned(params) if sharding is not None else self.optimized
        self.num_layers = len(trunk)
        # per group, the elements of its parameters each of its layers holds: how its step time is spread. Counted
        # here, on the caller's thread (the only one that changes the trunk's states), once per step
        self.layer_sizes = [self._layer_sizes(trunk, group) for group in self.groups] if self.proceed else []

    def run(self) -> None:
        """Step every group, each once its gradients are final (the optimizer thread then sets the step's
        event). Giving the sums back, it holds the backward to its pace (``window.py``'s back-pressure)."""
        if not self._gives_back():
            self._run()
            return
        with self.window.reclaiming(self._sums_budget, self._will_take_sums):
            self._run()

    def _will_take_sums(self) -> bool:
        """Whether this step will take sums out of the window without waiting for more (on a summing thread): it is
        taking a group's, or a group not stepped yet has final gradients."""
        return self._taking or bool(self.window.final_groups(list(self._pending)))

    def _run(self) -> None:
        pending = self._pending = list(range(len(self.groups)))  # shallowest first
        applied: list[str] = []
        seconds = [0.0] * self.num_layers  # per layer, its parameters' share of the step
        try:
            while pending:
                index = self._next_final(pending)
                self._read_ahead(pending, index)
                if index is None:
                    self._finish_broadcast(seconds)  # nothing to step meanwhile: let its group's uploads go
                    self.window.wait_progress()
                    continue
                self._taking = True  # before it leaves pending: a summing thread always sees one or the other
                pending.remove(index)
                self._wait_read_ahead(index)
                group = self.groups[index]
                if self.async_step:
                    self._publish(group, wait=True)
                grads = self._gradients(index)
                self._taking = False
                if self.keep_gradients:
                    self.stepped_with.update(grads)
                if not self.proceed:
                    group.ready.set()
                    self._give_back(group, grads)
                    continue
                self._step(index, grads, seconds)
                if self.disk is not None:  # the first step of a group made its state: from now on in files
                    self.disk.adopt(self.optimizer, group.params)
                self._give_back(group, grads)
                applied.append(group.label)
                if self.sharding is None:
                    group.ready.set()
                    continue
                # deepest first (averaged here): the others' updates of this group travel while the next group
                # steps, and the previous group's are awaited now. Shallowest first (every gradient was final),
                # the next iteration's first stages wait for this group: it is finished at once
                previous = self._broadcasting
                self._broadcasting = (index, self.sharding.start_broadcast(
                    [param for param in group.params if id(param) in grads and id(param) in self.optimized],
                    self.owners), self.timeline.now())
                if previous is not None:
                    self._finish(previous, seconds)
                if self.averaging is None:
                    self._finish_broadcast(seconds)
            self._finish_broadcast(seconds)
            if self._gives_back():
                self.window.trim_given_back()
            if self.proceed:
                self.on_whole(seconds)
        except BaseException:
            if applied and pending:  # stopped part-way: the pipeline failed, or the optimizer on a later part
                self.on_torn(self.number, applied)
            raise

    def _next_final(self, pending: list[int]) -> int | None:
        """The pending group to step now (async: after publishing what it can), or ``None``: wait for progress."""
        self.window.forget_progress()  # what happens from here on wakes run's wait_progress
        if self.async_step:
            for index in pending:
                self._publish(self.groups[index], wait=False)
        final = self.window.final_groups(pending)
        if self.averaging is not None:  # the collectives go in one order on every process: deepest first
            self._send_final(pending, final)
            final = [index for index in final if index == max(pending)]
        elif self.sharding is not None:  # every gradient is final already (averaged on the caller's thread)
            final = [index for index in final if index == min(pending)]
        return final[0] if final else None

    def _read_ahead(self, pending: list[int], next_index: int | None) -> None:
        """Offload: ask for the optimizer state of the :data:`READ_AHEAD` groups likely to step next: the one
        chosen, then those whose gradients are final (shallowest first), then the others in the order the
        backward finishes them (deepest first)."""
        if self.disk is None or not self.proceed:
            return
        final = set(self.window.final_groups(pending))
        likely = ([] if next_index is None else [next_index]) + sorted(final - {next_index}) + sorted(
            set(pending) - final - {next_index}, reverse=True)
        for index in likely:
            if len(self._read_ahead_asked) >= READ_AHEAD:
                return
            if index not in self._read_ahead_asked:
                self._read_ahead_asked[index] = self.disk.read_ahead(self.optimizer,
                                                                     self._stepped_params(self.groups[index]))

    def _wait_read_ahead(self, index: int) -> None:
        """Offload: before group ``index`` steps, wait for its state asked for ahead to be in memory: stepping
        it meanwhile would fault it in a page at a time. A group not asked for (its first step, or one the order
        did not foresee) steps at once."""
        arrived = self._read_ahead_asked.pop(index, None)
        if arrived is not None and self.disk is not None:
            self.disk.wait(arrived, f"the disk tier's read of step {self.number} {self.groups[index].label}")

    def _stepped_params(self, group: StepGroup) -> list[nn.Parameter]:
        return [param for param in group.params if id(param) in self.stepped]

    def _publish(self, group: StepGroup, wait: bool) -> bool:
        """Async: refresh the group's published copy once this iteration's uploads have read it."""
        if group.ready.is_set():
            return True
        if not wait and not self.window.uploads_done(group.readers):
            return False
        self.window.wait_uploads(group.readers)
        self.sources.refresh(group.params)
        group.ready.set()
        return True

    def _send_final(self, pending: list[int], final: list[int]) -> None:
        """Averaging, the optimizer-thread driver (the caller's-thread one is ``StepQueue.average``): start the
        all-reduce of pending groups whose gradients are final and whose deeper groups were sent, deepest first
        (the order every process sends in, whatever the timing), without waiting, so that the next group's
        communication runs while this thread steps the current one. At most :data:`SENT_AHEAD` groups beyond
        the one stepped next are in flight: each holds a flat copy of its gradients until received."""
        ready = set(final)
        in_flight = sum(1 for index in pending if index in self._sent_at)
        for index in sorted(pending, reverse=True):
            if index in self._sent_at:
                continue
            if index not in ready or in_flight > SENT_AHEAD:
                return
            in_flight += 1
            group = self.groups[index]
            self._sent_at[index] = self.timeline.now()
            self.averaging.send(group.params, self._local_gradients(group))  # type: ignore[union-attr]

    def _local_gradients(self, group: StepGroup) -> dict[int, torch.Tensor]:
        """This process's gradients of ``group`` by parameter id: the lent ones plus the window's."""
        grads = {key: self.lent[key] for key in map(id, group.params) if key in self.lent}
        for key, (_, grad) in self.window.take(group.params).items():
            held = grads.get(key)
            grads[key] = grad if held is None else held + grad  # out of place: the lent one stays
        return grads

    def _gradients(self, index: int) -> dict[int, torch.Tensor]:
        """The gradients group ``index`` steps with, by parameter id: this process's (averaging: their mean over
        the processes, sent by :meth:`_send_final`)."""
        group = self.groups[index]
        if self.averaging is None:
            return self._local_gradients(group)
        grads = self.averaging.receive(group.params)
        self.timeline.add("allreduce", f"average step {self.number} {group.label}", self._sent_at[index])
        return grads

    def _gives_back(self) -> bool:
        return not (self.keep_gradients or self.averaging is not None or self.sharding is not None)

    def _give_back(self, group: StepGroup, grads: dict[int, torch.Tensor]) -> None:
        """Once a group has stepped, the memory of its summed gradients serves the next sums, unless the caller
        keeps them (``keep_gradients``) or they are the caller's own (lent) or the processes' mean. Given back, they
        leave ``grads``, so that the pool alone references them."""
        if not self._gives_back():
            return
        sums = [(param, grads.pop(id(param))) for param in group.params
                if id(param) in grads and id(param) not in self.lent]
        grads.clear()
        self.window.give_back(sums)

    def _label(self, group: StepGroup) -> str:
        return f"step {self.number} {group.label}" if len(self.groups) > 1 else f"step {self.number}"

    def _step(self, index: int, grads: dict[int, torch.Tensor], seconds: list[float]) -> None:
        """Update group ``index`` (sharded: this process's parameters of it), and add its time to ``seconds``."""
        group = self.groups[index]
        start = time.perf_counter()
        with self.host.timed(self._label(group)):
            self._run_optimizer(group, grads)
            if not (self.async_step or self.sharding is not None):  # the low-precision copies the next uploads read
                self.sources.refresh(group.params)
        self._spread_seconds(index, time.perf_counter() - start, seconds)

    def _finish(self, broadcast: tuple[int, Broadcast, float], seconds: list[float]) -> None:
        """Sharded: wait for the others' updates of a stepped group, refresh its copies (sync) and set its event.
        The wait counts as the group's step time (it is what the group's uploads wait for, beyond the step)."""
        index, in_flight, started = broadcast
        group = self.groups[index]
        start = time.perf_counter()
        in_flight.finish()
        self.timeline.add("broadcast", f"broadcast step {self.number} {group.label}", started)
        if not self.async_step:  # the low-precision copies the next uploads read, from every owner's update
            with self.host.timed(self._label(group)):
                self.sources.refresh(group.params)
        self._spread_seconds(index, time.perf_counter() - start, seconds)
        group.ready.set()

    def _finish_broadcast(self, seconds: list[float]) -> None:
        """Finish the broadcast in flight, if any."""
        broadcast, self._broadcasting = self._broadcasting, None
        if broadcast is not None:
            self._finish(broadcast, seconds)

    def _run_optimizer(self, group: StepGroup, grads: dict[int, torch.Tensor]) -> None:
        """Step the parameters of ``group`` among :attr:`stepped` (the optimizer's; sharded: those this process
        owns), with the step's hyperparameters."""
        members = {id(param) for param in group.params}.intersection(self.stepped)
        if not members:
            return
        subset = [{**copy, "params": [param for param in copy["params"] if id(param) in members]}
                  for copy in self.hyperparameters]
        try:
            step_with_groups(self.optimizer, [copy for copy in subset if copy["params"]], grads,
                             host_kernels=self.host_kernels, rounding=self.rounding)
        except Exception as error:
            raise PipelineError(
                f"optimizer step {self.number} ({type(self.optimizer).__name__}) raised {type(error).__name__} on "
                f"the optimizer thread: {error}") from error

    @staticmethod
    def _layer_sizes(trunk: Trunk, group: StepGroup) -> list[int]:
        """Per layer of ``group``, the elements of the group's parameters it holds (parameters outside the trunk
        are left out)."""
        members = {id(param) for param in group.params}
        return [sum(param.numel() for param in trunk.states[layer].params if id(param) in members)
                for layer in group.layers]

    def _spread_seconds(self, index: int, seconds: float, per_layer: list[float]) -> None:
        """Add group ``index``'s step time to its layers, in proportion to the elements of the group's parameters
        each holds (the step's cost per element is about constant)."""
        sizes = self.layer_sizes[index]
        total = sum(sizes)
        for layer, size in zip(self.groups[index].layers, sizes, strict=True):
            per_layer[layer] += seconds * size / total if total else 0.0
