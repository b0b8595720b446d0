"""The state of one trunk call: what the caller's thread set, and the host data between stages.

A call keeps, on the host, the inputs of its microbatches, the checkpoints backward stages recompute
from, buffer snapshots for those recomputes, and one :class:`HostCell` per (job, microbatch) output. Cells
are made on the main thread at dispatch, in ring order, because the job that reads one may be enqueued
by its device's worker before the producing job's worker has even started.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from lightning_roundpipe.engine.device import HostEvent, poison
from lightning_roundpipe.engine.errors import PipelineError as PipelineError  # re-exported: its home before errors.py
from lightning_roundpipe.engine.layers import Trunk
from lightning_roundpipe.engine.recompute import module_draws_random_numbers
from lightning_roundpipe.engine.transfer import tree_tensors
from lightning_roundpipe.planning.partition import Plan
from lightning_roundpipe.planning.schedule import Job, StageKind

if TYPE_CHECKING:
    from lightning_roundpipe.engine.stage import HeldGraph


@dataclass(frozen=True)
class CallContext:
    """Thread-local state of the caller that must reach the workers, captured when the call starts."""

    grad_enabled: bool
    inference: bool
    autocast: tuple[tuple[str, bool, torch.dtype], ...]
    training: tuple[tuple[bool, ...], ...]
    random_layers: frozenset[int]

    @staticmethod
    def capture(trunk: Trunk) -> CallContext:
        autocast = tuple(
            (kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)) for kind in ("cpu", "cuda")
        )
        training: list[tuple[bool, ...]] = []
        random_layers: set[int] = set()
        for index, layer in enumerate(trunk.layers):  # one walk of each layer's modules: this runs every call
            modules = tuple(layer.modules())
            training.append(tuple(module.training for module in modules))
            if any(module_draws_random_numbers(module) for module in modules):
                random_layers.add(index)
        return CallContext(torch.is_grad_enabled(), torch.is_inference_mode_enabled(), autocast, tuple(training),
                           frozenset(random_layers))

    def autocast_dtype(self, device_type: str) -> torch.dtype | None:
        """The dtype autocast runs the call in on ``device_type`` devices; None without autocast there."""
        for kind, enabled, dtype in self.autocast:
            if kind == device_type and enabled:
                return dtype
        return None

    @contextmanager
    def applied(self, grad: bool):
        with ExitStack() as stack:
            if self.inference:
                stack.enter_context(torch.inference_mode())
            else:
                stack.enter_context(torch.set_grad_enabled(grad))
            for kind, enabled, dtype in self.autocast:
                if enabled:
                    stack.enter_context(torch.autocast(kind, dtype=dtype, cache_enabled=False))
            yield


class HostCell:
    """A host value produced by one stream and read by another after ``event``, with its readers counted.

    Jobs that will read the value are counted when they are dispatched (:meth:`expect_reader`); each
    :meth:`consume` after its copy, and the last one drops the value, so stage boundaries and
    checkpoints stay in host memory only while a job still needs them. Values nobody counted (what the
    caller reads: the call's outputs, losses) stay until the call ends.

    A value put with ``poison_on_drop`` (stress mode: a host copy the engine downloaded, never the
    user's data) is poisoned when the last counted reader drops it.
    """

    __slots__ = ("value", "event", "_readers", "_lock", "_poison_on_drop")

    def __init__(self, name: str) -> None:
        self.value: Any = None
        self.event = HostEvent(name)
        self._readers = 0
        self._lock = threading.Lock()
        self._poison_on_drop = False

    def expect_reader(self) -> None:
        with self._lock:
            self._readers += 1

    def consume(self) -> None:
        """One counted reader has its copy; the last one drops the value."""
        with self._lock:
            if self._readers == 0:
                raise RuntimeError(
                    f"{self.event.name} was read by more jobs than were counted: call expect_reader() at dispatch "
                    "for every job that reads it, so that its value is not dropped before the last one has it")
            self._readers -= 1
            if self._readers == 0:
                if self._poison_on_drop:
                    poison(tree_tensors(self.value))
                self.value = None

    def take(self) -> Any:
        """The caller's read of a value no job reads (a call's output): returns it and drops the cell's reference,
        so that the value lives exactly as long as the caller keeps it."""
        with self._lock:
            if self._readers:
                raise RuntimeError(f"{self.event.name} is still to be read by {self._readers} job(s); only a value "
                                   "no job reads may be taken")
            value, self.value = self.value, None
        return value

    def put(self, value: Any, poison_on_drop: bool = False, copied: torch.cuda.Event | None = None) -> None:
        """Publish ``value``. ``copied``: a CUDA event after the copies that fill it, still running: a reader's
        stream waits for it on the GPU, a host reader synchronizes it (see ``RoundPipeEngine._wait``)."""
        self.value = value
        self._poison_on_drop = poison_on_drop
        self.event.cuda_event = copied
        self.event.set()

    @staticmethod
    def ready(value: Any) -> HostCell:
        cell = HostCell("ready")
        cell.put(value)
        return cell


@dataclass
class FusedLoss:
    """The loss a fused-path call (``forward_backward``) computes and back-propagates in its fused stage."""

    loss_fn: Callable[[Any, Any], torch.Tensor]
    targets: list[Any]           # per microbatch, on the host
    scales: list[float]          # per microbatch: its loss weight / the batch's, so the sum is the batch loss
    backward_scale: float        # multiplies the loss before backward only (accumulation, loss scaling)
    losses: list[HostCell]       # per microbatch: the detached microbatch loss, downloaded


@dataclass
class Call:
    """Everything one trunk call keeps on the host between its forward and backward jobs.

    A fused-path call (``forward_backward``) also has :attr:`fused`; a transparent call (the engine
    called like a module, backward through autograd) uses :attr:`first_grads`.
    """

    step: int
    index: int
    plan: Plan
    context: CallContext
    sizes: list[int]
    inputs: list[HostCell]                  # per microbatch: (args, kwargs) for layer 0
    input_requires_grad: list[bool]          # per differentiable leaf of the inputs
    checkpoint_layers: frozenset[int]
    checkpoints: dict[tuple[int, int], HostCell] = field(default_factory=dict)
    snapshots: dict[tuple[int, int], HostCell] = field(default_factory=dict)
    outputs: dict[int, dict[int, HostCell]] = field(default_factory=dict)  # job index -> microbatch -> its output
    fused: FusedLoss | None = None                            # fused path: set before its jobs are dispatched
    first_grads: list[HostCell] | None = None                 # transparent backward: from autograd
    held: HeldGraph | None = None  # transparent call: the deepest stage's graphs, kept for its backward

    def holds(self, job: Job) -> bool:
        """``job`` is the forward job that keeps the deepest stage's graphs or the backward job that uses them."""
        return self.held is not None and job.kind is not StageKind.FUSED and job.layers == self.plan.fused

    @property
    def fused_loss(self) -> FusedLoss:
        """:attr:`fused`, for the fused stage, which only a fused-path call has."""
        if self.fused is None:
            raise RuntimeError(f"call {self.index} of step {self.step} has a fused stage but no fused loss; "
                               "set `Call.fused` before dispatching a fused-path call")
        return self.fused

    def input_cell(self, job: Job, microbatch: int) -> HostCell:
        """What ``job`` reads for ``microbatch`` (an index into the call's batch, one of ``job.microbatches``):
        the previous job's output, else the first output gradient (the first backward stage of a transparent
        call), else the call's input."""
        if job.depends_on:
            return self.outputs[job.depends_on[-1]][microbatch]
        if job.kind is StageKind.BACKWARD:
            if self.first_grads is None:
                raise RuntimeError(f"backward stage {job.label} (job {job.index}) of call {self.index} has no "
                                   "output gradients to read; dispatch a transparent backward with them")
            return self.first_grads[microbatch]
        return self.inputs[microbatch]

    def job_outputs(self, job: Job) -> list[HostCell]:
        """``job``'s output cells, in microbatch order."""
        outputs = self.outputs[job.index]
        return [outputs[microbatch] for microbatch in job.microbatches]

    @property
    def num_microbatches(self) -> int:
        return len(self.sizes)
