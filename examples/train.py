"""Train a tiny 1D-conv autoencoder from a birdzarr store, on one process or many (DDP).

    python examples/train.py STORE --epochs 2 --batch-size 8192 --workers 4 --checkpoint ckpt.pt
    python examples/train.py STORE ... --checkpoint ckpt.pt --resume    # continue where it stopped
    python examples/train.py s3://bucket/store.zarr ... --requests 16     # object stores
    python examples/train.py STORE ... --resident cuda    # the selection held on the GPU, no workers
    torchrun --nproc_per_node=4 examples/train.py STORE ... --checkpoint ckpt.pt [--resume]

STORE is a local path or a URL (``s3://bucket/store.zarr``; credentials come from the usual
AWS environment). Launched by ``torchrun`` (or ``srun`` with torchrun's variables set), every
process joins one process group (NCCL on GPUs, gloo on CPUs) and ``WindowDataset`` reads
``WORLD_SIZE``/``RANK`` from it, so each rank gets a disjoint share of every epoch with the same
number of batches. Launched plainly, it trains in one process.

Checkpoints (written by rank 0, atomically) hold the model, the optimizer and the loader's
position (``WindowDataset.state_dict``) every ``--checkpoint-every`` steps, at the end of each
epoch, and when SIGTERM or SIGUSR1 arrives (SLURM sends these before a time limit or
preemption). ``--resume`` restarts at the next batch of the interrupted epoch, with exactly the
batches an uninterrupted run would have seen; resuming needs the same world size, batch size
and seed (the loader refuses otherwise).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

import birdzarr


class TinyConvAutoencoder(nn.Module):
    """(B, 4, 20) -> a 32-value embedding -> (B, 4, 20); trained to reconstruct its input."""

    def __init__(self, channels: int = 4, length: int = 20, hidden: int = 32) -> None:
        super().__init__()
        self.encoder = nn.Sequential(
            nn.Conv1d(channels, hidden, kernel_size=5, padding=2), nn.ReLU(),
            nn.Conv1d(hidden, hidden, kernel_size=5, padding=2), nn.ReLU(),
            nn.AdaptiveAvgPool1d(1), nn.Flatten(),
        )
        self.decoder = nn.Linear(hidden, channels * length)
        self.shape = (channels, length)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x)).view(-1, *self.shape)


def setup_distributed() -> tuple[int, int, torch.device]:
    """Join the process group when launched by torchrun; returns (rank, world size, device)."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    use_cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(minutes=10))
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), device
    return 0, 1, device


def save_checkpoint(path: str, state: dict[str, Any]) -> None:
    """Write to a temporary file, then rename: a crash mid-write leaves the previous checkpoint."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(state, tmp)
    os.replace(tmp, path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("store", help="store path or URL")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=8192, help="windows per batch and rank")
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers per rank")
    p.add_argument("--checkpoint", default="checkpoint.pt", help="checkpoint file (rank 0 writes it)")
    p.add_argument("--checkpoint-every", type=int, default=100, help="steps between checkpoints")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint if it exists")
    p.add_argument("--seed", type=int, default=0, help="model init and loader shuffle seed")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--shuffle-buffer", type=int, default=None, help="WindowDataset shuffle_buffer")
    p.add_argument("--resident", default=None, choices=["cpu", "cuda"],
                   help="hold the data in memory (WindowDataset resident=); 'cuda' also drops the workers")
    p.add_argument("--requests", type=int, default=4,
                   help="chunk reads in flight per reader (raise it, e.g. 16, for object stores)")
    p.add_argument("--max-steps", type=int, default=None,
                   help="stop (after checkpointing) once this process has taken this many steps")
    p.add_argument("--log-file", default=None, help="append one JSON line per step here (rank 0)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank, world, device = setup_distributed()
    torch.manual_seed(args.seed)  # the same initial weights on every rank

    options: dict[str, Any] = {}
    if args.shuffle_buffer is not None:
        options["shuffle_buffer"] = args.shuffle_buffer
    if args.resident is not None:
        options["resident"] = device if args.resident == "cuda" else "cpu"
    ds = birdzarr.WindowDataset(args.store, batch_size=args.batch_size, shuffle=True, seed=args.seed,
                                channel_first=True, requests=args.requests, **options)
    loader: Any = ds  # batches already on the GPU: no DataLoader workers to feed it
    if args.resident != "cuda":
        workers = args.workers
        # persistent workers keep their S3 client and slots between epochs; set_epoch() reaches them
        loader = DataLoader(ds, batch_size=None, num_workers=workers, pin_memory=device.type == "cuda",
                            persistent_workers=workers > 0)

    model: nn.Module = TinyConvAutoencoder().to(device)
    if world > 1:
        ids = [device.index] if device.type == "cuda" else None
        model = nn.parallel.DistributedDataParallel(model, device_ids=ids)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    bare = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model

    start_epoch, global_step = 0, 0
    if args.resume and os.path.exists(args.checkpoint):
        ckpt = torch.load(args.checkpoint, map_location=device, weights_only=False)
        bare.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_epoch, global_step = ckpt["epoch"], ckpt["global_step"]
        if ckpt["loader"] is not None:
            ds.load_state_dict(ckpt["loader"])  # next iteration of that epoch starts at its next batch
        if rank == 0:
            at = ckpt["loader"]["next_batch"] if ckpt["loader"] else 0
            print(f"resumed from {args.checkpoint}: epoch {start_epoch}, batch {at}, step {global_step}",
                  flush=True)

    stop_requested = []
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, lambda signum, frame: stop_requested.append(signum))

    def checkpoint(epoch: int, loader_state: dict[str, Any] | None) -> None:
        if rank == 0:
            save_checkpoint(args.checkpoint, {
                "model": bare.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch,
                "global_step": global_step, "loader": loader_state, "world_size": world,
                "args": vars(args),
            })

    log = open(args.log_file, "a") if args.log_file and rank == 0 else None  # noqa: SIM115
    steps_here = 0
    if rank == 0:
        print(f"{ds!r} on {world} rank(s), device {device}", flush=True)
    try:
        for epoch in range(start_epoch, args.epochs):
            ds.set_epoch(epoch)  # keeps a resume point of this epoch, drops one of another
            first_batch = ds.state_dict(batches_seen=0)["next_batch"]
            started, consumed, loss_sum = time.perf_counter(), 0, 0.0
            for x in loader:
                x = x.to(device, non_blocking=True)
                loss = nn.functional.mse_loss(model(x), x)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()  # DDP all-reduces gradients here: equal batch counts keep ranks in step
                optimizer.step()
                consumed += 1
                global_step += 1
                steps_here += 1
                loss_value = loss.item()
                loss_sum += loss_value
                if log is not None:
                    record = {"epoch": epoch, "batch": first_batch + consumed - 1, "step": global_step,
                              "loss": loss_value, "x_sum": float(x.double().sum())}
                    log.write(json.dumps(record) + "\n")
                    log.flush()
                stop = bool(stop_requested) or (args.max_steps is not None and steps_here >= args.max_steps)
                if world > 1:  # every rank stops at the same step, or the others would hang
                    flag = torch.tensor([float(stop)], device=device)
                    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                    stop = bool(flag.item())
                if stop or global_step % args.checkpoint_every == 0:
                    checkpoint(epoch, ds.state_dict(batches_seen=consumed))
                if stop:
                    if rank == 0:
                        print(f"stopping at epoch {epoch}, batch {first_batch + consumed}, "
                              f"step {global_step}; resume with --resume", flush=True)
                    return 0
            checkpoint(epoch + 1, None)  # the epoch is done: resume at the start of the next one
            if rank == 0:
                seconds = time.perf_counter() - started
                print(f"epoch {epoch}: {consumed} batches, mean loss {loss_sum / max(consumed, 1):.5f}, "
                      f"{seconds:.1f} s", flush=True)
    finally:  # also on the early stop above
        if log is not None:
            log.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
