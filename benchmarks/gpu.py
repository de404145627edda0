"""Feeding a GPU: resident mode against streaming and against data already on the device.

    python benchmarks/gpu.py                          # on a GPU node: 10 M windows, batch 8192
    python benchmarks/gpu.py --windows 200000 --device cpu --workers 2   # a smoke run anywhere

Generates calibrated windows of 186 devices as per-device Parquet (in --workdir, removed unless
--keep), converts them twice (device order, and --shuffle), then measures, each case in its own
process, one after another:

  (r) reference: all windows already a tensor on the device, ``torch.randperm`` + gather per epoch
  (s) WindowDataset streaming from the --shuffle store, --workers DataLoader workers, pin_memory
  (c) WindowDataset(resident=DEVICE) on the device-ordered store (format-2 codes on the device;
      full batches replayed from one CUDA graph)

For each: loader-only windows/s (an epoch, batches moved to the device and synchronised), then
windows/s training a small 1-D CNN for one epoch, the load time, peak host memory of the process
tree (USS) and peak device memory. The table prints ratios to (r).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _util import PeakSampler, machine, table, tree_private  # noqa: E402

MB = 1e6


def prepare(workdir: str, n_windows: int) -> dict[str, str]:
    import birdzarr
    from birdzarr.demo import _synthetic

    stores = {name: os.path.join(workdir, f"{name}.zarr") for name in ("device", "shuffled")}
    if all(os.path.exists(p) for p in stores.values()):
        return stores
    source = os.path.join(workdir, "parquet")
    _synthetic.make_parquet_dir(source, n_devices=186, total_windows=n_windows, seed=0)
    birdzarr.convert(source, stores["device"], overwrite=True, progress=False)
    birdzarr.convert(source, stores["shuffled"], overwrite=True, progress=False, shuffle=True, seed=0)
    return stores


def _model(device: Any) -> Any:
    import torch
    from torch import nn

    return nn.Sequential(
        nn.Conv1d(4, 64, 5, padding=2), nn.ReLU(), nn.Conv1d(64, 64, 5, padding=2), nn.ReLU(),
        nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(64, 10),
    ).to(device).to(memory_format=torch.contiguous_format)


def run_case(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from torch.utils.data import DataLoader

    import birdzarr

    device = torch.device(spec["device"])
    batch = spec["batch"]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    started = time.perf_counter()
    if spec["kind"] == "reference":
        host = torch.from_numpy(birdzarr.open_store(spec["store"]).windows[:])
        data = host.to(device).transpose(1, 2).contiguous()

        def epoch_batches(epoch: int) -> Any:
            generator = torch.Generator(device=device).manual_seed(epoch)
            order = torch.randperm(len(data), generator=generator, device=device)
            for i in range(0, len(order), batch):
                yield data[order[i : i + batch]]
    else:
        options: dict[str, Any] = {"channel_first": True}
        if spec["kind"] == "resident":
            options["resident"] = device if device.type == "cuda" else "cpu"
            options["progress"] = False
        ds = birdzarr.WindowDataset(spec["store"], batch_size=batch, seed=1, **options)
        workers = 0 if spec["kind"] == "resident" else spec["workers"]
        loader = ds if spec["kind"] == "resident" and device.type == "cuda" else DataLoader(
            ds, batch_size=None, num_workers=workers, pin_memory=device.type == "cuda",
            persistent_workers=workers > 0)

        def epoch_batches(epoch: int) -> Any:
            ds.set_epoch(epoch)
            for x in loader:
                yield x.to(device, non_blocking=True)
    sync()
    result: dict[str, Any] = {"load_s": time.perf_counter() - started}
    for mode in ("loader", "train"):
        model = _model(device)
        optimiser = torch.optim.Adam(model.parameters(), lr=1e-3)
        n, first = 0, None
        epoch = 0 if mode == "loader" else 1
        t0 = time.perf_counter()
        for x in epoch_batches(epoch):
            if mode == "train":
                loss = model(x).square().mean()
                optimiser.zero_grad(set_to_none=True)
                loss.backward()
                optimiser.step()
            if first is None:
                sync()
                first = time.perf_counter()
            else:
                n += len(x)
        sync()
        assert first is not None
        result[f"{mode}_windows_per_s"] = n / (time.perf_counter() - first)
        result.setdefault("first_batch_s", first - t0)
    if device.type == "cuda":
        result["device_peak_mb"] = torch.cuda.max_memory_allocated(device) / MB
    return result


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    argv = [sys.executable, os.path.abspath(__file__), "--run-case", json.dumps(spec)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    with PeakSampler(lambda: tree_private(proc.pid), 0.2) as sampler:
        out, _ = proc.communicate()
    if proc.returncode:
        raise RuntimeError(f"case {spec['label']} failed (exit {proc.returncode})")
    result = json.loads(out.strip().splitlines()[-1])
    result["host_peak_uss_mb"] = sampler.peak[0] / MB
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=10_000_000)
    parser.add_argument("--batch", type=int, default=8192)
    parser.add_argument("--workers", type=int, default=15)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--workdir", default="/tmp/birdzarr-gpu-bench")
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--run-case", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run_case:
        print(json.dumps(run_case(json.loads(args.run_case))))
        return 0
    os.makedirs(args.workdir, exist_ok=True)
    try:
        stores = prepare(args.workdir, args.windows)
        common = {"device": args.device, "batch": args.batch, "workers": args.workers}
        specs = [
            {"label": "(r) data already on the device, randperm + gather", "kind": "reference",
             "store": stores["device"], **common},
            {"label": f"(s) streaming, --shuffle store, {args.workers} workers", "kind": "streaming",
             "store": stores["shuffled"], **common},
            {"label": f"(c) resident={args.device!r}, device-ordered store", "kind": "resident",
             "store": stores["device"], **common},
        ]
        results = []
        for spec in specs:
            # Each case's figures as soon as it ends, so that a run cut short keeps them.
            results.append((spec, measure(spec)))
            print(spec["label"], json.dumps(results[-1][1]), file=sys.stderr, flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(args.workdir, ignore_errors=True)
    ref = results[0][1]
    rows = [{
        "feeding": spec["label"],
        "loader M windows/s": r["loader_windows_per_s"] / MB,
        "x (r) loader": r["loader_windows_per_s"] / ref["loader_windows_per_s"],
        "training M windows/s": r["train_windows_per_s"] / MB,
        "x (r) training": r["train_windows_per_s"] / ref["train_windows_per_s"],
        "load s": r["load_s"],
        "host peak USS MB": r["host_peak_uss_mb"],
        "device peak MB": r.get("device_peak_mb", float("nan")),
    } for spec, r in results]
    print(f"{args.windows:,} windows, batch {args.batch}, device {args.device}; {machine()}")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
