"""Typed engine options, validated when constructed so that a bad value fails before any thread starts.

:class:`EngineOptions` is the one declaration of the engine's options. The strategy's keyword arguments,
the Hydra schema, ``app/conf/strategy/roundpipe.yaml`` and the README's options table are built from it or
checked against it (``tests/test_options.py``). A bad value raises :class:`OptionError`, whose message
starts with the bare option name; the Hydra app swaps in its own key (``strategy.<option>``), so both
read the same text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal, get_args

from lightning_roundpipe.engine.step.disk_tier import offload_refusal
from lightning_roundpipe.engine.step.groups import STREAMING_STEPS, StreamingStep
from lightning_roundpipe.engine.step.kernels import HOST_KERNELS, HostKernels
from lightning_roundpipe.planning.partition import Plan
from lightning_roundpipe.planning.schedule import default_microbatches

Recompute = Literal["stage", "layer"]
RECOMPUTE_GRAINS: tuple[str, ...] = get_args(Recompute)

TransportDtype = Literal["auto", "off", "bfloat16", "float16"]
TRANSPORT_DTYPES: tuple[str, ...] = get_args(TransportDtype)

FrozenWeights = Literal["auto", "as_stored", "round"]
FROZEN_WEIGHTS: tuple[str, ...] = get_args(FrozenWeights)

Offload = Literal["none", "optimizer", "optimizer+masters"]
OFFLOADS: tuple[str, ...] = get_args(Offload)

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


class OptionError(ValueError):
    """An option value that cannot work: ``"`option` problem"``. ``option`` is the bare field name and
    ``problem`` the rest, so a config front end can name its own key with the same text."""

    def __init__(self, option: str, problem: str) -> None:
        super().__init__(f"`{option}` {problem}")
        self.option = option
        self.problem = problem


def parse_bytes(value: int | str | None, option: str = "device_memory_limit") -> int | None:
    """``20GiB``, ``"512 MB"`` or an int number of bytes; ``None`` means no limit."""
    if value is None or isinstance(value, int) and not isinstance(value, bool):
        if value is not None and value <= 0:
            raise OptionError(option, f"must be positive, got {value}")
        return value
    if isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        if match and match.group(2).lower() in _UNITS:
            parsed = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
            if parsed > 0:
                return parsed
    raise OptionError(option, f"must be a positive number of bytes or a string such as '20GiB' or '512MB', "
                              f"got {value!r}")


def check_flag(option: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise OptionError(option, f"must be True or False, got {value!r}")


def check_count(option: str, value: Any, none_means: str) -> None:
    """A positive int, or None (which means ``none_means``)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise OptionError(option, f"must be a positive int (or None for {none_means}), got {value!r}")


def check_seconds(option: str, value: Any, *, allow_zero: bool) -> None:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or value < 0 or (value == 0 and not allow_zero):
        raise OptionError(option, f"must be a number of seconds {'>=' if allow_zero else '>'} 0, got {value!r}")


@dataclass
class EngineOptions:
    """How the RoundPipe engine runs. Every field has a safe default."""

    num_microbatches: int | None = None
    """Microbatches per trunk call (M). ``None``: number of devices + 1, which keeps every device busy
    in the steady state; on one device 1, the whole batch, as under Lightning's default strategy
    (``planning.schedule.default_microbatches``). Set it explicitly for results that do not depend on the
    device count."""

    num_stages: Literal["auto"] | int | Plan = "auto"
    """The chunk count: the number of *forward* stages. ``"auto"`` sizes stages from per-layer costs
    (bytes first, measured times later, except under ``torch.use_deterministic_algorithms(True)``, where
    timing must not change results); an ``int`` splits the non-fused layers into that many forward
    stages and derives the (smaller) backward stages; a :class:`~lightning_roundpipe.planning.partition.Plan`
    fixes the partition exactly."""

    round_size: Literal["auto", "whole"] | int = "auto"
    """How a training call (``forward_backward``: the strategy's fused path) dispatches its M microbatches.
    ``"whole"``: each stage job runs all M. An int R: in rounds of R microbatches (the paper's dispatch),
    each round the whole chain of stage jobs over its share of the batch, so the first backward stages start
    after R microbatches' forward instead of M's: less fill and drain in a sync iteration, for one upload of
    each stage per round instead of per call. ``"auto"``: in sync mode, whole jobs until layer times and the
    fixed cost of a job are measured (always under ``torch.use_deterministic_algorithms``), then whole jobs
    or rounds of N or 2N (N devices in the ring), whichever the simulator predicts faster for the current
    plan, those costs and the host step (logged when it changes); decided again when the plan changes or
    the measurements settle. Whole jobs in async mode (the next iteration fills the drain), with
    ``deferred_batchnorm``, which needs them, and with the disk tier (``offload``: rounds keep every step group's
    gradients until the last round, the memory the tier saves) (:attr:`auto_may_use_rounds`).
    Rounds sum the microbatches' gradients in another order (equal within float rounding)."""

    async_step: bool = False
    """``False`` (sync): exact, identical to plain training. ``True``: the paper's one-step-stale update,
    iteration k runs on W(k-2) and W(k) = step(W(k-1), g(k)), so the host step overlaps device work."""

    streaming_step: StreamingStep = "auto"
    """How the host step is cut (``step/groups.py``). ``"auto"``: a ``torch.optim`` optimizer (but LBFGS)
    without step hooks steps stage by stage: each backward stage's parameters as soon as their gradients are
    final, while the rest of the backward runs (after clipping or ``on_before_optimizer_step``, when
    something reads every gradient first: shallowest stage first), and each later upload waits only for the
    parameters it uploads. Results are those of the whole step. Other optimizers step whole. ``"on"``: also
    an optimizer of another class, which the user declares to update each parameter from its own gradient and
    state. ``"off"``: always whole. If the pipeline fails while a streamed step waits for gradients, the
    stages stepped so far keep the update (the error says which)."""

    host_optimizer: HostKernels = "exact"
    """Which kernel steps a ``torch.optim`` ``Adam``, ``AdamW`` or ``SGD`` built with ``fused`` and
    ``foreach`` unset (on CPU parameters torch then loops over per-tensor operations). ``"exact"``: torch's
    fused CPU kernel only where it is bitwise that loop (``SGD`` without momentum: 2x faster with weight
    decay), so sync training stays bitwise plain training. ``"fused"``: also ``Adam``, ``AdamW`` and
    ``SGD`` with momentum, about 3x faster for AdamW, equal within float rounding but not bitwise (about
    0.01% of the elements differ, by about one ulp). fp32/fp64 parameters only; ``fused=True`` is set in
    the step's own copy of the param groups, so the optimizer's ``param_groups``, ``state_dict()`` and
    state stay as plain training makes them. The pre-flight log shows the measured step time
    (:mod:`lightning_roundpipe.engine.step.kernels`)."""

    offload: Offload = "none"
    """Where the optimizer's state lives. ``"none"``: host memory. ``"optimizer"``: in files under
    ``offload_dir`` (:mod:`lightning_roundpipe.engine.step.disk_tier`), each step group's state read ahead
    before the group steps and written behind it, so host memory holds the state of the groups in flight only
    (AdamW: 8 bytes per parameter move to disk). ``"optimizer+masters"``: also the fp32 master weights that
    devices upload from a low-precision copy (the Linear and Conv weights under ``bf16-mixed``/``16-mixed``,
    ``transport_dtype``): only the step and a checkpoint read them, so they are read ahead and written behind
    with their state (4 more bytes per such parameter; a frozen one, a LoRA base, is never read again). Results
    are bitwise those of ``"none"``; checkpoints are plain, and a run may resume into any. Costs those bytes
    read and written per step on that disk. Linux only."""

    offload_dir: str | None = None
    """The directory of ``offload``'s files (made if missing): a local disk with room for the
    whole state, fast enough for the figure the pre-flight log gives. The files have no names and vanish
    with the process, a crashed one too."""

    frozen_weights: FrozenWeights = "auto"
    """How a frozen float32 weight that devices upload in the transport dtype (a Linear or Conv weight under
    ``bf16-mixed``/``16-mixed``; a LoRA base) is kept on the host
    (:mod:`lightning_roundpipe.engine.frozen_weights`). ``"auto"``: when that dtype holds its values exactly
    (a model loaded from a bfloat16 checkpoint), in that dtype alone, 2 bytes per parameter instead of 6 (its
    master and the copy); the others as stored. ``"as_stored"``: every one as stored, with its copy. ``"round"``:
    every one rounded to that dtype, which autocast computes with anyway (results unchanged), but the state dict
    then gives back the rounded values. Bitwise the same results; the state dict and checkpoints give the weights
    in the module's dtype, and the module has its dtypes back when the run ends; during the run, code reading
    such a weight itself sees the narrow dtype (the same values). A weight made trainable mid-run is widened
    first; one a module outside the trunk also holds is kept as stored."""

    stochastic_rounding: bool = False
    """Host step of bfloat16 parameters (``precision="bf16-true"``, or a model stored in bfloat16: the master is
    then its own upload copy, 2 host bytes per parameter). ``False``: as plain training, the optimizer steps them
    in bfloat16, each update rounded to nearest (one under half a unit in the last place is lost).
    ``True``: the optimizer steps float32 copies of the step group in flight (gradients widened, the state in
    float32; bitsandbytes' 8-bit state as it is) and each result is rounded into its bfloat16 parameter
    stochastically, unbiased, from a generator seeded by (``seed``, step, parameter): reproducible, resumable,
    the same in every data-parallel process, the user's random streams untouched
    (:mod:`lightning_roundpipe.engine.step.rounding`). Refused when no trainable parameter is bfloat16."""

    recompute: Recompute = "stage"
    """Recomputation grain of backward stages: ``"stage"`` keeps one input per backward stage, ``"layer"``
    keeps every layer's input (less device memory, more host traffic)."""

    pin_memory: bool = True
    """CUDA devices: pin the host weights in place (``cudaHostRegister``) so that uploads are fast
    asynchronous copies; when the system refuses (e.g. a locked-memory limit) they stay pageable, with a
    warning. Ignored on CPU devices."""

    transport_dtype: TransportDtype = "auto"
    """Under mixed precision, upload the weights autocast would cast anyway (the ``weight`` and ``bias`` of
    stock ``nn.Linear`` and ``nn.Conv1d/2d/3d`` modules, nothing else reads them) already in autocast's
    dtype: half the host-to-device bytes and half their device memory, the same results (autocast casts
    them to that dtype before use; their gradients come back in it and are summed in float32 on the host).
    Costs 2 host bytes per such parameter in sync mode (a copy cast once per step); none in async mode,
    where it is the published copy. ``"auto"``: the strategy uses its precision's autocast dtype under
    ``bf16-mixed``/``16-mixed`` and nothing otherwise; the engine alone treats it as ``"off"``.
    ``"bfloat16"``/``"float16"``: that dtype (for the engine run under your own autocast). ``"off"``:
    every weight as stored, e.g. when a layer reads a Linear's weight outside its forward."""

    device_memory_limit: int | str | None = None
    """Per-device memory budget in bytes or as ``"20GiB"`` (a string is parsed to bytes when the options
    are made): stage parameters, gradients and buffers, the stage-boundary activations in flight, what a
    fused or backward stage's compute keeps for backward (saved activations and autocast's weight copies,
    measured as they are saved) and, on GPUs, a fixed reserve for kernel workspaces (136 MiB per ring
    member, ``partition.CUDA_WORKSPACE_RESERVE``). The planner fits two stages (running and prefetched),
    with what their compute keeps for backward, in three quarters of what the workspace reserve leaves and
    keeps the rest for the activations in flight. ``None``: on GPUs 90% of what the process can still
    allocate there (free memory, capped by ``torch.cuda.set_per_process_memory_fraction``), split between
    ring members that share a GPU; unlimited on CPU devices, where a set limit is the simulated budget the
    residency accounting enforces."""

    freeze_plan: bool = False
    """Keep the first plan: never replan, neither from measured times nor from the activation bytes measured
    (deterministic timelines)."""

    replan_hysteresis: float = 0.1
    """Adopt a new plan only when its predicted iteration time is this fraction better; replanning
    happens only between steps, from device time (CUDA events on GPUs), once the measurements are
    trusted: the first step's are discarded (warm-up) and two later steps must agree within 25%."""

    deferred_batchnorm: bool = False
    """BatchNorm running statistics of the whole batch (:mod:`lightning_roundpipe.engine.batchnorm`).
    ``False``: a training-mode BatchNorm updates ``running_mean``, ``running_var`` and
    ``num_batches_tracked`` once per microbatch, as under gradient accumulation. ``True``: once per trunk
    call, from the statistics of all its microbatches together, exactly the update one BatchNorm forward
    over the whole batch makes (momentum, unbiased variance with the whole batch's count, cumulative average
    when ``momentum`` is None, ``num_batches_tracked`` + 1). Each microbatch is still *normalized* with its
    own statistics, so activations, gradients and weights are those of the microbatches, not of the whole
    batch (equal to the default strategy's only with ``num_microbatches=1``); the running statistics equal
    the default strategy's where a BatchNorm's inputs do (no training-mode BatchNorm before it, the same
    weights before it), up to float rounding. Eval mode is unaffected. Costs one extra reduction over each
    training-mode BatchNorm input in forward and fused stages. ``nn.BatchNorm1d/2d/3d``, ``nn.SyncBatchNorm``
    and subclasses keeping torch's ``forward``; other modules that track running statistics are refused."""

    seed: int | None = None
    """Base seed for per-(step, call, layer, microbatch) randomness. ``None``: ``torch.initial_seed()``, or in a
    run resumed from a checkpoint the checkpoint's (``RoundPipeEngine.load_state_dict``)."""

    record_timeline: bool = False
    """Record (device, job, microbatch, kind, start, end) events; read them with ``engine.events()``.
    The strategy sets this itself from its ``timeline`` option."""

    jitter: float = 0.0
    """Test mode: CPU stand-in streams sleep up to this many seconds before each operation, so an
    ordering bug (a missing wait) shows up on CPU instead of only on a GPU."""

    stress: bool = False
    """Test mode: CPU stand-in devices follow CUDA semantics strictly. Copies land late (visible only to
    whoever waited for the event recorded after them) and released device buffers and host staging are
    poisoned (NaN), so a missing wait or a buffer reused too early breaks the results on CPU. Ignored on
    CUDA devices; no cost when off."""

    wait_timeout: float = 600.0
    """Seconds any internal wait may block before the engine gives up with an error instead of hanging."""

    def __post_init__(self) -> None:
        check_count("num_microbatches", self.num_microbatches, "devices + 1, one device: 1")
        if not (self.num_stages == "auto" or isinstance(self.num_stages, Plan) or (
            isinstance(self.num_stages, int) and not isinstance(self.num_stages, bool) and self.num_stages >= 1
        )):
            raise OptionError("num_stages", f"must be 'auto', a positive int (the number of forward stages) or a "
                                            f"Plan, got {self.num_stages!r}")
        if self.round_size not in ("auto", "whole") and (
                isinstance(self.round_size, bool) or not isinstance(self.round_size, int) or self.round_size < 1):
            raise OptionError("round_size", f"must be 'auto', 'whole' or a positive int (microbatches per round), "
                                            f"got {self.round_size!r}")
        if isinstance(self.round_size, int) and self.deferred_batchnorm:
            raise OptionError("round_size", "must be 'auto' or 'whole' with `deferred_batchnorm=True`: the whole "
                                            "batch's BatchNorm statistics are collected by jobs that run every "
                                            f"microbatch, got {self.round_size!r}")
        if self.transport_dtype not in TRANSPORT_DTYPES:
            raise OptionError("transport_dtype", f"must be one of {', '.join(map(repr, TRANSPORT_DTYPES))}, "
                                                 f"got {self.transport_dtype!r}")
        if self.streaming_step not in STREAMING_STEPS:
            raise OptionError("streaming_step", f"must be one of {', '.join(map(repr, STREAMING_STEPS))}, "
                                                f"got {self.streaming_step!r}")
        if self.host_optimizer not in HOST_KERNELS:
            raise OptionError("host_optimizer", f"must be {' or '.join(map(repr, HOST_KERNELS))}, "
                                                f"got {self.host_optimizer!r}")
        if self.offload not in OFFLOADS:
            raise OptionError("offload", f"must be one of {', '.join(map(repr, OFFLOADS))}, got {self.offload!r}")
        if self.frozen_weights not in FROZEN_WEIGHTS:
            raise OptionError("frozen_weights", f"must be one of {', '.join(map(repr, FROZEN_WEIGHTS))}, "
                                                f"got {self.frozen_weights!r}")
        if self.offload_dir is not None and not isinstance(self.offload_dir, str):
            raise OptionError("offload_dir", f"must be a directory path (str) or None, got {self.offload_dir!r}")
        if self.offload != "none":
            if not self.offload_dir:
                raise OptionError("offload", f"{self.offload!r} keeps state in files: set `offload_dir` to a "
                                             "directory on a local disk with room for it")
            refusal = offload_refusal()
            if refusal is not None:
                raise OptionError("offload", f"{self.offload!r} cannot work here: {refusal}")
        if self.recompute not in RECOMPUTE_GRAINS:
            raise OptionError("recompute", f"must be {' or '.join(map(repr, RECOMPUTE_GRAINS))}, "
                                           f"got {self.recompute!r}")
        for flag in ("async_step", "pin_memory", "freeze_plan", "deferred_batchnorm", "record_timeline", "stress"):
            check_flag(flag, getattr(self, flag))
        self.device_memory_limit = parse_bytes(self.device_memory_limit)
        if isinstance(self.replan_hysteresis, bool) or not isinstance(self.replan_hysteresis, (int, float)) or (
                self.replan_hysteresis < 0):
            raise OptionError("replan_hysteresis", f"must be a fraction >= 0, got {self.replan_hysteresis!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise OptionError("seed", f"must be an int or None, got {self.seed!r}")
        check_seconds("jitter", self.jitter, allow_zero=True)
        check_seconds("wait_timeout", self.wait_timeout, allow_zero=False)

    @property
    def device_memory_limit_bytes(self) -> int | None:
        """``device_memory_limit`` in bytes: validation has parsed a string such as ``"20GiB"``."""
        limit = self.device_memory_limit
        assert not isinstance(limit, str), "parsed in __post_init__"
        return limit

    @property
    def auto_may_use_rounds(self) -> bool:
        """Whether ``round_size="auto"`` may choose rounds: in sync mode, without ``deferred_batchnorm`` and without
        the disk tier (see ``round_size``). The dispatch and the pre-flight's memory plan both ask this."""
        return not self.async_step and not self.deferred_batchnorm and self.offload == "none"

    def microbatches_for(self, num_devices: int) -> int:
        return self.num_microbatches if self.num_microbatches is not None else default_microbatches(num_devices)
