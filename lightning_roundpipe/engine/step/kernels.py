"""The host optimizer's kernels: torch's fused CPU step where it is safe, and the step's measured cost.

The engine steps the user's optimizer on the host (:mod:`.thread`). On CPU parameters, torch runs
``Adam``, ``AdamW`` and ``SGD`` as a loop of one tensor operation after another unless the optimizer was
built with ``fused=True`` (one pass over each tensor). Measured with torch 2.13
(``benchmarks/host_optimizer.py``: 5 steps, fp32 and fp64, under ``ATEN_CPU_CAPABILITY`` avx512, avx2 and
default, 1 and 2 threads), the fused kernel against that default path:

* ``SGD`` without momentum: **bitwise** equal (768 cases: learning rates, weight decay, ``maximize``,
  ``dampening``, sizes off the vector width), and 1.8x faster with weight decay (the default path first
  builds ``grad + weight_decay * param`` as a new tensor), as fast without.
* ``SGD`` with momentum: bitwise only without vector FMA (``ATEN_CPU_CAPABILITY=default``); with AVX2 or
  AVX512 one ulp on a few elements in a million. 1.6x faster.
* ``Adam``/``AdamW``: not bitwise on any kernel set. About 0.012% of the elements differ after five steps,
  by one ulp of the parameter (the fused kernel orders the update's operations differently). 3.2x faster
  (AdamW on 20M parameters: 3.63 -> 1.14 ns per parameter at one thread, 1.98 -> 0.62 at two).
* bf16/fp16 parameters: far apart (the fused kernel computes in fp32 and rounds once, the default path
  rounds after every operation), so they always stay as built.

Hence the engine option ``host_optimizer``:

* ``"exact"`` (the default): the fused kernel only where it is bitwise the default path (``SGD`` without
  momentum, on the x86 kernel sets measured), so sync training stays bitwise plain training;
* ``"fused"``: also ``Adam``, ``AdamW`` and ``SGD`` with momentum, equal within float rounding.

Either way only a group the user left to torch (``fused`` and ``foreach`` unset) of exactly those classes
switches (:func:`fused_refusal`), and only in the step's own copy of the groups
(:func:`~.thread.step_with_groups`): the user's ``param_groups`` and ``state_dict()`` stay as built. Both
paths keep the same state (``step`` a 0-dim fp32 CPU tensor, ``exp_avg``/``exp_avg_sq``/``max_exp_avg_sq``
and ``momentum_buffer`` like the parameter), so either steps state the other made: a checkpoint saved here
resumes under plain Lightning, and the other way round.

:func:`measure_step` times one step of an optimizer's class and hyperparameters on scratch parameters,
for the pre-flight plan's host-optimizer line. It draws its scratch values from a private generator: the
user's random streams stay as they are.
"""

from __future__ import annotations

import glob
import inspect
import math
import re
import time
import warnings
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch

HostKernels = Literal["exact", "fused"]
HOST_KERNELS: tuple[str, ...] = get_args(HostKernels)

FUSED_CLASSES: tuple[type[torch.optim.Optimizer], ...] = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)
"""Exactly these classes (not subclasses, which may step differently)."""

FUSED_DTYPES = (torch.float32, torch.float64)
"""Where the fused kernel is within float rounding of the default path (not bf16/fp16: see above)."""

EXACT_CAPABILITIES = ("DEFAULT", "AVX2", "AVX512")
"""The CPU kernel sets (``torch.backends.cpu.get_cpu_capability()``) on which fused SGD without momentum
was measured bitwise; elsewhere (ARM, ...) ``"exact"`` leaves it as built."""

SCRATCH_ELEMENTS = 4_000_000
"""At most this many scratch parameters are stepped to measure an optimizer: 64 MB of fp32 parameter,
gradient and two Adam buffers, and a few tens of milliseconds a step. Some server CPUs cache that much
(the figure then says so: a large model's step is slower)."""


def fused_refusal(optimizer: Any, group: dict, host_kernels: str) -> str | None:
    """Why ``host_optimizer=host_kernels`` leaves ``group`` of ``optimizer`` as built, or ``None`` if it
    steps it with ``fused=True``. Reads the group and its parameters only (not their gradients)."""
    if type(optimizer) not in FUSED_CLASSES:
        return f"{type(optimizer).__name__} is not torch.optim.Adam, AdamW or SGD"
    if host_kernels == "exact":
        if type(optimizer) is not torch.optim.SGD or group.get("momentum", 0) != 0:
            return "the fused kernel is bitwise the default path only for SGD without momentum"
        if torch.backends.cpu.get_cpu_capability() not in EXACT_CAPABILITIES:
            return f"fused SGD was not measured bitwise on {torch.backends.cpu.get_cpu_capability()} kernels"
    elif host_kernels != "fused":
        return "the optimizer steps as built"
    if group.get("fused") is not None or group.get("foreach") is not None:
        return "the optimizer chose its kernel (fused or foreach set)"
    if group.get("differentiable") or group.get("capturable"):
        return "differentiable or capturable"
    if any(isinstance(value, torch.Tensor) for key, value in group.items() if key != "params") or any(
            isinstance(beta, torch.Tensor) for beta in group.get("betas", ())):
        return "a hyperparameter is a tensor"
    if getattr(optimizer, "grad_scale", None) is not None or getattr(optimizer, "found_inf", None) is not None:
        return "a GradScaler drives the optimizer"
    if torch.get_default_dtype() != torch.float32:
        return "the default dtype is not float32 (the fused path would keep the step count in float32)"
    for param in group["params"]:
        if not param.requires_grad:  # never stepped (a frozen weight may be kept in bf16: ``frozen_weights.py``)
            continue
        if param.device.type != "cpu" or param.dtype not in FUSED_DTYPES or param.is_sparse:
            return f"a {param.dtype} parameter on {param.device}"
    return None


def _gradients_allow(optimizer: Any, group: dict) -> bool:
    """What only the step can check: no sparse gradient, and SGD's momentum buffers all made or none made
    (its fused step treats a group as starting only when no buffer exists yet)."""
    with_grad = [param for param in group["params"] if param.grad is not None]
    if any(param.grad.is_sparse for param in with_grad):
        return False
    if isinstance(optimizer, torch.optim.SGD) and group.get("momentum", 0) != 0:
        made = {optimizer.state.get(param, {}).get("momentum_buffer") is not None for param in with_grad}
        return len(made) <= 1
    return True


def use_fused(optimizer: Any, groups: list[dict], host_kernels: str) -> list[dict]:
    """``groups`` (the step's own copies, :func:`~.thread.snapshot_param_groups`) with ``fused=True`` set in
    those ``host_optimizer=host_kernels`` steps with torch's fused CPU kernel. Run on the optimizer thread,
    once the gradients are in place."""
    for group in groups:
        if fused_refusal(optimizer, group, host_kernels) is None and _gradients_allow(optimizer, group):
            group["fused"] = True
    return groups


def kernel_of(optimizer: Any, host_kernels: str) -> str:
    """The path a step of ``optimizer`` takes under ``host_kernels``: ``"fused"``, ``"foreach"``,
    ``"default"`` (torch's per-tensor loop, on CPU), ``"mixed"`` (the groups differ) or ``"own"`` (not a
    ``torch.optim`` class: its own step)."""
    if not type(optimizer).__module__.startswith("torch.optim"):
        return "own"
    paths = set()
    for group in optimizer.param_groups:
        if group.get("fused") or fused_refusal(optimizer, group, host_kernels) is None:
            paths.add("fused")
        elif group.get("foreach"):
            paths.add("foreach")
        else:
            paths.add("default")
    return paths.pop() if len(paths) == 1 else "mixed" if paths else "default"


def _scratch_optimizer(optimizer: Any, params: list[torch.nn.Parameter],
                       fused: bool) -> torch.optim.Optimizer:
    """A new optimizer of ``optimizer``'s class with its first group's hyperparameters, on ``params``."""
    group = optimizer.param_groups[0]
    accepted = inspect.signature(type(optimizer).__init__).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    hyper = {key: value.clone() if isinstance(value, torch.Tensor) else value for key, value in group.items()
             if key != "params" and (takes_any or key in accepted)}
    if fused:
        hyper.update(fused=True, foreach=None)
    return type(optimizer)(params, **hyper)


def _time_step(optimizer: Any, elements: int, dtype: torch.dtype, fused: bool) -> float:
    """Seconds per element of one step of ``optimizer``'s class on about ``elements`` scratch parameters
    (matrices, as some optimizers want): the best of a few steps after one that makes the state."""
    pieces = min(4, elements)
    columns = min(1024, elements // pieces)
    shapes = [(elements // pieces // columns, columns)] * pieces
    # scratch values from a private generator: drawing from torch's global one here, at setup, would change
    # everything a seeded run draws after it (a shuffled DataLoader's order, a dataset built in
    # train_dataloader) against Lightning's default strategy, which measures nothing
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.empty(shape, dtype=dtype).uniform_(-1.0, 1.0, generator=generator))
              for shape in shapes]
    elements = sum(param.numel() for param in params)
    for param in params:
        param.grad = torch.empty_like(param).uniform_(-1e-2, 1e-2, generator=generator)
    scratch = _scratch_optimizer(optimizer, params, fused)
    # an optimizer of the user's own class may draw random numbers in its step (noise, a random subset):
    # its scratch steps give back what they drew from torch's CPU generator
    with torch.random.fork_rng(devices=[]):
        scratch.step()  # makes the state
        best, spent = math.inf, 0.0
        for _ in range(5):
            start = time.perf_counter()
            scratch.step()
            took = time.perf_counter() - start
            best, spent = min(best, took), spent + took
            if spent > 0.05:  # enough for a stable best, and the whole measurement stays well under a second
                break
    return best / elements


@dataclass(frozen=True)
class StepFigure:
    """The measured cost of one optimizer's host step; ``None`` where it could not be measured."""

    optimizer: str            # the class name
    kernel: str               # the path its steps take: fused, foreach, default, mixed or own (kernel_of)
    params: int               # trainable parameters it steps
    threads: int              # torch.get_num_threads() when measured (the optimizer thread uses as many)
    sample: int               # scratch parameters stepped
    cached: int | None        # the CPU's last-level cache in bytes, when the scratch fits in it (else None)
    seconds_per_param: float | None
    fused_seconds_per_param: float | None = None  # host_optimizer="fused", when that would change the path
    problem: str = ""         # why it was not measured

    @property
    def step_seconds(self) -> float | None:
        return None if self.seconds_per_param is None else self.seconds_per_param * self.params

    def describe(self) -> str:
        """One or two sentences for the plan log."""
        head = f"host optimizer step: {self.optimizer} ({_KERNEL_WORDS.get(self.kernel, self.kernel)})"
        if self.seconds_per_param is None:
            return f"{head}: not measured ({self.problem})"
        text = (f"{head}: ~{_nanoseconds(self.seconds_per_param)}/param -> ~{_seconds(self.step_seconds)} per "
                f"step for {_count(self.params)} trainable parameters (measured at setup on {_count(self.sample)} "
                f"scratch parameters, {self.threads} thread{'s' * (self.threads != 1)}"
                + (f"; they fit in the CPU's {self.cached / 2**20:.0f} MiB last-level cache, so a large model's step "
                   "is slower" if self.cached else "")
                + "); sync mode steps stage by stage beside the backward (streaming_step) and waits for what is left, "
                   "async_step=True overlaps it with the next iteration")
        if self.fused_seconds_per_param is not None:
            text += (f". host_optimizer='fused' (torch's fused kernel, equal within float rounding, not bitwise) "
                     f"would take ~{_nanoseconds(self.fused_seconds_per_param)}/param -> "
                     f"~{_seconds(self.fused_seconds_per_param * self.params)}")
        return text


_KERNEL_WORDS = {"default": "torch's per-tensor loop", "fused": "fused kernel", "foreach": "foreach kernels",
                 "mixed": "mixed kernels", "own": "its own step"}


def _figure(value: float) -> str:
    return f"{value:.2g}" if value < 10 else f"{value:.0f}"


def _nanoseconds(seconds: float) -> str:
    return f"{_figure(seconds * 1e9)} ns"


def _seconds(value: float | None) -> str:
    if value is None:
        return "?"
    return f"{_figure(value * 1e3)} ms" if value < 1 else f"{_figure(value)} s"


def last_level_cache_bytes() -> int | None:
    """The size of the CPU's largest cache (Linux sysfs), or ``None`` where unknown."""
    sizes = []
    for entry in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            with open(entry) as file:
                text = file.read().strip()
        except OSError:
            continue
        match = re.fullmatch(r"(\d+)([KMG]?)", text)
        if match:
            sizes.append(int(match.group(1)) * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}[match.group(2)])
    return max(sizes) if sizes else None


def _count(value: int) -> str:
    for scale, unit in ((1e9, "B"), (1e6, "M")):
        if value >= scale:
            return f"{value / scale:.3g}{unit}"
    return f"{value:,}"


def measure_step(optimizer: Any, host_kernels: str = "exact", *, max_elements: int = SCRATCH_ELEMENTS) -> StepFigure:
    """Time one step of ``optimizer``'s class, with its first param group's hyperparameters, on scratch
    parameters (its trainable count, at most ``max_elements``, in its largest dtype), in a throwaway
    optimizer: ``optimizer``, its parameters and its state are only read. Also times the fused kernel when
    ``host_kernels="exact"`` leaves on the default path what ``"fused"`` would switch. A class that cannot be
    built from its hyperparameters, or whose step fails on scratch parameters, is reported not measured."""
    trainable = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    unique = list({id(p): p for p in trainable}.values())
    count = sum(p.numel() for p in unique)
    kernel = kernel_of(optimizer, host_kernels)
    sample = max(1, min(count, max_elements))
    dtypes: dict[torch.dtype, int] = {}
    for param in unique:
        dtypes[param.dtype] = dtypes.get(param.dtype, 0) + param.numel()
    dtype = max(dtypes, key=lambda d: dtypes[d]) if dtypes else torch.float32
    cache = last_level_cache_bytes()
    # the scratch's footprint: a parameter, its gradient and about two state buffers
    footprint = 4 * sample * (dtype.itemsize if dtype.is_floating_point else 4)
    base = dict(optimizer=type(optimizer).__name__, kernel=kernel, params=count, threads=torch.get_num_threads(),
                sample=sample, cached=cache if cache is not None and footprint <= cache and count > sample else None)
    if not count or not dtype.is_floating_point:
        return StepFigure(**base, seconds_per_param=None, problem="no trainable floating-point parameters")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            seconds = _time_step(optimizer, sample, dtype, fused=kernel == "fused")
        except Exception as error:  # noqa: BLE001 - any optimizer class: the plan says why, training goes on
            return StepFigure(**base, seconds_per_param=None,
                              problem=f"a scratch {type(optimizer).__name__} failed: {type(error).__name__}: {error}")
        fused_seconds = None
        if host_kernels == "exact" and kernel != "fused" and kernel_of(optimizer, "fused") in ("fused", "mixed"):
            try:
                fused_seconds = _time_step(optimizer, sample, dtype, fused=True)
            except Exception:  # noqa: BLE001 - the hint is optional
                fused_seconds = None
    return StepFigure(**base, seconds_per_param=seconds, fused_seconds_per_param=fused_seconds)
