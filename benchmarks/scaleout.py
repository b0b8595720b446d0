"""Scale out: gloo all-reduce here, data parallel over RoundPipe rings projected, and the reduction hidden in 2 processes.

Run: ``python benchmarks/scaleout.py [--sizes-mib 1,4,16,64] [--dtypes float32,bfloat16] [--repeats 10]
[--warmup 3] [--no-measure] [--nodes 2,4,8] [--links 25,100,400] [--iteration sim|paper] [--mode sync|async]
[--no-overlap] [--link-efficiency 1.0] [--lora-params N] [--no-engine-run] [--engine-width 896]
[--engine-blocks 8] [--engine-batch 16] [--engine-warmup 3] [--engine-steps 10]`` (default about 50 s on 2
cores, section 3 about 30 s of it; the projection alone, ``--no-measure --no-engine-run``, about 2 s;
``--smoke``: every section at tiny sizes, seconds beyond starting the processes). Not a test: it prints three
tables and always exits 0 unless a measurement fails.

1. gloo ``all_reduce`` (SUM) on this machine. Two processes (``torch.multiprocessing.start_processes``,
   spawn), one process group (``torch.distributed.init_process_group("gloo")`` over a ``FileStore`` in a
   temporary directory), one intra-op thread each, CPU tensors. For each dtype and bucket size ``S`` bytes
   (a tensor of ``S / element size`` zeros): ``--warmup`` untimed all-reduces, then ``--repeats`` timed
   ones, each after a ``barrier`` so that both ranks start together. A repetition's time ``t`` is the slower
   rank's (``time.perf_counter`` around the blocking call; the per-rank times are max-reduced at the end).
   Printed per row: the median and the fastest ``t`` in ms, the median per element in ns, and (GB = 1e9
   bytes)::

       algbw = S / t_median                    busbw = algbw x 2(p-1)/p     (p = 2 processes: busbw = algbw)

   ``busbw`` is the rate at which each process sends (and receives) in a ring all-reduce, so it is the
   figure to hold against a link's speed. Loopback on 2 shared cores measures gloo's own cost (copies, the
   reduction arithmetic, the TCP stack), not a network. bfloat16 is summed in bfloat16 (the precision a
   bf16 reduction would have). Below the table, per other dtype: its time per element over float32's at the
   largest bucket size both have (0.5 would be half the bytes at the same rate).

2. A projection for K nodes (``--nodes``), each an 8-GPU RoundPipe ring (the paper's 8 x RTX 4090 box),
   data parallel between them at ``--links`` Gb/s: every node keeps its batch (weak scaling: the global
   batch grows K times) and all-reduces the gradients of its P parameters once per iteration, in fp32
   (b = 4 bytes) or bf16 (b = 2). Formulas, printed above the table::

       bytes(K)  = 2(K-1)/K x P x b                      per node, each way (ring all-reduce)
       T_comm    = bytes(K) / (Gb/s x 1e9 / 8 x efficiency)
       exposed   = max(0, T_comm - H)
       T_K       = T1 + exposed
       speedup   = K x T1 / T_K      efficiency = T1 / T_K      tokens/s = K x X1 x T1 / T_K

   ``T1`` is one node's iteration and ``H`` the part of it the reduction can hide behind. ``--mode sync``
   (default): the reduction starts when the step seals the gradient window and runs beside the backward
   stages still running (``shared/notes/multinode_design.md`` §0, §6.2), so ``H`` is the backward after the
   fused stage: from the end of the fused stage's last microbatch to the iteration's end. ``--mode async``:
   the reduction of step k runs beside iteration k+1 (§6.3), ``H = T1``. ``--no-overlap``: ``H = 0``. Both
   overlaps are optimistic: the shallowest bucket's reduction can only start after the last backward job,
   and the host optimizer step (replicated on every node) is not counted. ``X1`` is the paper's measured
   tokens/s on one 8 x 4090 node (``RoundPipe-sync`` for ``--mode sync``, ``RoundPipe`` for ``async``,
   from ``throughput_tokens_per_s_8x4090_seq2048`` in ``lightning_roundpipe/observe/paper_profiles.json``).
   ``efficiency`` is a link's achieved share of its line rate (``--link-efficiency``, default 1: line rate;
   design note §3.1 cites about 1.07 GB/s, 8.6 Gb/s, for one gloo stream on 40 GbE: add ``--links 8.6``).

   ``T1`` and ``H`` (``--iteration``):

   * ``sim`` (default): the project's simulator on the paper's per-layer 4090 costs (8 devices, 16
     microbatches, our planner's ``plan_auto`` partition, our runtime's schedule as ``benchmarks/bubble.py``
     runs it: recompute ahead of the output gradient, sync in the dispatch ``choose_round_size`` picks): sync, the makespan of one isolated iteration and ``H`` from its events;
     async, the steady-state period of N + 3 iterations (``bubble.iteration_time``). The simulator leaves
     out the host optimizer step, so ``T1`` is short and the projection pessimistic; the paper's profiles do
     not give a microbatch's tokens, so tokens/s is ``X1`` scaled by the simulated efficiency.
   * ``paper``: ``T1`` = tokens per step / ``X1``, with the design note §6.4's tokens per step (512, 256 and
     128 sequences of 2048 tokens for Qwen3-1.7B, Llama3-8B and Qwen3-32B; none is given for the other
     models, which are left out); sync ``H`` = ``T1`` x the simulated sync iteration's backward share.

   P is the count in the model's name (``bubble.parameters``: ``Llama3-8B`` -> 8e9), all of it trainable. The
   paper trains Qwen3-235B with LoRA, where only the adapters are reduced; their size is not in the profiles,
   so that model is left out unless ``--lora-params`` gives it.

   Printed: per model its inputs (P, gradient bytes, ``T1``, ``H``, ``X1``), then one row per model, gradient
   dtype and link speed with, per K: ``T_comm`` (s), ``T_K`` (s), the speedup, the efficiency (%) and the
   projected tokens/s.

3. The share of the gradient reduction hidden behind the backward in a real 2-process run, from the
   engine's timeline (``--no-engine-run`` skips it). Two processes (spawned as in section 1, one intra-op
   thread each, a gloo group over a ``FileStore``; the gradients reduce on a group of their own, as the
   strategy makes it) each run a ``RoundPipeEngine`` on 2 CPU devices over the same model: ``--engine-blocks``
   layers of ``nn.Linear(w, w)`` + ``tanh`` (``w = --engine-width``; the default 896 makes 25.7 MB of fp32
   gradients per process, large against the compute of a batch of ``--engine-batch`` = 16 rows), AdamW,
   ``num_microbatches=2``, 4 forward stages (``freeze_plan=True``, ``round_size="whole"``: every call runs the
   same jobs), ``record_timeline=True``, MSE against random targets, each process on its own random data.
   Four variants, one after another in the same two processes (a barrier before each, so that both
   processes always run the same variant and share the cores alike): ``DataParallel(1, 0)`` (no averaging:
   the step without communication, the reference), ``DataParallel(2, rank)`` (fp32: ``reduce_dtype=None``),
   ``reduce_dtype=torch.bfloat16`` (bf16) and fp32 with ``shard_optimizer=True`` (each process keeps AdamW's
   state of half the parameters, steps those and broadcasts them; its "broadcast" events are not counted as
   reduction). Each runs ``--engine-warmup`` untimed iterations, then
   ``--engine-steps`` measured ones (an iteration: one ``forward_backward`` of the batch and one
   ``engine.step``), then one more that only closes the last measured period. Per measured iteration i
   (0-based), rank 0's figures, all on the engine's timeline clock (``engine.timeline.now()`` on the calling
   thread)::

       begin_i    = the clock just before iteration i's forward_backward
       step time  = begin_{i+1} - begin_i                 (one iteration, as the calling thread sees it)
       b_i        = the largest end of iteration i's compute events (kinds forward, fused, recompute,
                    backward, on a device): the end of its last backward compute
       reduction  = the summed length of step i + 1's "allreduce" events (on the host, labelled
                    "average step i+1"; each from its first gradient bucket sent to its means received).
                    The optimizer thread sends the next group's gradients before stepping the current
                    group, so an event also spans that step: it is the time in flight, an upper bound of
                    the communication, and "exposed" below overstates what the thread waited for
       hidden     = the part of that time before b_i / reduction; for one event [s, e]:
                    clip((b_i - s) / (e - s), 0, 1)
       exposed    = reduction - its part before b_i (the reduction left after the backward ended)
       sent       = DataParallel.sent_bytes + broadcast_bytes at the end / iterations (every step sends every
                    gradient; sharded, also the weights this process owns)

   Iteration i's compute events are found by job index: the engine numbers jobs in dispatch order and every
   call here dispatches the same ``J = engine.plan.num_stages`` jobs, so iteration i owns jobs ``i x J`` to
   ``(i + 1) x J - 1`` (checked: the timeline's compute jobs are exactly ``0 .. iterations x J - 1``). Jobs
   rather than times, because the next iteration's forward may start before this one's backward ends
   (always without averaging). The step's allreduce events are found by the step number in their label, one
   per step where the engine averages the whole step at once, one per step group where it averages each
   group separately (on the optimizer thread, each just before that group's update); their lengths are
   summed (they run on one thread, one after another). A single event's span also counts the time between
   sends spent waiting for the shallower groups' gradients, so it reads as more hidden than per-group events
   (each one group's send and wait) of the same run would. Printed per variant: the median step time in ms and its ratio to no averaging's, the
   median reduction, the median hidden share, the median exposed ms and the MB (1e6 bytes) sent per step.
   On this machine the two processes, their simulated devices and gloo share 2 cores: the figure shows that
   the reduction overlaps the backward, not what a real network would hide (the reduction's cost here is
   CPU time the compute also needs, so the step time with averaging is not the step time plus what is
   exposed).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from bubble import iteration_time, parameters  # noqa: E402
from bubble_paper import DEFAULT_JSON, model_inputs  # noqa: E402
from common import add_smoke, sized  # noqa: E402
from torch import nn  # noqa: E402

from lightning_roundpipe import EngineOptions, RoundPipeEngine  # noqa: E402
from lightning_roundpipe.engine.dataparallel import DataParallel  # noqa: E402
from lightning_roundpipe.observe.trace import COMPUTE_KINDS  # noqa: E402
from lightning_roundpipe.planning.partition import plan_auto  # noqa: E402
from lightning_roundpipe.planning.simulate import choose_round_size, simulate_roundpipe  # noqa: E402

WORLD = 2
MIB = 2**20
FUSED = "L"  # the fused stage's label in the simulator's events
#: design note §6.4: the paper's tokens per step (sequences x 2048 tokens), where the note gives them
DESIGN_NOTE_TOKENS_PER_STEP = {"Qwen3-1.7B": 512 * 2048, "Llama3-8B": 256 * 2048, "Qwen3-32B": 128 * 2048}
GRAD_BYTES = {"fp32": 4, "bf16": 2}
#: section 3's variants: name -> the reduction dtype's name ("none": no averaging, a process on its own)
# name: (reduce_dtype, or "none" for no averaging; shard_optimizer)
ENGINE_VARIANTS = {"no averaging": ("none", False), "fp32": (None, False), "bf16": ("bfloat16", False),
                   "fp32 sharded": (None, True)}


def spawn(target, args: tuple, timeout_s: float, what: str):
    """Run ``target(rank, store, result, *args)`` in ``WORLD`` spawned processes, wait for them (at most
    ``timeout_s`` in all) and return what rank 0 wrote (JSON); ends any process left and removes the scratch
    folder whatever happens."""
    scratch = Path(tempfile.mkdtemp(prefix="scaleout-"))
    store, result = scratch / "store", scratch / "result.json"
    context = mp.start_processes(target, args=(str(store), str(result), *args), nprocs=WORLD, join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=1.0):  # raises if a process failed (and ends the others)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} took more than {timeout_s:.0f} s")
        return json.loads(result.read_text())
    finally:
        for process in context.processes:
            if process.is_alive():
                process.terminate()
            process.join(10)
            if process.is_alive():
                process.kill()
                process.join()
        shutil.rmtree(scratch, ignore_errors=True)


# --- 1. gloo all-reduce on this machine -------------------------------------------------------------------


def _rank_main(rank: int, store: str, result: str, dtypes: list[str], sizes_mib: list[float], warmup: int,
               repeats: int, timeout_s: float) -> None:
    """One process of the measurement (spawned): times ``all_reduce`` per dtype and size; rank 0 writes the rows."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=timeout_s))
    try:
        rows = []
        for name in dtypes:
            dtype = getattr(torch, name)
            element = torch.empty((), dtype=dtype).element_size()
            for mib in sizes_mib:
                numel = max(int(mib * MIB) // element, 1)
                buffer = torch.zeros(numel, dtype=dtype)
                times = []
                for i in range(warmup + repeats):
                    dist.barrier()
                    start = time.perf_counter()
                    dist.all_reduce(buffer)
                    if i >= warmup:
                        times.append(time.perf_counter() - start)
                slowest = torch.tensor(times, dtype=torch.float64)
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                rows.append({"dtype": name, "mib": mib, "bytes": numel * element, "numel": numel,
                             "seconds": slowest.tolist()})
        if rank == 0:
            Path(result).write_text(json.dumps(rows))
    finally:
        dist.destroy_process_group()


def measure(dtypes: list[str], sizes_mib: list[float], warmup: int, repeats: int, timeout_s: float) -> list[dict]:
    """Spawn the two processes, wait for them (at most ``timeout_s`` in all) and return rank 0's rows."""
    return spawn(_rank_main, (dtypes, sizes_mib, warmup, repeats, timeout_s), timeout_s, "the gloo measurement")


def bandwidth_table(rows: list[dict], warmup: int, repeats: int) -> None:
    factor = 2 * (WORLD - 1) / WORLD
    print(f"1. gloo all_reduce (SUM) on this machine: {WORLD} processes on localhost (spawn, FileStore), "
          f"torch {torch.__version__}, 1 intra-op thread each")
    print(f"   t = the slower rank's time; median and fastest of {repeats} timed runs after {warmup} warm-up runs, "
          "each run after a barrier")
    print(f"   algbw = S / t_median (S: bucket bytes, GB = 1e9 B);  busbw = algbw x 2(p-1)/p = algbw x {factor:g} "
          f"(p = {WORLD})")
    print(f"{'dtype':<9} {'bucket MiB':>10} {'elements':>12} | {'median ms':>9} {'min ms':>8} {'ns/element':>10} | "
          f"{'algbw GB/s':>10} {'busbw GB/s':>10}")
    per_element: dict[str, dict[float, float]] = {}
    for row in rows:
        median = statistics.median(row["seconds"])
        algbw = row["bytes"] / median / 1e9
        per_element.setdefault(row["dtype"], {})[row["mib"]] = median / row["numel"]
        print(f"{row['dtype']:<9} {row['mib']:>10g} {row['numel']:>12,} | {1e3 * median:9.2f} "
              f"{1e3 * min(row['seconds']):8.2f} {1e9 * median / row['numel']:10.3f} | {algbw:10.3f} "
              f"{algbw * factor:10.3f}")
    print("Loopback: both processes share this machine's cores and memory; a real link adds its own limit.")
    base = per_element.get("float32", {})
    for name, sizes in per_element.items():
        common = sorted(set(sizes) & set(base))
        if name != "float32" and common:
            size = common[-1]
            print(f"{name} / float32 time per element at {size:g} MiB: {sizes[size] / base[size]:.2f} (section 2 "
                  "takes bf16 to halve T_comm: half the bytes at the same link rate)")


# --- 2. projection ------------------------------------------------------------------------------------------


@dataclass
class Node:
    """One node's figures for a model: what it reduces, its iteration and the part of it that can hide it."""

    name: str
    params: float  #: reduced (trainable) parameters
    lora: bool
    t1: float  #: seconds
    hidden: float  #: H, seconds
    tokens_per_s: float  #: X1


def paper_figure(figures: dict[str, float], name: str) -> tuple[str, float]:
    """The paper's throughput entry for a profile's model (``Llama3-8B`` is ``Llama3.1-8B`` there, and
    ``Qwen3-235B`` is ``Qwen3-235B-LoRA``)."""
    for key in (name, name.replace("Llama3-", "Llama3.1-"), f"{name}-LoRA"):
        if key in figures:
            return key, figures[key]
    raise KeyError(f"no throughput figure for {name!r} in {sorted(figures)}")


def node_inputs(data: dict, mode: str, source: str, lora_params: float | None) -> tuple[list[Node], list[str]]:
    ref = data["simulation"]
    figures = data["throughput_tokens_per_s_8x4090_seq2048"]["RoundPipe-sync" if mode == "sync" else "RoundPipe"]
    n, m = ref["num_devices"], ref["num_microbatches"]
    nodes, skipped = [], []
    for name in ref["models"]:
        key, tokens_per_s = paper_figure(figures, name)
        lora = key.endswith("-LoRA")
        if lora and lora_params is None:
            skipped.append(f"{name}: trained with LoRA in the paper ({key}); adapter size unknown (--lora-params)")
            continue
        if source == "paper" and name not in DESIGN_NOTE_TOKENS_PER_STEP:
            skipped.append(f"{name}: no tokens per step in the design note (--iteration paper)")
            continue
        costs, _, _, hop = model_inputs(ref, name)
        plan = plan_auto(costs, num_devices=n)
        chosen = choose_round_size(plan, costs, n, m, hop, recompute_ahead=True)
        isolated = simulate_roundpipe(plan, costs, n, m, hop, mode="sync", round_size=chosen, recompute_ahead=True)
        fused_end = max(event.end for event in isolated.events if event.label == FUSED)
        backward_share = (isolated.makespan - fused_end) / isolated.makespan
        if source == "sim":
            if mode == "sync":
                t1 = isolated.makespan / 1e3
            else:
                iterations = n + 3
                steady = simulate_roundpipe(plan, costs, n, m, hop, iterations=iterations, recompute_ahead=True)
                t1 = iteration_time(steady, iterations) / 1e3
        else:
            t1 = DESIGN_NOTE_TOKENS_PER_STEP[name] / tokens_per_s
        hidden = backward_share * t1 if mode == "sync" else t1
        params = lora_params if lora and lora_params is not None else parameters(name)
        nodes.append(Node(name, params, lora, t1, hidden, tokens_per_s))
    return nodes, skipped


def comm_seconds(params: float, grad_bytes: int, nodes: int, gbit_per_s: float, efficiency: float) -> float:
    return 2 * (nodes - 1) / nodes * params * grad_bytes / (gbit_per_s * 1e9 / 8 * efficiency)


def kilo(tokens_per_s: float) -> str:
    return f"{tokens_per_s / 1e3:.1f}k"


def projection_table(nodes: list[Node], skipped: list[str], args: argparse.Namespace) -> None:
    hide = ("0 (--no-overlap)" if args.no_overlap else
            "the backward after the fused stage" if args.mode == "sync" else "T1 (the next iteration)")
    source = ("simulated (planning.simulate, paper's 4090 per-layer costs, 8 devices, 16 microbatches, plan_auto, "
              "the runtime's dispatch; no host step)" if args.iteration == "sim" else
              "tokens per step (design note 6.4) / X1")
    print(f"\n2. Projection: K nodes, one 8-GPU RoundPipe ring each (the paper's 8 x RTX 4090), data parallel between "
          f"them, {args.mode} mode; weak scaling (each node keeps its batch)")
    print("   bytes(K) = 2(K-1)/K x P x b            per node, each way (ring all-reduce); b = 4 (fp32), 2 (bf16)")
    print(f"   T_comm   = bytes(K) / (Gb/s x 1e9 / 8 x {args.link_efficiency:g})")
    print("   exposed  = max(0, T_comm - H)          T_K = T1 + exposed")
    print("   speedup  = K x T1 / T_K                efficiency = T1 / T_K          tokens/s = K x X1 x T1 / T_K")
    print(f"   T1: {source}; H: {hide}; X1: the paper's measured "
          f"{'RoundPipe-sync' if args.mode == 'sync' else 'RoundPipe'} tokens/s on one node")
    print(f"{'model':<12} {'P':>9} {'fp32 GB':>8} {'bf16 GB':>8} {'T1 s':>7} {'H s':>7} {'X1 tok/s':>9}")
    for node in nodes:
        print(f"{node.name:<12} {node.params:9.3g} {4 * node.params / 1e9:8.1f} {2 * node.params / 1e9:8.1f} "
              f"{node.t1:7.2f} {0.0 if args.no_overlap else node.hidden:7.2f} {node.tokens_per_s:9,.0f}"
              + ("  (LoRA adapters, --lora-params)" if node.lora else ""))
    for line in skipped:
        print(f"  left out: {line}")
    head = " | ".join(f"{f'K={k}: comm s':>12} {'T_K s':>7} {'speedup':>7} {'eff%':>5} {'tok/s':>7}"
                      for k in args.nodes)
    print(f"\n{'model':<12} {'grads':<5} {'link':>9} | {head}")
    for node in nodes:
        hidden = 0.0 if args.no_overlap else node.hidden
        for grads, size in GRAD_BYTES.items():
            for link in args.links:
                cells = []
                for k in args.nodes:
                    comm = comm_seconds(node.params, size, k, link, args.link_efficiency)
                    t_k = node.t1 + max(0.0, comm - hidden)
                    efficiency = node.t1 / t_k
                    cells.append(f"{comm:12.2f} {t_k:7.2f} {k * efficiency:7.2f} {100 * efficiency:5.1f} "
                                 f"{kilo(k * node.tokens_per_s * efficiency):>7}")
                print(f"{node.name:<12} {grads:<5} {f'{link:g} Gb/s':>9} | " + " | ".join(cells))
    print("comm s = T_comm per iteration; T_K s = the iteration with K nodes; tok/s = all K nodes together.")


# --- 3. the reduction hidden behind the backward, 2 processes -----------------------------------------------


@dataclass
class EngineRun:
    """Section 3's model and schedule (the same in both processes)."""

    width: int
    blocks: int
    batch: int
    warmup: int
    steps: int
    timeout_s: float


def _engine_model(run: EngineRun) -> nn.Sequential:
    torch.manual_seed(0)  # the same weights in both processes, as data parallel training starts
    return nn.Sequential(*(nn.Sequential(nn.Linear(run.width, run.width), nn.Tanh()) for _ in range(run.blocks)))


def _iteration_figures(events: list, begins: list[float], jobs_per_iteration: int, first: int,
                       count: int) -> list[dict]:
    """Per iteration ``first .. first + count - 1`` (0-based): its period and with
    averaging its allreduce events' spans and the end of its last compute event (the module docstring's
    definitions). Iteration i's compute events are those of jobs ``i x J .. (i + 1) x J - 1`` (``J``: the frozen
    plan's stages, one job each per call); its allreduce events those labelled ``average step i + 1``."""
    compute = [event for event in events if event.device is not None and event.kind in COMPUTE_KINDS]
    iterations = len(begins) - 1
    if {event.job for event in compute} != set(range(iterations * jobs_per_iteration)):
        raise RuntimeError(f"expected the compute events of jobs 0 .. {iterations * jobs_per_iteration - 1} "
                           f"({iterations} iterations of {jobs_per_iteration} jobs)")
    spans: dict[int, list[list[float]]] = {}
    for event in events:
        match = re.match(r"average step (\d+)", event.label) if event.kind == "allreduce" else None
        if match:
            spans.setdefault(int(match.group(1)) - 1, []).append([event.start, event.end])
    rows = []
    for i in range(first, first + count):
        row: dict = {"period": begins[i + 1] - begins[i]}
        if i in spans:
            row["reductions"] = sorted(spans[i])
            row["backward_end"] = max(event.end for event in compute if event.job // jobs_per_iteration == i)
        rows.append(row)
    return rows


def _engine_variant(rank: int, run: EngineRun, reduce: str | None, shard: bool, groups: tuple) -> dict:
    """One variant in this process (both processes at once): this process's per-iteration figures."""
    if reduce == "none":
        data_parallel = DataParallel(1, 0, timeout=run.timeout_s)
    else:
        data_parallel = DataParallel(WORLD, rank, gradients=groups[0], timeout=run.timeout_s,
                                     reduce_dtype=None if reduce is None else getattr(torch, reduce),
                                     shard_optimizer=shard, weights=groups[1])
    model = _engine_model(run)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    # a frozen plan and whole jobs: every call runs the same J jobs, numbered on (iteration i: i x J ..)
    options = EngineOptions(num_microbatches=2, num_stages=4, round_size="whole", freeze_plan=True, seed=1,
                            record_timeline=True)
    data = torch.Generator().manual_seed(1000 + rank)  # each process on its own data
    total = run.warmup + run.steps + 1  # + 1: the iteration whose begin closes the last measured period
    begins = []
    dist.barrier()
    with RoundPipeEngine(model, 2, options, data_parallel=data_parallel) as engine:
        for _ in range(total):
            inputs = torch.randn(run.batch, run.width, generator=data)
            target = torch.randn(run.batch, run.width, generator=data)
            begins.append(engine.timeline.now())
            engine.forward_backward(inputs, target, nn.functional.mse_loss)
            engine.step(optimizer)
        engine.synchronize()
        begins.append(engine.timeline.now())
        events, jobs_per_iteration = engine.events(), engine.plan.num_stages
    figures = _iteration_figures(events, begins, jobs_per_iteration, run.warmup, run.steps)
    if reduce != "none" and any("reductions" not in row for row in figures):
        raise RuntimeError("a measured step of an averaged run has no allreduce event on the timeline")
    # every step sends every gradient: the bytes of one (read once all steps ended, the sends may run on the
    # optimizer thread after engine.step returned)
    state_bytes = sum(value.nbytes for entry in optimizer.state.values() for value in entry.values()
                      if isinstance(value, torch.Tensor))
    step_seconds = [sum(event.end - event.start for event in events
                        if event.kind == "optimizer" and re.match(rf"step {i + 1}\b", event.label))
                    for i in range(run.warmup, run.warmup + run.steps)]
    return {"rows": figures, "sent_per_step": (data_parallel.sent_bytes + data_parallel.broadcast_bytes) / total,
            "state_per_param": state_bytes / sum(param.numel() for param in model.parameters()),
            "step_seconds": statistics.median(step_seconds)}


def _engine_main(rank: int, store: str, result: str, run: EngineRun) -> None:
    """One process of section 3 (spawned): every variant in turn; rank 0 writes the figures."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=run.timeout_s))
    try:
        # the gradients' own group and the sharded optimizer's broadcasts' own, as the strategy makes them
        groups = (dist.new_group(backend="gloo"), dist.new_group(backend="gloo"))
        figures = {name: _engine_variant(rank, run, reduce, shard, groups)
                   for name, (reduce, shard) in ENGINE_VARIANTS.items()}
        if rank == 0:
            Path(result).write_text(json.dumps(figures))
    finally:
        dist.destroy_process_group()


def overlap_table(figures: dict[str, dict], run: EngineRun) -> None:
    grad_mb = run.blocks * (run.width + 1) * run.width * 4 / 1e6
    print(f"\n3. The gradient reduction behind the backward: {WORLD} processes (spawn, gloo over a FileStore, 1 "
          f"intra-op thread each), each a RoundPipeEngine on 2 CPU devices")
    print(f"   model: {run.blocks} x (Linear({run.width}, {run.width}) + tanh), {grad_mb:.1f} MB of fp32 gradients "
          f"per process; AdamW, batch {run.batch} in 2 microbatches, 4 forward stages (frozen plan, whole jobs); "
          "each process on its own data")
    print(f"   {run.steps} measured iterations (forward_backward + engine.step) after {run.warmup} warm-up ones, "
          "per variant; rank 0's medians, on the engine's timeline clock")
    print("   step ms      = begin(i+1) - begin(i), begin: the clock just before iteration i's forward_backward")
    print("   b            = the end of iteration i's last compute event (forward/fused/recompute/backward), its "
          "events found by job index (i x J .. (i+1) x J - 1, J jobs per call)")
    print("   reduction ms = the step's allreduce events (labelled 'average step i+1'), summed: first bucket sent .. "
          "its means received, per event (in flight: it spans the step of the group before, sent ahead of it)")
    print("   hidden       = the share of that time before b (one event [s, e]: clip((b - s) / (e - s), 0, 1));  "
          "exposed ms = the rest")
    print("   MB sent      = (DataParallel.sent_bytes + broadcast_bytes) / iterations / 1e6 (gradients with their "
          "flags; sharded: also the updated weights this process owns)")
    print("   host step ms = the step's optimizer events summed (AdamW arithmetic and copies; sharded: this process's "
          "share);  state B/param = AdamW state bytes this process holds / all parameters")
    print(f"{'variant':<13} {'step ms':>8} {'x no avg':>8} | {'reduction ms':>12} {'hidden':>7} {'exposed ms':>10} "
          f"{'MB sent':>8} | {'host step ms':>12} {'state B/param':>13}")
    base = statistics.median(row["period"] for row in figures["no averaging"]["rows"])
    for name, figure in figures.items():
        rows = figure["rows"]
        period = statistics.median(row["period"] for row in rows)
        cells = f"{'-':>12} {'-':>7} {'-':>10}"
        if "reductions" in rows[0]:
            spent = [sum(end - start for start, end in row["reductions"]) for row in rows]
            before = [sum(max(0.0, min(end, row["backward_end"]) - start) for start, end in row["reductions"])
                      for row in rows]
            hidden = [part / total if total > 0 else 1.0 for part, total in zip(before, spent, strict=True)]
            exposed = [total - part for part, total in zip(before, spent, strict=True)]
            cells = (f"{1e3 * statistics.median(spent):12.1f} {100 * statistics.median(hidden):6.0f}% "
                     f"{1e3 * statistics.median(exposed):10.1f}")
        print(f"{name:<13} {1e3 * period:8.1f} {period / base:8.2f} | {cells} {figure['sent_per_step'] / 1e6:8.1f} | "
              f"{1e3 * figure['step_seconds']:12.1f} {figure['state_per_param']:13.2f}")
    print("Caveat: the two processes, their simulated devices and gloo share this machine's 2 cores, so the reduction "
          "competes with the compute for CPU time: the hidden share shows that the reduction overlaps the backward, "
          "not what a real network would hide.")

def numbers(text: str, kind: type = float) -> list:
    return [kind(x) for x in text.split(",") if x.strip()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", type=numbers, default=None,
                        help="bucket sizes in MiB, comma separated (default 1,4,16,64, smoke 1)")
    parser.add_argument("--dtypes", default=None, help="torch dtype names, comma separated (default "
                                                       "float32,bfloat16, smoke float32)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed all-reduces per dtype and size (default 3, "
                                                                 "smoke 1)")
    parser.add_argument("--repeats", type=int, default=None, help="timed all-reduces per dtype and size (default 10, "
                                                                  "smoke 2)")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds for the whole measurement (also the process group's timeout)")
    parser.add_argument("--no-measure", action="store_true", help="skip section 1 (the gloo measurement)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="the paper's profiles and figures")
    parser.add_argument("--nodes", type=lambda text: numbers(text, int), default=[2, 4, 8],
                        help="node counts K, comma separated")
    parser.add_argument("--links", type=numbers, default=[25.0, 100.0, 400.0],
                        help="link speeds in Gb/s, comma separated")
    parser.add_argument("--link-efficiency", type=float, default=1.0,
                        help="achieved share of the line rate (1: line rate)")
    parser.add_argument("--iteration", choices=("sim", "paper"), default="sim",
                        help="T1 from the simulator or from the design note's tokens per step / the paper's tokens/s")
    parser.add_argument("--mode", choices=("sync", "async"), default="sync",
                        help="sync: the reduction hides behind the backward; async: behind the next iteration")
    parser.add_argument("--no-overlap", action="store_true", help="nothing hides the reduction (H = 0)")
    parser.add_argument("--lora-params", type=float, default=None,
                        help="adapter parameters of the paper's LoRA model (Qwen3-235B); left out without it")
    parser.add_argument("--no-engine-run", action="store_true",
                        help="skip section 3 (the 2-process engine run: the reduction hidden behind the backward)")
    parser.add_argument("--engine-width", type=int, default=None,
                        help="section 3: the width w of each Linear(w, w) (default 896, smoke 128)")
    parser.add_argument("--engine-blocks", type=int, default=8, help="section 3: Linear + tanh layers")
    parser.add_argument("--engine-batch", type=int, default=16, help="section 3: rows per process and iteration")
    parser.add_argument("--engine-warmup", type=int, default=None,
                        help="section 3: untimed iterations per variant (default 3, smoke 1)")
    parser.add_argument("--engine-steps", type=int, default=None,
                        help="section 3: measured iterations per variant (default 10, smoke 2)")
    add_smoke(parser, "one 1 MiB float32 bucket, 2 timed all-reduces; section 3 with Linear(128, 128) layers, 2 steps")
    args = parser.parse_args()
    args.sizes_mib = sized(args.sizes_mib, args, full=[1.0, 4.0, 16.0, 64.0], smoke=[1.0])
    args.dtypes = sized(args.dtypes, args, full="float32,bfloat16", smoke="float32")
    args.warmup = sized(args.warmup, args, full=3, smoke=1)
    args.repeats = sized(args.repeats, args, full=10, smoke=2)
    args.engine_width = sized(args.engine_width, args, full=896, smoke=128)
    args.engine_warmup = sized(args.engine_warmup, args, full=3, smoke=1)
    args.engine_steps = sized(args.engine_steps, args, full=10, smoke=2)
    dtypes = [name.strip() for name in args.dtypes.split(",") if name.strip()]
    for name in dtypes:
        if not isinstance(getattr(torch, name, None), torch.dtype):
            parser.error(f"--dtypes: {name!r} is not a torch dtype")
    if not args.sizes_mib or min(args.sizes_mib) <= 0 or args.repeats < 1 or args.warmup < 0:
        parser.error("need positive --sizes-mib, --repeats >= 1 and --warmup >= 0")
    if not args.nodes or min(args.nodes) < 2 or not args.links or min(args.links) <= 0 or args.link_efficiency <= 0:
        parser.error("need --nodes >= 2, positive --links and a positive --link-efficiency")
    if (min(args.engine_width, args.engine_blocks, args.engine_steps) < 1 or args.engine_batch < 2
            or args.engine_warmup < 0):
        parser.error("need --engine-width, --engine-blocks, --engine-steps >= 1, --engine-batch >= 2 (2 "
                     "microbatches) and --engine-warmup >= 0")

    if not args.no_measure:
        if not dist.is_available() or not dist.is_gloo_available():
            print("1. skipped: this torch build has no gloo backend")
        else:
            rows = measure(dtypes, args.sizes_mib, args.warmup, args.repeats, args.timeout)
            bandwidth_table(rows, args.warmup, args.repeats)
    nodes, skipped = node_inputs(json.loads(args.json.read_text()), args.mode, args.iteration, args.lora_params)
    projection_table(nodes, skipped, args)
    if not args.no_engine_run:
        if not dist.is_available() or not dist.is_gloo_available():
            print("\n3. skipped: this torch build has no gloo backend")
        else:
            run = EngineRun(args.engine_width, args.engine_blocks, args.engine_batch, args.engine_warmup,
                            args.engine_steps, args.timeout)
            overlap_table(spawn(_engine_main, (run,), args.timeout, "the 2-process engine run"), run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
