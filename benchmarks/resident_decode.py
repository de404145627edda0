"""What one batch costs in resident mode on the host: float32 rows against dict16 codes.

    python benchmarks/resident_decode.py [STORE] [--batches 40] [--repeat 5] [--batch-size 8192]
                                         [--loader V2STORE] [--loader-repeat 3]
    python benchmarks/resident_decode.py --load V2STORE [--load-repeat 3]

STORE must be a device-ordered dict16 store (format 1, which birdzarr reads and no longer writes:
one written by an earlier birdzarr); its default is /tmp/birdzarr-loader-bench/device.zarr, where
``python benchmarks/loader.py --keep`` now leaves a format-2 store, so name one. ``--load``
alone needs no format-1 store. The script holds the store's windows twice in this process,
as float32 and as 16-bit codes (the two forms of ``resident="cpu"``), draws ``--batches`` uniform
batches and times each way of making a batch on one core, ``--repeat`` passes (medians, since
this machine's speed varies from minute to minute). In a loader every batch is a fresh random
set of rows, so its codes and offsets are not in the CPU caches: every timed way starts after
the caches are flushed (a 64 MB write), and the ways run in a new random order for each batch,
so none is favoured by what ran before it.

- float32 gather: ``np.take`` of the batch's rows, the in-RAM gather limit;
- dict16 decode, as the loader does it (``ResidentSelection._decode_on_host``: 61 codes a
  window, gps_speed held once), then the same decode changed in one way each: gps_speed looked
  up in every sample (80 codes a window), the lookup in the batch's order (no sort), the index
  built in two passes, the codes taken by fancy indexing, each batch's offsets built from the
  chunks' four; all give the same values (checked);
- the decode's own steps, run in sequence after one flush, as in the decode: the rows sorted,
  the index (each chunk's dictionary offsets, the codes added), the table lookup, the batch's
  order restored and gps_speed copied to every sample; and the same lookup in a 16 KB table
  (every index in the caches);
- the ``with_ldt`` part of a batch: one packed int32 row a window, against three arrays;
- format 2 (``birdzarr.format._v2``): the same windows encoded as a version-2 store holds them
  (a dictionary row per device), held as ``resident="cpu"`` holds a version-2 store
  (``HeldCodes``: uint16 codes, the row and gps_speed once a window, in shared memory), and
  decoded as the loader does on the host (``HeldCodes.decode_host``, numpy, the windows grouped
  by dictionary row for the lookup), then the same decode with its lookups in the batch's order
  (no grouping), and by the torch ops a GPU runs (``HeldCodes.decode``, one torch thread).

Times are the CPU time of the timing thread (``time.thread_time``): on a machine shared with
other jobs, a wall clock also counts the time spent waiting for a core.

``--loader V2STORE`` (a version-2 store of the same windows, e.g. ``birdzarr convert`` of the
same source) then times whole epochs of
``WindowDataset(resident="cpu", with_ldt=True)`` through a DataLoader with 0 and 2 workers:
STORE held as float32 (``resident_codes=False``) and as dict16 codes, V2STORE as format-2
codes; windows/s after the first batch, medians of ``--loader-repeat`` interleaved rounds, and
each as a share of float32 with the same workers; and windows per CPU second after the first
batch (this process's CPU time and its workers' whole lives, which on a machine shared with
other jobs moves less than the wall clock), with its share of float32's.

``--load V2STORE`` only times resident loads (``with_ldt=True``) of every 2nd and every 10th
device of a version-2 store, each in a new process: CPU and wall seconds of building the
``WindowDataset``, and the process's peak RSS (interpreter and torch included).
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
from birdzarr.format import _v2  # noqa: E402
from birdzarr.format._spec import WINDOW_LENGTH  # noqa: E402
from birdzarr.loader._resident import CODE_BIAS, HeldCodes, held_dictionaries, timestamps_of  # noqa: E402

Step = Callable[[np.ndarray], object]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("store", nargs="?", default="/tmp/birdzarr-loader-bench/device.zarr")
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=8192)
    parser.add_argument("--loader", metavar="V2STORE", default=None,
                        help="also time resident epochs on STORE and this version-2 store")
    parser.add_argument("--loader-repeat", type=int, default=3)
    parser.add_argument("--load", metavar="V2STORE", default=None,
                        help="only time resident loads of device subsets of V2STORE, each in a new process")
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

    coded = resident(True).resident
    floats = resident(False).resident
    assert coded is not None and floats is not None and coded.table is not None and coded.ldt is not None
    if coded.x.dtype != torch.int16:
        raise SystemExit(f"{args.store} is not a dict16 store: its selection is held as float32")
    n = len(coded)
    rng = np.random.default_rng(0)
    batches = [rng.choice(n, args.batch_size, replace=False) for _ in range(args.batches)]

    x32 = floats.x.numpy()
    assert coded.row_offsets is not None and coded.layout is not None
    layout = coded.layout
    codes = coded._code_rows  # (n, layout.width) uint16: 61 with gps_speed once a window
    bounds = coded.chunk_bounds.numpy() if coded.chunk_bounds is not None else np.empty(0, np.int64)
    row_offsets = coded.row_offsets.numpy()
    # each chunk's four dictionary offsets (where each channel's first column takes them from)
    channel_offsets = row_offsets[:, [layout.columns(c).start for c in range(4)]]
    expand = layout.expand()
    # the same codes and offsets with gps_speed in every sample, as all 80 codes a window, in
    # shared memory like the loader's (its 4 KB pages cost ~3% against a private array's huge pages)
    codes80 = codes
    if expand is not None:
        codes80 = torch.empty((n, len(expand)), dtype=torch.int16).share_memory_().numpy().view(np.uint16)
        np.take(codes, expand, axis=1, out=codes80)
    offsets80 = np.ascontiguousarray(row_offsets[:, expand]) if expand is not None else row_offsets
    small = coded.table[:4096].clone()

    def decode(rows: np.ndarray, *, sort: bool = True, one_pass: bool = True, fancy: bool = False,
               tiled: bool = False, every_sample: bool = False) -> np.ndarray:
        """The decode with one of its choices changed (all at their defaults: the loader's)."""
        held, offsets_of = (codes80, offsets80) if every_sample else (codes, row_offsets)
        order = np.argsort(rows) if sort else None
        ascending = rows if order is None else rows[order]
        chunk = np.searchsorted(bounds, ascending, side="right") - 1
        picked = held[ascending] if fancy else np.take(held, ascending, axis=0)
        offsets = (layout.row_offsets(channel_offsets[chunk]) if tiled
                   else np.take(offsets_of, chunk, axis=0))
        if one_pass:
            index = offsets
            np.add(index, picked, out=index)
        else:
            index = picked.astype(np.int32)
            index += offsets
        looked_up = coded.table.index_select(0, torch.from_numpy(index.reshape(-1))).numpy()
        looked_up = looked_up.reshape(len(rows), -1)
        if order is not None:
            back = np.empty_like(order)
            back[order] = np.arange(len(order))
            looked_up = np.take(looked_up, back, axis=0)
        if not every_sample and expand is not None:
            looked_up = np.take(looked_up, expand, axis=1)
        return looked_up.reshape(len(rows), WINDOW_LENGTH, -1)

    ways: dict[str, Step] = {
        "float32 gather (np.take)": lambda rows: np.take(x32, rows, axis=0),
        "dict16 decode (the loader's)": coded._decode_on_host,
        "  instead: gps_speed looked up in every sample (80 codes a window)":
            lambda rows: decode(rows, every_sample=True),
        "  instead: in the batch's order (no sort)": lambda rows: decode(rows, sort=False),
        "  instead: the index in two passes (codes to int32 first)":
            lambda rows: decode(rows, one_pass=False),
        "  instead: the codes by fancy indexing": lambda rows: decode(rows, fancy=True),
        "  instead: the offsets built per batch from the chunks' four": lambda rows: decode(rows, tiled=True),
    }
    for rows in batches[:2]:  # every way decodes exactly
        for way in ways.values():
            assert np.array_equal(np.asarray(way(rows)), np.take(x32, rows, axis=0))

    state: dict[str, np.ndarray] = {}

    def sort_step(rows: np.ndarray) -> None:
        state["order"] = np.argsort(rows)
        state["ascending"] = rows[state["order"]]

    def index_step(rows: np.ndarray) -> None:
        chunk = np.searchsorted(bounds, state["ascending"], side="right") - 1
        state["index"] = np.take(row_offsets, chunk, axis=0)
        np.add(state["index"], np.take(codes, state["ascending"], axis=0), out=state["index"])

    def lookup_step(rows: np.ndarray) -> None:
        state["looked_up"] = coded.table.index_select(0, torch.from_numpy(state["index"].reshape(-1))).numpy()

    def order_step(rows: np.ndarray) -> None:
        back = np.empty_like(state["order"])
        back[state["order"]] = np.arange(len(rows))
        by_row = np.take(state["looked_up"].reshape(len(rows), -1), back, axis=0)
        if expand is not None:
            np.take(by_row, expand, axis=1)

    def small_lookup_step(rows: np.ndarray) -> None:
        small.index_select(0, torch.from_numpy(state["index"].reshape(-1) & 4095))

    steps: dict[str, Step] = {
        "    rows sorted (argsort)": sort_step,
        "    index: offsets' rows, codes' rows added": index_step,
        "    table lookup": lookup_step,
        "    batch order restored, gps_speed to every sample": order_step,
        "    (the same lookup in a 16 KB table)": small_lookup_step,
    }

    packed = coded.ldt.numpy()
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

    # format 2: the windows encoded with a dictionary row per device, held as the loader holds a
    # version-2 store (every window's gps_speed is one value here: held once)
    started = time.perf_counter()
    encoded = _v2.encode(x32, device)
    v2_row = encoded.row.astype(np.int32)
    v2_values, v2_offsets = held_dictionaries(encoded.new, v2_row)
    if not (encoded.gps == encoded.gps[:, :1]).all():
        raise SystemExit(f"{args.store}: some window's gps_speed varies; this benchmark holds it once")

    def shared(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).share_memory_()

    v2 = HeldCodes(shared((encoded.codes ^ np.uint16(CODE_BIAS)).view(np.int16)), shared(encoded.gps[:, 0]),
                   shared(v2_row), shared(v2_values), shared(v2_offsets))
    del encoded
    v2_decode = "format 2 codes: decode (the loader's HeldCodes.decode_host, numpy)"
    v2_out = np.empty((args.batch_size, WINDOW_LENGTH, 4), np.float32)
    v2_codes = v2.codes.numpy().reshape(n, -1)

    def v2_in_batch_order(rows: np.ndarray) -> np.ndarray:
        """decode_host without grouping the windows by dictionary row."""
        index = np.take(v2.offsets.numpy(), np.take(v2.row.numpy(), rows), axis=0)
        np.add(index, np.take(v2_codes, rows, axis=0), out=index)
        looked_up = np.empty(index.shape, np.float32)
        for first in range(0, index.size, 30720):  # below torch's parallel grain, as decode_host
            torch.index_select(v2.values, 0, torch.from_numpy(index.reshape(-1)[first : first + 30720]),
                               out=torch.from_numpy(looked_up.reshape(-1)[first : first + 30720]))
        out = v2_out[: len(rows)]
        out[:, :, :3] = looked_up.reshape(len(rows), WINDOW_LENGTH, 3)
        out[:, :, 3] = np.take(v2.gps.numpy(), rows)[:, None]
        return out

    ways[v2_decode] = lambda rows: v2.decode_host(rows, out=v2_out[: len(rows)])
    ways["  instead: format 2, the lookups in the batch's order (not grouped by row)"] = v2_in_batch_order
    ways["  instead: format 2, HeldCodes.decode (the torch ops a GPU runs)"] = (
        lambda rows: v2.decode(torch.from_numpy(rows)))
    for rows in batches[:2]:
        for way in (v2.decode_host, v2_in_batch_order, lambda r: v2.decode(torch.from_numpy(r)).numpy()):
            assert np.array_equal(np.asarray(way(rows)), np.take(x32, rows, axis=0))
    print(f"format 2: encoded and held in {time.perf_counter() - started:.0f} s; "
          f"{v2.nbytes / n:.1f} B a window ({v2.nbytes / x32.nbytes:.2f}x float32), of which "
          f"{(v2.values.numel() * 4 + v2.offsets.numel() * 4) / 2**20:.1f} MiB dictionaries "
          f"({v2.offsets.shape[0]} rows)", flush=True)

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
    decode_ms = float(np.median(times["dict16 decode (the loader's)"]))
    v2_ms = float(np.median(times[v2_decode]))
    rows_out = []
    for name, spent in times.items():
        ms = float(np.median(spent))
        whole = not name.startswith(("    ", "ldt", "  instead: ldt"))  # a step's own rate says nothing
        # each "instead" against its own format's loader decode
        versus = "" if not name.startswith("  instead: ") or "ldt" in name else round(
            ms / (v2_ms if "format 2" in name else decode_ms), 2)
        rows_out.append({f"way, batch of {args.batch_size} windows": name, "ms": round(ms * 1e3, 2),
                         "M windows/s": round(args.batch_size / ms / 1e6, 2) if whole else "",
                         "% of float32 gather": round(100 * ideal / ms, 1) if whole else "",
                         "x the loader's decode": versus})
    print(f"{args.store}: {n:,} windows, {coded.table.numel() * 4 / 2**20:.1f} MiB of dictionaries; "
          f"medians of {args.repeat} x {args.batches} batches, CPU time of one thread; {machine()}")
    print(table(rows_out), flush=True)
    if args.loader:
        torch.set_num_threads(default_threads)  # the training process's default again
        loader_epochs(args)


def loader_epochs(args: argparse.Namespace) -> None:
    """Whole resident epochs through a DataLoader: float32, dict16 codes, format-2 codes."""
    from torch.utils.data import DataLoader

    cases = [("float32 (resident_codes=False)", args.store, False), ("dict16 codes", args.store, True),
             ("format 2 codes", args.loader, True)]
    rates: dict[tuple[str, int], list[float]] = {}
    cpu_rates: dict[tuple[str, int], list[float]] = {}  # windows a CPU second: this process and its workers

    def children_cpu() -> float:
        used = resource.getrusage(resource.RUSAGE_CHILDREN)
        return used.ru_utime + used.ru_stime

    for _ in range(args.loader_repeat):
        for label, store, codes in cases:
            ds = birdzarr.WindowDataset(store, batch_size=args.batch_size, resident="cpu",
                                        resident_codes=codes, with_ldt=True, allow_device_order=True,
                                        progress=False)
            held = ds.resident
            assert held is not None
            if codes and (held.coded if store == args.loader else held.table) is None:
                raise SystemExit(f"{store} is not held as {label}")
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
    for label, _, _ in cases:
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
    print(f"resident epochs: {args.store} and {args.loader}; medians of {args.loader_repeat} rounds; "
          f"{machine()}")
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
    device of a version-2 store, each load in a new process: CPU and wall seconds of building
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
    print(f"resident loads of {args.load} (format 2), medians of {args.load_repeat}; {machine()}")
    print(table(rows))


if __name__ == "__main__":
    main()
