"""Train ``tests/models.Classifier`` with several processes: the script ``tests/test_scaleout.py`` starts.

A script, not a test: Lightning's launcher starts the other processes of a run by running this file again
(under pytest it would run pytest again), and torchrun starts it once per process. Each process writes what it
ends with to ``<out>/rank<global rank>.pt``: the final parameters and buffers, its losses, the sample indices it
trained on, the ``sync_dist`` mean of the losses and the world it saw.

    python tests/scaleout/train.py --strategy ddp --devices 2 --out OUT
    python tests/scaleout/train.py --strategy roundpipe --devices 4 --rings-per-node 2 --out OUT
    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/scaleout/train.py \\
        --strategy roundpipe --devices 4 --rings-per-node 2 --shard-optimizer --out OUT

The run: AdamW with a StepLR schedule stepped per optimizer step, ``accumulate_grad_batches=2``, gradient
clipping (unless ``--no-clip``), a fixed dataset sharded by the ``DistributedSampler`` Lightning injects, ``seed_everything``. The same
global batch on any number of processes: ``--batch`` is per process.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script: the repository root holds the `tests` package
    sys.path.insert(0, str(ROOT))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402
from torch.utils.data import DataLoader, Dataset, DistributedSampler  # noqa: E402

from lightning_roundpipe import RoundPipeStrategy  # noqa: E402
from tests.models import Classifier, state_bytes  # noqa: E402

SAMPLES = 32        # per epoch: 2 optimizer steps of 2 x 8 samples (per process: 8 / world size per batch)
GLOBAL_BATCH = 8    # samples per batch over all processes
CLIP = 0.5          # gradient_clip_val (norm): small enough to clip in the first steps
WAIT = 60.0         # seconds: a lost process fails the others quickly instead of hanging


class Indexed(Dataset):
    """``SAMPLES`` fixed random samples (6 features, 3 classes), each with its index."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(1)
        self.x = torch.randn(SAMPLES, 6, generator=generator)
        self.y = torch.randint(0, 3, (SAMPLES,), generator=generator)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[index], self.y[index], index


class Recording(Classifier):
    """``Classifier`` (the same parameters, so its checkpoints load as one) that also records which samples it
    trained on and logs the mean loss over the processes (``sync_dist``)."""

    def __init__(self, optimizer: str = "adamw", fused: bool = False) -> None:
        super().__init__(optimizer, fused)
        self.seen: list[int] = []

    def training_step(self, batch, batch_idx):
        x, y, index = batch
        self.seen.extend(index.tolist())
        loss = super().training_step((x, y), batch_idx)
        self.log("synced_loss", loss.detach(), on_step=False, on_epoch=True, sync_dist=True)
        return loss


def loader(world_size: int) -> DataLoader:
    """The data of one process: Lightning replaces the sampler by its ``DistributedSampler`` (shuffled, seed
    ``PL_GLOBAL_SEED``) when there are several. One process gets the same sampler for one replica, so that each of
    its batches holds the samples of one batch of all the processes of a run with several."""
    dataset = Indexed()
    if world_size > 1:
        return DataLoader(dataset, batch_size=GLOBAL_BATCH // world_size)
    return DataLoader(dataset, batch_size=GLOBAL_BATCH,
                      sampler=DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0))


def make_strategy(args: argparse.Namespace) -> Any:
    wait = args.wait if args.wait is not None else WAIT
    if args.strategy == "ddp":
        return DDPStrategy(timeout=timedelta(seconds=wait))
    return RoundPipeStrategy(num_microbatches=2, rings_per_node=args.rings_per_node, async_step=args.async_step,
                             timeline_dir=args.timeline_dir, wait_timeout=wait,
                             shard_optimizer=args.shard_optimizer, reduce_dtype=args.reduce_dtype)


class KillAt(pl.Callback):
    """Global rank ``rank`` kills itself with SIGKILL once ``step`` optimizer steps are done: a crash with no
    cleanup (no exception, no closed process group), as a lost machine or an out-of-memory kill leaves it."""

    roundpipe_reads_gradients = False  # it reads no gradients: the run keeps the path it has without it

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_rank == self.rank and trainer.global_step >= self.step:
            sys.stdout.flush()
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)


def make_trainer(strategy: Any, devices: int, steps: int, float64: bool, checkpoints: str | None = None,
                 clip: bool = True, **kwargs: Any) -> pl.Trainer:
    """The Trainer of every run (``kwargs``: more Trainer arguments). Without clipping (and without a hook that
    reads gradients) RoundPipe averages the gradients on its optimizer thread, else on the main thread."""
    callbacks = [ModelCheckpoint(dirpath=checkpoints, filename="{epoch}", every_n_epochs=1, save_top_k=-1)] \
        if checkpoints else []
    return pl.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_steps=steps,
                      accumulate_grad_batches=2, gradient_clip_val=CLIP if clip else None, precision="64-true" if float64 else "32-true",
                      logger=False, enable_checkpointing=bool(checkpoints), callbacks=callbacks,
                      enable_progress_bar=False, enable_model_summary=False, **kwargs)


def state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}


def host_bytes(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """What this process holds of the training state on the host: its parameters' bytes and element count, and
    its optimizer state's bytes (the tensors in ``optimizer.state``, which a sharded optimizer keeps for the
    parameters this process owns only)."""
    return {"params": sum(param.nbytes for param in module.parameters()),
            "numel": sum(param.numel() for param in module.parameters()),
            "optimizer_state": state_bytes(optimizer.state)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategy", choices=["ddp", "roundpipe"], required=True)
    parser.add_argument("--devices", type=int, required=True, help="Trainer(devices=...): per node")
    parser.add_argument("--rings-per-node", type=int, default=1, help="roundpipe: processes per node")
    parser.add_argument("--num-nodes", type=int, default=1, help="Trainer(num_nodes=...): run once per node, with "
                        "NODE_RANK, MASTER_ADDR and MASTER_PORT set")
    parser.add_argument("--fused", action="store_true", help="pipeline_loss instead of calling the trunk")
    parser.add_argument("--async-step", action="store_true", help="roundpipe: the one-step-stale update")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps in all (2 per epoch)")
    parser.add_argument("--float64", action="store_true", help='precision="64-true"')
    parser.add_argument("--no-clip", action="store_true", help="no gradient_clip_val")
    parser.add_argument("--out", required=True, help="folder for rank<r>.pt")
    parser.add_argument("--checkpoints", help="folder: a checkpoint at the end of each epoch (epoch=<e>.ckpt)")
    parser.add_argument("--resume", help="a checkpoint to resume from (ckpt_path)")
    parser.add_argument("--timeline-dir", help="roundpipe: record the timeline and write it here")
    parser.add_argument("--perturb-rank", type=int, help="start this global rank from other weights")
    parser.add_argument("--shard-optimizer", action="store_true", help="roundpipe: shard_optimizer=True")
    parser.add_argument("--reduce-dtype", default="auto", help="roundpipe: reduce_dtype")
    parser.add_argument("--wait", type=float, help=f"seconds: the strategy's wait timeout (default {WAIT:.0f})")
    parser.add_argument("--kill-rank", type=int, help="this global rank kills itself (SIGKILL) at --kill-at-step; "
                        "every process that fails instead writes <out>/exit_rank<r>.txt: its exit code and error")
    parser.add_argument("--kill-at-step", type=int, default=1, help="optimizer steps done before --kill-rank dies")
    args = parser.parse_args(argv)

    pl.seed_everything(0, verbose=False)
    trainer = make_trainer(make_strategy(args), args.devices, args.steps, args.float64, args.checkpoints,
                           num_nodes=args.num_nodes,
                           clip=not args.no_clip)
    world = trainer.world_size
    module = Recording("adamw", args.fused)
    if args.perturb_rank is not None and trainer.global_rank == args.perturb_rank:
        with torch.no_grad():
            for param in module.parameters():
                param.add_(0.1)
    if args.kill_rank is not None:
        trainer.callbacks.append(KillAt(args.kill_rank, args.kill_at_step))  # type: ignore[attr-defined]
        try:
            trainer.fit(module, loader(world), ckpt_path=args.resume)
        except BaseException as error:
            # how this process ends (the exception raised on, so exit code 1): under Lightning's launcher a
            # child's exit code reaches no one (its parent may be the process killed); one killed writes none
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, f"exit_rank{trainer.global_rank}.txt"), "w") as file:
                file.write(f"1\n{type(error).__name__}: {error}\n")
            raise
    else:
        trainer.fit(module, loader(world), ckpt_path=args.resume)
    os.makedirs(args.out, exist_ok=True)
    torch.save({
        "state": state(module), "losses": module.losses, "seen": module.seen, "world_size": world,
        "global_step": trainer.global_step, "synced_loss": float(trainer.callback_metrics["synced_loss"]),
        "distributed_sampler_kwargs": dict(trainer.strategy.distributed_sampler_kwargs),
        "environment": type(getattr(trainer.strategy, "cluster_environment", None)).__name__,
        "host_bytes": host_bytes(module, trainer.optimizers[0]),
        "sent_bytes": getattr(getattr(trainer.strategy, "data_parallel", None), "sent_bytes", None),
    }, os.path.join(args.out, f"rank{trainer.global_rank}.pt"))


if __name__ == "__main__":
    main()
