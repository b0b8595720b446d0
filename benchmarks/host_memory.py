"""Host memory per tier: resident bytes per parameter, disk bytes per step and step time, per configuration.

Run: ``python benchmarks/host_memory.py [--quick]`` (default about 4 minutes on 2 cores, ``--quick`` about 2,
``--smoke`` seconds: width 128, 4 layers, 1 measured step, one batch size). Not a test: it prints tables and
verdicts and always exits 0.

Setup: ``sync_async.py``'s emulated trunk (``--layers`` blocks ``x + tanh(Linear(width, width)(x))``, each
followed by a sleep that stands for device time: ``--forward-ms`` per microbatch in forward, twice that in
backward), 48 x 1024 wide by default: 50.4M parameters. ``RoundPipeStrategy`` on 2 CPU devices, one stage per
``--layers-per-stage`` layers (1: a step group is a layer, and the groups in flight are a small part of the model),
``precision="bf16-mixed"`` (the Linear weights travel as bf16 copies; one configuration ``bf16-true``), AdamW,
``torch.set_num_threads(1)``. Each configuration runs in a fresh process (its memory is its own), with
``MALLOC_MMAP_THRESHOLD_=65536``: otherwise glibc keeps freed blocks of up to 32 MB in its heap once one was freed,
and the resident set would keep the high-water mark of every allocation rather than what is live (a setting worth
having in training jobs too).

* ``gradients kept``: ``keep_gradients="always"``, what a step held before issue 26 (the whole model's fp32
  gradients in ``param.grad`` between steps);
* ``in flight``: the default, each step group's gradients only while in flight;
* ``state on disk``: ``offload="optimizer"`` under ``--dir`` (default: a temporary directory in the working
  directory's file system: point it at the disk to measure);
* ``state + masters on disk``: ``offload="optimizer+masters"``;
* ``LoRA, bf16 base frozen``: every Linear frozen and holding bfloat16 values (a bf16 checkpoint loaded into the
  float32 model), a rank ``--rank`` adapter beside each trained (``B @ A``, B zero at first); ``frozen_weights``
  at its default keeps the base in bf16 alone (its float32 masters are freed when the engine starts);
* ``LoRA, base stored in bf16``: the same with each base Linear converted to bf16 as it is built (what
  ``model.dtype=bfloat16`` or ``from_pretrained(torch_dtype=torch.bfloat16)`` gives): the model is never float32
  whole, the base is uploaded as stored;
* ``LoRA, bf16 base, built on meta from a checkpoint``: the first LoRA run's model built under
  ``Trainer.init_module(empty_init=True)`` (on the meta device) and resumed from the checkpoint that run ended
  with (float32, bf16 values): each layer materialized from the memory-mapped checkpoint and its base narrowed at
  once;
* ``state + masters on disk, built on meta from a checkpoint``: the same for the ``state + masters on disk`` run:
  each layer materialized from its checkpoint, its transport copy made and its masters moved into the tier's files
  at once, then the AdamW state loaded (memory-mapped) and moved into files a parameter at a time.
* ``8-bit state (AdamW8bit), in memory`` and ``8-bit state + masters on disk``: bitsandbytes' ``AdamW8bit`` instead
  of torch's AdamW (issue 27), its moments blockwise in 8 bits (about 2 bytes per parameter instead of 8), in
  memory with the gradients in flight, and with the disk tier.
* ``QLoRA, NF4 base``: the LoRA model with each base Linear's weight quantised to NF4 as it is built
  (``lightning_roundpipe.nf4.to_nf4``: half a byte a weight and a float32 scale per 64; the biases stay float32).
  Its bytes per parameter count an NF4 weight as one parameter.
* ``bf16 masters (stochastic rounding) + 8-bit state``: every weight in bfloat16 (``precision="bf16-true"``: the
  masters are the upload copies), stepped in float32 and rounded back stochastically (``stochastic_rounding``),
  with bitsandbytes' ``AdamW8bit``: the full fine-tuning of issue 27, no disk.

Resident bytes: a sampler thread reads, every ``--interval`` seconds, the process's anonymous and shared-memory
resident bytes (``RssAnon`` + ``RssShmem``: file pages it maps, its libraries or a checkpoint read memory-mapped,
are clean page cache the kernel drops under pressure) less what the CPU stand-in devices hold in it
(:func:`stand_in_bytes`: on GPUs it is device memory) and, with a disk tier, adds the pages of its files in memory,
mapped or cached (``mincore``): memory the tier keeps busy either way (an ``offload_dir`` on tmpfs would count
them twice). Per parameter: the
largest sample less the process before the model was built (imports, data), over the model's parameters. Setup:
from building the model to the first batch (the strategy's setup, the engine's start, the masters moved to disk);
steady: from the second batch on (the first makes the optimizer state). Disk bytes: ``read_bytes`` and
``write_bytes`` of ``/proc/self/io`` over the measured steps, per step (what reached the disk, not the page cache).
Step time: the median from one batch start to the next, over ``--steps`` steps after one warm-up.

Where a tier slows the step: each tier's step against ``in flight`` at several microbatch counts (``--sweep``):
more microbatches per step means more device time per step for the same disk bytes, so the first count at which
the ratio is at most ``TOLERANCE`` is the batch at which the tier stops costing (on this machine's disk). These runs
are for their step time alone: glibc's default allocator (``MALLOC_MMAP_THRESHOLD_`` maps and faults in every
large block afresh, CPU time that on 2 cores slowed the in-memory step by about a third and the tiers more) and a
memory sample a second at most (a sample of the tier's files is kernel time for each of their pages).

A second table splits the steady peak's sample: what the engine's own parts held then (:func:`known_parts`: the
upload copies, the tier's pages in memory, the gradient sums kept for reuse, the download buffers) and the rest
(the gradients and state being summed and stepped, activations, the allocator's own).

At the margin: the process's fixed part (threads, Lightning's objects, the allocator's arenas: about 50 MB here)
is about 1 B/param of a 50M-parameter model and nothing of an 8B one, so the configurations with a target run
again with half the layers, and the difference of the two runs' peaks over the difference of their parameters is
what each parameter costs (the figure to scale to a large model).

Targets (issue 26): full fine-tuning with state and masters on disk at most 4 resident B/param (at the margin);
LoRA on a bf16 base at most 2.2 B/param for the frozen weights (their memory and any upload copy of them, in the
steady peak's sample, per frozen parameter; the whole LoRA run at the margin is printed beside it, the adapters
included: rank 8 on width 1024 makes them 1.6% of the parameters, at about 16 B each); setup peak within 1.1x of
the steady state (over whole runs, every configuration but ``LoRA, bf16 base frozen`` and ``state + masters on
disk``, whose float32 weights are built in memory before the strategy sees them: the meta and bf16 builds are the
ways to avoid it, and their ratios are printed beside).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

CONFIGS = {  # name: (label, strategy options, LoRA: its frozen base's kind, or "" for full fine-tuning)
    "kept": ("gradients kept", {"keep_gradients": "always"}, ""),
    "in-flight": ("in flight", {}, ""),
    "state": ("state on disk", {"offload": "optimizer"}, ""),
    "masters": ("state + masters on disk", {"offload": "optimizer+masters"}, ""),
    "lora": ("LoRA, bf16 base frozen", {}, "bf16 values"),
    "lora-stored": ("LoRA, base stored in bf16", {}, "stored in bf16"),
    "lora-meta": ("LoRA, bf16 base, built on meta from a checkpoint", {}, "bf16 values"),
    "masters-meta": ("state + masters on disk, built on meta from a checkpoint", {"offload": "optimizer+masters"}, ""),
    "8bit": ("8-bit state (AdamW8bit), in memory", {}, ""),
    "8bit-masters": ("8-bit state + masters on disk", {"offload": "optimizer+masters"}, ""),
    "qlora": ("QLoRA, NF4 base", {}, "nf4"),
    "bf16-8bit": ("bf16 masters (stochastic rounding) + 8-bit state", {"stochastic_rounding": True}, ""),
}
# bitsandbytes' AdamW8bit (moments blockwise in 8 bits) instead of torch's AdamW
EIGHT_BIT = ("8bit", "8bit-masters", "bf16-8bit")
# every weight in bfloat16 (precision="bf16-true"), stepped in float32 and rounded back stochastically
BF16_MASTERS = ("bf16-8bit",)
# built in float32 in memory, 4 B/param before the strategy sees them: the "-meta" runs show how to avoid it
BUILT_WIDE = ("lora", "masters")
# built under Trainer.init_module(empty_init=True), resumed from the checkpoint the named configuration ended with
FROM_CHECKPOINT = {"lora-meta": "lora", "masters-meta": "masters"}
TIERS = ("state", "masters")
TOLERANCE = 1.05
MMAP_THRESHOLD = 65536
TARGETS = {"masters": 4.0, "lora": 2.2}
# run again with half the layers (in this order: a checkpoint first)
MARGINS = ("masters", "masters-meta", "lora", "in-flight", "8bit", "8bit-masters", "qlora", "bf16-8bit")
SETUP_TARGET = 1.1


def _rss() -> int:
    """The process's anonymous and shared-memory resident bytes (``RssAnon`` and ``RssShmem``): what only swap
    could free. The file pages it maps (libraries, a checkpoint being loaded memory-mapped) are clean page cache the
    kernel drops under pressure, so they are left out; the disk tier's, written in between, are counted apart."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return sum(int(fields[name].split()[0]) * 1024 for name in ("RssAnon", "RssShmem"))


def _disk_io() -> tuple[int, int]:
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(fields["read_bytes"]), int(fields["write_bytes"])


def stand_in_bytes(engine: Any) -> int:
    """What the CPU stand-in devices hold in host memory now: their accounted bytes (stage copies, gradients,
    activations) and the released stage copies they keep for reuse (``UploadSpares``, read from the engine's
    internals). On GPUs that memory is the devices'; here it is subtracted."""
    ring = engine._ring
    return (sum(device.residency.current for device in engine.devices)
            + sum(spares._free_bytes for spares in ring.runner._spares))


KNOWN = ("upload copies", "disk tier", "gradient sums", "gradient staging", "frozen weights")


def known_parts(engine: Any) -> dict[str, int]:
    """What the engine's own parts hold on the host now (from its internals, read-only): the copies uploads read
    (bf16 Linear weights), the disk tier's pages in memory (mapped or cached), the gradient sums it keeps for
    reuse, the download buffers, and the frozen weights (their memory and their copies)."""
    ring = engine._ring
    frozen = {id(param): param for param in engine.trunk.parameters() if not param.requires_grad}
    copies = {**ring.sources._low, **ring.sources._published}
    return {"upload copies": ring.sources.nbytes(),
            # the frozen weights' own memory and their upload copies (counted in "upload copies" too)
            "frozen weights": sum(param.untyped_storage().nbytes() + (copies[key].untyped_storage().nbytes()
                                                                      if key in copies else 0)
                                  for key, param in frozen.items()),
            "disk tier": engine.disk.resident_bytes() if engine.disk is not None else 0,
            "gradient sums": engine.dispatcher.sum_buffers.held_bytes(),
            "gradient staging": sum(worker.operations.grad_staging.nbytes() for worker in ring.workers)}


class Sampler:
    """The largest resident figure seen since each :meth:`phase` (a thread of its own)."""

    def __init__(self, interval: float, directory: str) -> None:
        self.interval, self.directory = interval, directory
        self.engine: Any = None  # the strategy's engine, once started
        self.peaks: dict[str, int] = {}
        self.parts: dict[str, dict[str, int]] = {}  # per phase, the parts of its peak sample
        self._phase = "setup"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def resident(self) -> tuple[int, dict[str, int]]:
        parts = {"rss": _rss(), "stand-in devices": 0}
        engine = self.engine
        if engine is not None and not engine.closed:
            parts["stand-in devices"] = stand_in_bytes(engine)
            parts.update(known_parts(engine))
        return parts["rss"] - parts["stand-in devices"] + parts.get("disk tier", 0), parts

    def phase(self, name: str) -> None:
        self.sample()
        self._phase = name

    def sample(self) -> None:
        resident, parts = self.resident()
        if resident > self.peaks.get(self._phase, 0):
            self.peaks[self._phase], self.parts[self._phase] = resident, parts

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One configuration, in this process: the figures of the module docstring."""
    import lightning.pytorch as pl
    import torch
    import torch.nn.functional as F
    from common import quiet
    from overhead import StepTimer
    from sync_async import EmulatedLayer, make_batches, make_plan
    from torch import nn

    from lightning_roundpipe import RoundPipeStrategy, pipeline_loss
    from lightning_roundpipe.nf4 import to_nf4, weight_count

    quiet()
    torch.set_num_threads(1)
    label, options, lora = CONFIGS[args.child]

    class Adapted(nn.Module):
        """A frozen Linear plus a trainable rank-``rank`` update ``B @ A`` (B zero: the same function at first)."""

        def __init__(self, base: nn.Linear, rank: int) -> None:
            super().__init__()
            self.base = base.requires_grad_(False)
            self.down = nn.Linear(base.in_features, rank, bias=False)
            self.up = nn.Linear(rank, base.out_features, bias=False)
            nn.init.zeros_(self.up.weight)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.base(x) + self.up(self.down(x))

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(1234)
            layers = []
            for _ in range(args.layers):  # one at a time: a bf16 base is float32 one layer at a time only
                layer = EmulatedLayer(args.width, args.forward_ms / 1e3, 2.0)
                if lora == "bf16 values":  # as a bf16 checkpoint loaded into a float32 model has
                    with torch.no_grad():
                        for param in layer.linear.parameters():
                            param.copy_(param.bfloat16().float())
                elif lora == "stored in bf16":
                    layer.linear.to(torch.bfloat16)
                if lora:
                    layer.linear = Adapted(layer.linear, args.rank)
                if lora == "nf4":  # quantised as it is built: the float32 base is never whole
                    to_nf4(layer)
                layers.append(layer)
            self.net = nn.Sequential(*layers)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return pipeline_loss(self.net, x, y, F.mse_loss)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            trained = [p for p in self.parameters() if p.requires_grad]
            if args.child in EIGHT_BIT:
                import bitsandbytes

                return bitsandbytes.optim.AdamW8bit(trained, lr=1e-4)
            return torch.optim.AdamW(trained, lr=1e-4)

    class Phases(pl.Callback):
        roundpipe_reads_gradients = False

        def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                                 batch_idx: int) -> None:
            sampler.engine = trainer.strategy.engine
            if io:
                io_batches[0] += 1
            if batch_idx == 0:
                sampler.phase("first step")
            elif batch_idx == 1:
                sampler.phase("steady")
                io.append(_disk_io())
                io_batches[0] = 1

        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            io.append(_disk_io())
            sampler.phase("teardown")  # not reported: the engine closes, its devices' memory is no longer counted

    steps = 1 + args.steps + 1  # a warm-up, the measured ones, and one whose start ends the last
    args.rows = 2
    data = make_batches(args, steps)
    io: list[tuple[int, int]] = []
    io_batches = [0]  # the batches between the two readings of io (from the second batch to the end of training)
    directory = tempfile.mkdtemp(prefix="roundpipe-host-memory-", dir=args.dir)
    baseline = _rss()
    sampler = Sampler(args.interval, directory)
    tier = {"offload_dir": directory} if "offload" in options else {}
    strategy = RoundPipeStrategy(num_microbatches=args.microbatches, log_pipeline_metrics=False, preflight="off",
                                 num_stages=make_plan(args.layers, args.layers_per_stage), **options, **tier)
    timer = StepTimer(warmup=1)
    resumed = args.child in FROM_CHECKPOINT  # the checkpoint is at step `steps`: as many again
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=2 * steps if resumed else steps,
                         precision="bf16-true" if args.child in BF16_MASTERS else "bf16-mixed", logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, limit_val_batches=0, callbacks=[timer, Phases()])
    with trainer.init_module(empty_init=resumed):
        model = Model()
    params, frozen = weight_count(model), weight_count(model, frozen_only=True)  # an NF4 weight counts as one
    trainer.fit(model, data, ckpt_path=args.checkpoint if resumed else None)
    sampler.stop()
    if args.save_checkpoint is not None:
        trainer.save_checkpoint(args.save_checkpoint)
    os.rmdir(directory)  # the tier's files had no names: nothing is left in it
    measured = max(1, io_batches[0])
    (read0, write0), (read1, write1) = io[0], io[-1]
    return {"config": args.child, "label": label, "parameters": params, "frozen": frozen, "baseline": baseline,
            "peaks": sampler.peaks, "parts": sampler.parts, "read_per_step": (read1 - read0) / measured,
            "written_per_step": (write1 - write0) / measured, "step_s": statistics.median(timer.step_seconds()),
            "microbatches": args.microbatches}


def run_child(config: str, microbatches: int, args: argparse.Namespace, layers: int | None = None,
              checkpoint: str | None = None, save_checkpoint: str | None = None,
              timing: bool = False) -> dict[str, Any]:
    """``config`` in a process of its own; ``timing``: for its step time alone, with glibc's default allocator and
    a sample a second at most (a sample of the disk tier asks the kernel about every page of its files)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        layers = args.layers if layers is None else layers
        command = [sys.executable, __file__, "--child", config, "--out", out.name, "--microbatches", str(microbatches),
                   "--width", str(args.width), "--layers", str(layers), "--steps", str(args.steps),
                   "--forward-ms", str(args.forward_ms), "--layers-per-stage", str(args.layers_per_stage),
                   "--rank", str(args.rank), "--interval", str(max(args.interval, 1.0) if timing else args.interval)]
        if args.dir is not None:
            command += ["--dir", args.dir]
        if checkpoint is not None:
            command += ["--checkpoint", checkpoint]
        if save_checkpoint is not None:
            command += ["--save-checkpoint", save_checkpoint]
        # glibc keeps a freed block of up to 32 MB in its heap once one such block was freed (its dynamic mmap
        # threshold), so the resident set would keep the high-water mark of every allocation; with a fixed
        # threshold, large blocks go back to the system when freed and the resident set follows what is live. That
        # costs CPU time (each such block is mapped and faulted in afresh, the host step's temporaries too), so
        # step times are measured without it
        env = {key: value for key, value in os.environ.items() if key != "MALLOC_MMAP_THRESHOLD_"}
        if not timing:
            env["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)
        result = subprocess.run(command, capture_output=True, text=True, env=env)
        if result.returncode != 0:
            raise RuntimeError(f"{config} failed:\n{result.stderr[-3000:]}")
        return json.loads(Path(out.name).read_text())


def per_param(result: dict[str, Any], phase: str) -> float:
    peak = result["peaks"].get(phase, 0)
    return (peak - result["baseline"]) / result["parameters"]


def frozen_per_param(result: dict[str, Any]) -> float:
    """The frozen weights' bytes (their memory and any upload copy of them) at the steady peak, per frozen
    parameter."""
    return result["parts"].get("steady", {}).get("frozen weights", 0) / result["frozen"]


def marginal_per_param(full: dict[str, Any], half: dict[str, Any], phase: str) -> float:
    """What each parameter the larger model adds costs: the difference of two runs' peaks (each less its process
    before the model) over the difference of their parameters, free of the process's fixed part (threads,
    Lightning's objects, the allocator's arenas), which the whole-run figure spreads over the parameters."""
    def above(result: dict[str, Any]) -> int:
        return result["peaks"].get(phase, 0) - result["baseline"]
    return (above(full) - above(half)) / (full["parameters"] - half["parameters"])


def run_configs(configs: tuple[str, ...], args: argparse.Namespace, layers: int) -> dict[str, dict[str, Any]]:
    """Run ``configs`` in order with ``layers`` layers; a FROM_CHECKPOINT one resumes from the checkpoint its source
    configuration (run before it) ended with."""
    with tempfile.TemporaryDirectory(prefix="roundpipe-host-memory-", dir=args.dir) as saved:
        def checkpoint(config: str) -> str:
            return os.path.join(saved, f"{config}.ckpt")

        return {config: run_child(config, args.microbatches, args, layers=layers,
                                  checkpoint=checkpoint(FROM_CHECKPOINT[config]) if config in FROM_CHECKPOINT else None,
                                  save_checkpoint=checkpoint(config) if config in FROM_CHECKPOINT.values() else None)
                for config in configs}


def main() -> int:
    from common import add_smoke, sized

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and batch sizes")
    parser.add_argument("--width", type=int, default=None, help="layer width (default 1024, smoke 128)")
    parser.add_argument("--layers", type=int, default=None, help="layers (default 48, smoke 4)")
    parser.add_argument("--layers-per-stage", type=int, default=1, help="layers a stage, hence a step group")
    parser.add_argument("--steps", type=int, default=None, help="measured steps (default 4, quick 2, smoke 1)")
    parser.add_argument("--forward-ms", type=float, default=None, help="emulated device ms per layer and microbatch "
                                                                       "in forward (default 1, smoke 0.5)")
    parser.add_argument("--microbatches", type=int, default=None, help="for the memory table (default 4)")
    parser.add_argument("--sweep", type=str, default=None,
                        help="microbatch counts of the step-time table (default 4,8,16; quick 4,16; smoke 2)")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank")
    parser.add_argument("--interval", type=float, default=0.01, help="sampler period, seconds")
    parser.add_argument("--dir", type=str, default=None, help="offload_dir's parent (default: the system's temp)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")
    parser.add_argument("--child", choices=tuple(CONFIGS), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", type=str, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--save-checkpoint", type=str, default=None, help=argparse.SUPPRESS)
    add_smoke(parser, "width 128, 4 layers, 1 measured step, microbatches 2")
    args = parser.parse_args()
    args.width = sized(args.width, args, full=1024, smoke=128)
    args.layers = sized(args.layers, args, full=48, smoke=4)
    args.steps = sized(args.steps, args, full=4, quick=2, smoke=1)
    args.forward_ms = sized(args.forward_ms, args, full=1.0, smoke=0.5)
    args.microbatches = sized(args.microbatches, args, full=4, smoke=2)
    sweep = [int(part) for part in sized(args.sweep, args, full="4,8,16", quick="4,16", smoke="2").split(",")]
    if args.child is not None:
        args.out.write_text(json.dumps(child(args)))
        return 0
    if args.layers < 2:
        parser.error("--layers must be at least 2: the margin compares the model with one of half its layers")

    began = time.perf_counter()
    print(f"Emulated trunk: {args.layers} x Linear({args.width}, {args.width}), {args.layers_per_stage} layers a "
          f"stage, 2 CPU devices, bf16-mixed, AdamW, {args.forward_ms:g} ms forward per layer and microbatch; "
          f"{args.steps} measured steps")
    results = run_configs(tuple(CONFIGS), args, args.layers)
    print(f"\nHost bytes per parameter ({results['kept']['parameters']:,} parameters; LoRA: "
          f"{results['lora']['parameters']:,} with its adapters), peak resident less the process before the model")
    print("| configuration | setup | first step | steady | setup/steady | disk read MB/step | disk written MB/step |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for result in results.values():
        setup, first, steady = (per_param(result, phase) for phase in ("setup", "first step", "steady"))
        print(f"| {result['label']} | {setup:.2f} | {first:.2f} | {steady:.2f} | {setup / steady:.2f} | "
              f"{result['read_per_step'] / 1e6:.1f} | {result['written_per_step'] / 1e6:.1f} |")
    print("\nThe steady peak's sample, bytes per parameter: what the engine's parts held, and the rest")
    engine_parts = KNOWN[:-1]  # the frozen weights are model memory, which "rest" holds
    print("| configuration | " + " | ".join(engine_parts) + " | rest | frozen weights, B per frozen parameter |")
    print("| --- | " + " | ".join("---" for _ in engine_parts) + " | --- | --- |")
    for result in results.values():
        parts, params = result["parts"].get("steady", {}), result["parameters"]
        known = [parts.get(name, 0) / params for name in engine_parts]
        frozen = (f"{frozen_per_param(result):.2f}" if result["frozen"] else "none frozen")
        print(f"| {result['label']} | " + " | ".join(f"{value:.2f}" for value in known)
              + f" | {per_param(result, 'steady') - sum(known):.2f} | {frozen} |")

    timing = {tier: {} for tier in ("in-flight", *TIERS)}
    for microbatches in sweep:
        for tier in timing:
            timing[tier][microbatches] = run_child(tier, microbatches, args, timing=True)["step_s"]
    print("\nStep time against the in-memory run (in flight), by microbatches per step")
    print("| microbatches | in memory ms/step | " + " | ".join(f"{CONFIGS[t][0]} ms/step (ratio)" for t in TIERS) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in TIERS) + " |")
    for microbatches in sweep:
        base = timing["in-flight"][microbatches]
        cells = [f"{timing[t][microbatches] * 1e3:.0f} ({timing[t][microbatches] / base:.2f})" for t in TIERS]
        print(f"| {microbatches} | {base * 1e3:.0f} | " + " | ".join(cells) + " |")
    for tier in TIERS:
        free = [m for m in sweep if timing[tier][m] / timing["in-flight"][m] <= TOLERANCE]
        where = f"from {free[0]} microbatches per step" if free else f"not within {sweep[-1]} microbatches"
        print(f"{CONFIGS[tier][0]}: within {TOLERANCE:.2f}x of in memory {where}")

    half_layers = args.layers // 2
    halves = run_configs(MARGINS, args, half_layers)
    print(f"\nAt the margin ({args.layers} against {half_layers} layers): what each added parameter costs, "
          "bytes per parameter")
    print("| configuration | setup | steady | setup/steady | whole run steady |")
    print("| --- | --- | --- | --- | --- |")
    margins = {}
    for config, half in halves.items():
        setup, steady = (marginal_per_param(results[config], half, phase) for phase in ("setup", "steady"))
        margins[config] = (setup, steady)
        print(f"| {CONFIGS[config][0]} | {setup:.2f} | {steady:.2f} | {setup / steady:.2f} | "
              f"{per_param(results[config], 'steady'):.2f} |")

    verdicts = []
    steady = margins["masters"][1]
    meta_peak = max(margins["masters-meta"])
    verdicts.append(f"{CONFIGS['masters'][0]} {steady:.2f} B/param at the margin, "
                    f"{per_param(results['masters'], 'steady'):.2f} over the whole run (target <= {TARGETS['masters']:g}) "
                    f"{'MET' if steady <= TARGETS['masters'] else 'NOT MET'}; its setup {margins['masters'][0]:.2f} "
                    f"built in float32 in memory, at most {meta_peak:.2f} setup or steady built on meta "
                    f"{'MET' if meta_peak <= TARGETS['masters'] else 'NOT MET'}")
    frozen = frozen_per_param(results["lora"])
    verdicts.append(f"{CONFIGS['lora'][0]}: the frozen weights {frozen:.2f} B per frozen parameter (target <= "
                    f"{TARGETS['lora']:g}) {'MET' if frozen <= TARGETS['lora'] else 'NOT MET'}, the whole LoRA run "
                    f"{margins['lora'][1]:.2f} B/param at the margin (adapters included)")
    verdicts.append(f"{CONFIGS['qlora'][0]}: the frozen weights {frozen_per_param(results['qlora']):.2f} B per frozen "
                    f"parameter, the whole run {margins['qlora'][1]:.2f} B/param at the margin")
    ratios = {config: per_param(result, "setup") / per_param(result, "steady") for config, result in results.items()}
    setup_ratio = max(ratio for config, ratio in ratios.items() if config not in BUILT_WIDE)
    verdicts.append(f"setup/steady at most {setup_ratio:.2f} (target <= {SETUP_TARGET:g}) "
                    f"{'MET' if setup_ratio <= SETUP_TARGET else 'NOT MET'}; "
                    + ", ".join(f"{CONFIGS[config][0]} {ratios[config]:.2f}" for config in BUILT_WIDE)
                    + " (built in float32 in memory: their '-meta' runs build on meta from a checkpoint)")
    print("\nVerdict: " + "; ".join(verdicts))
    seconds = time.perf_counter() - began
    print(f"({seconds:.0f} s)")
    if args.json is not None:
        args.json.write_text(json.dumps({"config": vars(args) | {"json": str(args.json), "out": None},
                                         "results": results, "halves": halves, "timing": timing,
                                         "verdicts": verdicts,
                                         "seconds": seconds}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
