"""The caller's-thread half of an optimizer step: what a step is, decided where the gradients live.

:class:`StepQueue` runs on the thread that calls ``RoundPipeEngine.step``: it checks the optimizer's parameters
against the trunk, cuts the step into step groups (``groups.py``), closes the dispatcher's gradient window,
makes the gradients final in ``param.grad`` when a hook must see them (published, or averaged over the
processes: the caller's-thread driver of :class:`~lightning_roundpipe.engine.dataparallel.Averaging`), and
queues a :class:`~lightning_roundpipe.engine.step.queued.QueuedStep`, the optimizer-thread half, built from one
:class:`~lightning_roundpipe.engine.step.queued.StepRequest`. It also keeps what the caller's thread must know of
the steps in flight: the gradient tensors lent to them, the last step's end, and a step stopped part-way.
"""

from __future__ import annotations

import logging
import warnings
from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
from torch import nn

from lightning_roundpipe.engine.dataparallel import Averaging, DataParallel
from lightning_roundpipe.engine.device import HostEvent
from lightning_roundpipe.engine.dispatch import Dispatcher
from lightning_roundpipe.engine.layers import Trunk
from lightning_roundpipe.engine.options import EngineOptions, OptionError
from lightning_roundpipe.engine.step.disk_tier import DiskTier
from lightning_roundpipe.engine.step.groups import StepGroup, coupling, stage_groups, streaming_refusal, upload_waits
from lightning_roundpipe.engine.step.queued import QueuedStep, StepRequest
from lightning_roundpipe.engine.step.rounding import StochasticRounding, optimizer_positions
from lightning_roundpipe.engine.step.thread import HostOptimizer, snapshot_param_groups
from lightning_roundpipe.engine.step.window import GradWindow
from lightning_roundpipe.engine.transport import UploadSources
from lightning_roundpipe.observe.trace import Timeline

log = logging.getLogger(__name__)

BeforeStep = Callable[[], bool | None]


class StepQueue:
    """Queues the optimizer steps of one engine (see the module docstring). :meth:`attach` hands it the parts
    the engine's start makes; ``retired_ids`` names the parameters the trunk dropped (``follow.py``), and
    ``surfaced`` is the engine's failure surfacing for waits."""

    def __init__(self, trunk: Trunk, options: EngineOptions, data_parallel: DataParallel, dispatcher: Dispatcher,
                 retired_ids: Callable[[], set[int]], surfaced: Callable[[], AbstractContextManager[None]]) -> None:
        self.trunk = trunk
        self.options = options
        self.data_parallel = data_parallel
        self.dispatcher = dispatcher
        self._retired_ids = retired_ids
        self._surfaced = surfaced
        self._parts: tuple[UploadSources, HostOptimizer, Timeline] | None = None  # attach: made by start
        self.disk: DiskTier | None = None  # attach: offload's files, where the steps keep the optimizer state
        self._base_seed = 0  # attach: the engine's seed
        self.last_step_done: HostEvent | None = None
        self.torn: tuple[int, list[str]] | None = None  # a step stopped part-way: its number, the groups stepped
        self._lent: deque[tuple[HostEvent, frozenset[int]]] = deque()  # per queued step, the gradients it was lent
        # the last step made with keep_gradients in sync mode, and what it was lent: restore_gradients' input
        self._kept: tuple[QueuedStep, list[nn.Parameter], dict[int, torch.Tensor]] | None = None
        self._streaming_said: str | None = ""  # why the last step was not cut by stage, once logged
        self._warned_unstepped = False

    def attach(self, sources: UploadSources, host: HostOptimizer, timeline: Timeline, disk: DiskTier | None,
               base_seed: int) -> None:
        """What the engine's start made: the upload sources, the optimizer thread, the timeline and the disk tier;
        and the seed it settled on (``stochastic_rounding``'s random bits)."""
        self._parts = (sources, host, timeline)
        self.disk = disk
        self._base_seed = base_seed

    def _started(self) -> tuple[UploadSources, HostOptimizer, Timeline]:
        assert self._parts is not None, "the engine's start attaches its parts before any step"
        return self._parts

    # ------------------------------------------------------------------ one step
    def step(self, optimizer: torch.optim.Optimizer, before_step: BeforeStep | None,
             keep_gradients: bool) -> GradWindow:
        """``RoundPipeEngine.step`` on this thread (its docstring says what it does); returns the window it closed."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        outside, unstepped = self.check_optimizer_params(params)
        if self.data_parallel.sharded:
            coupled = coupling(optimizer, "on" if self.options.streaming_step == "on" else "auto")
            if coupled is not None:
                raise ValueError(f"shard_optimizer=True steps each parameter on the process owning it alone, but "
                                 f"{coupled}: set shard_optimizer=False")
        groups = self.step_groups(optimizer, outside)
        window = self.dispatcher.next_window()
        window.close([group.params for group in groups])
        # the hook must see final gradients in param.grad, on this thread; the gradients of trainable trunk
        # parameters this optimizer does not step stay in param.grad, which only this thread may write
        averaging = self.data_parallel.averaging
        gradients_final = before_step is not None or bool(unstepped)
        self.dispatcher.step_order = ("off" if sum(1 for group in groups if group.layers) < 2
                                      else "forward" if gradients_final else "backward" if averaging else "latest")
        if averaging and gradients_final:  # what the hook and clipping see is the mean over the processes
            self.average(window, groups, [*params, *unstepped])
        elif gradients_final:
            self.publish(window.wait_complete, window)
        # without a hook the optimizer thread averages each part before stepping it, deepest first
        on_thread = self.data_parallel.start(params) if averaging and not gradients_final else None
        proceed = before_step() if before_step is not None else True
        finished = self.queue(optimizer, params, window, groups, proceed=proceed is not False, averaging=on_thread,
                              keep=keep_gradients and not self.options.async_step)
        if not keep_gradients:
            for param in params:
                param.grad = None
        if outside:  # main-thread code reads those parameters next: wait for the update
            self.dispatcher.wait(finished)
        self.last_step_done = finished
        return window

    def check_optimizer_params(self, params: list[nn.Parameter]) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        """Refuse or warn about an optimizer that steps parameters outside the trunk or misses trunk ones;
        returns the trainable parameters it steps outside the trunk, and the trainable trunk parameters it
        does not step."""
        trunk_ids = {id(p) for p in self.trunk.parameters()} | self._retired_ids()
        outside = [p for p in params if p.requires_grad and id(p) not in trunk_ids]
        if outside and self.options.async_step:
            raise ValueError(
                f"async_step=True needs every trainable parameter inside the pipelined trunk, but the optimizer "
                f"has {len(outside)} outside it (main-thread code would read them while the step writes them). "
                "Set async_step=False or move those parameters into the trunk."
            )
        stepped = {id(p) for p in params}
        unstepped = [p for p in self.trunk.trainable_parameters() if id(p) not in stepped]
        if unstepped and not self._warned_unstepped:
            self._warned_unstepped = True
            warnings.warn(
                f"{len(unstepped)} trainable trunk parameters are not in the optimizer: their gradients keep "
                "accumulating in param.grad. Freeze them (requires_grad_(False)) or add them to the optimizer.",
                stacklevel=4,
            )
        return outside, unstepped

    def step_groups(self, optimizer: torch.optim.Optimizer, outside: list[nn.Parameter]) -> list[StepGroup]:
        """How the next step of ``optimizer`` is cut (``groups.py``): by backward stage, shallowest first, or
        whole; the optimizer's parameters ``outside`` the trunk step first, in a group of their own."""
        refusal = streaming_refusal(optimizer, self.options.streaming_step)
        if refusal != self._streaming_said:
            self._streaming_said = refusal
            self._log_streaming(optimizer, refusal)
        groups = stage_groups(self.trunk, self.dispatcher.planner.plan, whole=refusal is not None)
        if outside and refusal is not None:
            groups[0].params += outside  # one step call, as built
        elif outside:
            groups.insert(0, StepGroup(range(0), outside, frozenset()))
        number = self.dispatcher.step + 1  # called before the dispatcher counts the step
        for group in groups:
            group.ready.name = (f"the weights of layers {group.label} "
                                f"{'published' if self.options.async_step else 'updated'} by optimizer step {number}")
        return groups

    def _log_streaming(self, optimizer: torch.optim.Optimizer, refusal: str | None) -> None:
        """Say how steps of ``optimizer`` are cut, and why not by stage (``refusal``), when that changes."""
        data_parallel = self.data_parallel
        across = ("" if not data_parallel.averaging
                  else f"; each part's gradients averaged over {data_parallel.world_size} processes first"
                  + (", and each process steps the parameters it owns (sharded)" if data_parallel.sharded else ""))
        log.info("RoundPipe steps %s %s%s", type(optimizer).__name__,
                 "by stage, overlapping the backward and the next iteration" if refusal is None
                 else f"whole after the backward: {refusal}", across)

    def queue(self, optimizer: torch.optim.Optimizer, params: list[nn.Parameter], window: GradWindow,
              groups: list[StepGroup], *, proceed: bool, averaging: Averaging | None, keep: bool) -> HostEvent:
        """Queue the step just closed on the optimizer thread, cut into ``groups`` (:class:`QueuedStep` says how
        it runs, and what ``proceed`` and ``averaging`` do), and make each later upload wait for the groups of
        the layers it uploads; returns the event of the step's end.

        The step's gradients: the tensors in ``param.grad`` now (read here, on the caller's thread, and lent to
        the step), plus what ``window`` holds once each group's are final (taken on the optimizer thread)."""
        sources, host, timeline = self._started()
        hyperparameters = snapshot_param_groups(optimizer)  # as they are now
        # an LR scheduler checks that a step preceded its own
        optimizer._opt_called = True  # type: ignore[attr-defined]
        number = self.dispatcher.step
        finished = HostEvent(f"optimizer step {number}")
        lent = {id(param): param.grad for param in params if param.grad is not None}
        self._lent_now()  # forgets the steps that have ended
        if lent:
            self._lent.append((finished, frozenset(id(grad) for grad in lent.values())))
        rounding = self._rounding(optimizer, number)
        step = QueuedStep(StepRequest(
            optimizer=optimizer, number=number, params=params, groups=groups, window=window, lent=lent,
            hyperparameters=hyperparameters, proceed=proceed, averaging=averaging, keep_gradients=keep,
            trunk=self.trunk, sources=sources, host=host, timeline=timeline,
            host_kernels=self.options.host_optimizer, async_step=self.options.async_step,
            num_devices=self.dispatcher.num_devices,
            sharding=self.data_parallel if self.data_parallel.sharded else None, disk=self.disk, rounding=rounding,
            on_whole=self._record_step_seconds, on_torn=self._record_torn_step))
        self._kept = (step, params, lent) if keep else None
        host.submit(step.run, finished, f"step {number}")
        self.dispatcher.upload_waits = upload_waits(groups, len(self.trunk))
        return finished

    def _rounding(self, optimizer: torch.optim.Optimizer, number: int) -> StochasticRounding | None:
        """``stochastic_rounding=True``: step ``number``'s rounding of ``optimizer``'s bfloat16 parameters."""
        if not self.options.stochastic_rounding:
            return None
        positions = optimizer_positions(optimizer)
        if not positions:
            raise OptionError(
                "stochastic_rounding", f"rounds the host step into bfloat16 parameters, and none of "
                f"{type(optimizer).__name__}'s parameters is bfloat16: train with precision='bf16-true' (or a model "
                "stored in bfloat16), or leave stochastic_rounding off")
        return StochasticRounding(self._base_seed, number, positions)

    def _record_step_seconds(self, seconds: list[float]) -> None:
        """On the optimizer thread: per layer, the seconds a step that ran whole spent on its parameters."""
        self.dispatcher.layer_step_seconds = seconds  # one assignment: the main thread reads it whole

    def _record_torn_step(self, number: int, applied: list[str]) -> None:
        """On the optimizer thread: step ``number`` stopped part-way, after stepping the groups ``applied``."""
        self.torn = (number, applied)

    def torn_message(self) -> str | None:
        """``RoundPipeEngine.torn_step``: which layers a step stopped part-way had updated, or ``None``."""
        if self.torn is None:
            return None
        number, labels = self.torn
        return (f"Optimizer step {number} had updated the parameters of layers {', '.join(labels)} when the pipeline "
                f"stopped; the other layers keep step {number - 1}'s weights, so the module's weights mix two steps. "
                "Resume from a checkpoint written before the failure (or set streaming_step='off' to apply every "
                "step whole or not at all)")

    # ------------------------------------------------------------------ gradients in param.grad
    def publish(self, wait_for_jobs: Callable[[], None], window: GradWindow) -> None:
        """On this thread: wait for the window's jobs, then add the window's gradients into ``param.grad``
        (a gradient a queued step still reads is replaced by the sum, never changed in place)."""
        with self._surfaced():
            wait_for_jobs()
        window.publish(self._lent_now())

    def average(self, window: GradWindow, groups: list[StepGroup], params: list[nn.Parameter]) -> None:
        """Data parallel, the caller's-thread driver: the step's gradients, averaged over the processes, into
        ``param.grad`` on this thread. Each step group's gradients are sent as soon as they are final, deepest
        first (the order they become final in, and the same on every process), so the communication runs while
        the shallower backward stages still compute; on the timeline as ``allreduce`` (host track
        ``communication``), from the first send to the last mean in place."""
        timeline = self._started()[2]
        averaging = self.data_parallel.start(params)
        lent = self._lent_now()
        started: float | None = None
        with self._surfaced():
            for index in reversed(range(len(groups))):
                window.wait_final(index)
                window.publish(lent, groups[index].params)
                started = timeline.now() if started is None else started
                averaging.send(groups[index].params)
            window.wait_complete()
        window.publish(lent)  # trainable trunk parameters the optimizer does not step
        averaging.finish()
        timeline.add("allreduce", f"average step {self.dispatcher.step}",
                     timeline.now() if started is None else started)

    def _lent_now(self) -> frozenset[int]:
        """Ids of the gradient tensors queued steps may still read: those the caller's thread handed over
        (they may stay in ``param.grad``), of the steps that have not ended (steps end in order). An id of a
        tensor that died meanwhile only makes one addition out of place."""
        while self._lent and self._lent[0][0].is_set():
            self._lent.popleft()
        return frozenset().union(*(ids for _, ids in self._lent))

    # ------------------------------------------------------------------ after a step
    def wait_for_steps(self) -> None:
        """Wait until every queued step has finished (and no longer reads the gradients it was handed)."""
        if self.last_step_done is not None:
            self.dispatcher.wait(self.last_step_done)

    def restore_gradients(self) -> None:
        """After :meth:`wait_for_steps`: ``RoundPipeEngine.restore_gradients``."""
        kept, self._kept = self._kept, None
        if kept is None:
            return
        step, params, lent = kept
        for param in params:
            grad, held = step.stepped_with.get(id(param)), param.grad
            if grad is None or grad is held or not (held is None or held is lent.get(id(param))):
                continue
            if held is not None and held.shape == grad.shape and held.dtype == grad.dtype:
                # the tensor the step was lent (gradients gathered for a hook, kept across steps), which it summed
                # out of place: the step is done, so the sum goes into it, as autograd accumulates into param.grad
                # in place; a reference user code kept to it then sees the step's gradients, as in plain training
                with torch.no_grad():
                    held.copy_(grad)
            else:
                param.grad = grad
