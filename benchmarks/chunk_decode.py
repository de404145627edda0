"""What reading one chunk of a store costs, step by step, and what blosc's block size changes.

    python benchmarks/chunk_decode.py [STORE] [--chunks 12] [--repeat 7] [--cpu]
    python benchmarks/chunk_decode.py V2STORE --against V1STORE --variants --cpu

STORE defaults to the ``--shuffle`` store that ``python benchmarks/loader.py --keep`` leaves in
/tmp/birdzarr-loader-bench. For a sample of chunks (spread over the store) it prints, per chunk,
the best of ``--repeat`` interleaved passes, averaged over the chunks (this machine's speed
varies from minute to minute; the best pass is the least disturbed):

- fetch + CRC-32C: the chunk's bytes from the store, checksum verified;
- blosc: decompressing them;
- dictionary decode: the window codec (dict16 / gdict16) into a reused float32 buffer;
- ``ChunkReader.read``: all of it, as the training loader calls it.

A version-2 store prints the same steps for its arrays (codes, rows, gps_speed fetched and
decompressed; the dictionary lookup; all of it), then ``ChunkReader.read_windows`` with
``--fractions`` of each chunk selected (what the streaming loader reads for a selection), and no
block-size table. ``--against STORE`` times another store's ``ChunkReader.read`` in the same
passes (its version-1 twin: the CPU per window of one against the other); ``--variants`` times
ways to do the lookup against each other (each checked bit for bit); ``--cpu`` times the
thread's CPU time instead of wall time (on a loaded machine).

Then it re-encodes the same decompressed chunks with the store's blosc compressor at blosc's
automatic block size and at 256 KiB (what birdzarr writes for zstd), and prints size, encode
and decode time for both, from one interleaved run.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import numcodecs
import numpy as np
from numcodecs import Blosc

import birdzarr
from birdzarr.format import _codec
from birdzarr.format._spec import GIMU, N_CHANNELS, WINDOW_LENGTH

CLOCK = time.perf_counter  # --cpu: time.thread_time, this thread's CPU time (every step runs on it)


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
    parser.add_argument("store", nargs="?", default="/tmp/birdzarr-loader-bench/shuffled.zarr")
    parser.add_argument("--chunks", type=int, default=12)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--fractions", type=float, nargs="*", default=[0.5, 0.1, 0.01],
                        help="format 2: read_windows with these parts of each chunk selected")
    parser.add_argument("--against", default=None,
                        help="format 2: another store (say, its version-1 twin) whose ChunkReader.read "
                             "is timed in the same run")
    parser.add_argument("--variants", action="store_true",
                        help="format 2: time ways to do the dictionary lookup against each other")
    parser.add_argument("--cpu", action="store_true",
                        help="time this thread's CPU time instead of wall time (a loaded machine)")
    args = parser.parse_args()
    global CLOCK
    if args.cpu:
        CLOCK = time.thread_time

    numcodecs.blosc.set_nthreads(1)  # one core a chunk, as in a DataLoader worker's thread
    store = birdzarr.open_store(args.store)
    reader = store.reader
    if reader.format_version >= 2:
        format2(reader, args)
        return
    layout = reader.layouts[GIMU]
    chunks = np.unique(np.linspace(0, reader.n_chunks - 2, args.chunks).astype(int)).tolist()
    shape = (reader.chunk_windows, WINDOW_LENGTH, N_CHANNELS)
    out = np.empty(shape, np.float32)
    stored = [bytes(_codec.strip_crc32c(reader._fetch(layout, c))) for c in chunks]
    decompressed = [np.frombuffer(Blosc().decode(raw), np.uint8) for raw in stored]
    decode = _codec.decode_gdict16 if layout.chain == "gdict16" else _codec.decode_dict16

    print(f"{args.store}: codec {layout.chain}, {len(chunks)} chunks of {reader.chunk_windows:,} windows, "
          f"{np.mean([len(r) for r in stored]) / 1e3:,.0f} KB stored a chunk, best of {args.repeat}, "
          f"{'thread CPU' if CLOCK is time.thread_time else 'wall'} time")
    steps = best_ms({
        "fetch + CRC-32C": lambda c: _codec.strip_crc32c(reader._fetch(layout, c)),
        "blosc": lambda c: _codec.blosc_decode_scratch(_codec.strip_crc32c(reader._fetch(layout, c))),
        "ChunkReader.read (all)": lambda c: reader.read(GIMU, c, out=out),
    }, chunks, args.repeat)
    in_memory = best_ms({"d": lambda d: decode(d, shape, out=out)}, decompressed, args.repeat)
    steps["dictionary decode"] = in_memory["d"]
    print("| step | ms a chunk |\n|---|---|")
    for name in ("fetch + CRC-32C", "blosc", "dictionary decode", "ChunkReader.read (all)"):
        value = steps[name] - (steps["fetch + CRC-32C"] if name == "blosc" else 0.0)
        print(f"| {name}{' (without the fetch)' if name == 'blosc' else ''} | {value:.2f} |")

    config = next(c for c in store.gimu.metadata.to_dict()["codecs"] if c["name"] == "blosc")["configuration"]
    shuffle = _codec._SHUFFLES[config["shuffle"]]
    variants = {
        f"{config['cname']} {config['clevel']}, automatic block": 0,
        f"{config['cname']} {config['clevel']}, 256 KiB blocks": 2**18,
    }
    codecs = {name: Blosc(config["cname"], int(config["clevel"]), shuffle, size)
              for name, size in variants.items()}
    typed = [d.view(np.uint16) if int(config["typesize"]) == 2 else d for d in decompressed]
    encoded = {name: [codec.encode(d) for d in typed] for name, codec in codecs.items()}
    encode = best_ms({name: codec.encode for name, codec in codecs.items()}, typed, args.repeat)
    decode_ms = best_ms({name: lambda i, name=name: codecs[name].decode(encoded[name][i]) for name in codecs},
                        list(range(len(typed))), args.repeat)
    print("\n| blosc | KB a chunk | encode ms | decode ms |\n|---|---|---|---|")
    for name in codecs:
        size = np.mean([len(e) for e in encoded[name]]) / 1e3
        print(f"| {name} | {size:,.0f} | {encode[name]:.2f} | {decode_ms[name]:.2f} |")


def format2(reader: Any, args: argparse.Namespace) -> None:
    """A version-2 store: its three per-window chunks fetched, CRC-checked and decompressed, the
    lookup of the codes in the dictionaries (``_v2.decode`` in the reader's blocks, on the chunks
    as the reader holds them: codes channel-major), all of it (``ChunkReader.read``), and
    ``ChunkReader.read_windows`` for selections keeping a part of each chunk (what the streaming
    loader reads); with ``--against`` also another store's ``ChunkReader.read``, all interleaved in
    one run. The dictionaries are read once before timing, as a reader keeps them."""
    from birdzarr.format import _v2
    from birdzarr.store._chunks import _DECODE_BLOCK

    chunks = np.unique(np.linspace(0, reader.n_chunks - 2, args.chunks).astype(int)).tolist()
    width = reader.chunk_windows
    out = np.empty((width, WINDOW_LENGTH, N_CHANNELS), np.float32)
    dictionaries = reader.dictionaries()
    values, start = dictionaries.values, dictionaries.start
    parts = {}
    for c in chunks:
        codes, row, gps = reader.read_coded(c)
        parts[c] = (np.ascontiguousarray(codes.transpose(2, 0, 1)).transpose(1, 2, 0), row, gps)

    def blocks(decode: Callable[..., Any], block: int = _DECODE_BLOCK) -> Callable[[int], None]:
        def run(c: int) -> None:
            codes, row, gps = parts[c]
            for a in range(0, len(row), block):
                decode(codes[a : a + block], row[a : a + block], gps[a : a + block], values, start,
                       out=out[a : a + block])
        return run

    rng = np.random.default_rng(0)
    selected = {f: np.flatnonzero(rng.random(width) < f) for f in args.fractions}
    print(f"{args.store}: format 2, {len(chunks)} chunks of {width:,} windows, "
          f"{dictionaries.n_rows:,} dictionary rows, best of {args.repeat}, "
          f"{'thread CPU' if CLOCK is time.thread_time else 'wall'} time")
    fetch = "fetch + CRC-32C + blosc (codes, rows, gps_speed)"
    steps: dict[str, Callable[[Any], Any]] = {
        fetch: lambda c: [reader._v2_part(name, c, owned=False) for name in (_v2.ROW, _v2.GPS, _v2.CODES)],
        "dictionary lookup (_v2.decode)": blocks(_v2.decode),
        "ChunkReader.read (all)": lambda c: reader.read(GIMU, c, out=out),
    }
    for f, chosen in selected.items():
        steps[f"read_windows, {f:.0%} of each chunk selected"] = (
            lambda c, chosen=chosen: reader.read_windows(c, chosen, out))
    if args.against:
        other = birdzarr.open_store(args.against).reader
        other_chunks = dict(zip(chunks, np.unique(np.linspace(0, other.n_chunks - 2, len(chunks)).astype(int))
                                .tolist(), strict=False))
        other_out = np.empty((other.chunk_windows, WINDOW_LENGTH, N_CHANNELS), np.float32)
        against = f"ChunkReader.read of {args.against}"
        steps[against] = lambda c: other.read(GIMU, other_chunks.get(c, 0), out=other_out)
    best = best_ms(steps, chunks, args.repeat)
    print("| step | ms a chunk | ns a window | ns a selected window |\n|---|---|---|---|")
    for name, ms in best.items():
        windows = width
        if name.startswith("read_windows"):
            windows = len(selected[float(name.split(", ")[1].split("%")[0]) / 100])
        elif args.against and name == against:
            width_here = other.chunk_windows
            print(f"| {name} | {ms:.2f} | {ms * 1e6 / width_here:.0f} | |")
            continue
        kept = f"{ms * 1e6 / max(windows, 1):.0f}" if windows != width else ""
        print(f"| {name} | {ms:.2f} | {ms * 1e6 / width:.0f} | {kept} |")
    if args.against:
        ratio = (best["ChunkReader.read (all)"] / width) / (best[against] / other.chunk_windows)
        print(f"\nChunkReader.read, CPU per window: {ratio:.2f}x {args.against}'s (same run)")
    if args.variants:
        variants(blocks, parts, chunks, out, values, start, args.repeat)


def _previous_decode(codes: np.ndarray, row: np.ndarray, gps: np.ndarray, values: np.ndarray,
                     start: np.ndarray, out: np.ndarray) -> None:
    """``_v2.decode`` before the measured changes: fancy indexing, mixed-dtype add, mode clip."""
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


def variants(blocks: Callable[..., Callable[[int], None]], parts: dict[int, Any], chunks: list[int],
             out: np.ndarray, values: np.ndarray, start: np.ndarray, repeat: int) -> None:
    """Ways to do the lookup, each checked bit for bit against ``_v2.decode``, timed in one run."""
    from birdzarr.format import _v2

    def sorted_by_row(c: int) -> None:  # each row's windows together: lookups within one dictionary
        codes, row, gps = parts[c]
        order = np.argsort(row, kind="stable")
        cm = np.take(codes.transpose(2, 0, 1), order, axis=1)
        for a in range(0, len(row), 4096):
            part = order[a : a + 4096]
            _v2.decode(cm[:, a : a + 4096].transpose(1, 2, 0), row[part], gps[part], values, start,
                       out=out[a : a + 4096])

    ways: dict[str, Callable[[int], None]] = {
        "before: start[row], uint16 + int64 add, take clip": blocks(_previous_decode),
        "np.take of start's rows": blocks(_variant(True, False, "clip")),
        "codes cast to int64, base added in place": blocks(_variant(False, True, "clip")),
        "take mode wrap": blocks(_variant(False, False, "wrap")),
        "take mode raise": blocks(_variant(False, False, "raise")),
        "int32 index, values[index]": blocks(_variant(True, True, "wrap", fancy32=True)),
        "_v2.decode now (the first three)": blocks(_v2.decode),
        "_v2.decode now, blocks of 1024": blocks(_v2.decode, 1024),
        "_v2.decode now, blocks of 16384": blocks(_v2.decode, 16384),
        "_v2.decode now, whole chunk in one call": blocks(_v2.decode, 1 << 30),
        "_v2.decode now, windows sorted by row first (order not restored)": sorted_by_row,
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
    before = best[next(iter(ways))]
    print("\n| lookup (blocks of 4096 unless said) | ms a chunk | x before |\n|---|---|---|")
    for name, ms in best.items():
        print(f"| {name} | {ms:.2f} | {ms / before:.2f} |")


if __name__ == "__main__":
    main()
