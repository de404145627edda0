"""In-process decoding against DataLoader workers, on the same ``--shuffle`` store and cores.

    python benchmarks/in_process.py --rounds 3         # 1.5 M windows, 3 epochs a run (docs/training.md)
    python benchmarks/in_process.py --store STORE      # reuse a --shuffle store (never removed)
    python benchmarks/in_process.py --cases "0,2" --compare-source /tmp/changed   # A/B a library change

``WindowDataset`` (defaults but ``requests``; batch 8192) read in the training process
(``num_workers=0``, its reader decoding pools on ``requests`` threads) or by 1 or 2 persistent
DataLoader workers, each case in a fresh process, every case once per round, the rounds
interleaved. Each case runs ``--epochs`` epochs (``set_epoch`` before each), without a training
step and with one: a stand-in that uses the training process's CPU, a two-layer MLP forward
(``relu(x @ W1) @ W2``, ``--step-hidden`` units, on ``--step-threads`` torch threads) on every batch.

Reported, the median run of each case: windows/s of epoch 0 (from creating its iterator, worker
start included) and of the later epochs (the steady state), CPU seconds per million windows of
the whole process tree (the training process and its workers, from /proc through psutil, read
at the end of each epoch; the training step's CPU included), the time to the first batch of
epoch 0 and of later epochs (median), the peak private memory of the tree (the sum of USS,
sampled every 0.5 s from this process; and of PSS, which counts the pages forked workers share
with the training process), and the load average (1 min) before each run. Ratios
are against ``num_workers=2, requests=4`` (the default recommendation) of the same step.
Generated data goes to --workdir (removed at the end unless --keep, or unless it existed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _util import (  # noqa: E402
    PeakSampler,
    log,
    machine,
    outside_repository,
    table,
    tree_cpu,
    tree_private,
    work_directory,
)

BATCH = 8192
SEED = 1234
MB = 1e6
# (num_workers, requests): the reference (the default recommendation) is (2, 4)
CASES = [(0, 1), (0, 2), (0, 4), (1, 4), (2, 4)]
REFERENCE = (2, 4)


def make_store(workdir: str, n_windows: int, n_devices: int) -> str:
    """A ``--shuffle`` store of synthetic per-device Parquet files (reused if already there)."""
    import birdzarr
    from birdzarr.demo import _synthetic

    store = os.path.join(workdir, f"shuffled-{n_windows}-{n_devices}.zarr")
    if os.path.exists(os.path.join(store, "zarr.json")):
        log(f"reusing {store}")
        return store
    parquet = os.path.join(workdir, "parquet")
    os.makedirs(parquet, exist_ok=True)
    sizes = _synthetic.device_sizes(n_devices, n_windows, seed=0).tolist()
    for device, size in zip(_synthetic.device_ids(n_devices).tolist(), sizes, strict=True):
        _synthetic.write_parquet(_synthetic.curated_windows(size, seed=device),
                                 os.path.join(parquet, f"{device}.parquet"))
    started = time.perf_counter()
    birdzarr.convert(parquet, store, shuffle=True, seed=0, overwrite=True, progress=False)
    log(f"converted {n_windows:,} windows of {n_devices} devices with --shuffle in "
        f"{time.perf_counter() - started:.0f} s")
    return store


def run_case(spec: dict[str, Any]) -> dict[str, Any]:
    """One case in this (fresh) process: ``epochs`` epochs, timed and CPU-counted per epoch."""
    import torch
    from torch.utils.data import DataLoader

    import birdzarr

    workers, requests = spec["workers"], spec["requests"]
    step = None
    if spec["step_hidden"]:
        torch.set_num_threads(spec["step_threads"])
        generator = torch.Generator().manual_seed(0)
        w1 = torch.randn(80, spec["step_hidden"], generator=generator) / 9
        w2 = torch.randn(spec["step_hidden"], 80, generator=generator) / 9

        def step(x: torch.Tensor) -> float:
            return float(torch.relu(x.reshape(len(x), 80) @ w1).matmul(w2).sum())

    cpu0 = tree_cpu()
    ds = birdzarr.WindowDataset(spec["store"], batch_size=BATCH, seed=SEED, requests=requests)
    loader = DataLoader(ds, batch_size=None, num_workers=workers, persistent_workers=workers > 0)
    epochs = []
    for epoch in range(spec["epochs"]):
        ds.set_epoch(epoch)
        started = time.perf_counter()
        first = None
        n = 0
        for x in loader:
            if first is None:
                first = time.perf_counter() - started
            if step is not None:
                step(x)
            n += len(x)
        epochs.append({"seconds": time.perf_counter() - started, "first_s": first, "windows": n,
                       "cpu": tree_cpu()})
    return {"epochs": epochs, "cpu_open": cpu0, "torch_threads": torch.get_num_threads()}


def step_cost(hidden: int, threads: int, repeat: int = 50) -> float:
    """CPU ms of one training-step stand-in on a batch, alone (this process, ``threads`` torch threads)."""
    import torch

    torch.set_num_threads(threads)
    generator = torch.Generator().manual_seed(0)
    w1 = torch.randn(80, hidden, generator=generator)
    w2 = torch.randn(hidden, 80, generator=generator)
    x = torch.randn(BATCH, 20, 4, generator=generator)
    started = time.process_time()
    for _ in range(repeat):
        float(torch.relu(x.reshape(BATCH, 80) @ w1).matmul(w2).sum())
    return (time.process_time() - started) / repeat * 1e3


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one case in a child process; sample the USS of its process tree from here."""
    load = os.getloadavg()[0]
    argv = [sys.executable, os.path.abspath(__file__), "--run-case", json.dumps(spec)]
    env = dict(os.environ)
    if spec.get("source"):  # birdzarr imported from another copy (an A/B of a library change)
        env["PYTHONPATH"] = os.pathsep.join([spec["source"], *filter(None, [env.get("PYTHONPATH")])])
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env)
    with PeakSampler(lambda: tree_private(proc.pid), 0.5) as sampler:
        out, _ = proc.communicate()
    if proc.returncode:
        raise RuntimeError(f"case {spec} failed (exit {proc.returncode})")
    result = json.loads(out.strip().splitlines()[-1])
    result["peak_uss_mb"], result["peak_pss_mb"] = sampler.peak[0] / MB, sampler.peak[1] / MB
    result["load"] = load
    e = result["epochs"]
    steady_windows = sum(x["windows"] for x in e[1:])
    steady_seconds = sum(x["seconds"] for x in e[1:])
    result["rate0"] = e[0]["windows"] / e[0]["seconds"] / MB
    result["rate"] = steady_windows / steady_seconds / MB
    result["cpu0"] = (e[0]["cpu"] - result["cpu_open"]) / (e[0]["windows"] / MB)
    result["cpu"] = (e[-1]["cpu"] - e[0]["cpu"]) / (steady_windows / MB)
    result["first0"] = e[0]["first_s"]
    result["first"] = statistics.median(x["first_s"] for x in e[1:])
    return result


def label(workers: int, requests: int, source: str | None = None) -> str:
    return f"num_workers={workers}, requests={requests}" + (" (--compare-source)" if source else "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=1_500_000)
    parser.add_argument("--devices", type=int, default=186)
    parser.add_argument("--store", default=None, help="a --shuffle store to read (else one is generated)")
    parser.add_argument("--workdir", default="/tmp/birdzarr-in-process-bench")
    parser.add_argument("--keep", action="store_true", help="keep the generated store (reused next time)")
    parser.add_argument("--epochs", type=int, default=3, help="epochs a run: epoch 0, then the steady state")
    parser.add_argument("--rounds", type=int, default=2, help="runs of every case, interleaved")
    parser.add_argument("--step-hidden", type=int, default=64,
                        help="hidden units of the training-step stand-in (0: run without a step only)")
    parser.add_argument("--step-threads", type=int, default=1,
                        help="torch threads of the training process with the step (torch's default "
                             "spins its threads: on 2 loaded cores the step then cost 10-34x the CPU)")
    parser.add_argument("--compare-source", default=None, metavar="DIR",
                        help="also run the num_workers=0 cases with birdzarr imported from DIR (a "
                             "changed copy of the package's parent directory), interleaved")
    parser.add_argument("--cases", default=None, metavar="W,R W,R",
                        help="(num_workers, requests) pairs to run, e.g. '0,2 2,4' (default: "
                             + " ".join(f"{w},{r}" for w, r in CASES) + "; the reference 2,4 is always run)")
    parser.add_argument("--run-case", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run_case:
        print(json.dumps(run_case(json.loads(args.run_case))))
        return 0
    chosen = CASES
    if args.cases:
        try:
            chosen = [(int(w), int(r)) for w, r in (pair.split(",") for pair in args.cases.split())]
        except ValueError:
            parser.error(f"--cases takes pairs like '0,2 2,4', got {args.cases!r}")
        chosen = list(dict.fromkeys([*chosen, REFERENCE]))
    if args.epochs < 2:
        parser.error("--epochs must be at least 2 (epoch 0, then the steady state)")
    workdir = outside_repository(parser, args.workdir)
    started = time.perf_counter()
    with work_directory(workdir, prefix="", keep=args.keep or args.store is not None):
        store = os.path.abspath(args.store) if args.store else make_store(workdir, args.windows, args.devices)
        steps = [0] + ([args.step_hidden] if args.step_hidden else [])
        sources = [None] + ([os.path.abspath(args.compare_source)] if args.compare_source else [])
        specs = [{"store": store, "workers": w, "requests": r, "epochs": args.epochs, "step_hidden": h,
                  "step_threads": args.step_threads, "source": source}
                 for h in steps for w, r in chosen for source in sources if source is None or w == 0]
        runs: dict[tuple[int, int, int, str | None], list[dict[str, Any]]] = {}
        for round_ in range(args.rounds):
            for spec in specs:
                result = measure(spec)
                key = (spec["step_hidden"], spec["workers"], spec["requests"], spec["source"])
                runs.setdefault(key, []).append(result)
                log(f"round {round_ + 1}, step {spec['step_hidden']}, "
                    f"{label(spec['workers'], spec['requests'], spec['source'])}: "
                    f"epoch 0 {result['rate0']:.2f}, later "
                    f"{result['rate']:.2f} M windows/s, {result['cpu']:.2f} CPU s/M, peak "
                    f"{result['peak_uss_mb']:.0f} MB, load {result['load']:.1f}")
        cost = {h: step_cost(h, args.step_threads) for h in steps if h}
    windows = runs[next(iter(runs))][0]["epochs"][0]["windows"]
    rows = []
    for (hidden, workers, requests, source), measured in runs.items():
        median = sorted(measured, key=lambda r: r["rate"])[len(measured) // 2]
        reference = sorted(runs[(hidden, *REFERENCE, None)], key=lambda r: r["rate"])[len(measured) // 2]
        rows.append({
            "step": f"MLP {hidden} ({cost[hidden]:.1f} ms)" if hidden else "none",
            "reader": label(workers, requests, source),
            "M windows/s": median["rate"],
            "x workers=2": median["rate"] / reference["rate"],
            "runs M/s": " ".join(f"{r['rate']:.2f}" for r in measured),
            "epoch 0 M/s": median["rate0"],
            "CPU s/M": median["cpu"],
            "CPU x workers=2": median["cpu"] / reference["cpu"],
            "epoch 0 CPU s/M": median["cpu0"],
            "first batch 0 s": median["first0"],
            "first batch later s": median["first"],
            "peak USS MB": max(r["peak_uss_mb"] for r in measured),
            "peak PSS MB": max(r["peak_pss_mb"] for r in measured),
            "load": " ".join(f"{r['load']:.1f}" for r in measured),
        })
    print()
    print(f"{windows:,} windows ({store}), batch {BATCH}, {args.epochs} epochs a run (steady: epochs 1-"
          f"{args.epochs - 1}), median of {args.rounds} interleaved rounds, peak memory the largest; "
          f"{machine()}; torch threads {runs[next(iter(runs))][0]['torch_threads']} (with the step: "
          f"{args.step_threads}); total "
          f"{time.perf_counter() - started:.0f} s")
    print(table(rows))
    print("step: the training-step stand-in run on every batch in the training process (its CPU ms a "
          "batch alone, after the run); CPU s/M: CPU seconds of the training process and its workers a "
          "million windows, step included; peak USS / PSS: the process tree's private memory (pages a "
          "forked worker shares with the training process count in neither's USS; PSS splits them); "
          "load: 1-minute load average before each run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
