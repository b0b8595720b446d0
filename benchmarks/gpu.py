"""The GPU check: environment and transfer ceilings, the GPU tests, RoundPipe against Lightning's single-device
strategy and against the published RoundPipe library. One command, at most 9 minutes on one H200.

Run from a clone, installed or not: ``python benchmarks/gpu.py [--out results.json] [--cap-gib 24]`` (or
``bash benchmarks/gpu_check.sh``, which first installs any wheels in ``.wheels/``), or
``python benchmarks/gpu.py --smoke`` anywhere: every section on CPU with tiny sizes, in under a minute, so
the script is debugged before a GPU is at hand (the test suite runs it). What needs CUDA says
``skipped: no CUDA`` there.

Each section runs in its own process under its own time cap (plus what earlier sections left unused), all
within ``--budget`` (540 s), so a section that hangs or runs out of memory costs only itself and GPU memory
starts clean for the next (the smoke run shares one process between the training sections). Sections print
a ``STEP`` line after every training step, so a timeout keeps the steps done; the JSON is rewritten after
every section, and a table is printed at the end.

Sections:

* ``environment``: versions, ``ulimit -l``, cores, MemAvailable; host-to-device and device-to-host GB/s from
  memory registered in place (``cudaHostRegister``, the engine's own path), from ``cudaHostAlloc`` memory
  (``pin_memory()``) and from pageable memory; the dense bf16 matmul rate (the MFU denominator); a
  registration that fails on purpose on the main thread followed by a kernel there (does CUDA's sticky
  last-error reach the next launch?).
* ``pytest``: ``python -m pytest -q -m gpu tests/test_gpu.py``.
* ``sanitizer``: the fp32 transparency cases (one ring member; one GPU visited twice) under torch's CUDA
  sanitizer, which flags unsynchronized cross-stream accesses, entered in every engine thread
  (``engine/sanitizer.py``: its mode is per thread, so enabled on the main thread alone it would check none of
  the engine's kernels); it reports how many operators each kind of thread had checked. In ``--smoke``, the
  happens-before checker of the CPU stand-ins over a small stress-mode run.
* ``fits_baseline`` / ``fits_sync`` / ``fits_async``: a model that fits the capped GPU (Llama-3.2-1B's shape):
  Lightning's single-device strategy with per-block activation checkpointing and fused AdamW on the GPU,
  against RoundPipe sync and async with fused AdamW on the host. All bf16-mixed with fp32 weights and the
  same chunked LM-head loss, sequence 2048.
* ``big_async`` / ``big_sync``: a model whose training state does not fit the cap (Llama-3.2-3B's shape:
  fp32 weights, gradients and AdamW state take 16 bytes a parameter) under RoundPipe.
* ``published``: the same model, batch, microbatches and cap with the published library (PyPI ``roundpipe``)
  in its async mode, with a shim for its transformers incompatibility; reported as our async tokens/s over
  theirs.

For each training section: tokens/s, MFU (model FLOPs without the input embedding, against the measured
matmul rate), the GPU busy share, H2D GB/s achieved against the registered-memory ceiling, gradient
download and host optimizer seconds per step, ``max_memory_allocated``/``max_memory_reserved`` and
``num_alloc_retries``. Figures are medians over the timed steps after the warm-up steps. Engine figures come
from ``engine.pipeline_metrics()``; a key an engine version lacks is reported as n/a.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if (ROOT / "lightning_roundpipe").is_dir() and str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # a clone without `pip install`: the package beside this script comes first

# section -> its time cap in seconds on the GPU, in running order; they add up to BUDGET_S
SECTIONS: dict[str, float] = {
    "environment": 35, "pytest": 70, "sanitizer": 40, "fits_baseline": 40, "fits_sync": 55, "fits_async": 50,
    "big_async": 65, "published": 120, "big_sync": 65,
}
BUDGET_S = 540.0   # 9 minutes: the whole check fits one 600 s command
SMOKE_CAP_S = 60.0
# the smoke run shares one process per group: importing Lightning and transformers once keeps it under a minute
SMOKE_GROUPS = (("environment",), ("pytest",), ("sanitizer",),
                ("fits_baseline", "fits_sync", "fits_async", "big_async", "published", "big_sync"))
SANITIZER_CASES = [f"tests/test_gpu.py::test_training_equals_plain_pytorch_on_the_gpu[{ring}-fp32]"
                   for ring in ("one", "ring-0-0")]

# (hidden, intermediate, layers, heads, kv heads, vocab); all tie the head to the embedding, as Llama 3.2 does
SHAPES = {
    "fits": (2048, 8192, 16, 32, 8, 128256),   # Llama-3.2-1B
    "big": (3072, 8192, 28, 24, 8, 128256),    # Llama-3.2-3B
    "smoke": (64, 128, 4, 4, 2, 512),
}
# (sequence, batch, microbatches, warm-up steps, timed steps)
RUNS = {"fits": (2048, 4, 4, 2, 4), "big": (2048, 8, 8, 2, 3), "smoke": (64, 4, 4, 1, 2)}
_current_section = ""  # the section this process runs, for its STEP lines


# ---------------------------------------------------------------------------- helpers
def _version(distribution: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _child_env(**extra: str) -> dict[str, str]:
    """The environment of a child process: this clone's package importable even if it is not installed."""
    env = dict(os.environ, **extra)
    if (ROOT / "lightning_roundpipe").is_dir():
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return env


def _run(command: list[str], timeout: float, **kwargs) -> tuple[int | None, str]:
    """Run ``command`` in its own process group; on timeout kill the whole group (a section's own children
    too) and return ``(None, output so far)``."""
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True, **kwargs) as process:
        try:
            output, _ = process.communicate(timeout=timeout)
            return process.returncode, output
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
            return None, output


def _cuda(args) -> bool:
    import torch

    return not args.smoke and torch.cuda.is_available()


def _billions(count: int) -> str:
    return f"{count / 1e9:.2f}B" if count >= 1e8 else f"{count / 1e6:.2f}M"


def _gib(nbytes: float) -> float:
    return round(nbytes / 2**30, 2)


def _median(values):
    values = [v for v in values if isinstance(v, (int, float))]
    return statistics.median(values) if values else None


def _earlier(args, section: str) -> dict:
    """A result of an earlier section of this run (the ceilings, for instance), from the JSON file."""
    path = Path(args.out)
    if path.exists():
        return json.loads(path.read_text()).get(section, {}).get("result", {})
    return {}


def _metric(metrics: dict, *words: str) -> float | None:
    """The first engine metric whose key holds all ``words``: the engine's keys change between versions."""
    for key, value in metrics.items():
        if all(word in key for word in words) and isinstance(value, (int, float)):
            return float(value)
    return None


# ---------------------------------------------------------------------------- models and training
def _llama(shape: tuple[int, ...], dtype: str, args):
    """A Llama-shaped causal LM with random weights on the host. On CUDA the weights are drawn on the GPU
    (seconds instead of a minute for billions of parameters) and then moved to the host."""
    import torch
    import transformers

    # On CPU torch's bf16 SDPA kernel fails when ATEN_CPU_CAPABILITY is below the machine's AVX-512; the smoke
    # run checks this script, not attention kernels, so it uses the eager attention there.
    hidden, intermediate, layers, heads, kv_heads, vocab = shape
    config = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                                      num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                                      max_position_embeddings=4096, tie_word_embeddings=True, use_cache=False,
                                      attn_implementation="eager" if args.smoke else "sdpa", dtype=dtype)
    torch.manual_seed(0)
    if _cuda(args):
        with torch.device("cuda"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        model = model.to("cpu")
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    else:
        model = transformers.AutoModelForCausalLM.from_config(config)
    return model


def _sizes(model) -> dict:
    """Real parameter counts; matmul parameters leave out the input embedding (a lookup, no FLOPs) but keep
    a tied head, whose matmul runs."""
    total = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    matmul = total - embedding.numel() + (head.numel() if head is embedding else 0)
    return {"parameters": total, "matmul_parameters": matmul, "label": _billions(total)}


def _flops_per_token(model, sequence: int) -> float:
    """Model FLOPs per token: 6 x matmul parameters plus attention (12 x layers x hidden x sequence); the
    recompute that RoundPipe and checkpointing both pay is not model FLOPs."""
    config = model.config
    return 6 * _sizes(model)["matmul_parameters"] + 12 * config.num_hidden_layers * config.hidden_size * sequence


def _lm_module(model, *, baseline: bool):
    """The LightningModule: RoundPipe runs the model's own forward (its preset holds the chunked LM-head loss);
    the baseline computes the same chunked loss from the last hidden states. Both use fused AdamW."""
    import lightning.pytorch as pl
    import torch

    from lightning_roundpipe.hf.lm_loss import chunked_lm_loss

    class CausalLMModule(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch, batch_idx):
            if not baseline:
                return self.model(input_ids=batch, labels=batch).loss
            hidden = self.model.model(input_ids=batch).last_hidden_state
            losses = chunked_lm_loss(hidden[:, :-1], self.model.lm_head.weight, batch[:, 1:])
            return losses.mean()

        def configure_optimizers(self):
            return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-4, fused=True)

    return CausalLMModule()


def _token_batches(vocab: int, batch: int, sequence: int, count: int):
    import torch

    generator = torch.Generator().manual_seed(0)
    data = torch.randint(0, vocab, (count * batch, sequence), generator=generator)
    return torch.utils.data.DataLoader(data, batch_size=batch)


def _emit_step(index: int, seconds: float, tokens: int, warmup: int, metrics: dict | None = None) -> dict:
    step = {"step": index, "seconds": round(seconds, 4), "tokens_per_s": round(tokens / seconds, 1),
            "timed": index >= warmup}
    if metrics:
        step["metrics"] = metrics
    print(f"STEP {_current_section} " + json.dumps(step), flush=True)
    return step


def _step_recorder(tokens: int, warmup: int, cuda_sync: bool, cuda_figures: bool):
    """A Lightning callback: each step's wall time (batch end to batch end) and the engine's metrics, printed
    as a STEP line as soon as the step ends."""
    import lightning.pytorch as pl
    import torch

    class StepRecorder(pl.Callback):
        roundpipe_reads_gradients = False  # reads no gradient: RoundPipe need not gather them for its hooks

        def __init__(self) -> None:
            self.steps: list[dict] = []
            self.memory: dict = {}  # the engine's allocator and accounting figures, where it has them
            self._last: float | None = None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if self._last is None:
                self._last = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if cuda_sync:  # the baseline queues kernels ahead; the step ends when the GPU is done
                torch.cuda.synchronize()
            now = time.perf_counter()
            engine = getattr(trainer.strategy, "engine", None)
            metrics = engine.pipeline_metrics() if engine is not None else None
            figures = getattr(engine, "cuda_memory_figures", None)
            if cuda_figures and figures is not None:
                self.memory = figures()
            assert self._last is not None
            self.steps.append(_emit_step(batch_idx, now - self._last, tokens, warmup, metrics))
            self._last = now

    return StepRecorder()


def _matmul_mode(precision: str) -> str:
    """The precision and how matmuls accumulate, for the tables: fp16 accumulation (the ``fp16_accumulation``
    option, ``torch.backends.cuda.matmul.allow_fp16_accumulation``) changes fp16 matmuls only, so under bf16 the
    accumulation is fp32 whatever the flag says."""
    import torch

    fp16 = precision.startswith("16") and getattr(torch.backends.cuda.matmul, "allow_fp16_accumulation", False)
    return f"{precision}, {'fp16' if fp16 else 'fp32'} accumulation"


def _apply_cap(args) -> int | None:
    """Cap this process's GPU memory at ``--cap-gib`` (a consumer GPU). RoundPipe's automatic device budget
    honours the fraction, so no ``device_memory_limit`` is passed."""
    if not _cuda(args):
        return None
    import torch

    cap = int(args.cap_gib * 2**30)
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total))
    return cap


def _device_memory(args) -> dict:
    if not _cuda(args):
        return {"device_memory": "skipped: no CUDA"}
    import torch

    stats = torch.cuda.memory_stats()
    return {"max_allocated_gib": _gib(torch.cuda.max_memory_allocated()),
            "max_reserved_gib": _gib(torch.cuda.max_memory_reserved()),
            "num_alloc_retries": stats.get("num_alloc_retries"), "num_ooms": stats.get("num_ooms")}


def _host_peak_rss_gib() -> float:
    import resource

    return _gib(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def _summary(steps: list[dict], model, sequence: int, args) -> dict:
    """Medians over the timed steps, with MFU, transfer and breakdown figures from the engine's metrics."""
    timed = [step for step in steps if step["timed"]] or steps[1:] or steps
    step_s = _median(step["seconds"] for step in timed)
    tokens_per_s = _median(step["tokens_per_s"] for step in timed)
    result: dict = {"tokens_per_s": tokens_per_s, "step_s": step_s, "timed_steps": len(timed)}
    environment = _earlier(args, "environment")
    peak = environment.get("bf16_matmul_tflops")
    if peak and tokens_per_s:
        result["mfu"] = round(_flops_per_token(model, sequence) * tokens_per_s / (peak * 1e12), 4)
    metrics = [step.get("metrics") or {} for step in timed]
    if any(metrics):
        keys = sorted({key for m in metrics for key in m})
        result["engine_metric_keys"] = keys
        medians = {key: _median(m.get(key) for m in metrics) for key in keys}
        result["engine_metrics"] = medians
        uploaded = medians.get("uploaded_bytes")
        if uploaded is not None and step_s:
            result["h2d_gb_per_s"] = round(uploaded / step_s / 1e9, 2)
            transfers = environment.get("h2d_gb_per_s")
            ceiling = transfers.get("registered") if isinstance(transfers, dict) else None
            if isinstance(ceiling, (int, float)) and ceiling > 0:
                result["h2d_share_of_registered_ceiling"] = round(uploaded / step_s / 1e9 / ceiling, 3)
        busy = _metric(medians, "busy")
        if busy is None and medians.get("bubble_ratio") is not None:
            result["gpu_busy_share"] = round(1.0 - medians["bubble_ratio"], 3)
            result["gpu_busy_source"] = "1 - bubble_ratio: the engine's compute seconds over the wall time"
        else:
            result["gpu_busy_share"] = busy
        result["grad_download_s"] = _metric(medians, "download", "seconds")
        result["host_optimizer_s"] = medians.get("optimizer_seconds")
        result["optimizer_exposed_s"] = medians.get("optimizer_exposed_seconds")
        if medians.get("peak_device_bytes") is not None:
            result["accounted_peak_gib"] = _gib(max(m.get("peak_device_bytes") or 0 for m in metrics))
    return result


def _train_lightning(section: str, args, *, strategy_kind: str) -> dict:
    """One training section through Lightning: ``baseline`` (single device, checkpointed), ``sync`` or
    ``async`` (RoundPipe)."""
    import lightning.pytorch as pl

    size = "smoke" if args.smoke else section
    sequence, batch, microbatches, warmup, timed = RUNS[size]
    cuda = _cuda(args)
    cap = _apply_cap(args)
    model = _llama(SHAPES[size], "float32", args)
    sizes = _sizes(model)
    print(f"MODEL {sizes['label']} parameters ({sizes['parameters']:,}; {sizes['matmul_parameters']:,} in matmuls)",
          flush=True)
    if strategy_kind == "baseline":
        model.gradient_checkpointing_enable()  # per decoder block
        strategy: object = "single_device" if cuda else "auto"
        devices = 1
        optimizer = "fused AdamW on the GPU"
    else:
        from lightning_roundpipe import RoundPipeStrategy

        strategy = RoundPipeStrategy(num_microbatches=microbatches, async_step=strategy_kind == "async",
                                     log_pipeline_metrics=False, preflight="warn")
        devices = 1 if cuda else 2
        optimizer = "fused AdamW on the host"
    recorder = _step_recorder(batch * sequence, warmup, cuda_sync=cuda and strategy_kind == "baseline",
                              cuda_figures=cuda)
    trainer = pl.Trainer(strategy=strategy, accelerator="gpu" if cuda else "cpu", devices=devices,
                         max_steps=warmup + timed, precision="bf16-mixed", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[recorder])
    trainer.fit(_lm_module(model, baseline=strategy_kind == "baseline"),
                _token_batches(model.config.vocab_size, batch, sequence, warmup + timed))
    result = {"model": sizes["label"], **sizes, "sequence": sequence, "batch": batch,
              "microbatches": None if strategy_kind == "baseline" else microbatches, "precision": "bf16-mixed",
              "numerics": _matmul_mode("bf16-mixed"),
              "optimizer": optimizer, "strategy": strategy_kind, "cap_gib": None if cap is None else args.cap_gib,
              **_summary(recorder.steps, model, sequence, args), **_device_memory(args),
              "host_peak_rss_gib": _host_peak_rss_gib()}
    if recorder.memory:
        result["engine_memory_gib"] = {key.removesuffix("_bytes"): _gib(value) if key.endswith("_bytes") else value
                                       for key, value in recorder.memory.items()}
    plan = getattr(trainer.strategy, "memory_plan", None)
    if plan is not None:  # the pre-flight's host total (activations not included)
        result["planned_host_bytes_per_parameter"] = round(plan.host_total_bytes / sizes["parameters"], 1)
    return result


# ---------------------------------------------------------------------------- sections
def section_environment(args) -> dict:
    import resource

    import torch

    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    meminfo = {}
    if os.path.exists("/proc/meminfo"):
        with open("/proc/meminfo") as file:
            meminfo = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in file if line[:3] in ("Mem",)}
    import lightning_roundpipe

    result: dict = {
        "python": sys.version.split()[0], "torch": torch.__version__, "cuda_runtime": torch.version.cuda,
        "transformers": _version("transformers"), "lightning": _version("lightning"),
        "hydra_core": _version("hydra-core"), "roundpipe_published": _version("roundpipe"),
        "lightning_roundpipe_from": str(Path(lightning_roundpipe.__file__).parent),
        "ulimit_l": "unlimited" if soft == resource.RLIM_INFINITY else f"{soft // 1024} KiB",
        "nproc": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "mem_total_gib": _gib(meminfo.get("MemTotal", 0)), "mem_available_gib": _gib(meminfo.get("MemAvailable", 0)),
    }
    if not _cuda(args):
        n = 256
        a = torch.randn(n, n, dtype=torch.bfloat16)
        start = time.perf_counter()
        for _ in range(3):
            a @ a
        # the CPU's rate, so the smoke run computes an MFU too (a meaningless one)
        result["bf16_matmul_tflops"] = round(3 * 2 * n**3 / (time.perf_counter() - start) / 1e12, 4)
        for key in ("device", "h2d_gb_per_s", "d2h_gb_per_s", "small_registrations", "a6_probe"):
            result[key] = "skipped: no CUDA"
        return result
    properties = torch.cuda.get_device_properties(0)
    result["device"] = f"{properties.name}, {_gib(properties.total_memory)} GiB"
    result.update(_transfer_ceilings())
    result["bf16_matmul_tflops"] = _matmul_tflops()
    result["small_registrations"] = _small_registrations()
    result["a6_probe"] = _a6_probe()  # last: it may leave an error on this thread
    return result


def _timed_copy(dst, src, repeats: int) -> float:
    """GB/s of ``dst.copy_(src)``, wall clock to the end of the copies (pageable copies block the host anyway)."""
    import torch

    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return round(src.numel() * src.element_size() * repeats / (time.perf_counter() - start) / 1e9, 2)


def _transfer_ceilings() -> dict:
    """H2D and D2H GB/s over 1 GiB from memory registered in place (as the engine pins weights), from
    ``cudaHostAlloc`` memory (``pin_memory()``, torch's caching host allocator) and from pageable memory."""
    import torch

    from lightning_roundpipe.engine.pinned import PinnedStorages

    size = 2**30
    device = torch.empty(size, dtype=torch.uint8, device="cuda")
    pageable = torch.ones(size, dtype=torch.uint8)
    registered = torch.ones(size, dtype=torch.uint8)
    pins = PinnedStorages()
    pins.pin([registered])
    allocated = torch.ones(size, dtype=torch.uint8).pin_memory()
    h2d, d2h = {}, {}
    for name, host, repeats in (("registered", registered, 5), ("cudaHostAlloc", allocated, 5),
                                ("pageable", pageable, 3)):
        if name == "registered" and pins.refused:
            h2d[name] = d2h[name] = f"refused: {pins.refused}"
            continue
        h2d[name] = _timed_copy(device, host, repeats)
        d2h[name] = _timed_copy(host, device, repeats)
    pins.release()
    return {"h2d_gb_per_s": h2d, "d2h_gb_per_s": d2h, "registered_is_pinned": not pins.refused}


def _matmul_tflops() -> float:
    import torch

    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    return round(10 * 2 * n**3 / (time.perf_counter() - start) / 1e12, 1)


def _small_registrations() -> dict:
    """Two small host tensors (likely on one page) registered one after the other, from a helper thread."""
    import torch

    from lightning_roundpipe.engine.pinned import _on_helper_thread, cuda_error_text

    tensors = [torch.ones(256), torch.ones(256)]
    cudart = torch.cuda.cudart()

    def register() -> list[str]:
        statuses = [cudart.cudaHostRegister(t.data_ptr(), t.numel() * 4, 1) for t in tensors]
        for tensor, status in zip(tensors, statuses, strict=True):
            if int(status) == 0:
                cudart.cudaHostUnregister(tensor.data_ptr())
        return [cuda_error_text(cudart, status) if int(status) else "ok" for status in statuses]

    return {"same_page": len({t.data_ptr() // 4096 for t in tensors}) == 1, "statuses": _on_helper_thread(register)}


def _a6_probe() -> dict:
    """Register one range twice on the main thread (the second call fails), then launch kernels there: does
    the failed call's error surface in an unrelated launch? The engine registers from a helper thread."""
    import torch

    from lightning_roundpipe.engine.pinned import cuda_error_text

    cudart = torch.cuda.cudart()
    host = torch.ones(2**20, dtype=torch.uint8)
    first = cudart.cudaHostRegister(host.data_ptr(), host.numel(), 0)
    second = cudart.cudaHostRegister(host.data_ptr(), host.numel(), 0)
    kernels = []
    for _ in range(2):
        try:
            kernels.append(f"ok ({(torch.arange(4.0, device='cuda') * 2).sum().item():g})")
        except RuntimeError as error:
            kernels.append(f"raised: {str(error).splitlines()[0]}")
    if int(first) == 0:
        cudart.cudaHostUnregister(host.data_ptr())
    return {"first_register": cuda_error_text(cudart, first) if int(first) else "ok",
            "second_register": cuda_error_text(cudart, second) if int(second) else "ok",
            "next_kernel": kernels[0], "kernel_after": kernels[1],
            "a6": "confirmed: the stale error surfaced" if kernels[0].startswith("raised") else "not reproduced"}


def _pytest(args, command_tail: list[str], env: dict[str, str]) -> dict:
    import importlib.util

    if not (ROOT / "tests" / "test_gpu.py").exists():
        return {"skipped": f"no tests/test_gpu.py beside this script ({ROOT})"}
    if importlib.util.find_spec("pytest") is None:
        return {"skipped": "pytest is not installed"}
    command = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-m", "gpu", *command_tail]
    code, output = _run(command, max(5.0, args.section_timeout - 5), cwd=ROOT, env=env)
    lines = output.strip().splitlines()
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)",
                                                     lines[-1] if lines else "")}
    result = {"command": " ".join(["python", *command[1:]]), "returncode": code,
              "summary": lines[-1] if lines else "", "counts": counts}
    if code != 0:
        result["error"] = "timed out" if code is None else f"pytest exit code {code}: {result['summary']}"
        result["tail"] = lines[-40:]
    elif counts.get("skipped") and not counts.get("passed"):
        result["skipped"] = f"no CUDA ({counts['skipped']} skipped)"
    return result


def section_pytest(args) -> dict:
    return _pytest(args, ["tests/test_gpu.py"], _child_env())


def section_sanitizer(args) -> dict:
    """Race checks over the engine's own threads (``engine/sanitizer.py``): on a GPU torch's CUDA sanitizer,
    enabled here and entered by every stream thread, over the fp32 transparency cases (one ring member, and one
    GPU visited twice); on CPU (smoke) the happens-before checker over a small stress-mode engine run. Either way
    the operators each thread handed to the checker are counted, so a check that reached no engine thread fails."""
    from lightning_roundpipe.engine import sanitizer

    if _cuda(args):
        from torch.cuda import _sanitizer as csan

        csan.enable_cuda_sanitizer()
        result = _pytest_in_process(SANITIZER_CASES)
        checker = sanitizer.cuda_sanitizer()
        result["sanitizer"] = "torch's CUDA sanitizer (CSAN), entered in every engine thread"
    else:
        with sanitizer.HappensBefore() as checker:
            _small_engine_run()
        result = {"sanitizer": "CPU stand-ins: the happens-before checker (CSAN needs CUDA)",
                  "races_reported": len(checker.reports), "reports": checker.reports[:5]}
    assert checker is not None, "the CUDA sanitizer is not enabled"
    by_kind: dict[str, int] = {}
    for thread, count in checker.ops_by_thread.items():
        kind = thread.rsplit("-", 1)[-1] if thread.startswith("roundpipe-") else (
            "main" if thread == "MainThread" else "other (autograd's device threads)")
        by_kind[kind] = by_kind.get(kind, 0) + count
    result["ops_checked_by_thread"] = by_kind
    if not by_kind.get("compute"):
        result["error"] = "no operator of a compute stream thread was checked: the checks missed the engine"
    elif result["races_reported"]:
        result["error"] = f"{result['races_reported']} possible data race(s) reported"
    return result


def _pytest_in_process(cases: list[str]) -> dict:
    """``pytest -m gpu cases`` in this process (where the sanitizer is on), with the reported races counted."""
    import pytest

    failures: list[str] = []

    class Failures:
        def pytest_runtest_logreport(self, report) -> None:
            if report.failed:
                failures.append(report.longreprtext)

    code = pytest.main(["-q", "-p", "no:cacheprovider", "-m", "gpu", *cases], plugins=[Failures()])
    races = sum(text.count("CSAN detected a possible data race") for text in failures)
    result = {"returncode": int(code), "races_reported": races, "failures": [text[-1500:] for text in failures[:3]]}
    if int(code) != 0 and not races:
        result["error"] = f"pytest exit code {int(code)}"
    return result


def _small_engine_run() -> None:
    """Three SGD steps of a small model on two CPU stand-ins in stress mode (late copies, poisoned releases)."""
    import torch
    import torch.nn.functional as F

    from lightning_roundpipe import EngineOptions, RoundPipeEngine

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 32),
                                torch.nn.LayerNorm(32), torch.nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    options = EngineOptions(num_microbatches=2, num_stages=2, stress=True)
    with RoundPipeEngine(model, ["cpu", "cpu"], options) as engine:
        for step in range(3):
            generator = torch.Generator().manual_seed(step)
            inputs, target = torch.randn(8, 16, generator=generator), torch.randint(0, 4, (8,), generator=generator)
            engine.forward_backward(inputs, target, F.cross_entropy)
            engine.step(optimizer)
        engine.synchronize()


def section_fits_baseline(args) -> dict:
    return _train_lightning("fits", args, strategy_kind="baseline")


def section_fits_sync(args) -> dict:
    return _train_lightning("fits", args, strategy_kind="sync")


def section_fits_async(args) -> dict:
    return _train_lightning("fits", args, strategy_kind="async")


def section_big_sync(args) -> dict:
    return _train_lightning("big", args, strategy_kind="sync")


def section_big_async(args) -> dict:
    return _train_lightning("big", args, strategy_kind="async")


def causal_mask_shim(create_causal_mask):
    """``create_causal_mask`` accepting roundpipe 0.1.1's call: it passes ``input_embeds=``, ``cache_position=``
    and ``past_key_values=``, which transformers 5 renamed (``inputs_embeds``, ``cache``) or dropped."""
    import inspect

    parameters = inspect.signature(create_causal_mask).parameters
    open_ended = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    renames = {"input_embeds": "inputs_embeds", "past_key_values": "cache"}

    def shim(*args, **kwargs):
        for old, new in renames.items():
            if old in kwargs and old not in parameters and new in parameters:
                kwargs[new] = kwargs.pop(old)
        # what the builder does not name goes, cache_position even where **kwargs would swallow it
        kwargs = {key: value for key, value in kwargs.items()
                  if key in parameters or (open_ended and key != "cache_position")}
        return create_causal_mask(*args, **kwargs)

    return shim


def _check_mask_shim() -> str:
    """The shim, called as roundpipe 0.1.1 calls the mask builder, against this transformers."""
    import torch
    import transformers
    from transformers import masking_utils

    config = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, vocab_size=32,
                                      attn_implementation="sdpa")
    embeds = torch.zeros(1, 5, 16)
    positions = torch.arange(5)
    causal_mask_shim(masking_utils.create_causal_mask)(
        config=config, input_embeds=embeds, attention_mask=None, cache_position=positions, past_key_values=None,
        position_ids=positions.unsqueeze(0))
    return f"ok with transformers {transformers.__version__}"


def section_published(args) -> dict:
    version = _version("roundpipe")
    shim = _check_mask_shim()
    if version is None:
        return {"skipped": "the published library is not installed (pip install roundpipe==0.1.1; it needs "
                           "beartype, ninja, py-cpuinfo, tqdm; gpu_check.sh installs wheels from .wheels/)",
                "mask_shim": shim}
    if not _cuda(args):
        return {"skipped": "no CUDA (the published library enumerates GPUs on import)", "version": version,
                "mask_shim": shim}
    import torch

    cap = _apply_cap(args)  # before the import: its device threads allocate on the GPU
    import roundpipe
    import roundpipe.models.llama as published_llama

    published_llama.create_causal_mask = causal_mask_shim(published_llama.create_causal_mask)
    sequence, batch, microbatches, warmup, timed = RUNS["big"]
    start = time.perf_counter()
    probe = torch.nn.Parameter(torch.zeros(8))
    with roundpipe.OptimizerCtx():
        roundpipe.optim.Adam([probe], lr=1e-4)  # builds its C++ Adam (JIT) once, outside the timed steps
    build_s = round(time.perf_counter() - start, 1)
    print(f"BUILD its optimizer extension in {build_s} s", flush=True)
    model = _llama(SHAPES["big"], "bfloat16", args)
    sizes = _sizes(model)
    wrapped = roundpipe.wrap_model_to_roundpipe(model, use_sequential_preset=True, optim_dtype=torch.float32)
    with roundpipe.OptimizerCtx():
        optimizer = roundpipe.optim.Adam(wrapped.optim_parameters(), lr=1e-4)
    assert cap is not None
    # its planner's limit is in GB (10^9) for parameters and gradients; its default takes 0.6 of free memory
    limit_gb = 0.6 * cap / 1e9
    data = iter(_token_batches(SHAPES["big"][-1], batch, sequence, warmup + timed))
    steps = []
    last = time.perf_counter()
    for index in range(warmup + timed):
        ids = next(data)
        plan = roundpipe.ModelExecutePlan.auto("fused", wrapped, model_memory_limit=limit_gb)
        config = roundpipe.RoundPipeRunConfig(num_microbatch=microbatches, execute_plan=plan)
        wrapped.forward_backward(input_kwargs={"input_ids": ids, "labels": ids, "return_logits": False},
                                 loss_fn=lambda output, _: output.loss, run_config=config)
        wrapped.step(lambda: (optimizer.step(), optimizer.zero_grad()), is_async=True)
        now = time.perf_counter()
        steps.append(_emit_step(index, now - last, batch * sequence, warmup))
        last = now
    wrapped.synchronize()
    return {"version": version, "model": sizes["label"], **sizes, "sequence": sequence, "batch": batch,
            "microbatches": microbatches, "mode": "async (its only fast mode)", "model_memory_limit_gb": limit_gb,
            "precision": "bf16 weights and compute, fp32 master weights", "numerics": _matmul_mode("bf16"),
            "optimizer": "its C++ Adam on the host",
            "loss": "its torch.compile'd chunked loss", "extension_build_s": build_s, "mask_shim": shim,
            "cap_gib": args.cap_gib, **_summary(steps, model, sequence, args), **_device_memory(args),
            "host_peak_rss_gib": _host_peak_rss_gib()}


# ---------------------------------------------------------------------------- driver
def run_sections(names: list[str], args) -> int:
    """Child process: run sections one after the other, each printing ``RESULT name seconds json``; a section
    that raises prints its traceback and the next one still runs."""
    global _current_section
    if args.smoke:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import logging
    import traceback
    import warnings

    for logger in ("lightning", "lightning.pytorch", "lightning_roundpipe"):
        logging.getLogger(logger).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    failed = 0
    for name in names:
        _current_section = name
        start = time.perf_counter()
        if name != "pytest":  # it only starts pytest: no torch here
            import torch

            torch.set_num_threads(1 if args.smoke else max(1, (os.cpu_count() or 4) - 2))
        try:
            result = globals()[f"section_{name}"](args)
        except Exception:  # noqa: BLE001 - reported on stdout; the parent records the section as failed
            traceback.print_exc(file=sys.stdout)
            print(f"FAILED {name}", flush=True)
            failed += 1
            continue
        print(f"RESULT {name} {time.perf_counter() - start:.1f} " + json.dumps(result), flush=True)
    return 1 if failed else 0


def _entries(names: list[str], code: int | None, output: str, timeout: float, seconds: float) -> dict[str, dict]:
    """Each section's JSON entry from its process's output: its RESULT, or the steps it finished and the error."""
    lines = output.splitlines()
    entries = {}
    for name in names:
        done = [line.split(" ", 3) for line in lines if line.startswith(f"RESULT {name} ")]
        if done:
            _, _, elapsed, payload = done[-1]
            result = json.loads(payload)
            entry: dict = {"result": result, "seconds": float(elapsed)}
            if result.get("error"):  # the section ran, and what it ran failed (a GPU test, say)
                entry["error"] = result["error"]
            entries[name] = entry
            continue
        steps = [json.loads(line.split(" ", 2)[2]) for line in lines if line.startswith(f"STEP {name} ")]
        if code is None:
            error = f"timed out after {timeout:.0f} s"
        elif any(line == f"FAILED {name}" for line in lines):
            error = "raised (see tail)"
        else:
            error = f"did not finish (exit code {code})"
        entry = {"error": error, "tail": [line for line in lines if not line.startswith(("STEP ", "RESULT "))][-15:],
                 "seconds": round(seconds, 1) if len(names) == 1 else None}
        if steps:  # a timeout or a crash keeps the steps done
            timed = [step for step in steps if step["timed"]] or steps[1:] or steps
            entry["partial"] = {"steps": len(steps), "tokens_per_s": _median(step["tokens_per_s"] for step in timed)}
        entries[name] = entry
    return entries


def _compare(results: dict) -> dict:
    """Ratios of tokens/s: RoundPipe against the checkpointed baseline, ours (async) against the published."""

    def tokens(name: str) -> float | None:
        entry = results.get(name, {})
        value = entry.get("result", {}).get("tokens_per_s") or entry.get("partial", {}).get("tokens_per_s")
        return value if isinstance(value, (int, float)) and value > 0 else None

    pairs = {"fits_sync_over_baseline": ("fits_sync", "fits_baseline"),
             "fits_async_over_baseline": ("fits_async", "fits_baseline"),
             "big_async_over_big_sync": ("big_async", "big_sync"),
             "ours_async_over_published": ("big_async", "published")}
    out = {}
    for key, (ours, theirs) in pairs.items():
        a, b = tokens(ours), tokens(theirs)
        out[key] = round(a / b, 3) if a and b else None
    return out


def _cell(value, digits: int = 2) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def _table(results: dict) -> str:
    header = ("section", "status", "s", "model", "numerics", "tokens/s", "MFU", "busy", "H2D GB/s", "of ceil",
              "grad dl s", "opt s", "reserved GiB", "accounted GiB", "retries")
    rows = [header]
    for name in SECTIONS:
        if name not in results:
            continue
        entry = results[name]
        result = entry.get("result", {})
        status = _status(entry)
        tokens = result.get("tokens_per_s", entry.get("partial", {}).get("tokens_per_s"))
        h2d = result.get("h2d_gb_per_s")  # the environment's is a table of ceilings, shown below
        rows.append((name, status, _cell(entry.get("seconds"), 0), result.get("model", ""), result.get("numerics", ""),
                     _cell(tokens, 0),
                     _cell(result.get("mfu"), 3), _cell(result.get("gpu_busy_share")),
                     _cell(h2d if isinstance(h2d, float) else None), _cell(result.get("h2d_share_of_registered_ceiling")),
                     _cell(result.get("grad_download_s")), _cell(result.get("host_optimizer_s")),
                     _cell(result.get("max_reserved_gib")), _cell(result.get("accounted_peak_gib")),
                     _cell(result.get("num_alloc_retries"))))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(header))]
    lines = ["  ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=True)) for row in rows]
    environment = results.get("environment", {}).get("result", {})
    if environment:
        lines.append(f"{environment.get('device')}: bf16 matmul {environment.get('bf16_matmul_tflops')} TFLOP/s; "
                     f"H2D GB/s {json.dumps(environment.get('h2d_gb_per_s'))}; D2H GB/s "
                     f"{json.dumps(environment.get('d2h_gb_per_s'))}; ulimit -l {environment.get('ulimit_l')}; "
                     f"A6 {json.dumps(environment.get('a6_probe'))}")
    summary = results.get("pytest", {}).get("result", {}).get("summary")
    if summary:
        lines.append(f"pytest: {summary}")
    checked = results.get("sanitizer", {}).get("result", {})
    if checked.get("ops_checked_by_thread"):
        lines.append(f"sanitizer ({checked.get('sanitizer')}): {checked.get('races_reported')} race(s) reported; "
                     f"operators checked by thread: {json.dumps(checked['ops_checked_by_thread'])}")
    lines.append("ratios: " + json.dumps(results.get("comparisons", {})))
    return "\n".join(lines)


def _status(entry: dict) -> str:
    if "error" in entry:
        return "partial" if "partial" in entry else "FAILED"
    return "skipped" if "skipped" in entry.get("result", {}) else "ok"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="run every section on CPU with tiny sizes")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gpu_results.json"))
    parser.add_argument("--cap-gib", type=float, default=24.0, help="the consumer-GPU memory cap")
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for all sections together")
    parser.add_argument("--only", nargs="*", choices=list(SECTIONS), help="run only these sections")
    parser.add_argument("--environment-from", help="take the environment section (transfer ceilings, matmul rate) "
                                                   "from this results file of an earlier run instead of measuring it")
    parser.add_argument("--section", help=argparse.SUPPRESS)  # a child: these sections, comma-separated
    parser.add_argument("--section-timeout", type=float, default=SMOKE_CAP_S, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.section:
        return run_sections(args.section.split(","), args)
    results: dict = {"smoke": args.smoke, "cap_gib": args.cap_gib, "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    out = Path(args.out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.exists():
        out.unlink()  # sections read the ceilings from this run's file only
    if args.environment_from:  # ... or from the file named here (benchmarks/gpu_first_run.sh measures them first)
        try:
            results["environment"] = json.loads(Path(args.environment_from).read_text())["environment"]
            out.write_text(json.dumps(results, indent=1))
        except (OSError, ValueError, KeyError) as error:  # without the ceilings, MFU and ceiling shares are n/a
            print(f"no environment section in {args.environment_from} ({error!r}): figures that need it are n/a")
    selected = args.only or list(SECTIONS)
    if args.smoke:
        groups = [[name for name in group if name in selected] for group in SMOKE_GROUPS]
    else:
        groups = [[name] for name in SECTIONS if name in selected]
    groups = [group for group in groups if group]

    def cap(group: list[str]) -> float:
        return SMOKE_CAP_S if args.smoke else sum(SECTIONS[name] for name in group)

    deadline = time.monotonic() + args.budget
    for index, group in enumerate(groups):
        left = deadline - time.monotonic()
        # its own cap, plus what earlier sections left unused while the later ones keep theirs
        timeout = min(left, max(cap(group), left - sum(cap(later) for later in groups[index + 1:])))
        if timeout < 10:
            for name in group:
                results[name] = {"result": {"skipped": f"out of the {args.budget:.0f} s budget"}, "seconds": 0.0}
            continue
        command = [sys.executable, str(Path(__file__).resolve()), "--section", ",".join(group), "--out", str(out),
                   "--cap-gib", str(args.cap_gib), "--section-timeout", str(timeout)]
        start = time.perf_counter()
        code, output = _run(command + (["--smoke"] if args.smoke else []), timeout, cwd=ROOT, env=_child_env())
        for name, entry in _entries(group, code, output, timeout, time.perf_counter() - start).items():
            results[name] = entry
            results["comparisons"] = _compare(results)
            out.write_text(json.dumps(results, indent=1))  # after every section: a later timeout keeps this
            shown = entry.get("result", {key: entry[key] for key in ("error", "partial", "tail") if key in entry})
            print(f"{name:<14} {_status(entry):<7} {_cell(entry.get('seconds'), 1):>6} s  {json.dumps(shown)[:400]}",
                  flush=True)
    print()
    print(_table(results))
    print(f"wrote {out}")
    return 1 if any(_status(results[name]) in ("FAILED", "partial") for name in selected if name in results) else 0


if __name__ == "__main__":
    sys.exit(main())
