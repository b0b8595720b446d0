"""Memory: a model ~10x larger than ``device_memory_limit`` trains; device and host bytes it takes.

Run: ``python benchmarks/memory.py [--quick] [--transport off] [--json PATH]`` (default about 1 minute on 2
cores, ``--quick`` about 15-25 s, ``--smoke`` seconds: 16 blocks, a limit of 0.4 of the parameter bytes,
2 steps). Not a test: it prints tables and a verdict and always exits 0.

Setup: the app's byte GPT (``gpt(width, depth, ...)``, deep enough that ``device_memory_limit`` is about
a tenth of its parameter bytes), ``RoundPipeStrategy`` on 2 CPU devices, Lightning
``precision="bf16-mixed"`` (autocast; the module and the optimizer stay fp32), AdamW, ``ByteLM`` with
the fused loss. The same run is done in sync mode and in async mode, from the same initial weights.
``torch.set_num_threads(1)``: two devices, one compute thread each, on a 2-core machine.

Device memory: the engine's own accounting (``engine.peak_resident_bytes()``): per device, the bytes of
the resident stages' parameters, gradients and buffers, the stage-boundary activations in flight, and
what a stage's autograd keeps *inside* a job (the recompute's saved tensors, the fused stage's logits),
counted as it is saved. It does not see temporaries that are never saved, nor a GPU's kernel workspaces
and allocator rounding (the engine reserves a fixed figure for those on GPUs, not on CPU stand-ins).

Host memory: the package keeps no host-byte accounting, so this script measures what is allocated on
the host, by category, from the live objects (a sampler thread, every ``--interval`` seconds, plus a
sample in an optimizer step pre-hook, when the step holds every one of its gradients):

* ``parameters``: the module's parameters, the master weights (module dtype: fp32).
* ``gradients``: ``param.grad`` plus every gradient window still alive (the open one and the ones
  queued steps hold: in async mode iteration k+1's gradients accumulate while step k runs), plus the
  gradients the step being run holds (its stand-in parameters' ``.grad``), plus the memory of earlier sums the
  engine keeps for reuse (``SumBuffers``). Where nothing reads a step's whole gradients (``keep_gradients``), each
  group's exist only while in flight.
* ``optimizer state``: the tensors in ``optimizer.state`` (AdamW: exp_avg, exp_avg_sq, step).
* ``low-precision copies`` and ``published (full precision)``: the host copies devices read instead of
  the masters (``transport.UploadSources``). Under bf16-mixed (``transport_dtype="auto"``) the Linear
  weights travel from a bf16 copy, 2 B per such parameter, in both modes (in async mode it is their
  published copy); async mode also publishes the other trainable weights (embeddings, norms) in their
  own dtype.
* ``staging buffers``: the reused gradient download buffers (each device's two, a stage's gradients each;
  pinned on CUDA devices).
* ``checkpoints`` and ``other activations``: what live trunk calls keep on the host (every ``HostCell`` of
  every ``Call``; calls are tracked with weak references, so the benchmark does not extend their life).
  ``checkpoints``: the inputs backward stages recompute from (and buffer snapshots); ``other``: the
  microbatch inputs and targets, the forward stages' outputs, the gradients passed between backward
  stages, the losses. They scale with tokens x width x stages, not with the parameters: the per-parameter
  figure depends on the shape (``--batch``, ``--context``); the largest single call is printed too.

Tensors are counted by storage (``untyped_storage().nbytes()``), each storage once (by
``data_ptr()``), in the order above, and divided by the parameter count (a tied weight counts once).
The simulated devices' copies live in host RAM too on CPU, but they stand for device memory and are
bounded by the limit above: they are left out. A sampler misses peaks shorter than its interval; the
step pre-hook sample catches the gradient peak. ``total`` is the largest sampled sum; each category's
column is its value in that sample, and ``own peak`` is the category's largest value in any sample.

Caveats of the method. No thread but the main one reads ``param.grad``: reading it while another thread
assigns it crashes torch (a segfault, reproduced with plain torch 2.13), and the main thread assigns it
(``zero_grad``). The step pre-hook runs on the optimizer thread and reads the gradients of the optimizer
it is given (the engine's stand-ins for the parameters, which only that thread touches); ``param.grad`` is
read after the run. There is no
public API for any of this, so the accountant reaches into engine internals, read-only: it wraps the
engine instance's ``_new_call`` and ``step`` (to hold weak references to calls and gradient windows)
and reads ``_window._grads``, ``dispatcher.sum_buffers``, ``_sources._low``/``_published``, the workers' ``operations.grad_staging`` and the ``Call``'s host cells; it may need updating
when those change.

Also printed: parameter bytes uploaded per parameter per optimizer step (the engine's counters), which the
transport halves. ``--transport off`` runs without it, for comparison.

Targets: host bytes per parameter <= 18 in both modes with the transport (sync: 16 + the 2 B/param
low-precision copy; async: the published copy is that copy); without it <= 16 (sync) and <= 20 (async).
The RoundPipe paper reports ~20.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import weakref
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from common import add_smoke, quiet, sized  # noqa: E402
from torch.utils import _pytree as pytree  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_roundpipe import RoundPipeStrategy  # noqa: E402
from lightning_roundpipe.app.data import stdlib_bytes  # noqa: E402
from lightning_roundpipe.app.model import ByteLM, gpt  # noqa: E402
from lightning_roundpipe.engine.transfer import NoGrad  # noqa: E402

CATEGORIES = ("parameters", "low-precision copies", "published (full precision)", "optimizer state", "gradients", "staging buffers", "checkpoints",
              "other activations")
MODEL_STATE = ("parameters", "low-precision copies", "published (full precision)", "optimizer state", "gradients", "staging buffers")
TARGETS = {"auto": {"sync": 18.0, "async": 18.0}, "off": {"sync": 16.0, "async": 20.0}}


def tensors_of(value: object) -> list[torch.Tensor]:
    found = []
    for leaf in pytree.tree_leaves(value):
        if isinstance(leaf, torch.Tensor):
            found.append(leaf)
        elif isinstance(leaf, NoGrad):
            found.extend(leaf.tensors())
    return found


def call_values(call: object) -> tuple[list[object], list[object]]:
    """The host values a trunk call (``lightning_roundpipe.engine.call.Call``) holds: checkpoints, and the rest."""
    checkpoints = list(call.checkpoints.values()) + list(call.snapshots.values())
    fused = call.fused  # the fused path's per-microbatch losses and targets; None for a transparent call
    others = list(call.inputs) + (list(fused.losses) if fused else []) + list(call.first_grads or [])
    for column in list(call.outputs.values()):  # job index -> microbatch -> its output cell
        others.extend(list(column.values()))
    return [cell.value for cell in checkpoints], [cell.value for cell in others] + [fused.targets if fused else None]


class HostAccountant(pl.Callback):
    """Samples the host bytes the engine and the optimizer hold, by category, during ``fit``."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.peak_total = 0
        self.at_peak = dict.fromkeys(CATEGORIES, 0)
        self.own_peak = dict.fromkeys(CATEGORIES, 0)
        self.samples = 0
        self.skipped = 0
        self.most_live_calls = 0
        self.largest_call = 0  # host activation bytes of one call
        self.device_peaks: list[int] = []
        self.plan = None
        self._lock = threading.Lock()
        self._calls: list[weakref.ref] = []
        self._windows: list[weakref.ref] = []
        self._stop = threading.Event()
        self._static_cache: tuple[set[int], dict[str, int]] | None = None

    # ------------------------------------------------------------------ wiring
    def on_train_start(self, trainer, pl_module) -> None:
        engine = trainer.strategy.engine
        self.engine, self.optimizer = engine, trainer.optimizers[0]
        self.params = list(engine.trunk.parameters())
        new_call, step = engine._new_call, engine.step

        def tracked_new_call(*args, **kwargs):
            call = new_call(*args, **kwargs)
            self._calls.append(weakref.ref(call))
            return call

        def tracked_step(optimizer, **kwargs):
            self._windows.append(weakref.ref(engine.dispatcher.window))  # the window this step closes
            return step(optimizer, **kwargs)

        engine._new_call, engine.step = tracked_new_call, tracked_step  # instance attributes, removed at the end
        self._hook = self.optimizer.register_step_pre_hook(lambda stepped, *_: self.sample(stepped))
        self._thread = threading.Thread(target=self._run, name="host-accountant", daemon=True)
        self._thread.start()

    def on_train_end(self, trainer, pl_module) -> None:
        self.engine.synchronize()
        self.sample(self.params)  # on the main thread, the only one that touches param.grad
        self._stop.set()
        self._thread.join()
        self._hook.remove()
        for name in ("_new_call", "step"):
            self.engine.__dict__.pop(name, None)
        self.device_peaks = self.engine.peak_resident_bytes()
        self.plan = self.engine.plan

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    # ------------------------------------------------------------------ counting
    def sample(self, grads_of: object = None) -> None:
        """One sample; ``grads_of``: parameters whose ``.grad`` may be read on this thread, or an optimizer
        (the step's, in its pre-hook) whose parameters' ``.grad`` may."""
        try:
            counts = self._count(grads_of)
        except RuntimeError:  # a dict changed size under us (another thread); the next sample will do
            self.skipped += 1
            return
        with self._lock:
            self.samples += 1
            for name, value in counts.items():
                self.own_peak[name] = max(self.own_peak[name], value)
            total = sum(counts.values())
            if total > self.peak_total:
                self.peak_total, self.at_peak = total, counts

    def _static(self) -> tuple[set[int], dict[str, int]]:
        """Parameters, the upload copies and the optimizer state: allocated once (updated in place), so
        counted until the optimizer state is complete, then cached (keeps the sampler cheap)."""
        if self._static_cache is not None:
            return self._static_cache
        seen: set[int] = set()
        counts = dict.fromkeys(CATEGORIES, 0)
        engine = self.engine
        for param in self.params:
            _add(seen, counts, "parameters", param)
        for category, copies in (("low-precision copies", engine._ring.sources._low),
                                 ("published (full precision)", engine._ring.sources._published)):
            for copy in list(copies.values()):
                _add(seen, counts, category, copy)
        states = list(self.optimizer.state.values())
        for state in states:
            for value in list(state.values()):
                _add(seen, counts, "optimizer state", value)
        if len(states) >= sum(p.requires_grad for p in self.params) and all(len(s) >= 3 for s in states):
            self._static_cache = (seen, counts)
        return seen, counts

    def _count(self, grads_of: object) -> dict[str, int]:
        static_seen, static_counts = self._static()
        seen, counts = set(static_seen), dict(static_counts)

        def add(category: str, tensor: object) -> None:
            _add(seen, counts, category, tensor)

        engine = self.engine
        if isinstance(grads_of, torch.optim.Optimizer):
            grads_of = [param for group in grads_of.param_groups for param in group["params"]]
        for param in grads_of or ():  # never param.grad off the main thread: a concurrent read can crash torch
            add("gradients", param.grad)
        windows = [engine.dispatcher.window] + [w for w in (ref() for ref in self._windows) if w is not None]
        for window in windows:
            for grad in list(window._grads.values()):
                add("gradients", grad)
        self._windows = [ref for ref in self._windows if ref() is not None]
        for memory in engine.dispatcher.sum_buffers.held():  # the sums' memory, kept for reuse
            add("gradients", memory)
        for worker in engine.dispatcher.workers:
            for memory in worker.operations.grad_staging.allocated():
                add("staging buffers", memory)
        calls = [c for c in (ref() for ref in self._calls) if c is not None]
        self._calls = [ref for ref in self._calls if ref() is not None]
        self.most_live_calls = max(self.most_live_calls, len(calls))
        for call in calls:
            before = counts["checkpoints"] + counts["other activations"]
            checkpoints, others = call_values(call)
            for category, values in (("checkpoints", checkpoints), ("other activations", others)):
                for value in values:
                    for tensor in tensors_of(value):
                        add(category, tensor)
            self.largest_call = max(self.largest_call, counts["checkpoints"] + counts["other activations"] - before)
        return counts


def _add(seen: set[int], counts: dict[str, int], category: str, tensor: object) -> None:
    """Count ``tensor``'s host storage under ``category`` unless a storage was counted already."""
    if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
        return
    storage = tensor.untyped_storage()
    key = storage.data_ptr()
    if key and key not in seen:
        seen.add(key)
        counts[category] += storage.nbytes()


# ---------------------------------------------------------------------- runs
def make_data(context: int, batch: int, count: int) -> DataLoader:
    data = stdlib_bytes(1_000_000)
    generator = torch.Generator().manual_seed(0)
    starts = torch.randint(0, len(data) - context - 1, (count * batch,), generator=generator)
    windows = torch.stack([data[s: s + context + 1] for s in starts.tolist()])
    return DataLoader(TensorDataset(windows[:, :-1], windows[:, 1:]), batch_size=batch, shuffle=False)


def parameter_count(module: torch.nn.Module) -> tuple[int, int]:
    unique = {id(p): p for p in module.parameters()}.values()
    return sum(p.numel() for p in unique), sum(p.numel() * p.element_size() for p in unique)


def run(mode: str, args: argparse.Namespace, limit: int) -> dict:
    torch.manual_seed(1234)
    net = gpt(width=args.width, depth=args.depth, heads=args.heads, context=args.context)
    module = ByteLM(net, fused=True, context=args.context)
    accountant = HostAccountant(args.interval)
    strategy = RoundPipeStrategy(num_microbatches=args.microbatches, device_memory_limit=limit,
                                 async_step=(mode == "async"), transport_dtype=args.transport)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=args.devices, precision="bf16-mixed",
                         max_steps=args.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                         callbacks=[accountant])
    began = time.perf_counter()
    trainer.fit(module, make_data(args.context, args.batch, args.steps))
    seconds = time.perf_counter() - began
    count, _ = parameter_count(net)
    uploaded = sum(device.counters.uploaded_param_bytes for device in strategy.engine.devices)
    return {
        "uploaded_param_bytes_per_param_per_step": uploaded / count / max(1, trainer.global_step),
        "mode": mode, "seconds": seconds, "steps": trainer.global_step,
        "device_peak_bytes": accountant.device_peaks,
        "host_bytes_at_peak": accountant.at_peak, "host_bytes_own_peak": accountant.own_peak,
        "host_peak_total": accountant.peak_total,
        "per_param_at_peak": {k: v / count for k, v in accountant.at_peak.items()},
        "per_param_own_peak": {k: v / count for k, v in accountant.own_peak.items()},
        "samples": accountant.samples, "skipped_samples": accountant.skipped,
        "most_live_calls": accountant.most_live_calls, "largest_call_per_param": accountant.largest_call / count,
        "plan": (len(accountant.plan.forward), len(accountant.plan.fused), len(accountant.plan.backward)),
        "final_loss": float(trainer.callback_metrics.get("train/loss", float("nan"))),
    }


def mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps (under 40 s)")
    parser.add_argument("--steps", type=int, default=None,
                        help="optimizer steps per mode (default 12, quick 4, smoke 2)")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--depth", type=int, default=None, help="transformer blocks (default 64, smoke 16)")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--context", type=int, default=32)
    parser.add_argument("--batch", type=int, default=6)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=3)
    parser.add_argument("--fraction", type=float, default=None,
                        help="device_memory_limit as a fraction of the parameter bytes (default 0.1, smoke 0.4: "
                             "a stage of a shallower model is a larger share of it)")
    parser.add_argument("--interval", type=float, default=0.01, help="host sampler period, seconds")
    parser.add_argument("--transport", choices=("auto", "off"), default="auto",
                        help="transport_dtype: auto (Linear weights uploaded in bf16) or off")
    parser.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")
    add_smoke(parser, "16 blocks, a limit of 0.4 of the parameter bytes, 2 steps")
    args = parser.parse_args()
    args.steps = sized(args.steps, args, full=12, quick=4, smoke=2)
    args.depth = sized(args.depth, args, full=64, smoke=16)
    args.fraction = sized(args.fraction, args, full=0.1, smoke=0.4)
    torch.set_num_threads(1)
    quiet()

    began = time.perf_counter()
    torch.manual_seed(1234)
    count, nbytes = parameter_count(gpt(args.width, args.depth, args.heads, args.context))
    limit = int(nbytes * args.fraction)
    print(f"Byte GPT: width {args.width}, depth {args.depth}, context {args.context}, batch {args.batch} in "
          f"{args.microbatches} microbatches; {count:,} parameters = {mib(nbytes)} (fp32 module), "
          "bf16-mixed, AdamW")
    print(f"device_memory_limit {mib(limit)} = {nbytes / limit:.1f}x smaller than the parameters; {args.devices} CPU "
          f"devices; {args.steps} steps per mode")
    results = {mode: run(mode, args, limit) for mode in ("sync", "async")}

    print("\nDevice memory (engine accounting: resident stages + stage-boundary activations in flight + what "
          "the compute keeps for backward)")
    print(f"{'mode':<6} {'device':>6} {'peak':>12} {'limit':>12} {'peak/limit':>10}")
    device_ok = True
    for mode, result in results.items():
        for index, peak in enumerate(result["device_peak_bytes"]):
            device_ok &= peak <= limit
            print(f"{mode:<6} {index:>6} {mib(peak):>12} {mib(limit):>12} {peak / limit:10.3f}")
    for mode, result in results.items():
        f, _, b = result["plan"]
        print(f"{mode}: plan {f} forward + 1 fused + {b} backward stages; {result['steps']} steps in "
              f"{result['seconds']:.1f} s; final loss {result['final_loss']:.3f}")

    print(f"\nHost bytes per parameter ({count:,} parameters), at the largest sampled total | each category's own peak")
    print(f"{'category':<28} {'sync':>8} {'(own)':>7} {'async':>8} {'(own)':>7}")
    rows = {}
    for category in CATEGORIES:
        cells = [(results[m]["per_param_at_peak"][category], results[m]["per_param_own_peak"][category])
                 for m in ("sync", "async")]
        rows[category] = cells
        print(f"{category:<28} " + " ".join(f"{at:8.2f} {own:7.2f}" for at, own in cells))
    print(f"{'(largest single call)':<28} {results['sync']['largest_call_per_param']:8.2f} {'':7} "
          f"{results['async']['largest_call_per_param']:8.2f}")
    state = {m: sum(results[m]["per_param_at_peak"][c] for c in MODEL_STATE) for m in results}
    total = {m: results[m]["host_peak_total"] / count for m in results}
    print(f"{'model state (no acts)':<28} {state['sync']:8.2f} {'':7} {state['async']:8.2f}")
    print(f"{'total':<28} {total['sync']:8.2f} {'':7} {total['async']:8.2f}")
    targets = TARGETS[args.transport]
    print(f"{'target':<28} {'<= ' + format(targets['sync'], 'g'):>8} {'':7} {'<= ' + format(targets['async'], 'g'):>8}")
    print(f"{'uploaded B/param/step':<28} " + " ".join(
        f"{results[m]['uploaded_param_bytes_per_param_per_step']:8.2f} {'':7}" for m in ("sync", "async")))
    for mode, result in results.items():
        print(f"{mode}: {result['samples']} samples ({result['skipped_samples']} skipped mid-update), at most "
              f"{result['most_live_calls']} trunk calls alive at once")

    verdicts = []
    for mode in ("sync", "async"):
        ok = round(total[mode], 2) <= targets[mode]
        verdicts.append(f"{mode} {total[mode]:.2f} B/param (model state {state[mode]:.2f}) "
                        f"{'MET' if ok else 'NOT MET'} (<= {targets[mode]:g})")
    device = "device peaks within the limit" if device_ok else "a device peak EXCEEDS the limit"
    print(f"\nVerdict: {device}; host: " + "; ".join(verdicts) + f". [{time.perf_counter() - began:.0f} s]")
    if args.json is not None:
        args.json.write_text(json.dumps({"config": {k: v for k, v in vars(args).items() if k != "json"},
                                         "parameters": count, "parameter_bytes": nbytes, "limit": limit,
                                         "results": results}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
