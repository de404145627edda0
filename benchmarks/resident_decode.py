"""What one batch costs in resident mode on the host: float32 rows against a format-2 store's codes.

    python benchmarks/resident_decode.py [STORE] [--batches 40] [--repeat 5] [--batch-size 8192]
                                         [--loader] [--loader-repeat 3]
    python benchmarks/resident_decode.py --load STORE [--load-repeat 3]

STORE is a store birdzarr wrote (its default, /tmp/birdzarr-loader-bench/device.zarr, is the
device-ordered store ``python benchmarks/loader.py --keep`` leaves). The script holds the store's
windows twice in this process, as ``resident="cpu"`` holds them: float32
(``resident_codes=False``) and the store's codes (``HeldCodes``: uint16 codes, a dictionary row
and gps_speed once a window, in shared memory), draws ``--batches`` uniform batches and times
each way of making a batch on one core, ``--repeat`` passes (medians, since this machine's speed
varies from minute to minute). In a loader every batch is a fresh random set of rows, so its
codes are not in the CPU caches: every timed way starts after the caches are flushed (a 64 MB
write), and the ways run in a new random order for each batch, so none is favoured by what ran
before it.

- float32 gather: ``np.take`` of the batch's rows, the in-RAM gather limit;
- the codes' decode as the loader does it on the host (``HeldCodes.decode_host``: the batch's
  windows grouped by dictionary row, looked up, put back in the batch's order), then the same
  decode with its lookups in the batch's order (no grouping), and the torch ops a GPU runs
  (``HeldCodes.decode``, one torch thread); all give the float32 windows (checked);
- the decode's own steps, run in sequence after one flush: the windows grouped by row (a stable
  sort of their rows), the index (each window's row offsets, its codes added), the table lookup,
  the batch's order restored and the samples and gps_speed copied out; and the same lookup in a
  16 KB table (every index in the caches);
- the ``with_ldt`` part of a batch: one packed int32 row a window, against three arrays.

Times are the CPU time of the timing thread (``time.thread_time``): on a machine shared with
other jobs, a wall clock also counts the time spent waiting for a core.

``--loader`` then times whole epochs of ``WindowDataset(resident="cpu", with_ldt=True)`` of
STORE through a DataLoader with 0 and 2 workers, float32 and codes: windows/s after the first
batch, medians of ``--loader-repeat`` interleaved rounds, each as a share of float32 with the
same workers; and windows per CPU second after the first batch (this process's CPU time and its
workers' whole lives, which on a machine shared with other jobs moves less than the wall clock).

``--load STORE`` only times resident loads (``with_ldt=True``) of every 2nd and every 10th
device, each in a new process: CPU and wall seconds of building the ``WindowDataset``, and the
process's peak RSS (interpreter and torch included).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _util import machine, table  # noqa: E402

import birdzarr  # noqa: E402
from birdzarr.format._spec import WINDOW_LENGTH  # noqa: E402
from birdzarr.loader._resident import timestamps_of  # noqa: E402

Step = Callable[[np.ndarray], object]
DEFAULT_STORE = "/tmp/birdzarr-loader-bench/device.zarr"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("store", nargs="?", default=DEFAULT_STORE)
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=8192)
    parser.add_argument("--loader", action="store_true",
                        help="also time resident epochs of STORE, float32 and codes, 0 and 2 workers")
    parser.add_argument("--loader-repeat", type=int, default=3)
    parser.add_argument("--load", metavar="STORE", default=None,
                        help="only time resident loads of device subsets of STORE, each in a new process")
    parser.add_argument("--load-repeat", type=int, default=3)
    parser.add_argument("--load-child", nargs=2, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.load_child:
        load_child(args.load_child[0], int(args.load_child[1]))
        return
    if args.load:
        load_selections(args)
        return
    default_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core, as in a DataLoader worker

    def resident(codes: bool) -> birdzarr.WindowDataset:
        return birdzarr.WindowDataset(args.store, batch_size=args.batch_size, resident="cpu",
                                      resident_codes=codes, with_ldt=codes, allow_device_order=True,
                                      progress=False)

    coded_selection = resident(True).resident
    floats = resident(False).resident
    assert coded_selection is not None and floats is not None and coded_selection.ldt is not None
    coded = coded_selection.coded
    if coded is None:
        raise SystemExit(f"{args.store} is not held as codes (a format-2 store birdzarr wrote is)")
    n = len(coded_selection)
    rng = np.random.default_rng(0)
    batches = [rng.choice(n, args.batch_size, replace=False) for _ in range(args.batches)]
    x32 = floats.x.numpy()
    out = np.empty((args.batch_size, WINDOW_LENGTH, 4), np.float32)
    held_codes = coded.codes.numpy().reshape(n, -1)  # (n, 60) int16
    held_row, offsets, gps = coded.row.numpy(), coded.offsets.numpy(), coded.gps.numpy()
    small = coded.values[:4096].clone()

    def in_batch_order(rows: np.ndarray) -> np.ndarray:
        """decode_host without grouping the windows by dictionary row."""
        index = np.take(offsets, np.take(held_row, rows), axis=0)
        np.add(index, np.take(held_codes, rows, axis=0), out=index)
        looked_up = np.empty(index.shape, np.float32)
        for first in range(0, index.size, 30720):  # below torch's parallel grain, as decode_host
            torch.index_select(coded.values, 0, torch.from_numpy(index.reshape(-1)[first : first + 30720]),
                               out=torch.from_numpy(looked_up.reshape(-1)[first : first + 30720]))
        got = out[: len(rows)]
        got[:, :, :3] = looked_up.reshape(len(rows), WINDOW_LENGTH, 3)
        got[:, :, 3] = np.take(gps, rows)[:, None] if gps.ndim == 1 else np.take(gps, rows, axis=0)
        return got

    decode_name = "codes: decode (the loader's HeldCodes.decode_host)"
    ways: dict[str, Step] = {
        "float32 gather (np.take)": lambda rows: np.take(x32, rows, axis=0),
        decode_name: lambda rows: coded.decode_host(rows, out=out[: len(rows)]),
        "  instead: the lookups in the batch's order (not grouped by row)": in_batch_order,
        "  instead: HeldCodes.decode (the torch ops a GPU runs)":
            lambda rows: coded.decode(torch.from_numpy(rows)),
    }
    for rows in batches[:2]:  # every way decodes exactly
        for way in ways.values():
            assert np.array_equal(np.asarray(way(rows)), np.take(x32, rows, axis=0))

    state: dict[str, np.ndarray] = {}

    def sort_step(rows: np.ndarray) -> None:
        row = np.take(held_row, rows)
        state["order"] = np.argsort(row.astype(np.uint16) if len(offsets) <= 2**16 else row, kind="stable")
        state["ascending"] = rows[state["order"]]
        state["row"] = row[state["order"]]

    def index_step(rows: np.ndarray) -> None:
        state["index"] = np.take(offsets, state["row"], axis=0)
        np.add(state["index"], np.take(held_codes, state["ascending"], axis=0), out=state["index"])

    def lookup_step(rows: np.ndarray) -> None:
        index = torch.from_numpy(state["index"].reshape(-1))
        state["looked_up"] = coded.values.index_select(0, index).numpy()

    def order_step(rows: np.ndarray) -> None:
        back = np.empty_like(state["order"])
        back[state["order"]] = np.arange(len(rows))
        got = out[: len(rows)]
        got[:, :, :3] = np.take(state["looked_up"].reshape(len(rows), -1), back, axis=0).reshape(
            len(rows), WINDOW_LENGTH, 3)
        got[:, :, 3] = np.take(gps, rows)[:, None] if gps.ndim == 1 else np.take(gps, rows, axis=0)

    def small_lookup_step(rows: np.ndarray) -> None:
        small.index_select(0, torch.from_numpy(state["index"].reshape(-1) & 4095))

    steps: dict[str, Step] = {
        "    windows grouped by row (stable sort)": sort_step,
        "    index: the rows' offsets, the codes added": index_step,
        "    table lookup": lookup_step,
        "    batch order restored, samples and gps_speed copied out": order_step,
        "    (the same lookup in a 16 KB table)": small_lookup_step,
    }

    packed = coded_selection.ldt.numpy()
    label, device = packed[:, 0].copy(), packed[:, 1].copy()
    timestamp = timestamps_of(packed[:, 2:])
    ldt_out = np.empty((args.batch_size, 3), np.int64)

    def packed_ldt(rows: np.ndarray) -> None:
        held = np.take(packed, rows, axis=0)
        ldt_out[: len(rows), :2] = held[:, :2]
        ldt_out[: len(rows), 2] = timestamps_of(held[:, 2:])

    def three_array_ldt(rows: np.ndarray) -> None:
        ldt_out[: len(rows), 0] = label[rows]
        ldt_out[: len(rows), 1] = device[rows]
        ldt_out[: len(rows), 2] = timestamp[rows]

    ways["ldt: one packed int32 row a window"] = packed_ldt
    ways["  instead: ldt from three arrays"] = three_array_ldt

    flush_buffer = np.zeros(64 * 2**20, dtype=np.uint8)

    def flush() -> None:
        np.add(flush_buffer, 1, out=flush_buffer)  # 64 MB: twice the development machine's L3

    def timed(step: Step, rows: np.ndarray) -> float:
        started = time.thread_time()
        step(rows)
        return time.thread_time() - started

    shuffle = np.random.default_rng(1)
    shown = [*list(ways)[:2], *steps, *list(ways)[2:]]  # the decode's steps under it
    times: dict[str, list[float]] = {name: [] for name in shown}
    names = list(ways)
    for _ in range(args.repeat):
        for rows in batches:
            for i in shuffle.permutation(len(names)).tolist():
                flush()
                times[names[i]].append(timed(ways[names[i]], rows))
            flush()
            for name, step in steps.items():  # in sequence, as in the decode
                times[name].append(timed(step, rows))
    ideal = float(np.median(times["float32 gather (np.take)"]))
    decode_ms = float(np.median(times[decode_name]))
    rows_out = []
    for name, spent in times.items():
        ms = float(np.median(spent))
        whole = not name.startswith(("    ", "ldt", "  instead: ldt"))  # a step's own rate says nothing
        versus = round(ms / decode_ms, 2) if name.startswith("  instead: ") and "ldt" not in name else ""
        rows_out.append({f"way, batch of {args.batch_size} windows": name, "ms": round(ms * 1e3, 2),
                         "M windows/s": round(args.batch_size / ms / 1e6, 2) if whole else "",
                         "% of float32 gather": round(100 * ideal / ms, 1) if whole else "",
                         "x the loader's decode": versus})
    print(f"{args.store}: {n:,} windows; codes {coded.nbytes / n:.1f} B a window "
          f"({coded.nbytes / x32.nbytes:.2f}x float32), of which "
          f"{(coded.values.numel() + coded.offsets.numel()) * 4 / 2**20:.1f} MiB dictionaries "
          f"({coded.offsets.shape[0]} rows); medians of {args.repeat} x {args.batches} batches, "
          f"CPU time of one thread; {machine()}")
    print(table(rows_out), flush=True)
    if args.loader:
        torch.set_num_threads(default_threads)  # the training process's default again
        loader_epochs(args)


def loader_epochs(args: argparse.Namespace) -> None:
    """Whole resident epochs through a DataLoader: float32 and codes, 0 and 2 workers."""
    from torch.utils.data import DataLoader

    cases = [("float32 (resident_codes=False)", False), ("codes", True)]
    rates: dict[tuple[str, int], list[float]] = {}
    cpu_rates: dict[tuple[str, int], list[float]] = {}  # windows a CPU second: this process and its workers

    def children_cpu() -> float:
        used = resource.getrusage(resource.RUSAGE_CHILDREN)
        return used.ru_utime + used.ru_stime

    for _ in range(args.loader_repeat):
        for label, codes in cases:
            ds = birdzarr.WindowDataset(args.store, batch_size=args.batch_size, resident="cpu",
                                        resident_codes=codes, with_ldt=True, allow_device_order=True,
                                        progress=False)
            held = ds.resident
            assert held is not None and (held.coded is not None) == codes
            for workers in (0, 2):
                batches = iter(DataLoader(ds, batch_size=None, num_workers=workers,
                                          multiprocessing_context="fork" if workers else None))
                next(batches)
                started, cpu_started, workers_cpu = time.perf_counter(), time.process_time(), children_cpu()
                count = sum(len(x) for x, _ in batches)  # the workers exit (and are waited for) at the end
                rates.setdefault((label, workers), []).append(count / (time.perf_counter() - started))
                cpu = time.process_time() - cpu_started + children_cpu() - workers_cpu
                cpu_rates.setdefault((label, workers), []).append(count / cpu)
            del ds, held
    rows = []
    for label, _ in cases:
        for workers in (0, 2):
            rate = float(np.median(rates[(label, workers)]))
            base = float(np.median(rates[("float32 (resident_codes=False)", workers)]))
            cpu_rate = float(np.median(cpu_rates[(label, workers)]))
            cpu_base = float(np.median(cpu_rates[("float32 (resident_codes=False)", workers)]))
            rows.append({"resident='cpu', one epoch, with_ldt": label, "workers": workers,
                         "M windows/s": round(rate / 1e6, 2), "x float32": round(rate / base, 2),
                         "runs M/s": " ".join(f"{r / 1e6:.2f}" for r in rates[(label, workers)]),
                         "M windows a CPU s": round(cpu_rate / 1e6, 2),
                         "x float32 (CPU)": round(cpu_rate / cpu_base, 2)})
    print(f"resident epochs of {args.store}; medians of {args.loader_repeat} rounds; {machine()}")
    print(table(rows))


def load_child(url: str, every: int) -> None:
    """One resident load of every ``every``-th device of ``url``, in this new process."""
    store = birdzarr.open_store(url)
    devices = sorted(set(store.window_devices[:].tolist()))[::every]
    cpu, started = time.process_time(), time.perf_counter()
    ds = birdzarr.WindowDataset(url, batch_size=8192, resident="cpu", with_ldt=True, devices=devices,
                                allow_device_order=True, progress=False)
    assert ds.resident is not None
    print(json.dumps({"windows": len(ds.resident), "cpu": time.process_time() - cpu,
                      "wall": time.perf_counter() - started,
                      "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))


def load_selections(args: argparse.Namespace) -> None:
    """``WindowDataset(resident="cpu", with_ldt=True, devices=...)`` of every 2nd and every 10th
    device of a format-2 store, each load in a new process: CPU and wall seconds of building
    the dataset, and the process's peak RSS (the interpreter and torch included)."""
    runs: dict[int, list[dict[str, float]]] = {2: [], 10: []}
    for _ in range(args.load_repeat):
        for every in runs:
            done = subprocess.run([sys.executable, __file__, "--load-child", args.load, str(every)],
                                  check=True, capture_output=True, text=True)
            runs[every].append(json.loads(done.stdout.strip().splitlines()[-1]))
    rows = []
    for every, got in runs.items():
        rows.append({"devices": f"every {every}th" if every > 2 else "every 2nd",
                     "windows": f"{int(got[0]['windows']):,}",
                     "CPU s": round(float(np.median([g["cpu"] for g in got])), 2),
                     "wall s": round(float(np.median([g["wall"] for g in got])), 2),
                     "peak RSS MB": round(float(np.median([g["peak"] for g in got])) / 1e6),
                     "runs CPU s": " ".join(f"{g['cpu']:.2f}" for g in got)})
    print(f"resident loads of {args.load}, medians of {args.load_repeat}; {machine()}")
    print(table(rows))


if __name__ == "__main__":
    main()
