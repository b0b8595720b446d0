#!/usr/bin/env bash
# The first GPU run: the riskiest CUDA paths first, each step's JSON into $OUT as the step ends, so a run cut
# short still reports what it did. At most 460 s of step timeouts (about 8 minutes on one H200 with the start):
#
#   step         timeout  what
#   environment      40   versions, ulimit -l, H2D/D2H GB/s from registered, cudaHostAlloc and pageable memory,
#                         the bf16 matmul rate, a refused registration on the main thread (gpu.py's section)
#   pinning          25   200 small tensors sharing pages through the engine's PinnedStorages: how many stay
#                         pageable; _sleep's GPU time at idle and at warm clocks (the GPU-time test's spin);
#                         fork time before and after pinning 1 GiB (D7); workspace bytes per thread (D8)
#   gpu_tests        90   python -m pytest -m gpu tests/test_gpu.py, JUnit XML into $OUT
#   sanitizer        45   torch's CUDA sanitizer entered in every engine thread (engine/sanitizer.py), over the
#                         fp32 transparency cases; operators checked per kind of thread (gpu.py's section)
#   transport        30   bf16 transport against fp32 uploads under autocast, one microbatch, sync and async:
#                         bitwise equal by design; the uploaded-bytes ratio
#   waits            20   CPU seconds per wall second of a thread waiting on the GPU: stream synchronize
#                         against a blocking event, and the engine's own threads while a GPU-bound layer runs
#   throughput      205   gpu.py's fits_sync, fits_async, big_async, big_sync (tokens/s, GPU busy share, ...),
#                         with whatever the steps above left of their 250 s too
#   summary           5   first_run.json: every step's status and key figures
#
# The published-library comparison (gpu.py's `published`, finding C4: a JIT build and a torch.compile first) is
# not part of this run: run `python benchmarks/gpu.py --only published` as its own later run.
#
# On the device, from the repository root:  bash benchmarks/gpu_first_run.sh   (run(..., timeout_s=540)).
# Needs torch, lightning, transformers and pytest (the device image has them; not hydra or omegaconf); wheels
# found in .wheels/ are installed into a scratch folder first, as gpu_check.sh does.
# `--dry-run`: the same steps on CPU in under a minute: what needs CUDA writes a JSON saying it skipped, the
# transport check runs on CPU stand-ins and gpu.py runs in --smoke (tests/test_benchmarks.py runs it).
set -uo pipefail
cd "$(dirname "$0")/.."
DRY_RUN=0
if [[ "${1:-}" == "--dry-run" ]]; then DRY_RUN=1; fi
OUT=${OUT:-$PWD/gpu_first_run_out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PY=${PY:-python3}
if compgen -G ".wheels/*.whl" >/dev/null; then
    site="${TMPDIR:-/tmp}/gpu_first_run_site"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$site" .wheels/*.whl || exit 1
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export OUT DRY_RUN PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
SMOKE=()
if [[ $DRY_RUN == 1 ]]; then SMOKE=(--smoke); export CUDA_VISIBLE_DEVICES=""; fi
START=$(date +%s)
LOG="$OUT/first_run.log"
: >"$LOG"
: >"$OUT/steps.tsv"
say() { echo "[$(( $(date +%s) - START ))s] $*" | tee -a "$LOG"; }

# finish STEP RC SECONDS: the step's exit status into its JSON (a step killed or crashed before writing one gets
# one saying so) and a line into steps.tsv
finish() {
    printf '%s\t%s\t%s\n' "$1" "$2" "$3" >>"$OUT/steps.tsv"
    "$PY" - "$OUT/$1.json" "$1" "$2" <<'EOF' >>"$LOG" 2>&1
import json, sys
path, step, rc = sys.argv[1], sys.argv[2], int(sys.argv[3])
try:
    result = json.load(open(path))
except (OSError, ValueError):
    result = {"step": step, "error": "no result (see first_run.log)"}
result["rc"] = rc
if rc in (124, 137):
    result["error"] = "timed out" + (f"; {result['error']}" if "error" in result else "")
json.dump(result, open(path, "w"), indent=1)
EOF
    say "$1 rc=$2 (${3}s)"
}

# python_step STEP TIMEOUT [cuda]: runs the Python on stdin after PRELUDE (save() writes $OUT/STEP.json as it goes)
PRELUDE='
import json, os, sys, time
OUT, STEP, DRY_RUN = os.environ["OUT"], os.environ["STEP"], os.environ["DRY_RUN"] == "1"
RESULT, T0 = {"step": STEP}, time.perf_counter()
def save(**fields):
    RESULT.update(fields)
    RESULT["seconds"] = round(time.perf_counter() - T0, 1)
    with open(os.path.join(OUT, STEP + ".json"), "w") as file:
        json.dump(RESULT, file, indent=1, default=str)
def probe(name, function):
    try:
        value = function()
    except Exception as error:  # reported, and the next probe runs
        value = {"error": f"{type(error).__name__}: {error}"[:500]}
    save(**{name: value})
import torch
CUDA = torch.cuda.is_available() and not DRY_RUN
save(torch=torch.__version__, cuda=CUDA)
'
# (a third argument `cuda`: the step needs CUDA, so a dry run writes its skip without starting Python)
python_step() {
    local step=$1 limit=$2 body began rc
    body=$(cat)
    began=$(date +%s)
    if [[ $DRY_RUN == 1 && ${3:-} == cuda ]]; then
        printf '{"step": "%s", "skipped": "no CUDA (dry run)"}\n' "$step" >"$OUT/$step.json"
        finish "$step" 0 0
        return
    fi
    STEP=$step timeout "$limit" "$PY" -c "$PRELUDE$body" >>"$LOG" 2>&1
    rc=$?
    finish "$step" "$rc" $(( $(date +%s) - began ))
}

# gpu_py STEP TIMEOUT ARGS...: a benchmarks/gpu.py run whose results file is the step's JSON
gpu_py() {
    local step=$1 limit=$2 began rc
    shift 2
    began=$(date +%s)
    timeout "$limit" "$PY" benchmarks/gpu.py "$@" "${SMOKE[@]}" --out "$OUT/$step.json" >>"$LOG" 2>&1
    rc=$?
    finish "$step" "$rc" $(( $(date +%s) - began ))
}

say "gpu_first_run: OUT=$OUT dry_run=$DRY_RUN"
gpu_py environment 40 --only environment --budget 35

python_step pinning 25 cuda <<'EOF'
if not CUDA:
    save(skipped="no CUDA")
    sys.exit(0)
import warnings
from lightning_roundpipe.engine.pinned import PinnedStorages
def small_tensors():  # norm weights and biases: many small storages, several to a page
    tensors = [torch.ones(64) for _ in range(200)]
    pins = PinnedStorages()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pins.pin(tensors)
    pinned = sum(tensor.is_pinned() for tensor in tensors)
    result = {"tensors": len(tensors), "pinned": pinned, "stayed_pageable": len(tensors) - pinned,
              "pages": len({tensor.data_ptr() // 4096 for tensor in tensors}),
              "refused": getattr(pins, "refused", None), "warnings": [str(w.message)[:300] for w in caught][:3]}
    pins.release()
    return result
probe("small_tensors_sharing_pages", small_tensors)
def sleep_clock():  # the GPU-time test's spin: how far apart are idle and warm clocks?
    def spin_ms():
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(); torch.cuda._sleep(50_000_000); end.record(); end.synchronize()
        return round(start.elapsed_time(end), 2)
    time.sleep(2)  # let the clocks fall back
    cold = spin_ms()
    warm = [spin_ms() for _ in range(4)]
    return {"cold_ms": cold, "warm_ms": warm, "cold_over_warm": round(cold / min(warm), 2)}
probe("sleep_clock", sleep_clock)
def fork_after_pin():  # D7: does a fork (a DataLoader worker) copy registered pages?
    def fork_s():
        start = time.perf_counter()
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        took = time.perf_counter() - start
        os.waitpid(pid, 0)
        return round(took, 4)
    host = torch.ones(2**30, dtype=torch.uint8)
    before = fork_s()
    pins = PinnedStorages()
    pins.pin([host])
    result = {"before_pin_s": before, "after_pin_1GiB_s": fork_s(), "pinned": host.is_pinned()}
    pins.release()
    return result
probe("fork_after_pin", fork_after_pin)
def workspaces():  # D8: device bytes a new (thread, stream) pair keeps after matmuls, against the planner's reserve
    import threading
    from lightning_roundpipe.planning.partition import CUDA_WORKSPACE_RESERVE
    def work(backward):
        torch.cuda.set_device(0)
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            a = torch.randn(512, 512, device="cuda", dtype=torch.bfloat16, requires_grad=backward)
            b = (a @ a).float() @ torch.randn(512, 512, device="cuda")
            if backward:
                b.sum().backward()
        stream.synchronize()
    result = {"reserve_MiB": CUDA_WORKSPACE_RESERVE / 2**20}
    for backward in (False, True):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        thread = threading.Thread(target=work, args=(backward,))
        thread.start()
        thread.join()
        torch.cuda.synchronize()
        kept = (torch.cuda.memory_allocated() - before) / 2**20
        result[("backward" if backward else "forward") + "_kept_MiB"] = round(kept, 1)
    return result
probe("workspaces", workspaces)
EOF

began=$(date +%s)
timeout 90 "$PY" -m pytest -q -rA -p no:cacheprovider -m gpu tests/test_gpu.py --junitxml="$OUT/gpu_tests.xml" \
    >>"$LOG" 2>&1
rc=$?
"$PY" - "$OUT/gpu_tests.xml" "$OUT/gpu_tests.json" "$rc" <<'EOF' >>"$LOG" 2>&1
import json, sys, xml.etree.ElementTree as ET
source, target, rc = sys.argv[1], sys.argv[2], int(sys.argv[3])
result = {"step": "gpu_tests", "rc": rc, "tests": {}}
try:
    for case in ET.parse(source).getroot().iter("testcase"):
        failed = case.find("failure") if case.find("failure") is not None else case.find("error")
        skipped = case.find("skipped")
        result["tests"][case.get("name")] = (
            "failed: " + (failed.get("message") or "")[:400] if failed is not None
            else "skipped: " + (skipped.get("message") or "")[:100] if skipped is not None else "passed")
except (OSError, ET.ParseError) as error:
    result["error"] = f"no JUnit XML ({error}); pytest rc={rc}"
outcomes = [value.split(":")[0] for value in result["tests"].values()]
result["counts"] = {kind: outcomes.count(kind) for kind in ("passed", "failed", "skipped")}
if rc not in (0, 5) and "error" not in result:
    result["error"] = f"pytest rc={rc}" + (" (timed out)" if rc in (124, 137) else "")
json.dump(result, open(target, "w"), indent=1)
EOF
finish gpu_tests "$rc" $(( $(date +%s) - began ))

gpu_py sanitizer 45 --only sanitizer --budget 40

python_step transport 30 <<'EOF'
import torch.nn.functional as F
from lightning_roundpipe import EngineOptions, RoundPipeEngine
from tests.models import gpt_batch, gpt_loss, tiny_gpt
device = "cuda" if CUDA else "cpu"
def train(transport, async_step):
    model = tiny_gpt()
    optimizer, losses = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), []
    options = EngineOptions(num_microbatches=1, num_stages=2, async_step=async_step, transport_dtype=transport)
    with RoundPipeEngine(model, ["cuda:0" if CUDA else "cpu"], options) as engine:
        for step in range(4 if CUDA else 2):  # the dry run checks the step, not the numerics: 2 steps
            inputs, target = gpt_batch(8, step)
            with torch.autocast(device, dtype=torch.bfloat16):
                losses.append(engine.forward_backward(inputs, target, gpt_loss).item())
            engine.step(optimizer)
        engine.synchronize()
        uploaded = sum(d.counters.uploaded_bytes for d in engine.devices)
    return losses, dict(model.named_parameters()), uploaded
save(devices="one GPU" if CUDA else "one CPU stand-in (dry run)")
for async_step in (False, True):
    (losses_off, off, bytes_off), (losses_on, on, bytes_on) = train("off", async_step), train("bfloat16", async_step)
    bitwise = losses_on == losses_off and all(torch.equal(on[name], off[name]) for name in off)
    save(**{"async" if async_step else "sync": {
        "bitwise": bitwise, "max_param_diff": max((on[n] - off[n]).abs().max().item() for n in off),
        "max_loss_diff": max(abs(a - b) for a, b in zip(losses_on, losses_off)),
        "uploaded_ratio": round(bytes_on / bytes_off, 3)}})
if not all(RESULT[mode]["bitwise"] for mode in ("sync", "async")):
    save(error="bf16 transport differs from fp32 uploads with one microbatch (expected bitwise equal)")
EOF

python_step waits 20 cuda <<'EOF'
if not CUDA:
    save(skipped="no CUDA")
    sys.exit(0)
def one_wait(kind):  # a 0.3 s kernel, waited for on the host; CPU seconds of the whole process meanwhile
    stream = torch.cuda.Stream()
    event = torch.cuda.Event(blocking=True)
    with torch.cuda.stream(stream):
        torch.cuda._sleep(400_000_000)
        event.record(stream)
    cpu, wall = time.process_time(), time.perf_counter()
    stream.synchronize() if kind == "stream_synchronize" else event.synchronize()
    wall = time.perf_counter() - wall
    return {"wall_s": round(wall, 3), "cpu_per_wall": round((time.process_time() - cpu) / wall, 2)}
for kind in ("stream_synchronize", "blocking_event"):
    probe(kind, lambda: one_wait(kind))
def engine_threads():  # every engine thread while a GPU-bound layer runs: spinning shows as CPU time
    import torch.nn.functional as F
    from lightning_roundpipe import EngineOptions, RoundPipeEngine
    class Spin(torch.nn.Module):
        def forward(self, x):
            torch.cuda._sleep(100_000_000)
            return x
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), Spin(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with RoundPipeEngine(model, ["cuda:0"], EngineOptions(num_microbatches=2, num_stages=1)) as engine:
        engine.forward_backward(torch.randn(4, 8), torch.tensor([0, 1, 0, 1]), F.cross_entropy)  # warm-up
        engine.step(optimizer)
        engine.synchronize()
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(4):
            engine.forward_backward(torch.randn(4, 8), torch.tensor([0, 1, 0, 1]), F.cross_entropy)
            engine.step(optimizer)
        engine.synchronize()
        wall = time.perf_counter() - wall
        busy = engine.pipeline_metrics().get("bubble_ratio")
    return {"wall_s": round(wall, 2), "cpu_per_wall": round((time.process_time() - cpu) / wall, 2),
            "bubble_ratio": busy}
probe("engine_threads", engine_threads)
EOF

# throughput: its own 205 s plus what the steps above left of their 250 s; the summary keeps its 5 s
left=$(( 455 - ($(date +%s) - START) ))
limit=$(( left < 205 ? 205 : left ))
limit=$(( limit > 260 ? 260 : limit ))
gpu_py throughput "$limit" --only fits_sync fits_async big_async big_sync --budget $(( limit - 8 )) \
    --environment-from "$OUT/environment.json"

timeout 5 "$PY" - <<'EOF' 2>&1 | tee -a "$LOG"
import json, os
out = os.environ["OUT"]
summary = {"dry_run": os.environ["DRY_RUN"] == "1", "steps": {}}
for line in open(os.path.join(out, "steps.tsv")):
    step, rc, seconds = line.rstrip("\n").split("\t")
    try:
        result = json.load(open(os.path.join(out, step + ".json")))
    except (OSError, ValueError) as error:
        result = {"error": f"unreadable: {error}"}
    sections = {key: value for key, value in result.items() if isinstance(value, dict) and "result" in value}
    errors = [name for name, value in sections.items() if "error" in value] + (["step"] if "error" in result else [])
    status = "failed" if errors or int(rc) != 0 else "skipped" if "skipped" in result else "ok"
    entry = {"status": status, "rc": int(rc), "seconds": int(seconds), "errors": errors}
    if step == "throughput":
        entry["sections"] = {name: {key: value.get("result", {}).get(key) for key in (
            "numerics", "tokens_per_s", "mfu", "gpu_busy_share", "h2d_gb_per_s", "grad_download_s",
            "host_optimizer_s", "max_reserved_gib")} | ({"error": value["error"]} if "error" in value else {})
            for name, value in sections.items() if name != "environment"}
    elif step == "environment":
        found = sections.get("environment", {}).get("result", {})
        entry["result"] = {key: found.get(key) for key in (
            "torch", "cuda_runtime", "device", "h2d_gb_per_s", "d2h_gb_per_s", "bf16_matmul_tflops",
            "small_registrations", "a6_probe", "ulimit_l")}
    elif step == "sanitizer":
        entry["result"] = sections.get("sanitizer", {}).get("result")
    elif step == "gpu_tests":
        entry["counts"] = counts = result.get("counts") or {}
        entry["failed"] = [name for name, outcome in result.get("tests", {}).items() if outcome.startswith("failed")]
        if status == "ok" and counts.get("skipped") and not counts.get("passed"):
            entry["status"] = "skipped"
    else:
        entry["result"] = {key: value for key, value in result.items()
                           if key not in ("step", "torch", "cuda", "seconds", "rc")}
    summary["steps"][step] = entry
json.dump(summary, open(os.path.join(out, "first_run.json"), "w"), indent=1, default=str)
for step, entry in summary["steps"].items():
    print(f"{step:<12} {entry['status']:<8} rc={entry['rc']:<4} {entry['seconds']:>4} s  {', '.join(entry['errors'])}")
EOF
say "done: $OUT/first_run.json"
