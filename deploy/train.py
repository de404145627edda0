"""A short self-supervised training run on a birdzarr store: the script every deploy recipe calls.

    python deploy/train.py STORE --epochs N --batch-size B          # one process (CPU or one GPU)
    torchrun --nproc-per-node 4 deploy/train.py STORE --epochs N     # one process per GPU (DDP)

STORE is a path or URL (``s3://bucket/x.zarr``) of a store converted with ``--shuffle`` (streaming
shuffled batches from a large device-ordered store is refused); S3 credentials come from the
standard AWS chain (``AWS_*`` variables, profile, instance role) and ``AWS_ENDPOINT_URL`` points
at MinIO. The model is a small autoencoder of the 20x4 windows, enough to show the data path end
to end; replace it with yours.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from torch import nn
from torch.utils.data import DataLoader

import birdzarr


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("store", help="store path or URL")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=8192)
    parser.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
    parser.add_argument("--requests", type=int, default=4,
                        help="chunk reads in flight per worker (raise it on S3)")
    args = parser.parse_args(argv)

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1  # set by torchrun
    cuda = torch.cuda.is_available()
    if distributed:
        torch.distributed.init_process_group("nccl" if cuda else "gloo")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(f"cuda:{local_rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    rank = torch.distributed.get_rank() if distributed else 0

    # WindowDataset splits every epoch over ranks (torch.distributed) and DataLoader workers.
    dataset = birdzarr.WindowDataset(args.store, batch_size=args.batch_size, shuffle=True, seed=0,
                                     requests=args.requests)
    # Persistent workers keep their S3 clients and buffers between epochs; set_epoch reaches them.
    loader = DataLoader(dataset, batch_size=None, num_workers=args.workers, pin_memory=cuda,
                        persistent_workers=args.workers > 0)
    model: nn.Module = nn.Sequential(nn.Flatten(), nn.Linear(80, 32), nn.GELU(), nn.Linear(32, 80)).to(device)
    if distributed:
        model = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank] if cuda else None)
    optimiser = torch.optim.AdamW(model.parameters(), lr=1e-3)

    for epoch in range(args.epochs):
        dataset.set_epoch(epoch)  # new batches every epoch
        started, windows, loss = time.perf_counter(), 0, torch.zeros(())
        for batch in loader:
            x = batch.to(device, non_blocking=True)
            loss = nn.functional.mse_loss(model(x), x.flatten(1))
            optimiser.zero_grad(set_to_none=True)
            loss.backward()
            optimiser.step()
            windows += len(x)
        seconds = time.perf_counter() - started
        if rank == 0:
            print(f"epoch {epoch}: {windows:,} windows in {seconds:.1f} s "
                  f"({windows / seconds:,.0f} windows/s per rank), loss {loss.item():.4f}", flush=True)
    if distributed:
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
