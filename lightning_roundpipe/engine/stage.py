"""Device-side work of one stage job: upload, bind into replicas, and run microbatches.

:class:`StageRunner` holds what every job needs (the trunk, the replicas of each device, where uploads
read weights from) and computes one microbatch of a forward, fused or backward job. It runs on the
devices' compute and parameter streams; the worker decides when. A :class:`StageCopy` is one job's
copy of its stage's tensors on one device (a plan's stage is only a range of layers).

A job records what it measures in its :class:`StageCopy` (device-time spans of each layer call and each
microbatch's compute, what its layers keep for backward); ``feedback.py`` resolves them when the job
finishes and feeds the planner.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_roundpipe.engine import batchnorm
from lightning_roundpipe.engine import replica as replicas
from lightning_roundpipe.engine.activations import ActivationMeter
from lightning_roundpipe.engine.call import Call, PipelineError
from lightning_roundpipe.engine.device import Device, EngineAborted, HostEvent, Residency, error_hint
from lightning_roundpipe.engine.layers import LayerInput, Trunk, as_layer_input, single_argument
from lightning_roundpipe.engine.recompute import layer_seed, recomputing, seeded
from lightning_roundpipe.engine.step.window import GradWindow
from lightning_roundpipe.engine.timing import Span
from lightning_roundpipe.engine.transfer import (
    clone_tree,
    copy_tensor,
    differentiable_leaves,
    nbytes_of,
    tensors_nbytes,
    tree_map,
)
from lightning_roundpipe.engine.transport import UploadSources
from lightning_roundpipe.observe.trace import Timeline
from lightning_roundpipe.planning.schedule import Job, StageKind


class ReplicaWriteWarning(UserWarning):
    """A trunk layer writes state in its forward that stays on its per-device copy (see ``replica.py``)."""


@dataclass
class Task:
    """A stage job as dispatched: the job, its call, and the events it waits for and sets."""

    job: Job
    call: Call
    window: GradWindow
    weights_ready: tuple[HostEvent, ...]  # the optimizer steps' events for the weights it uploads [2]
    buffer_waits: list[HostEvent]
    buffer_done: dict[int, HostEvent]
    upload_done: HostEvent
    done: HostEvent
    needs_grad: bool          # the job differentiates (fused, backward)
    # where each of its slots in the step's window takes its gradient from: (layer, position in the layer's
    # params); and its ticket there
    grad_positions: list[tuple[int, int]] = field(default_factory=list)
    ticket: int = -1
    # per layer, from bind to unbind: the replica's attributes as bound, and the buffers bound into it
    bound: dict[int, tuple[replicas.AttributeSnapshot, list[torch.Tensor]]] = field(default_factory=dict)
    # per layer, from bind to unbind: its training-mode BatchNorms whose updates wait for the whole call
    deferred: dict[int, list[batchnorm.DeferredNorm]] = field(default_factory=dict)
    # a forward job that keeps its graphs for its call's backward, or the backward job that uses them
    held: HeldGraph | None = None
    # set as its first microbatch starts back-propagating: the backward job that uses them (``run_backward``), and
    # on a one-device ring a training call's first backward job, after its recompute (``run_training``)
    backpropagating: HostEvent | None = None

    @property
    def kind(self) -> StageKind:
        return self.job.kind

    @property
    def keeps_graph(self) -> bool:
        """A forward job whose graphs its call's first backward job back-propagates (:class:`HeldGraph`)."""
        return self.held is not None and self.job.kind is StageKind.FORWARD

    @property
    def uses_kept_graph(self) -> bool:
        """A backward job that back-propagates the graphs its call's forward job kept: no upload, no recompute."""
        return self.held is not None and self.job.kind is StageKind.BACKWARD

    @property
    def recomputes(self) -> bool:
        """A backward job that recomputes its stage from checkpoints before back-propagating it."""
        return self.held is None and self.job.kind is StageKind.BACKWARD


@dataclass
class Recomputed:
    """A recompute group's autograd graph on the device, from its recompute until its backward: the group's
    layers, its input leaves (which collect the input gradients) and its output's differentiable leaves."""

    group: range
    leaves: list[torch.Tensor]
    outputs: list[torch.Tensor]

    def back_propagate(self, output_grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Back-propagate ``output_grads`` (one per output leaf; ``None``: none reaches it) through the graph,
        which frees it; returns the input leaves' gradients (``None`` for a leaf that takes none)."""
        pairs = [(o, g) for o, g in zip(self.outputs, output_grads, strict=True) if g is not None and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return [leaf.grad if leaf.requires_grad else None for leaf in self.leaves]


@dataclass(eq=False)
class HeldGraph:
    """The deepest stage's forward graphs of one transparent call, kept on its device from the forward job to
    the call's first backward job, which back-propagates them instead of recomputing that stage (the
    dispatcher decides when: :meth:`Dispatcher.new_call`). The forward job's stage copy stays with them,
    accounted on the device, and becomes the backward job's: that job uploads nothing.

    Dropped unused (the caller never back-propagated the call), it gives the device its bytes back when it
    is collected."""

    ready: HostEvent | None = None   # the forward job's done: its stage copy and graphs are complete
    stage_copy: StageCopy | None = None  # the forward job's (set by the worker that makes it)
    microbatches: dict[int, Recomputed] = field(default_factory=dict)  # per microbatch, from its compute
    _release: weakref.finalize | None = None
    _claimed: bool = False  # the call's backward has been dispatched

    def claim(self) -> None:
        """The call's backward is being dispatched, on the caller's thread: only once, since it frees the graphs.
        Checked there, before any job runs, so a second backward fails the same way whatever the timing."""
        if self._claimed:
            raise PipelineError(
                "the kept forward graphs of a pipelined call were already back-propagated: a pipelined call runs "
                "backward once (backward(retain_graph=True) through it twice is not supported)")
        self._claimed = True

    def keep(self, residency: Residency, nbytes: int) -> None:
        """The forward job is done: its stage copy's ``nbytes`` stay accounted on ``residency`` until the
        backward job adopts them (:meth:`adopt`) or this object is collected unused."""
        self._release = weakref.finalize(self, residency.release, nbytes, stage=True)

    def adopt(self) -> None:
        """The backward job (the only one: :meth:`claim`) takes the stage copy over, and releases it as its own."""
        assert self._release is not None, "adopted before the forward job kept its stage copy"
        self._release.detach()

    def take(self, microbatch: int) -> Recomputed:
        """``microbatch``'s forward graph, once: back-propagating it frees it."""
        return self.microbatches.pop(microbatch)


@dataclass
class StageCopy:
    """One job's copy of its stage on one device: the uploaded parameters and buffers, bound into that
    device's layer replicas while the job computes, and what the job measured."""

    params: dict[int, list[torch.Tensor]] = field(default_factory=dict)    # per layer, in LayerState order
    buffers: dict[int, list[torch.Tensor]] = field(default_factory=dict)   # per layer, in LayerState order
    nbytes: int = 0                      # accounted on the device from upload to release, gradients included
    device: Device | None = None         # the device it is on (set by the worker that makes it)
    # device-time spans of the compute stream (timing.py), resolved when the job finishes
    layer_spans: list[tuple[int, Span]] = field(default_factory=list)    # (layer, span) per layer call
    # (microbatch, timeline kind, span) per compute: a backward microbatch has two, "recompute" then "backward"
    compute_spans: list[tuple[int, str, Span]] = field(default_factory=list)
    forward_time: dict[int, float] = field(default_factory=dict)  # per layer, summed over microbatches (resolved)
    compute_time: float = 0.0            # all compute of the job, summed over microbatches (resolved)
    activations: ActivationMeter | None = None  # differentiating job: what the computing microbatch keeps for backward
    activation_bytes: dict[int, int] = field(default_factory=dict)  # per layer, the most one microbatch kept

    def tensors(self) -> list[torch.Tensor]:
        """The tensors of this copy on its device, gradients included."""
        tensors = [tensor for tensors in (*self.params.values(), *self.buffers.values()) for tensor in tensors]
        return tensors + [tensor.grad for tensor in tensors if tensor.grad is not None]


class UploadSpares:
    """The memory of released stage copies, reused by a CPU stand-in device's next uploads of the same shapes.

    Torch's CPU allocator gives large blocks back to the system, so every upload would page-fault fresh
    memory (on a 5M-parameter stage about three times the copy's own time); a GPU's caching allocator reuses
    its blocks itself, so CUDA devices do not use this. Nor does stress mode, whose released memory must stay
    poisoned. A stage copy is released when ``operations.finish`` has cleared its tensors (nothing reads them
    after that); it keeps at most twice the largest upload. Used from the device's parameter stream only."""

    _WATCHED = 8  # stage copies watched for their release, at most
    SMALLEST = 64 * 2**10  # bytes: smaller blocks come from the allocator's free lists, already touched

    def __init__(self) -> None:
        self._watched: deque[tuple[StageCopy, list[tuple[tuple[Any, ...], torch.Tensor]]]] = deque()
        self._free: dict[tuple[Any, ...], list[torch.Tensor]] = {}
        self._free_bytes = 0
        self._most = 0  # the largest upload seen, in bytes

    @staticmethod
    def _key(tensor: torch.Tensor) -> tuple[Any, ...]:
        return tuple(tensor.shape), tensor.stride(), tensor.dtype

    def copy_all(self, sources: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        """``copy_tensor(source, device)`` of each of ``sources``, into a spare of its shape where there is one;
        the copies into spares in one torch call, as each call gives up the GIL and may wait for it while another
        thread runs Python (``transport.StagingBuffer.views``)."""
        copies: list[torch.Tensor] = []
        into, sent = [], []  # spares and their sources
        for source in sources:
            spares = (self._free.get(self._key(source))
                      if type(source) is torch.Tensor and nbytes_of(source) >= self.SMALLEST else None)
            if not spares:
                copies.append(copy_tensor(source, device))
                continue
            target = spares.pop()
            self._free_bytes -= nbytes_of(target)
            copies.append(target)
            into.append(target)
            sent.append(source)
        if into:
            torch._foreach_copy_(into, sent)
        return copies

    def collect(self) -> None:
        """Take back what the stage copies released since the last call held."""
        for _ in range(len(self._watched)):
            stage_copy, tensors = self._watched.popleft()
            if stage_copy.params:  # not released yet
                self._watched.append((stage_copy, tensors))
                continue
            for key, tensor in tensors:
                self._free.setdefault(key, []).append(tensor)
                self._free_bytes += nbytes_of(tensor)
        while self._free_bytes > 2 * self._most:  # the oldest shapes go first
            key = next(iter(self._free))
            self._free_bytes -= nbytes_of(self._free[key].pop())
            if not self._free[key]:
                del self._free[key]

    def watch(self, stage_copy: StageCopy, copies: list[torch.Tensor]) -> None:
        """``copies`` (made by :meth:`copy_all`) are free once ``stage_copy`` is released."""
        self._most = max(self._most, tensors_nbytes(copies))
        # detached aliases: the same memory, not the stage's tensors (their gradients and autograd state)
        self._watched.append((stage_copy, [(self._key(tensor), tensor.detach()) for tensor in copies
                                           if type(tensor) is torch.Tensor and nbytes_of(tensor) >= self.SMALLEST]))
        while len(self._watched) > self._WATCHED:
            self._watched.popleft()


class StageRunner:
    """Runs stage jobs' device-side steps; shared by the workers of one engine."""

    def __init__(self, trunk: Trunk, num_devices: int, recompute: str, timeline: Timeline, base_seed: int,
                 sources: UploadSources, deferred_batchnorm: bool = False, measure_times: bool = False) -> None:
        self.trunk = trunk
        self.recompute = recompute
        self._deferred_batchnorm = deferred_batchnorm
        # per layer, the BatchNorms whose running statistics forward and fused jobs commit once per call
        self._norms = ([batchnorm.norm_buffers(layer, state) for layer, state in zip(trunk.layers, trunk.states,
                                                                                   strict=True)]
                       if deferred_batchnorm else [[] for _ in trunk.layers])
        self.timeline = timeline
        self.base_seed = base_seed
        self._sources = sources
        self._bindings: list[dict[int, replicas.Binding]] = [{} for _ in range(num_devices)]  # per device, by layer
        self._spares = [UploadSpares() for _ in range(num_devices)]  # per device (CPU stand-ins only)
        self._measure_times = measure_times  # time each layer call (for the planner: Measurements.measure_times)
        self._warned_writes: set[int] = set()  # layers warned about writing state in forward
        self._warn_lock = threading.Lock()

    def follow_layers(self, layers: list[int]) -> None:
        """Layers whose state the trunk collected again (:meth:`Trunk.recollect`): their replicas are made
        again from the host layers at their next job, and their BatchNorms found again. Call it while no job
        runs (the engine waits for them first)."""
        for layer in layers:
            for bindings in self._bindings:
                bindings.pop(layer, None)
            if self._deferred_batchnorm:
                self._norms[layer] = batchnorm.norm_buffers(self.trunk.layers[layer], self.trunk.states[layer])

    def replica(self, device: Device, layer: int) -> nn.Module:
        return self._binding(device, layer).replica

    def _binding(self, device: Device, layer: int) -> replicas.Binding:
        bindings = self._bindings[device.index]
        binding = bindings.get(layer)
        if binding is None:
            binding = bindings[layer] = replicas.Binding(self.trunk.layers[layer], self.trunk.states[layer])
        return binding

    def upload_stage(self, device: Device, task: Task, stage_copy: StageCopy) -> None:
        """Copy the job's parameters and buffers to the device into ``stage_copy`` (made earlier by the
        worker, which hands it to the job before the copy has run); runs on the parameter stream."""
        differentiate = task.needs_grad
        # on a GPU every copy is enqueued at once and the stream synchronized once, below: the host source
        # (the published copy in async mode) may be rewritten as soon as this upload reports done
        asynchronous = device.is_cuda
        sources = self._sources
        low_precision = (sources.transport is not None
                         and task.call.context.autocast_dtype(device.torch_device.type) == sources.transport)
        uploaded = 0
        # (layer, position, dtype): low-precision copies (async's, narrowed frozen weights) in a call outside autocast
        widen: list[tuple[int, int, torch.dtype]] = []
        spares = None if device.is_cuda or device.stress else self._spares[device.index]
        if spares is not None:
            spares.collect()

        def copy(sources: list[torch.Tensor], to: torch.device) -> list[torch.Tensor]:
            if spares is not None:
                return spares.copy_all(sources, to)
            return [copy_tensor(source, to, asynchronous) for source in sources]
        made: list[torch.Tensor] = []
        # a backward job recomputes each layer on the buffer snapshots its forward saw (bound before the layer
        # runs) and writes no buffer: the live buffers, which another job may be writing back, are not uploaded
        upload_buffers = task.kind is not StageKind.BACKWARD
        for layer in task.job.layers:
            state = self.trunk.states[layer]
            host = [sources.source(param, layer, low_precision) for param in state.params]
            params = copy(host, device.torch_device)
            host_buffers = [buffer.detach() for buffer in state.buffers] if upload_buffers else []
            buffers = copy(host_buffers, device.torch_device)
            made += params + buffers
            if device.stress:  # the copies land late, at the synchronize below
                device.param_stream.copy_late(host + host_buffers, params + buffers)
            if not low_precision:
                wide = [sources.module_dtype(param) for param in state.params]
                widen += [(layer, position, dtype) for position, (dtype, copied)
                          in enumerate(zip(wide, params, strict=True)) if copied.dtype != dtype]
            stage_copy.params[layer], stage_copy.buffers[layer] = params, buffers
            uploaded += tensors_nbytes(params) + tensors_nbytes(buffers)
        device.param_stream.synchronize()
        if spares is not None:
            spares.watch(stage_copy, made)
        for layer, position, dtype in widen:  # after the copies have landed
            stage_copy.params[layer][position] = stage_copy.params[layer][position].to(dtype)
        resident = 0
        for layer in task.job.layers:
            for param, copied in zip(self.trunk.states[layer].params, stage_copy.params[layer], strict=True):
                # a differentiating job's leaves collect its gradients on the device, in their own dtype
                copies = 2 if differentiate and param.requires_grad else 1
                # a trained parameter requires grad in a forward-only job too, as in plain training (no_grad
                # records nothing, so it costs nothing): torch.matmul folds a non-contiguous batched input
                # into one mm only when an operand requires grad, whatever the grad mode, so F.linear on
                # one (nn.MultiheadAttention's input projection) rounds differently without it; the
                # forward's outputs, which the loss is computed from, must be bitwise the recompute's and
                # plain training's
                if param.requires_grad:
                    copied.requires_grad = True  # not requires_grad_(): no dispatcher call, which gives up the GIL
                resident += copies * nbytes_of(copied)
            resident += tensors_nbytes(stage_copy.buffers[layer])
        stage_copy.nbytes = resident
        device.residency.allocate(stage_copy.nbytes, f"the parameters of stage {task.job.label}", stage=True)
        device.counters.uploaded_param_bytes += uploaded

    def bind(self, device: Device, task: Task, stage_copy: StageCopy) -> None:
        # a backward job uploads no buffer: its replicas keep the host's until the recompute binds snapshots
        backward = task.kind is StageKind.BACKWARD
        for layer in task.job.layers:
            binding = self._binding(device, layer)
            buffers = list(self.trunk.states[layer].buffers) if backward else stage_copy.buffers[layer]
            binding.bind(stage_copy.params[layer], buffers)
            # the flags first: the attribute snapshot then holds them, and the next job's sync finds them unchanged
            binding.set_training_flags(task.call.context.training[layer])
            attributes = binding.sync_attributes()
            task.bound[layer] = (attributes, stage_copy.buffers[layer])
            if self._norms[layer] and task.kind is not StageKind.BACKWARD:  # a backward job writes no buffer
                deferred = batchnorm.defer(binding.replica, self._norms[layer], stage_copy.buffers[layer])
                if deferred:
                    task.deferred[layer] = deferred

    def unbind(self, device: Device, task: Task) -> None:
        for layer in task.job.layers:
            binding = self._binding(device, layer)
            bound = task.bound.pop(layer, None)
            deferred = task.deferred.pop(layer, None)
            if deferred is not None and bound is not None:  # before the check: the replica is as bound again
                batchnorm.commit(deferred, bound[1])
                binding.bind_buffers(bound[1])
            if bound is not None and layer not in self._warned_writes:
                self._check_writes(layer, binding, *bound, task.kind)
            binding.unbind(self.trunk.states[layer])

    def _check_writes(self, layer: int, binding: replicas.Binding, attributes: replicas.AttributeSnapshot,
                      buffers: list[torch.Tensor], kind: StageKind) -> None:
        """Warn (once per layer) when the layer's forward wrote state that stays on its replica."""
        written = replicas.written_attributes(binding.replica, attributes)
        # a backward job rebinds buffers itself (snapshots for the recompute); its forward job already checked
        rebound = [] if kind is StageKind.BACKWARD else binding.rebound_buffers(self.trunk.states[layer], buffers)
        if not written and not rebound:
            return
        with self._warn_lock:
            if layer in self._warned_writes:
                return
            self._warned_writes.add(layer)
        name = type(self.trunk.layers[layer]).__name__
        problems = []
        if written:
            problems.append(
                f"assigns the attribute(s) {', '.join(f'`{n}`' for n in written)} in its forward. Each device runs "
                "the layer on its own copy, which starts every job from the host layer's attributes, so the write "
                "lands on the copy and is lost: the host layer (and other devices, and later jobs) never see it, "
                "unlike plain training. Keep such state in a registered buffer updated in place "
                "(`self.register_buffer('calls', torch.zeros(()))`, then `self.calls += 1`), or compute it "
                "outside the trunk. (A cache the forward rebuilds from its inputs, parameters or buffers loses "
                "nothing: declare it with `roundpipe_transient = ('name',)` on the layer's class.)")
        if rebound:
            problems.append(
                f"assigns new tensors to the buffer(s) {', '.join(f'`{n}`' for n in rebound)} in its forward. "
                "After a job the pipeline copies back the buffer tensors it bound into the layer's copy, so the "
                "new tensors are lost; update buffers in place instead (`self.ema.mul_(0.9).add_(x.mean(), "
                "alpha=0.1)`, `self.buffer.copy_(value)`)")
        warnings.warn(f"trunk layer {layer} ({name}) " + "; it also ".join(problems) + " (shown once per layer)",
                      ReplicaWriteWarning, stacklevel=2)

    def _run_layer(self, device: Device, task: Task, layer: int, microbatch: int, layer_input: LayerInput,
                   stage_copy: StageCopy) -> Any:
        call = task.call
        args, kwargs = layer_input
        module = self.replica(device, layer)
        timer = device.compute_timer if self._measure_times else None  # per-layer times serve the planner only
        started = timer.start() if timer is not None else None
        meter = stage_copy.activations
        try:
            with meter.saving(layer) if meter is not None else contextlib.nullcontext():
                if layer in call.context.random_layers:
                    seed = layer_seed(self.base_seed, call.step, call.index, layer, microbatch)
                    with seeded(seed, device.torch_device):
                        output = module(*args, **kwargs)
                else:
                    output = module(*args, **kwargs)
        except EngineAborted:
            raise
        except Exception as error:
            raise PipelineError(
                f"trunk layer {layer} raised {type(error).__name__} in stage {task.job.label} "
                f"(job {task.job.index}, device {device.index}, microbatch {microbatch}): {error}"
                f"{error_hint(error, device.residency.advice)}"
            ) from error
        if timer is not None:
            stage_copy.layer_spans.append((layer, timer.stop(started)))
        return output

    def forward_microbatch(self, device: Device, task: Task, stage_copy: StageCopy, microbatch: int,
                           layer_input: LayerInput) -> tuple[LayerInput, dict[int, LayerInput],
                                                             dict[int, list[torch.Tensor]]]:
        """Run a forward stage on one microbatch. Returns the next stage's input, and the checkpoints
        (layer inputs) and buffer snapshots a backward stage recomputes from, by layer."""
        call = task.call
        checkpoints: dict[int, LayerInput] = {}
        snapshots: dict[int, list[torch.Tensor]] = {}
        value = layer_input
        self._start_microbatch(task)
        for layer in task.job.layers:
            if layer in call.checkpoint_layers and layer != task.job.layers.start:
                # a copy: the next layer may work in place on its input before the download runs
                checkpoints[layer] = clone_tree(value)
            if call.checkpoint_layers and stage_copy.buffers[layer]:
                snapshots[layer] = [buffer.clone() for buffer in stage_copy.buffers[layer]]
            value = as_layer_input(self._run_layer(device, task, layer, microbatch, value, stage_copy))
        return value, checkpoints, snapshots

    @staticmethod
    def _start_microbatch(task: Task) -> None:
        for deferred in task.deferred.values():
            batchnorm.start_microbatch(deferred)

    def _prepare_inputs(self, layer_input: Any, requires_grad: list[bool] | None) -> tuple[list[torch.Tensor], Any]:
        """Make the differentiable inputs leaves that collect gradients; returns them and the input to run,
        in which they are replaced by clones so a layer may modify its input in place (as it can in plain
        training, where its input is not a leaf)."""
        leaves = differentiable_leaves(layer_input)
        clones: dict[int, torch.Tensor] = {}
        for position, leaf in enumerate(leaves):
            if requires_grad is None or requires_grad[position]:
                leaf.requires_grad_(True)
                clones[id(leaf)] = leaf.clone()
        value = tree_map(lambda t: clones.get(id(t), t) if isinstance(t, torch.Tensor) else t, layer_input)
        return leaves, value

    def fused_microbatch(self, device: Device, task: Task, stage_copy: StageCopy, microbatch: int,
                         layer_input: LayerInput, target: Any) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """Run the fused stage on one microbatch: its layers, the loss, and the backward. Returns the
        detached loss and the gradients of the stage input's differentiable leaves."""
        call = task.call
        fused = call.fused_loss
        first = task.job.layers.start
        self._start_microbatch(task)
        with call.context.applied(grad=True):
            leaves, value = self._prepare_inputs(layer_input, call.input_requires_grad if first == 0 else None)
            for layer in task.job.layers:
                value = as_layer_input(self._run_layer(device, task, layer, microbatch, value, stage_copy))
            output = single_argument(value)
            meter = stage_copy.activations  # what the loss saves for backward counts as the last layer's
            try:
                with meter.saving(task.job.layers[-1]) if meter is not None else contextlib.nullcontext():
                    loss = fused.loss_fn(output, target)
            except Exception as error:
                raise PipelineError(
                    f"the loss function raised {type(error).__name__} in the fused stage (device {device.index}, "
                    f"microbatch {microbatch}): {error}{error_hint(error, device.residency.advice)}") from error
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise PipelineError(
                    f"the loss function must return a scalar tensor (the microbatch mean), got "
                    f"{type(loss).__name__} of shape {getattr(loss, 'shape', None)}")
            weight = fused.scales[microbatch]
            if weight != 0.0 and loss.requires_grad:
                (loss.reshape(()) * (weight * fused.backward_scale)).backward()
                if meter is not None:
                    meter.release()  # the backward has freed what the forward saved
        return loss.detach().reshape(()), [leaf.grad if leaf.requires_grad else None for leaf in leaves]

    def forward_keeping_graph(self, device: Device, task: Task, stage_copy: StageCopy, microbatch: int,
                              layer_input: LayerInput) -> LayerInput:
        """Run the deepest stage of a transparent call on one microbatch recording its autograd graph, which
        stays on the device in ``task.held`` for the call's backward (as the fused stage's would, minus the
        loss). Returns the stage output (the call's), without checkpoints or snapshots: nothing recomputes."""
        call = task.call
        first = task.job.layers.start
        with call.context.applied(grad=True):
            leaves, value = self._prepare_inputs(layer_input, call.input_requires_grad if first == 0 else None)
            for layer in task.job.layers:
                value = as_layer_input(self._run_layer(device, task, layer, microbatch, value, stage_copy))
        assert task.held is not None
        task.held.microbatches[microbatch] = Recomputed(
            task.job.layers, leaves, differentiable_leaves(single_argument(value)))
        return value

    @staticmethod
    def backward_kept_graph(task: Task, microbatch: int,
                            output_grads: list[torch.Tensor | None] | None) -> list[torch.Tensor | None] | None:
        """Back-propagate ``output_grads`` through the graph the call's forward job kept for ``microbatch``
        (:meth:`forward_keeping_graph`); returns the stage input's gradients, or None when no gradient
        reaches the stage (the graph is dropped, which frees it)."""
        assert task.held is not None
        graph = task.held.take(microbatch)
        if output_grads is None or all(g is None for g in output_grads):
            return None
        with task.call.context.applied(grad=True):
            return graph.back_propagate(output_grads)

    def _recompute_groups(self, layers: range) -> list[range]:
        """A backward stage's recompute groups, shallow to deep: stage grain, one recompute of every layer
        from the stage input; layer grain, one layer at a time from its own input."""
        return [layers] if self.recompute == "stage" else [range(layer, layer + 1) for layer in layers]

    def _recompute_group(self, device: Device, task: Task, stage_copy: StageCopy, microbatch: int, group: range,
                         checkpoints: dict[int, LayerInput], snapshots: dict[int, list[torch.Tensor]]) -> Recomputed:
        """Run ``group``'s layers from its checkpoint, recording the autograd graph (under the call's context
        and :func:`recomputing`, which the caller enters)."""
        call = task.call
        leaves, value = self._prepare_inputs(checkpoints[group.start],
                                             call.input_requires_grad if group.start == 0 else None)
        for layer in group:
            if layer in snapshots:
                self._binding(device, layer).bind_buffers(snapshots[layer])
            value = as_layer_input(self._run_layer(device, task, layer, microbatch, value, stage_copy))
        return Recomputed(group, leaves, differentiable_leaves(single_argument(value)))

    def recompute_microbatch(self, device: Device, task: Task, stage_copy: StageCopy, microbatch: int,
                             checkpoints: dict[int, LayerInput],
                             snapshots: dict[int, list[torch.Tensor]]) -> Recomputed:
        """The first part of a backward stage's microbatch, run before its output gradient has arrived (it
        needs only the checkpoints, on the host long before): recompute the deepest group (the whole stage at
        stage grain). :meth:`backward_microbatch` continues from it."""
        with task.call.context.applied(grad=True), recomputing():
            return self._recompute_group(device, task, stage_copy, microbatch,
                                         self._recompute_groups(task.job.layers)[-1], checkpoints, snapshots)

    def backward_microbatch(self, device: Device, task: Task, stage_copy: StageCopy, microbatch: int,
                            recomputed: Recomputed, checkpoints: dict[int, LayerInput],
                            snapshots: dict[int, list[torch.Tensor]],
                            output_grads: list[torch.Tensor | None] | None) -> list[torch.Tensor | None] | None:
        """Back-propagate ``output_grads`` (per differentiable leaf of the stage output) through the deepest
        group ``recomputed`` ahead (:meth:`recompute_microbatch`), then recompute and back-propagate each
        shallower group from its checkpoint (layer grain). Returns the gradients of the stage input's
        differentiable leaves, or None when no gradient reaches the stage (the recompute ahead was wasted)."""
        meter = stage_copy.activations
        if output_grads is None or all(g is None for g in output_grads):
            return None  # dropping the recomputed graph frees what it saved; the caller releases the meter
        grads = output_grads
        with task.call.context.applied(grad=True), recomputing():
            for group in reversed(self._recompute_groups(task.job.layers)):
                if group != recomputed.group:
                    recomputed = self._recompute_group(device, task, stage_copy, microbatch, group, checkpoints,
                                                       snapshots)
                grads = recomputed.back_propagate(grads)
                if meter is not None:
                    meter.release()  # the group's backward has freed what its recompute saved
        return grads

