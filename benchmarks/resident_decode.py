"""What one batch costs in resident mode on the host: float32 rows against dict16 codes.

    python benchmarks/resident_decode.py [STORE] [--batches 40] [--repeat 4] [--batch-size 8192]

STORE defaults to the device-ordered dict16 store that ``python benchmarks/loader.py --keep``
leaves in /tmp/birdzarr-loader-bench. The script holds the store's windows twice in this process,
as float32 and as 16-bit codes (the two forms of ``resident="cpu"``), draws ``--batches`` uniform
batches and times, per batch and interleaved (``--repeat`` passes; medians, since this machine's
speed varies from minute to minute), on one core:

- float32 gather: ``np.take`` of the batch's rows, the in-RAM gather limit;
- dict16 decode: what the loader does for a batch of a dict16 selection, and its steps:
  the rows sorted, the index (each chunk's dictionary offsets, the codes added), the table
  lookup, the batch order restored;
- the same lookup in a 16 KB table (the same indices, folded into it): what the lookup costs
  when no index misses the CPU caches;
- ways the decode does not take, each beside what it would replace: the codes gathered by
  fancy indexing of the ``(n, 20, 4)`` array, each batch's offsets tiled from the chunks' four
  per window, the index built in two passes, the lookup in the batch's order (no sort);
- the ``with_ldt`` part of a batch: one packed int32 row a window, against three arrays.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _util import machine, table  # noqa: E402

import birdzarr  # noqa: E402
from birdzarr.format._spec import WINDOW_LENGTH  # noqa: E402

Step = Callable[[np.ndarray], object]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("store", nargs="?", default="/tmp/birdzarr-loader-bench/device.zarr")
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--repeat", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8192)
    args = parser.parse_args()
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
    for rows in batches[:3]:  # the decode is exact
        assert np.array_equal(coded._decode_on_host(rows), np.take(floats.x.numpy(), rows, axis=0))

    x32 = floats.x.numpy()
    codes = coded._codes_by_window
    bounds = coded.chunk_bounds.numpy() if coded.chunk_bounds is not None else np.empty(0, np.int64)
    window_offsets = coded._window_offsets
    small = coded.table[:4096].clone()
    state: dict[str, np.ndarray] = {}

    def sort_step(rows: np.ndarray) -> None:
        state["order"] = np.argsort(rows)
        state["ascending"] = rows[state["order"]]

    def index_step(rows: np.ndarray) -> None:
        chunk = np.searchsorted(bounds, state["ascending"], side="right") - 1
        state["index"] = np.take(window_offsets, chunk, axis=0)
        np.add(state["index"], np.take(codes, state["ascending"], axis=0), out=state["index"])

    def lookup_step(rows: np.ndarray) -> None:
        state["looked_up"] = coded.table.index_select(0, torch.from_numpy(state["index"].reshape(-1))).numpy()

    def small_lookup_step(rows: np.ndarray) -> None:
        small.index_select(0, torch.from_numpy(state["index"].reshape(-1) & 4095))

    def order_step(rows: np.ndarray) -> None:
        back = np.empty_like(state["order"])
        back[state["order"]] = np.arange(len(rows))
        np.take(state["looked_up"].reshape(len(rows), -1), back, axis=0)

    table_offsets = coded.table_offsets.numpy() if coded.table_offsets is not None else np.empty(0)
    codes_3d = coded.x.numpy().view(np.uint16)  # (n, 20, 4)

    def codes_rows_step(rows: np.ndarray) -> None:
        np.take(codes, state["ascending"], axis=0)

    def fancy_codes_step(rows: np.ndarray) -> None:
        codes_3d[state["ascending"]]

    def offsets_rows_step(rows: np.ndarray) -> None:
        np.take(window_offsets, np.searchsorted(bounds, state["ascending"], side="right") - 1, axis=0)

    def tiled_offsets_step(rows: np.ndarray) -> None:
        chunk = np.searchsorted(bounds, state["ascending"], side="right") - 1
        np.tile(table_offsets[chunk].astype(np.int32), (1, WINDOW_LENGTH))

    def two_pass_index_step(rows: np.ndarray) -> None:
        chunk = np.searchsorted(bounds, state["ascending"], side="right") - 1
        index = np.take(codes, state["ascending"], axis=0).astype(np.int32)
        index += np.take(window_offsets, chunk, axis=0)

    def unsorted_decode(rows: np.ndarray) -> None:
        index = np.take(window_offsets, np.searchsorted(bounds, rows, side="right") - 1, axis=0)
        np.add(index, np.take(codes, rows, axis=0), out=index)
        coded.table.index_select(0, torch.from_numpy(index.reshape(-1)))

    packed = coded.ldt.numpy()
    label, device = packed[:, 0].copy(), packed[:, 1].copy()
    timestamp = packed[:, 2:].copy().view(np.int64)[:, 0]
    ldt_out = np.empty((args.batch_size, 3), np.int64)

    def packed_ldt(rows: np.ndarray) -> None:
        held = np.take(packed, rows, axis=0)
        ldt_out[: len(rows), :2] = held[:, :2]
        ldt_out[: len(rows), 2] = held[:, 2:].copy().view(np.int64)[:, 0]

    def three_array_ldt(rows: np.ndarray) -> None:
        ldt_out[: len(rows), 0] = label[rows]
        ldt_out[: len(rows), 1] = device[rows]
        ldt_out[: len(rows), 2] = timestamp[rows]

    steps: dict[str, Step] = {
        "float32 gather (np.take)": lambda rows: np.take(x32, rows, axis=0),
        "dict16 decode, all of it": coded._decode_on_host,
        "  rows sorted (argsort)": sort_step,
        "  index: offsets' rows, codes' rows added (one pass)": index_step,
        "  table lookup": lookup_step,
        "  batch order restored": order_step,
        "  (the lookup in a 16 KB table)": small_lookup_step,
        "  (the codes' rows alone: np.take of (n, 80))": codes_rows_step,
        "  (instead: the codes by fancy indexing of (n, 20, 4))": fancy_codes_step,
        "  (the offsets' rows alone: np.take of a row per chunk)": offsets_rows_step,
        "  (instead: the offsets tiled per batch)": tiled_offsets_step,
        "  (instead: the index in two passes, codes to int32 first)": two_pass_index_step,
        "instead: dict16 decode in the batch's order (no sort)": unsorted_decode,
        "ldt: one packed int32 row a window": packed_ldt,
        "  (instead: ldt from three arrays)": three_array_ldt,
    }
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.repeat):
        for rows in batches:
            for name, step in steps.items():
                started = time.perf_counter()
                step(rows)
                times[name].append(time.perf_counter() - started)
    ideal = float(np.median(times["float32 gather (np.take)"]))
    rows_out = []
    for name, spent in times.items():
        ms = float(np.median(spent))
        whole = not name.startswith(("  ", "ldt"))  # a step's own rate says nothing
        rows_out.append({"step": name, "ms a batch": round(ms * 1e3, 2),
                         "M windows/s": round(args.batch_size / ms / 1e6, 2) if whole else "",
                         "% of float32 gather": round(100 * ideal / ms, 1) if whole else ""})
    print(f"{args.store}: {n:,} windows, {coded.table.numel() * 4 / 2**20:.1f} MiB of dictionaries; "
          f"batches of {args.batch_size}, medians of {args.repeat} x {args.batches}; {machine()}")
    print(table(rows_out))


if __name__ == "__main__":
    main()
