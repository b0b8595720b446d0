"""The strategy's options, declared once.

Two dataclasses hold every option of :class:`~lightning_roundpipe.strategy.RoundPipeStrategy`:
:class:`StrategyOptions` (how the strategy drives Lightning: trunk, ring, metrics, timeline, pre-flight)
and :class:`~lightning_roundpipe.engine.options.EngineOptions` (how the engine runs). Every other
declaration is built from them or checked against them by ``tests/test_options.py``: the strategy's
keyword arguments and their defaults, its docstring's Args, the Hydra schema (``app/schema.RoundPipeConf``
is made from :func:`option_specs`), ``app/conf/strategy/roundpipe.yaml`` and the README's options tables.

The timeline knobs: ``timeline`` switches recording on (at the cost of one branch per operation when
off); ``timeline_dir`` says where the files go and ``timeline_steps`` how much of the run they keep.
Giving ``timeline_dir`` switches recording on by itself. The engine's ``record_timeline`` is not a
strategy option: the strategy sets it from ``timeline``.

Imports no torch, so the Hydra app can build its schema from these fields cheaply.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, get_args, get_type_hints

from lightning_roundpipe.engine.options import EngineOptions, OptionError, check_count, check_flag

ReduceDtype = Literal["auto", "float32", "bfloat16"]
REDUCE_DTYPES: tuple[str, ...] = get_args(ReduceDtype)
PreflightMode = Literal["refuse", "warn", "off"]
PREFLIGHT_MODES: tuple[str, ...] = get_args(PreflightMode)
KeepGradients = Literal["auto", "always"]
KEEP_GRADIENTS: tuple[str, ...] = get_args(KeepGradients)

TIMELINE_MAX_EVENTS = 200_000
"""The most timeline events a strategy keeps (about 40 MB), whatever ``timeline_steps`` says."""

SET_BY_STRATEGY = frozenset({"record_timeline"})
"""``EngineOptions`` fields that are not strategy options: the strategy sets them itself."""


@dataclass
class StrategyOptions:
    """How :class:`~lightning_roundpipe.strategy.RoundPipeStrategy` drives Lightning. Every field has a safe
    default; the engine's own options are :class:`~lightning_roundpipe.engine.options.EngineOptions`."""

    pipeline: str | None = None
    """Dotted attribute path of the trunk in the LightningModule (e.g. ``"net"``, ``"model.blocks"``): an
    ``nn.Sequential`` whose children are the layers, or a Hugging Face causal LM. ``None``: the first
    Hugging Face causal LM, else the ``nn.Sequential`` holding the most parameters; the choice is logged."""

    ring: list[int] | None = None
    """The ring's members as indices into the Trainer's devices, e.g. ``[0, 0]`` with ``devices=1``: two
    ring members on one GPU (Lightning itself refuses duplicate device ids). ``None``: each device once.
    With ``rings_per_node > 1`` the indices are into each process's share of the node's devices."""

    rings_per_node: int = 1
    """Processes per node, each driving a ring of ``devices // rings_per_node`` of the node's devices (the
    Trainer's ``devices`` stays the number of devices per node, which must be a multiple of this). With more
    than one process in all (``rings_per_node * num_nodes``), the processes train data parallel: each on its
    own share of the data (Lightning's ``DistributedSampler``), the gradients of every step averaged across
    them before the step, as with ``strategy="ddp"``. One ring per node (the default) is usually best: every
    process holds a full host copy of the training state; two suit a two-socket machine (one per socket)."""

    shard_optimizer: bool = False
    """With several processes: each keeps the host optimizer state of about ``1 / world_size`` of the
    parameters (whole parameters; ZeRO-1), steps those alone and broadcasts them to the others, so a node holds
    less host memory (AdamW: 16 bytes per parameter become 8 + 8 / world_size) and the host step shrinks, for one
    broadcast of the weights per step. Gradients are still averaged whole, so clipping and hooks see them all;
    checkpoints are gathered whole on process 0 and resume on any number of processes. Needs an optimizer that
    updates each parameter on its own (every ``torch.optim`` one but LBFGS)."""

    reduce_dtype: ReduceDtype = "auto"
    """With several processes: the dtype the gradients are averaged in. ``"auto"``: each gradient's own (the
    masters', float32 under mixed precision); ``"bfloat16"`` halves the bytes sent, at bfloat16's precision for
    the mean (about 3 significant digits); ``"float32"``."""

    log_pipeline_metrics: bool = True
    """Log ``roundpipe/*`` figures (bubble ratio, peak device bytes, bytes uploaded, host step time and the
    part of it the devices waited for) every ``log_every_n_steps`` optimizer steps, each over the steps since the
    last."""

    timeline: bool = False
    """Record the pipeline's timeline (every upload, compute, download and host optimizer step) and, when
    the strategy tears down (after an exception too, without masking it), write ``timeline.json`` (a
    Chrome trace: open it at https://ui.perfetto.dev) and ``timeline.png`` (a Gantt chart; needs
    ``pip install 'lightning_roundpipe[plot]'``, else a warning and the trace only). ``False``: nothing
    is recorded, at the cost of one branch per operation."""

    timeline_dir: str | None = None
    """Where ``timeline`` writes its files. ``None``: the Trainer's ``default_root_dir`` (in the Hydra app,
    the run's folder). Giving a folder switches ``timeline`` on."""

    timeline_steps: int | None = 3
    """The timeline keeps only the events of the last this many optimizer steps (and of what ran since the
    last one, e.g. a final validation), so a long run's timeline stays small; at most
    ``TIMELINE_MAX_EVENTS`` events whatever happens. ``None``: every step."""

    preflight: PreflightMode = "refuse"
    """The memory plan made at setup, before any thread starts (:mod:`lightning_roundpipe.preflight`): host
    bytes for parameters, gradients, optimizer state and device copies against what the machine allows, and
    the largest layer and stages against ``device_memory_limit``; logged and kept as
    ``strategy.memory_plan``. ``"refuse"``: raise ``HostMemoryError`` or ``DeviceMemoryError`` naming what
    does not fit, by how much and what to change. ``"warn"``: warn and train anyway. ``"off"``: no plan."""

    fp16_accumulation: bool = False
    """CUDA under ``precision="16-mixed"`` only: fp16 matmuls accumulate in fp16 instead of fp32
    (``torch.backends.cuda.matmul.allow_fp16_accumulation``, set for the run and restored at teardown; it is
    process-global), about twice the matmul rate on consumer GPUs, at fp16's precision for every sum (a 10-bit
    mantissa: a dot product of length K loses about log2(K) of those bits, and a partial sum past 65504 becomes
    inf). Refused on CPU devices, under another precision and with a torch that lacks the flag."""

    keep_gradients: KeepGradients = "auto"
    """Sync mode: whether ``param.grad`` holds each step's gradients after it, until ``zero_grad``, as under
    Lightning's default strategy. ``"auto"``: only where something may read them whole: a gradient hook
    (``on_after_backward``, ``on_train_batch_end``, ... of the module or a callback;
    ``gradient_readers.GRADIENT_HOOKS``), clipping, ``on_before_optimizer_step``, a loss scaler's inf check, a
    precision plugin's own step, manual optimization, gradient accumulation, ``StochasticWeightAveraging`` (its
    BatchNorm epoch steps again with them). Otherwise each step group's gradients exist on the host only while in
    flight, from their first contribution until the group steps, in reused memory (4 bytes per parameter less at
    fp32), and ``param.grad`` is ``None`` after each step: code outside those hooks that reads it (in
    ``training_step``, or after ``fit``) should set ``"always"``. The pre-flight plan says which was chosen and why.
    Async mode never shows a step's gradients after it; its sums are given back the same way unless one of those
    readers needs them."""

    weights_from: str | None = None
    """A safetensors file, or a Hugging Face model directory (``model.safetensors``, or the shards
    ``model.safetensors.index.json`` names: what ``save_pretrained`` writes), that a module built on the meta device
    takes its weights from at setup, tensor by tensor as each module is materialized (``pretrained.py``): the files
    are never whole in memory, and with ``frozen_weights`` or ``offload="optimizer+masters"`` each layer goes to its
    host home as soon as it is whole. Setting it builds the module on the meta device under Lightning's
    ``configure_model`` and ``Trainer.init_module()`` (unless ``empty_init=False`` is asked). The files' keys are the
    Hugging Face model's; inside a LightningModule they are found under the model's attribute (``model.``). Tensors
    the files lack are initialised by their modules (the rotary tables; a tied LM head is its embedding), and listed
    in a warning when they are weights. Resuming a checkpoint (``ckpt_path``) takes precedence."""

    def __post_init__(self) -> None:
        if self.weights_from is not None:
            if not isinstance(self.weights_from, (str, os.PathLike)) or not os.fspath(self.weights_from):
                raise OptionError("weights_from", "must be a safetensors file or a Hugging Face model directory, "
                                                  f"or None; got {self.weights_from!r}")
            self.weights_from = os.fspath(self.weights_from)
        if self.pipeline is not None and (not isinstance(self.pipeline, str) or not self.pipeline):
            raise OptionError("pipeline", f"must be a dotted attribute path such as 'net' or 'model.blocks', or "
                                          f"None to find the trunk; got {self.pipeline!r}")
        if self.ring is not None:
            ring = self.ring
            if isinstance(ring, str) or not isinstance(ring, Sequence) or not ring or any(
                    isinstance(index, bool) or not isinstance(index, int) or index < 0 for index in ring):
                raise OptionError("ring", f"must be a non-empty list of device indices (ints >= 0), e.g. [0, 0], "
                                          f"or None for each device once; got {ring!r}")
            self.ring = list(ring)  # a Hydra ListConfig becomes a plain list
        if isinstance(self.rings_per_node, bool) or not isinstance(self.rings_per_node, int) \
                or self.rings_per_node < 1:
            raise OptionError("rings_per_node", f"must be a positive int (processes per node, each driving a ring "
                                                f"of devices // rings_per_node devices), got {self.rings_per_node!r}")
        check_flag("shard_optimizer", self.shard_optimizer)
        if self.reduce_dtype not in REDUCE_DTYPES:
            raise OptionError("reduce_dtype", f"must be one of {', '.join(map(repr, REDUCE_DTYPES))}, "
                                              f"got {self.reduce_dtype!r}")
        check_flag("log_pipeline_metrics", self.log_pipeline_metrics)
        check_flag("timeline", self.timeline)
        if self.timeline_dir is not None:
            if not isinstance(self.timeline_dir, (str, os.PathLike)):
                raise OptionError("timeline_dir", f"must be a folder path or None, got {self.timeline_dir!r}")
            self.timeline_dir = os.fspath(self.timeline_dir)
            self.timeline = True
        check_count("timeline_steps", self.timeline_steps, "every step")
        if self.preflight not in PREFLIGHT_MODES:
            raise OptionError("preflight", f"must be one of {', '.join(map(repr, PREFLIGHT_MODES))}, "
                                           f"got {self.preflight!r}")
        check_flag("fp16_accumulation", self.fp16_accumulation)
        if self.keep_gradients not in KEEP_GRADIENTS:
            raise OptionError("keep_gradients", f"must be one of {', '.join(map(repr, KEEP_GRADIENTS))}, "
                                                f"got {self.keep_gradients!r}")


    def ring_members(self, num_devices: int, whose: str = "the Trainer's") -> list[int]:
        """``ring``'s indices, checked against ``num_devices``, the Trainer's devices or (``whose``) a process's
        share of them (a device may appear twice)."""
        ring = self.ring if self.ring is not None else list(range(num_devices))
        if any(index >= num_devices for index in ring):
            raise OptionError("ring", f"lists indices into {whose} {num_devices} device(s), each in "
                                      f"0..{num_devices - 1}; got {ring!r}. For two ring members on one GPU: "
                                      "Trainer(devices=1), ring=[0, 0]")
        return ring


class OptionSpec(NamedTuple):
    """One strategy option: its name, its type (the resolved annotation), its default, and its class."""

    name: str
    type: Any
    default: Any
    owner: type


def option_specs(classes: Sequence[type] = (StrategyOptions, EngineOptions)) -> list[OptionSpec]:
    """The strategy's options: the fields of ``classes`` in order, less :data:`SET_BY_STRATEGY`."""
    specs = []
    for owner in classes:
        hints = get_type_hints(owner)
        for field in dataclasses.fields(owner):
            if field.name not in SET_BY_STRATEGY:
                specs.append(OptionSpec(field.name, hints[field.name], field.default, owner))
    return specs


def build_options(values: Mapping[str, Any]) -> tuple[StrategyOptions, EngineOptions]:
    """Validated options from ``{option: value}``; an option left out takes its default. Raises
    :class:`~lightning_roundpipe.engine.options.OptionError` for a bad value, ``TypeError`` for an unknown
    name."""
    owners = {spec.name: spec.owner for spec in option_specs()}
    unknown = sorted(set(values) - set(owners))
    if unknown:
        raise TypeError(f"unknown RoundPipe option(s) {unknown}; the options are {sorted(owners)}")
    strategy = StrategyOptions(**{k: v for k, v in values.items() if owners[k] is StrategyOptions})
    engine = EngineOptions(**{k: v for k, v in values.items() if owners[k] is EngineOptions},
                           record_timeline=strategy.timeline)
    return strategy, engine
