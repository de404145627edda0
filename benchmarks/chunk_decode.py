"""What reading one chunk of a store costs, step by step.

    python benchmarks/chunk_decode.py [STORE ...] [--chunks 12] [--repeat 7] [--cpu] [--variants]

STORE defaults to the three stores ``python benchmarks/loader.py --keep`` leaves in
/tmp/birdzarr-loader-bench: the default ``--shuffle`` store (32,768-window chunks), the
``--shuffle`` store in 8192-window chunks and the device-ordered store. For a sample of each
store's chunks (spread over the store) it prints, per chunk, the best of ``--repeat`` passes
averaged over the chunks, every step of every store interleaved in each pass (this machine's
speed varies from minute to minute; the best pass is the least disturbed):

- fetch + CRC-32C + blosc: the chunk's three per-window arrays (codes, rows, gps_speed) from the
  store, checksums verified, decompressed;
- dictionary lookup: ``_v2.decode`` in the reader's blocks, on the chunk as the reader holds it
  (codes channel-major; the dictionaries read once before timing, as a reader keeps them);
- ``ChunkReader.read``: all of it (with the check of every code), as the training loader calls it;
- ``ChunkReader.read_windows`` with ``--fractions`` of each chunk selected (what the streaming
  loader reads for a selection).

The last column compares each store's ``ChunkReader.read`` per window with the first store's.
``--variants`` times ways to do the lookup on the first store against ``_v2.decode`` (each
checked bit for bit); ``--cpu`` times the thread's CPU time instead of wall time (on a loaded
machine).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import numcodecs
import numpy as np

import birdzarr
from birdzarr.format._spec import GIMU, N_CHANNELS, WINDOW_LENGTH

CLOCK = time.perf_counter  # --cpu: time.thread_time, this thread's CPU time (every step runs on it)
LOADER_STORES = [f"/tmp/birdzarr-loader-bench/{name}.zarr" for name in ("shuffled", "shuffled8k", "device")]


def best_ms(steps: dict[str, Callable[[Any], Any]], items: list[Any], repeat: int) -> dict[str, float]:
    """Milliseconds per item of each step: each item's best of ``repeat`` passes, averaged over
    the items; the steps interleaved each pass."""
    best = {name: [float("inf")] * len(items) for name in steps}
    for _ in range(repeat):
        for name, step in steps.items():
            for i, item in enumerate(items):
                started = CLOCK()
                step(item)
                best[name][i] = min(best[name][i], CLOCK() - started)
    return {name: sum(times) / len(times) * 1e3 for name, times in best.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("stores", nargs="*", default=LOADER_STORES)
    parser.add_argument("--chunks", type=int, default=12)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--fractions", type=float, nargs="*", default=[0.5, 0.1, 0.01],
                        help="read_windows with these parts of each chunk selected")
    parser.add_argument("--variants", action="store_true",
                        help="time ways to do the dictionary lookup on the first store")
    parser.add_argument("--cpu", action="store_true",
                        help="time this thread's CPU time instead of wall time (a loaded machine)")
    args = parser.parse_args()
    global CLOCK
    if args.cpu:
        CLOCK = time.thread_time

    numcodecs.blosc.set_nthreads(1)  # one core a chunk, as in a DataLoader worker's thread

    rng = np.random.default_rng(0)
    steps: dict[str, Callable[[int], Any]] = {}
    described: list[tuple[str, str, str, int, int]] = []  # store, step, key, chunk windows, windows
    held = [store_steps(url, args, rng, steps, described) for url in args.stores]
    print(f"best of {args.repeat}, {'thread CPU' if CLOCK is time.thread_time else 'wall'} time")
    best = best_ms(steps, list(range(args.chunks)), args.repeat)
    reference = None
    print("| store | step | ms a chunk | ns a window | ns a selected window "
          "| read a window, x the first store |")
    print("|---|---|---|---|---|---|")
    for name, step, key, width, windows in described:
        ms = best[key]
        versus = ""
        if step.startswith("ChunkReader.read,"):
            per_window = ms / width
            reference = per_window if reference is None else reference
            versus = f"{per_window / reference:.2f}"
        kept = f"{ms * 1e6 / max(windows, 1):.0f}" if windows != width else ""
        print(f"| {name} | {step} | {ms:.2f} | {ms * 1e6 / width:.0f} | {kept} | {versus} |")
    if args.variants:
        variants(held[0], args.repeat)


def store_steps(url: str, args: argparse.Namespace, rng: np.random.Generator,
                steps: dict[str, Callable[[int], Any]], described: list[tuple[str, str, str, int, int]]
                ) -> Held:
    """Add one store's timed steps to ``steps`` (item i of a pass: the store's i-th sampled chunk)."""
    from birdzarr.format import _v2

    reader = birdzarr.open_store(url).reader
    if reader.format_version != 2:
        raise SystemExit(f"{url} is a format-{reader.format_version} store; this script times format 2")
    chunks = np.linspace(0, reader.n_chunks - 2, args.chunks).astype(int).tolist()  # -2: full chunks
    width = reader.chunk_windows
    held = Held(reader, chunks)
    print(f"{url}: {reader.n_chunks} chunks of {width:,} windows, {held.dictionaries.n_rows:,} dictionary "
          f"rows; {len(set(chunks))} chunks timed")

    def fetch(i: int) -> None:
        for array in (_v2.ROW, _v2.GPS, _v2.CODES):
            reader._v2_part(array, chunks[i], owned=False)

    lookup = held.blocks(_v2.decode)
    mine: dict[str, tuple[Callable[[int], Any], int]] = {
        "fetch + CRC-32C + blosc (codes, rows, gps_speed)": (fetch, width),
        "dictionary lookup (_v2.decode)": (lambda i: lookup(chunks[i]), width),
        "ChunkReader.read, all of it": (lambda i: reader.read(GIMU, chunks[i], out=held.out), width),
    }
    for f in args.fractions:
        chosen = np.flatnonzero(rng.random(width) < f)
        mine[f"ChunkReader.read_windows, {f:.0%} selected"] = (
            lambda i, s=chosen: reader.read_windows(chunks[i], s, held.out), len(chosen))
    name = url.rstrip("/").split("/")[-1]
    for step, (run, windows) in mine.items():
        key = f"{name}: {step}"
        steps[key] = run
        described.append((name, step, key, width, windows))
    return held


class Held:
    """A store's sampled chunks as its reader holds them before the lookup (codes channel-major),
    its dictionaries (read once, as a reader keeps them) and a decode buffer."""

    def __init__(self, reader: Any, chunks: list[int]) -> None:
        self.chunks = sorted(set(chunks))
        self.out = np.empty((reader.chunk_windows, WINDOW_LENGTH, N_CHANNELS), np.float32)
        self.dictionaries = reader.dictionaries()
        self.values, self.start = self.dictionaries.values, self.dictionaries.start
        self.parts = {}
        for c in self.chunks:
            codes, row, gps = reader.read_coded(c)
            self.parts[c] = (np.ascontiguousarray(codes.transpose(2, 0, 1)).transpose(1, 2, 0), row, gps)

    def blocks(self, decode: Callable[..., Any], block: int | None = None) -> Callable[[int], None]:
        """``decode`` over a chunk in blocks of ``block`` windows (the reader's block by default)."""
        from birdzarr.store._chunks import _DECODE_BLOCK

        size = block or _DECODE_BLOCK

        def run(c: int) -> None:
            codes, row, gps = self.parts[c]
            for a in range(0, len(row), size):
                decode(codes[a : a + size], row[a : a + size], gps[a : a + size], self.values, self.start,
                       out=self.out[a : a + size])
        return run


def _fancy_decode(codes: np.ndarray, row: np.ndarray, gps: np.ndarray, values: np.ndarray,
                     start: np.ndarray, out: np.ndarray) -> None:
    """The lookup by fancy indexing of ``start``'s rows, a mixed-dtype add and ``np.take`` mode clip."""
    n = len(row)
    base = start[row]
    index = np.empty((n, WINDOW_LENGTH), np.int64)
    looked_up = np.empty((n, WINDOW_LENGTH), np.float32)
    for c in range(3):
        np.add(codes[:, :, c], base[:, c : c + 1], out=index)
        np.take(values, index, out=looked_up, mode="clip")
        out[:, :, c] = looked_up
    out[:, :, 3] = gps


def _variant(take_rows: bool, cast_first: bool, mode: str, fancy32: bool = False) -> Callable[..., None]:
    def decode(codes: np.ndarray, row: np.ndarray, gps: np.ndarray, values: np.ndarray,
               start: np.ndarray, out: np.ndarray) -> None:
        n = len(row)
        base = np.take(start, row, axis=0) if take_rows else start[row]
        index = np.empty((n, WINDOW_LENGTH), np.int64)
        looked_up = np.empty((n, WINDOW_LENGTH), np.float32)
        for c in range(3):
            if fancy32:
                out[:, :, c] = values[codes[:, :, c] + base[:, c : c + 1].astype(np.int32)]
                continue
            if cast_first:
                np.copyto(index, codes[:, :, c])
                index += base[:, c : c + 1]
            else:
                np.add(codes[:, :, c], base[:, c : c + 1], out=index)
            np.take(values, index, out=looked_up, mode=mode)
            out[:, :, c] = looked_up
        out[:, :, 3] = gps
    return decode


def variants(held: Held, repeat: int) -> None:
    """Ways to do the lookup, each checked bit for bit against ``_v2.decode``, timed in one run."""
    from birdzarr.format import _v2

    blocks, parts, chunks, out = held.blocks, held.parts, held.chunks, held.out
    values, start = held.values, held.start

    def sorted_by_row(c: int) -> None:  # each row's windows together: lookups within one dictionary
        codes, row, gps = parts[c]
        order = np.argsort(row, kind="stable")
        cm = np.take(codes.transpose(2, 0, 1), order, axis=1)
        for a in range(0, len(row), 4096):
            part = order[a : a + 4096]
            _v2.decode(cm[:, a : a + 4096].transpose(1, 2, 0), row[part], gps[part], values, start,
                       out=out[a : a + 4096])

    ways: dict[str, Callable[[int], None]] = {
        "_v2.decode": blocks(_v2.decode),
        "start[row], uint16 + int64 add, take clip": blocks(_fancy_decode),
        "np.take of start's rows": blocks(_variant(True, False, "clip")),
        "codes cast to int64, base added in place": blocks(_variant(False, True, "clip")),
        "take mode wrap": blocks(_variant(False, False, "wrap")),
        "take mode raise": blocks(_variant(False, False, "raise")),
        "int32 index, values[index]": blocks(_variant(True, True, "wrap", fancy32=True)),
        "_v2.decode, blocks of 1024": blocks(_v2.decode, 1024),
        "_v2.decode, blocks of 16384": blocks(_v2.decode, 16384),
        "_v2.decode, whole chunk in one call": blocks(_v2.decode, 1 << 30),
        "_v2.decode, windows sorted by row first (order not restored)": sorted_by_row,
    }
    for c in chunks[:2]:
        blocks(_v2.decode)(c)
        expected = out.copy()
        for name, way in ways.items():
            if "sorted" in name:
                continue
            out[...] = 0
            way(c)
            assert np.array_equal(out.view(np.uint32), expected.view(np.uint32)), name
    best = best_ms(ways, chunks, repeat)
    reference = best["_v2.decode"]
    print("\n| lookup (blocks of 4096 unless said) | ms a chunk | x _v2.decode |\n|---|---|---|")
    for name, ms in best.items():
        print(f"| {name} | {ms:.2f} | {ms / reference:.2f} |")


if __name__ == "__main__":
    main()
