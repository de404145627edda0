"""Train a small behaviour classifier on a labelled birdzarr store, on one process or many (DDP).

    python examples/train_classifier.py STORE --epochs 10 --batch-size 4096 --checkpoint clf.pt
    python examples/train_classifier.py STORE ... --checkpoint clf.pt --resume   # continue
    python examples/train_classifier.py STORE ... --resident cuda   # selection on the GPU, no workers
    torchrun --nproc_per_node=4 examples/train_classifier.py STORE ... --checkpoint clf.pt [--resume]

The store's labelled windows (label != -1) are split by device (``split="train"`` / ``"val"``,
``--val-fraction``, ``--split-seed``): a bird's windows are all on one side, so the validation
figures are those of birds the model never saw. The model is a 1-D CNN over the (4, 20) window
(channels first); its input is normalised with the mean and std of the training side only
(``WindowDataset.stats()``). The loss is cross-entropy weighted by ``WindowDataset.class_weights()``
(every label weighs as much, however rare; ``--no-class-weights`` turns it off). With
``--balanced`` (needs ``--resident``) the training batches are class-balanced instead
(``label_weights="balanced"``: every label an equal share of every batch) and the loss is unweighted.

After every epoch the validation side is scored: overall accuracy, per-class accuracy (recall:
the share of a label's windows predicted as that label), their mean (balanced accuracy) and the
confusion matrix (rows: true label, columns: predicted), summed over all ranks.

Checkpoints (written by rank 0, atomically) hold the model, the optimizer and the loader's
position (``WindowDataset.state_dict``) every ``--checkpoint-every`` steps, at the end of each
epoch, and when SIGTERM or SIGUSR1 arrives (SLURM sends these before a time limit or
preemption). ``--resume`` restarts at the next batch of the interrupted epoch with exactly the
batches an uninterrupted run would have seen, so it ends with the same weights; resuming needs
the same world size, batch size, workers, seed and split (the loader refuses otherwise).
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


class WindowClassifier(nn.Module):
    """(B, 4, 20) -> logits (B, num_classes): normalise, two convolutions, pool, a linear layer."""

    mean: torch.Tensor  # buffers, (1, 4, 1)
    std: torch.Tensor

    def __init__(self, num_classes: int, mean: torch.Tensor, std: torch.Tensor,
                 channels: int = 4, hidden: int = 32) -> None:
        super().__init__()
        # the training side's statistics travel with the model (checkpoints hold them)
        self.register_buffer("mean", mean.reshape(1, channels, 1).float())
        self.register_buffer("std", std.reshape(1, channels, 1).float().clamp_min(1e-6))
        self.features = nn.Sequential(
            nn.Conv1d(channels, hidden, kernel_size=5, padding=2), nn.ReLU(),
            nn.Conv1d(hidden, hidden, kernel_size=5, padding=2), nn.ReLU(),
            nn.AdaptiveAvgPool1d(1), nn.Flatten(),
        )
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features((x - self.mean) / self.std))


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


def make_datasets(args: argparse.Namespace, device: torch.device
                  ) -> tuple[birdzarr.WindowDataset, birdzarr.WindowDataset]:
    """The two sides of one device split, labelled windows only, with their labels (ldt)."""
    common: dict[str, Any] = dict(
        batch_size=args.batch_size, channel_first=True, with_ldt=True, labelled_only=True,
        split_by="device", val_fraction=args.val_fraction, split_seed=args.split_seed,
        requests=args.requests,
    )
    if args.resident is not None:
        common["resident"] = device if args.resident == "cuda" else "cpu"
    train_options: dict[str, Any] = {}
    if args.shuffle_buffer is not None:
        train_options["shuffle_buffer"] = args.shuffle_buffer
    if args.balanced:
        train_options["label_weights"] = "balanced"
    train = birdzarr.WindowDataset(args.store, split="train", shuffle=True, seed=args.seed,
                                   **train_options, **common)
    val = birdzarr.WindowDataset(args.store, split="val", shuffle=False, **common)
    return train, val


def loader_of(ds: birdzarr.WindowDataset, args: argparse.Namespace, device: torch.device) -> Any:
    if args.resident == "cuda":
        return ds  # batches already on the GPU: no DataLoader workers to feed it
    # persistent workers keep their buffers between epochs; set_epoch() reaches them
    return DataLoader(ds, batch_size=None, num_workers=args.workers, pin_memory=device.type == "cuda",
                      persistent_workers=args.workers > 0)


@torch.no_grad()
def evaluate(model: nn.Module, loader: Any, num_classes: int, device: torch.device,
             world: int) -> tuple[torch.Tensor, set[int]]:
    """The confusion matrix (rows: true label, columns: predicted) over the whole validation
    side (every rank scores its share, then they are summed), and this rank's device ids."""
    model.eval()
    confusion = torch.zeros(num_classes * num_classes, dtype=torch.int64, device=device)
    devices: set[int] = set()
    for x, ldt in loader:
        x, ldt = x.to(device, non_blocking=True), ldt.to(device, non_blocking=True)
        predicted = model(x).argmax(dim=1)
        confusion += torch.bincount(ldt[:, 0] * num_classes + predicted, minlength=num_classes ** 2)
        devices.update(ldt[:, 1].unique().tolist())
    model.train()
    if world > 1:
        dist.all_reduce(confusion)
    return confusion.view(num_classes, num_classes).cpu(), devices


def scores(confusion: torch.Tensor) -> dict[str, Any]:
    """Accuracy, per-class accuracy (None for a label absent from the side), balanced accuracy."""
    total, correct = int(confusion.sum()), int(confusion.diagonal().sum())
    per_class: dict[int, float | None] = {}
    for label in range(confusion.shape[0]):
        n = int(confusion[label].sum())
        per_class[label] = int(confusion[label, label]) / n if n else None
    present = [a for a in per_class.values() if a is not None]
    return {"windows": total, "accuracy": correct / max(total, 1), "per_class": per_class,
            "balanced_accuracy": sum(present) / max(len(present), 1)}


def report(epoch: int, confusion: torch.Tensor, result: dict[str, Any]) -> str:
    lines = [f"epoch {epoch} validation: {result['windows']:,} windows, accuracy {result['accuracy']:.3f}, "
             f"balanced accuracy {result['balanced_accuracy']:.3f}"]
    lines.append("  per-class accuracy: " + ", ".join(
        f"{label}: {'-' if a is None else f'{a:.3f}'}" for label, a in result["per_class"].items()))
    width = max(7, len(f"{int(confusion.max()):,}") + 1)
    lines.append("  confusion (rows true, columns predicted):")
    lines.append("  " + "true".rjust(6) + "".join(f"{c:>{width}}" for c in range(confusion.shape[1])))
    for label, row in enumerate(confusion.tolist()):
        lines.append("  " + f"{label:>6}" + "".join(f"{n:>{width},}" for n in row))
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("store", help="store path or URL (labelled windows are used)")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=4096, help="windows per batch and rank")
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers per rank")
    p.add_argument("--val-fraction", type=float, default=0.2,
                   help="each device is in val with this probability")
    p.add_argument("--split-seed", type=int, default=0, help="seed of the device split")
    p.add_argument("--class-weights", action=argparse.BooleanOptionalAction, default=True,
                   help="weight the loss by WindowDataset.class_weights() (default: on)")
    p.add_argument("--balanced", action="store_true",
                   help="class-balanced training batches (WindowDataset label_weights='balanced', every "
                        "label an equal share of each batch); needs --resident cpu|cuda. The loss is then "
                        "unweighted (the batches already equalise the classes; --class-weights is ignored)")
    p.add_argument("--checkpoint", default="classifier.pt", help="checkpoint file (rank 0 writes it)")
    p.add_argument("--checkpoint-every", type=int, default=100, help="steps between checkpoints")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint if it exists")
    p.add_argument("--seed", type=int, default=0, help="model init and loader shuffle seed")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--shuffle-buffer", type=int, default=None, help="WindowDataset shuffle_buffer")
    p.add_argument("--resident", default=None, choices=["cpu", "cuda"],
                   help="hold the data in memory (WindowDataset resident=); 'cuda' also drops the workers")
    p.add_argument("--requests", type=int, default=4,
                   help="chunk reads in flight per reader (raise it, e.g. 16, for object stores)")
    p.add_argument("--max-steps", type=int, default=None,
                   help="stop (after checkpointing) once this process has taken this many steps")
    p.add_argument("--log-file", default=None, help="append one JSON line per step and epoch here (rank 0)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.balanced and args.resident is None:
        print("error: --balanced draws batches by label from memory: add --resident cpu (or cuda)",
              file=sys.stderr)
        return 2
    rank, world, device = setup_distributed()
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    try:
        try:
            train, val = make_datasets(args, device)
        except (ValueError, birdzarr.BirdzarrError) as error:  # no labelled window, an empty side, ...
            print(f"error: {error}", file=sys.stderr)
            return 2
        return _train(args, rank, world, device, train, val)
    finally:  # also on an early stop or an error
        if dist.is_initialized():
            dist.destroy_process_group()


def _train(args: argparse.Namespace, rank: int, world: int, device: torch.device,
           train: birdzarr.WindowDataset, val: birdzarr.WindowDataset) -> int:
    train_counts, val_counts = train.label_counts(), val.label_counts()
    num_classes = max([*train_counts, *val_counts]) + 1
    # balanced batches already give every label an equal share: no weighting on top
    use_weights = args.class_weights and not args.balanced
    weights = train.class_weights(num_classes).to(device) if use_weights else None
    stats = train.stats()  # normalisation constants of the training side only
    model: nn.Module = WindowClassifier(num_classes, torch.as_tensor(stats.mean), torch.as_tensor(stats.std))
    model = model.to(device)
    if world > 1:
        ids = [device.index] if device.type == "cuda" else None
        model = nn.parallel.DistributedDataParallel(model, device_ids=ids)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    bare = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    train_loader, val_loader = loader_of(train, args, device), loader_of(val, args, device)

    start_epoch, global_step, history = 0, 0, []
    if args.resume and os.path.exists(args.checkpoint):
        ckpt = torch.load(args.checkpoint, map_location=device, weights_only=False)
        try:
            if ckpt["num_classes"] != num_classes:
                raise ValueError(f"it has {ckpt['num_classes']} classes, the store's labels make "
                                 f"{num_classes}")
            if ckpt["loader"] is not None:
                train.load_state_dict(ckpt["loader"])  # next iteration of that epoch starts at its next batch
        except ValueError as error:  # another store, split, batch size, world size, workers, ...
            print(f"error: cannot resume from {args.checkpoint}: {error}", file=sys.stderr)
            return 2
        bare.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_epoch, global_step, history = ckpt["epoch"], ckpt["global_step"], ckpt["history"]
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
                "num_classes": num_classes, "history": history, "args": vars(args),
            })

    log = open(args.log_file, "a") if args.log_file and rank == 0 else None  # noqa: SIM115
    steps_here = 0
    if rank == 0:
        print(f"{train!r} on {world} rank(s), device {device}", flush=True)
        print(f"train: devices {list(train.selection.devices or [])}, labels {train_counts}", flush=True)
        print(f"val: devices {list(val.selection.devices or [])}, labels {val_counts}", flush=True)
        if weights is not None:
            print(f"class weights {[round(w, 4) for w in weights.tolist()]}", flush=True)
    try:
        for epoch in range(start_epoch, args.epochs):
            train.set_epoch(epoch)  # keeps a resume point of this epoch, drops one of another
            first_batch = train.state_dict(batches_seen=0)["next_batch"]
            started, consumed, loss_sum, windows = time.perf_counter(), 0, 0.0, 0
            train_devices: set[int] = set()
            train_labels = torch.zeros(num_classes, dtype=torch.int64, device=device)
            for x, ldt in train_loader:
                x, ldt = x.to(device, non_blocking=True), ldt.to(device, non_blocking=True)
                loss = nn.functional.cross_entropy(model(x), ldt[:, 0], weight=weights, ignore_index=-1)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()  # DDP all-reduces gradients here: equal batch counts keep ranks in step
                optimizer.step()
                consumed += 1
                global_step += 1
                steps_here += 1
                windows += len(x)
                loss_value = loss.item()
                loss_sum += loss_value
                if log is not None:
                    train_devices.update(ldt[:, 1].unique().tolist())
                    train_labels += torch.bincount(ldt[:, 0].clamp_min(0), minlength=num_classes)
                    record = {"epoch": epoch, "batch": first_batch + consumed - 1, "step": global_step,
                              "loss": loss_value, "x_sum": float(x.double().sum()),
                              "label_sum": int(ldt[:, 0].sum())}
                    log.write(json.dumps(record) + "\n")
                    log.flush()
                stop = bool(stop_requested) or (args.max_steps is not None and steps_here >= args.max_steps)
                if world > 1:  # every rank stops at the same step, or the others would hang
                    flag = torch.tensor([float(stop)], device=device)
                    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                    stop = bool(flag.item())
                if stop or global_step % args.checkpoint_every == 0:
                    checkpoint(epoch, train.state_dict(batches_seen=consumed))
                if stop:
                    if rank == 0:
                        print(f"stopping at epoch {epoch}, batch {first_batch + consumed}, "
                              f"step {global_step}; resume with --resume", flush=True)
                    return 0
            seconds = time.perf_counter() - started
            confusion, val_devices = evaluate(model, val_loader, num_classes, device, world)
            result = scores(confusion)
            history.append({"epoch": epoch, **result})
            checkpoint(epoch + 1, None)  # the epoch is done: resume at the start of the next one
            if rank == 0:
                rate = windows / max(seconds, 1e-9)
                print(f"epoch {epoch}: {consumed} batches, mean loss {loss_sum / max(consumed, 1):.4f}, "
                      f"{seconds:.1f} s ({rate:,.0f} windows/s on rank 0)", flush=True)
                print(report(epoch, confusion, result), flush=True)
            if log is not None:
                record = {"epoch": epoch, "validation": result, "confusion": confusion.tolist(),
                          "train_devices": sorted(train_devices), "val_devices": sorted(val_devices),
                          "train_labels": train_labels.tolist()}
                log.write(json.dumps(record) + "\n")
                log.flush()
    finally:  # also on the early stop above
        if log is not None:
            log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
