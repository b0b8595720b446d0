"""The GPU check: measured ceilings, RoundPipe against Lightning's single-device strategy and against the
published RoundPipe library, on one GPU. One command, at most about 5 minutes on one H200.

Run: ``python benchmarks/gpu.py [--out results.json] [--cap-gib 24]`` on a machine with a CUDA GPU, or
``python benchmarks/gpu.py --smoke`` anywhere: the same script on CPU with tiny sizes, in seconds, so it
is debugged before a GPU is at hand.

Each section runs in its own process (``--section NAME``) under a time cap, so a section that hangs or
runs out of memory costs only itself, GPU memory starts clean for the next, and the published library
runs apart from ours. The combined JSON is rewritten after every section: a timeout keeps what finished.

Sections:

* ``ceilings``: pinned host-to-device copy bandwidth, and the dense bf16 matmul rate.
* ``fits``: a ~1B Llama-shaped model that fits the GPU. Lightning's single-device strategy with
  activation checkpointing (Hugging Face ``gradient_checkpointing_enable``) against ``roundpipe``,
  bf16-mixed, sequence 2048: tokens/s and their ratio.
* ``big_sync`` / ``big_async``: a ~4B model that does not fit a ``--cap-gib`` GPU with its training
  state but fits host memory, under ``roundpipe`` / ``roundpipe_async`` with that cap as the device budget
  (also set as the process's memory fraction): tokens/s, model FLOPs utilization against the measured
  matmul rate, achieved upload bandwidth against the measured ceiling, peak device memory, host bytes per
  parameter.
* ``published``: the same model with the published RoundPipe library (PyPI ``roundpipe``), its memory
  limit set to the cap: tokens/s, and ours over theirs.

All language models use the chunked LM-head loss (the preset's head). Figures are medians over the timed
steps after warm-up steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ("ceilings", "fits", "big_sync", "big_async", "published")

# (hidden, intermediate, layers, heads, kv heads, vocab); smoke sizes run on CPU in seconds
SHAPES = {
    "fits": (2048, 8192, 16, 32, 8, 128256),      # Llama-3.2-1B's shape, ~1.24B parameters
    "big": (3072, 8192, 36, 24, 8, 128256),       # ~3.6B parameters (Llama-3.2-3B-like, deeper)
    "smoke": (64, 128, 4, 4, 2, 512),
}


def _llama(shape: tuple[int, ...], dtype, smoke: bool):
    import torch
    import transformers

    # On CPU torch's bf16 SDPA kernel fails when ATEN_CPU_CAPABILITY is set below the machine's AVX-512
    # ("pack_vnni2 is only supported when avx512 is supported"); the smoke run checks this script, not
    # attention kernels, so it uses the eager attention there.
    attention = "eager" if smoke else "sdpa"
    hidden, intermediate, layers, heads, kv_heads, vocab = shape
    config = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                                      num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                                      max_position_embeddings=4096, tie_word_embeddings=False, use_cache=False,
                                      attn_implementation=attention, dtype=dtype)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


def _parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


def _flops_per_token(model, sequence: int) -> float:
    """Training FLOPs per token: 6 x parameters (forward + backward) + attention, plus one more forward for
    the recompute (RoundPipe and activation checkpointing both pay it; MFU counts model FLOPs only)."""
    config = model.config
    return 6 * _parameters(model) + 12 * config.num_hidden_layers * config.hidden_size * sequence


class _StepTimer:
    """A Lightning callback: wall time between consecutive batch starts, after ``warmup`` steps."""

    def __new__(cls, warmup: int):
        import lightning.pytorch as pl

        class StepTimer(pl.Callback):
            def __init__(self) -> None:
                self.times: list[float] = []
                self._last: float | None = None

            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
                now = time.perf_counter()
                if self._last is not None and batch_idx > warmup:
                    self.times.append(now - self._last)
                self._last = now

        return StepTimer()


def _lm_module(model, lr: float = 1e-4):
    import lightning.pytorch as pl
    import torch

    class CausalLMModule(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=lr)

    return CausalLMModule()


def _token_batches(vocab: int, batch: int, sequence: int, count: int):
    import torch

    generator = torch.Generator().manual_seed(0)
    data = torch.randint(0, vocab, (count * batch, sequence), generator=generator)
    return torch.utils.data.DataLoader(data, batch_size=batch)


def _train(model, strategy, args, *, batch: int, sequence: int, steps: int, warmup: int) -> dict:
    import lightning.pytorch as pl

    timer = _StepTimer(warmup)
    accelerator = "cpu" if args.smoke else "gpu"
    devices = 2 if args.smoke and not isinstance(strategy, str) else 1
    trainer = pl.Trainer(strategy=strategy, accelerator=accelerator, devices=devices, max_steps=steps,
                         precision="bf16-mixed", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[timer])
    trainer.fit(_lm_module(model), _token_batches(model.config.vocab_size, batch, sequence, steps + 1))
    step = statistics.median(timer.times)
    return {"tokens_per_s": batch * sequence / step, "step_s": step, "timed_steps": len(timer.times),
            "trainer": trainer}


# ---------------------------------------------------------------------------- sections
def section_ceilings(args) -> dict:
    import torch

    device = torch.device("cpu" if args.smoke else "cuda")
    size = (16 if args.smoke else 1024) * 2**20
    host = torch.empty(size, dtype=torch.uint8, pin_memory=not args.smoke)
    target = torch.empty(size, dtype=torch.uint8, device=device)
    n = 2048 if not args.smoke else 256
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)

    def timed(fn, repeats: int) -> float:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - start) / repeats

    copy_s = timed(lambda: target.copy_(host, non_blocking=True), 10)
    if not args.smoke:  # larger matmuls reach the peak; the smoke run only checks the code path
        n = 8192
        a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    matmul_s = timed(lambda: a @ b, 20 if not args.smoke else 3)
    return {"h2d_gb_per_s": size / copy_s / 1e9, "bf16_matmul_tflops": 2 * n**3 / matmul_s / 1e12,
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}


def section_fits(args) -> dict:
    from lightning_roundpipe import RoundPipeStrategy

    shape = SHAPES["smoke" if args.smoke else "fits"]
    sequence, batch, steps, warmup = (64, 4, 6, 2) if args.smoke else (2048, 4, 12, 3)
    model = _llama(shape, "float32", args.smoke)
    model.gradient_checkpointing_enable()
    baseline = _train(model, "auto" if args.smoke else "single_device", args, batch=batch, sequence=sequence,
                      steps=steps, warmup=warmup)
    model.gradient_checkpointing_disable()  # RoundPipe's backward stages recompute already
    ours = _train(model, RoundPipeStrategy(num_microbatches=4), args, batch=batch, sequence=sequence, steps=steps,
                  warmup=warmup)
    return {"parameters": _parameters(model), "sequence": sequence, "batch": batch,
            "baseline_checkpointed_tokens_per_s": baseline["tokens_per_s"],
            "roundpipe_tokens_per_s": ours["tokens_per_s"],
            "ratio_roundpipe_over_baseline": ours["tokens_per_s"] / baseline["tokens_per_s"]}


def _cap(args) -> int | None:
    """The device budget in bytes, also set as this process's GPU memory fraction (which mem_get_info
    ignores: the strategy is given the cap explicitly)."""
    if args.smoke:
        return None
    import torch

    cap = int(args.cap_gib * 2**30)
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total))
    return cap


def _ceilings(args) -> dict:
    path = Path(args.out)
    if path.exists():
        return json.loads(path.read_text()).get("ceilings", {}).get("result", {})
    return {}


def _big(args, async_step: bool) -> dict:
    import torch

    from lightning_roundpipe import RoundPipeStrategy

    shape = SHAPES["smoke" if args.smoke else "big"]
    sequence, batch, steps, warmup = (64, 4, 6, 2) if args.smoke else (2048, 8, 10, 3)
    model = _llama(shape, "float32", args.smoke)
    cap = _cap(args)
    strategy = RoundPipeStrategy(num_microbatches=4 if args.smoke else 8, async_step=async_step,
                                 device_memory_limit=cap, log_pipeline_metrics=False)
    run = _train(model, strategy, args, batch=batch, sequence=sequence, steps=steps, warmup=warmup)
    plan = run["trainer"].strategy.memory_plan
    engine = run["trainer"].strategy.engine
    if engine is not None:  # bytes copied to the devices per step, over the median step time
        uploaded = sum(device.counters.uploaded_bytes for device in engine.devices)
        run["uploaded_bytes_per_s"] = uploaded / steps / run["step_s"]
    result = {"parameters": _parameters(model), "sequence": sequence, "batch": batch,
              "tokens_per_s": run["tokens_per_s"], "cap_gib": None if cap is None else args.cap_gib}
    flops = _flops_per_token(model, sequence) * run["tokens_per_s"]
    ceilings = _ceilings(args)
    if ceilings.get("bf16_matmul_tflops"):
        result["mfu"] = flops / (ceilings["bf16_matmul_tflops"] * 1e12)
    if not args.smoke:
        result["peak_device_gib"] = torch.cuda.max_memory_allocated() / 2**30
    if plan is not None:  # the pre-flight plan's host total (activations not included)
        result["planned_host_bytes_per_parameter"] = plan.host_total_bytes / max(_parameters(model), 1)
    uploaded = run.get("uploaded_bytes_per_s")
    if uploaded and ceilings.get("h2d_gb_per_s"):
        result["upload_gb_per_s"] = uploaded / 1e9
        result["upload_share_of_ceiling"] = uploaded / (ceilings["h2d_gb_per_s"] * 1e9)
    return result


def section_big_sync(args) -> dict:
    return _big(args, async_step=False)


def section_big_async(args) -> dict:
    return _big(args, async_step=True)


def section_published(args) -> dict:
    try:
        import roundpipe
    except ImportError as error:
        return {"skipped": f"the published library is not installed ({error}); pip install roundpipe"}
    import torch

    shape = SHAPES["smoke" if args.smoke else "big"]
    sequence, batch, steps, warmup = (64, 4, 6, 2) if args.smoke else (2048, 8, 10, 3)
    cap = _cap(args)
    model = _llama(shape, "bfloat16", args.smoke)
    wrapped = roundpipe.wrap_model_to_roundpipe(model, use_sequential_preset=True, optim_dtype=torch.float32)
    with roundpipe.OptimizerCtx():
        optimizer = roundpipe.optim.Adam(wrapped.parameters(), lr=1e-4)
    plan = None
    config = roundpipe.RoundPipeRunConfig(num_microbatch=8)
    data = iter(_token_batches(shape[-1], batch, sequence, steps + 1))
    times = []
    for step in range(steps):
        ids = next(data)
        if cap is not None:
            plan = roundpipe.ModelExecutePlan.auto("fused", wrapped, model_memory_limit=cap / 2**30)
            config = roundpipe.RoundPipeRunConfig(num_microbatch=8, execute_plan=plan)
        start = time.perf_counter()
        wrapped.forward_backward(input_kwargs={"input_ids": ids, "labels": ids, "return_logits": False},
                                 loss_fn=lambda output, _: output.loss, run_config=config)
        wrapped.step(lambda: (optimizer.step(), optimizer.zero_grad()), is_async=True)
        if step >= warmup:
            times.append(time.perf_counter() - start)
    wrapped.synchronize()
    return {"tokens_per_s": batch * sequence / statistics.median(times), "version": roundpipe.__version__}


# ---------------------------------------------------------------------------- driver
def run_section(name: str, args) -> None:
    """Child process: run one section and print its result as one JSON line."""
    if args.smoke:
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    import torch

    torch.set_num_threads(1 if args.smoke else max(1, (os.cpu_count() or 2) - 4))
    result = globals()[f"section_{name}"](args)
    print("RESULT " + json.dumps(result), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="run everything on CPU with tiny sizes")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gpu_results.json"))
    parser.add_argument("--cap-gib", type=float, default=24.0, help="the consumer-GPU memory cap")
    parser.add_argument("--section-timeout", type=float, default=None,
                        help="seconds per section (default: 60 with --smoke, else 75)")
    parser.add_argument("--only", nargs="*", choices=SECTIONS, help="run only these sections")
    parser.add_argument("--section", choices=SECTIONS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.section:
        run_section(args.section, args)
        return 0
    timeout = args.section_timeout or (60.0 if args.smoke else 75.0)
    results: dict = {"smoke": args.smoke, "cap_gib": args.cap_gib, "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.exists():
        out.unlink()  # sections read the ceilings from this run's file only
    failed = 0
    for name in args.only or SECTIONS:
        command = [sys.executable, __file__, "--section", name, "--out", str(out), "--cap-gib", str(args.cap_gib)]
        if args.smoke:
            command.append("--smoke")
        start = time.perf_counter()
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
            lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
            if done.returncode == 0 and lines:
                entry = {"result": json.loads(lines[-1][len("RESULT "):])}
            else:
                entry = {"error": (done.stderr or done.stdout).strip().splitlines()[-12:]}
        except subprocess.TimeoutExpired:
            entry = {"error": f"timed out after {timeout:.0f} s"}
        entry["seconds"] = round(time.perf_counter() - start, 1)
        results[name] = entry
        out.write_text(json.dumps(results, indent=1))  # after every section: a later timeout keeps this
        status = "ok" if "result" in entry else "FAILED"
        failed += status != "ok"
        print(f"{name:<10} {status:<7} {entry['seconds']:>6.1f} s  {json.dumps(entry.get('result', entry.get('error')))[:300]}",
              flush=True)
    print(f"wrote {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
