"""What one batch costs in resident mode on the host: float32 rows against a format-2 store's codes.

    python benchmarks/resident_decode.py [STORE] [--batches 40] [--repeat 5] [--batch-size 8192]
                                         [--loader] [--loader-repeat 3] [--baseline DIR]
    python benchmarks/resident_decode.py --load STORE [--load-repeat 3]

STORE is a store birdzarr wrote (its default, /tmp/birdzarr-loader-bench/device.zarr, is the
device-ordered store ``python benchmarks/loader.py --keep`` leaves). The script holds the
store's windows twice in this process, as ``resident="cpu"`` holds them: float32
(``resident_codes=False``) and the store's codes (``HeldCodes``: uint16 codes, a dictionary row
and gps_speed once a window, one 128-byte row a window in shared memory), draws ``--batches``
uniform batches and times each way of making a batch on one core, ``--repeat`` passes (medians,
since this machine's speed varies from minute to minute). In a loader every batch is a fresh
random set of rows, so its codes are not in the CPU caches: every timed way starts after the
caches are flushed (a 64 MB write), and the ways run in a new random order for each batch, so
none is favoured by what ran before it.

- float32 gather: ``np.take`` of the batch's rows, the in-RAM gather limit;
- the codes' decode as the loader does it on the host (``HeldCodes.decode_host``: the windows'
  rows gathered, looked up in the batch's order, copied out), then the same decode with the
  windows grouped by dictionary row for the lookups (sorted, the order restored after), and the
  torch ops a GPU runs (``HeldCodes.decode``, one torch thread); all give the float32 windows
  (checked);
- the decode's own steps, run in sequence after one flush: the windows' rows gathered, the
  index (each window's row offsets, its codes added), the table lookup, the samples and
  gps_speed copied out; and the same lookup in a 16 KB table (every index in the caches);
- the ``with_ldt`` part of a batch: one packed int32 row a window, against three arrays.

Times are the CPU time of the timing thread (``time.thread_time``): on a machine shared with
other jobs, a wall clock also counts the time spent waiting for a core.

``--loader`` then times one epoch each of: the in-RAM numpy gather of sorted random indices
(``benchmarks/loader.py``'s (e), the limit: no DataLoader, on the same windows held as float32),
and ``WindowDataset(resident="cpu", with_ldt=True)`` of STORE through a DataLoader with 0 and 2
workers, float32 and codes; every epoch in a new process, ``--loader-repeat`` interleaved rounds,
medians: windows/s after the first batch (as a share of the gather, and the codes as a share of
float32 with the same workers) and windows per CPU second after the first batch (the process and
its workers, which on a machine shared with other jobs moves less than the wall clock). With
``--baseline DIR`` the resident epochs also run on the birdzarr of DIR (another checkout, e.g.
``git worktree add /tmp/base HEAD~1``), interleaved with this checkout's: before and after in
one run.

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
    parser.add_argument("--baseline", metavar="DIR", default=None,
                        help="with --loader: also run the resident epochs on the birdzarr of DIR (another "
                             "checkout, e.g. a git worktree of the previous commit), interleaved")
    parser.add_argument("--epoch-child", nargs=2, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--load", metavar="STORE", default=None,
                        help="only time resident loads of device subsets of STORE, each in a new process")
    parser.add_argument("--load-repeat", type=int, default=3)
    parser.add_argument("--load-child", nargs=2, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.load_child:
        load_child(args.load_child[0], int(args.load_child[1]))
        return
    if args.epoch_child:
        epoch_child(args.store, args.epoch_child[0], int(args.epoch_child[1]), args.batch_size)
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
    assert coded.packed is not None, "held on the host: one row a window"
    packed, offsets = coded.packed.numpy(), coded.offsets.numpy()  # (n, 64) int16: codes, row, gps_speed
    small = coded.values[:4096].clone()
    sample = np.dtype((np.void, 16))  # a sample's 16 bytes, as decode_host copies them

    def copied_out(looked_up: np.ndarray, taken: np.ndarray, got: np.ndarray) -> np.ndarray:
        """decode_host's last step: the looked-up values (padded by one sample) into ``got`` a
        sample at a time, gps_speed over each sample's fourth value."""
        np.copyto(got.reshape(-1).view(sample),
                  np.ndarray((got.shape[0] * WINDOW_LENGTH,), sample, buffer=looked_up, strides=(12,)))
        got[:, :, 3] = taken[:, 62:].view(np.float32)
        return got

    def grouped_by_row(rows: np.ndarray) -> np.ndarray:
        """decode_host with the windows grouped by dictionary row for the lookups (a stable
        sort of their rows, their rows gathered again in that order), the order restored after."""
        taken = np.take(packed, rows, axis=0)
        row = np.ascontiguousarray(taken[:, 60:62]).view(np.int32).reshape(-1)
        order = np.argsort(row.astype(np.uint16) if len(offsets) <= 2**16 else row, kind="stable")
        grouped = np.take(taken, order, axis=0)
        index = np.take(offsets, row[order], axis=0)
        np.add(index, grouped[:, :60], out=index)
        looked_up = coded.values.index_select(0, torch.from_numpy(index.reshape(-1))).numpy()
        back = np.empty_like(order)
        back[order] = np.arange(len(rows))
        in_order = np.empty(looked_up.size + 4, np.float32)
        np.take(looked_up.reshape(index.shape), back, axis=0, out=in_order[:-4].reshape(index.shape))
        return copied_out(in_order, taken, out[: len(rows)])

    decode_name = "codes: decode (the loader's HeldCodes.decode_host)"
    ways: dict[str, Step] = {
        "float32 gather (np.take)": lambda rows: np.take(x32, rows, axis=0),
        decode_name: lambda rows: coded.decode_host(rows, out=out[: len(rows)]),
        "  instead: the lookups grouped by dictionary row (sorted, order restored)": grouped_by_row,
        "  instead: HeldCodes.decode (the torch ops a GPU runs)":
            lambda rows: coded.decode(torch.from_numpy(rows)),
    }
    for rows in batches[:2]:  # every way decodes exactly
        for way in ways.values():
            assert np.array_equal(np.asarray(way(rows)), np.take(x32, rows, axis=0))

    state: dict[str, np.ndarray] = {}

    def gather_step(rows: np.ndarray) -> None:
        state["taken"] = np.take(packed, rows, axis=0)

    def index_step(rows: np.ndarray) -> None:
        row = np.ascontiguousarray(state["taken"][:, 60:62]).view(np.int32).reshape(-1)
        state["index"] = np.take(offsets, row, axis=0)
        np.add(state["index"], state["taken"][:, :60], out=state["index"])

    def lookup_step(rows: np.ndarray) -> None:
        state["looked_up"] = np.empty(state["index"].size + 4, np.float32)
        torch.index_select(coded.values, 0, torch.from_numpy(state["index"].reshape(-1)),
                           out=torch.from_numpy(state["looked_up"][:-4]))

    def copy_step(rows: np.ndarray) -> None:
        copied_out(state["looked_up"], state["taken"], out[: len(rows)])

    def small_lookup_step(rows: np.ndarray) -> None:
        small.index_select(0, torch.from_numpy(state["index"].reshape(-1) & 4095))

    steps: dict[str, Step] = {
        "    the windows' rows gathered (codes, dictionary row, gps_speed: 128 B a window)": gather_step,
        "    index: the rows' offsets, the codes added": index_step,
        "    table lookup": lookup_step,
        "    samples copied out (16 bytes at a time), gps_speed written": copy_step,
        "    (the same lookup in a 16 KB table)": small_lookup_step,
    }

    ldt_rows = coded_selection.ldt.numpy()
    label, device = ldt_rows[:, 0].copy(), ldt_rows[:, 1].copy()
    timestamp = timestamps_of(ldt_rows[:, 2:])
    ldt_out = np.empty((args.batch_size, 3), np.int64)

    def packed_ldt(rows: np.ndarray) -> None:
        held = np.take(ldt_rows, rows, axis=0)
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


LOADER_CASES = [("ideal", 0), ("float32", 0), ("float32", 2), ("codes", 0), ("codes", 2)]
LOADER_LABELS = {"ideal": "in-RAM numpy gather of sorted random indices (no DataLoader: the limit)",
                 "float32": "resident='cpu', float32 (resident_codes=False)",
                 "codes": "resident='cpu', codes"}


def loader_epochs(args: argparse.Namespace) -> None:
    """One epoch each of the ideal gather and of resident float32 and codes with 0 and 2 workers,
    every one in a new process, ``--loader-repeat`` interleaved rounds; with ``--baseline DIR``
    the resident cases also run on the birdzarr of DIR (another checkout), interleaved."""
    versions = [("this checkout", None)] + ([("baseline", args.baseline)] if args.baseline else [])
    runs: dict[tuple[str, str, int], list[dict[str, float]]] = {}
    for _ in range(args.loader_repeat):
        for case, workers in LOADER_CASES:
            for version, path in versions[: 1 if case == "ideal" else None]:
                env = dict(os.environ)
                if path:
                    env["PYTHONPATH"] = os.pathsep.join([path, *filter(None, [env.get("PYTHONPATH")])])
                argv = [sys.executable, __file__, args.store, "--epoch-child", case, str(workers),
                        "--batch-size", str(args.batch_size)]
                done = subprocess.run(argv, check=True, capture_output=True, text=True, env=env)
                result = json.loads(done.stdout.strip().splitlines()[-1])
                runs.setdefault((version, case, workers), []).append(result)
    ideal = float(np.median([r["rate"] for r in runs[("this checkout", "ideal", 0)]]))
    rows = []
    for version, _ in versions:
        for case, workers in LOADER_CASES:
            got = runs.get((version, case, workers))
            if not got:
                continue
            rate = float(np.median([r["rate"] for r in got]))
            float32 = runs.get((version, "float32", workers))
            base = float(np.median([r["rate"] for r in float32])) if float32 and case == "codes" else None
            label = LOADER_LABELS[case] + ("" if case == "ideal" else f" ({version})")
            rows.append({"one epoch, with_ldt": label,
                         "workers": "" if case == "ideal" else workers,
                         "M windows/s": round(rate / 1e6, 2), "% of the gather": round(100 * rate / ideal, 1),
                         "x float32": "" if base is None else round(rate / base, 2),
                         "runs M/s": " ".join(f"{r['rate'] / 1e6:.2f}" for r in got),
                         "M windows a CPU s": round(float(np.median([r["cpu_rate"] for r in got])) / 1e6, 2)})
    print(f"epochs of {args.store}, each in a new process; medians of {args.loader_repeat} interleaved "
          f"rounds; {machine()}")
    print(table(rows))


def epoch_child(store: str, case: str, workers: int, batch_size: int) -> None:
    """One epoch of ``case`` in this new process: windows/s and windows a CPU second (this process
    and its workers) after the first batch, as ``benchmarks/loader.py`` times its cases."""
    from _loader_baselines import ideal_gather
    from torch.utils.data import DataLoader

    def children_cpu() -> float:
        used = resource.getrusage(resource.RUSAGE_CHILDREN)
        return used.ru_utime + used.ru_stime

    ds = birdzarr.WindowDataset(store, batch_size=batch_size, resident="cpu", resident_codes=case == "codes",
                                with_ldt=True, allow_device_order=True, progress=False)
    held = ds.resident
    assert held is not None and (held.coded is not None) == (case == "codes")
    if case == "ideal":  # (e) of benchmarks/loader.py, on the same windows held as float32
        batches = ideal_gather(held.x.numpy(), batch_size, seed=0)
    else:
        batches = iter(DataLoader(ds, batch_size=None, num_workers=workers,
                                  multiprocessing_context="fork" if workers else None))
    next(batches)
    started, cpu_started, workers_cpu = time.perf_counter(), time.process_time(), children_cpu()
    count = sum(len(x) for x, _ in batches)  # the workers exit (and are waited for) at the end
    rate = count / (time.perf_counter() - started)
    cpu = time.process_time() - cpu_started + children_cpu() - workers_cpu
    print(json.dumps({"rate": rate, "cpu_rate": count / cpu}))


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
