"""What reading one chunk of a store costs, step by step, and what blosc's block size changes.

    python benchmarks/chunk_decode.py [STORE] [--chunks 12] [--repeat 7]

STORE defaults to the ``--shuffle`` store that ``python benchmarks/loader.py --keep`` leaves in
/tmp/birdzarr-loader-bench. For a sample of chunks (spread over the store) it prints, per chunk,
the best of ``--repeat`` interleaved passes (this machine's speed varies from minute to minute;
the best pass is the least disturbed):

- fetch + CRC-32C: the chunk's bytes from the store, checksum verified;
- blosc: decompressing them;
- dictionary decode: the window codec (dict16 / gdict16) into a reused float32 buffer;
- ``ChunkReader.read``: all of it, as the training loader calls it.

A version-2 store prints the same steps for its arrays (codes, rows, gps_speed fetched and
decompressed; the dictionary lookup; all of it) and no block-size table.

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


def best_ms(steps: dict[str, Callable[[Any], Any]], items: list[Any], repeat: int) -> dict[str, float]:
    """Best-of-``repeat`` milliseconds per item of each step, the steps interleaved each pass."""
    best = dict.fromkeys(steps, float("inf"))
    for _ in range(repeat):
        for name, step in steps.items():
            started = time.perf_counter()
            for item in items:
                step(item)
            best[name] = min(best[name], (time.perf_counter() - started) / len(items) * 1e3)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("store", nargs="?", default="/tmp/birdzarr-loader-bench/shuffled.zarr")
    parser.add_argument("--chunks", type=int, default=12)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()

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
          f"{np.mean([len(r) for r in stored]) / 1e3:,.0f} KB stored a chunk, best of {args.repeat}")
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
    """A version-2 store: its three per-window chunks fetched, checked and decompressed
    (``read_coded``), the lookup of the codes in the dictionaries (``_v2.decode``), and all of it
    (``ChunkReader.read``); the dictionaries are read once before timing, as a reader keeps them."""
    from birdzarr.format import _v2

    chunks = np.unique(np.linspace(0, reader.n_chunks - 2, args.chunks).astype(int)).tolist()
    out = np.empty((reader.chunk_windows, WINDOW_LENGTH, N_CHANNELS), np.float32)
    dictionaries = reader.dictionaries()
    parts = [reader.read_coded(c) for c in chunks]
    print(f"{args.store}: format 2, {len(chunks)} chunks of {reader.chunk_windows:,} windows, "
          f"{dictionaries.n_rows:,} dictionary rows, best of {args.repeat}")
    steps = best_ms({
        "fetch + CRC-32C + blosc (read_coded)": lambda c: reader.read_coded(c),
        "ChunkReader.read (all)": lambda c: reader.read(GIMU, c, out=out),
    }, chunks, args.repeat)
    def lookup(p: Any) -> Any:
        return _v2.decode(p[0], p[1], p[2], dictionaries.values, dictionaries.start, out=out[: len(p[1])])

    steps["dictionary lookup (_v2.decode)"] = best_ms({"d": lookup}, parts, args.repeat)["d"]
    print("| step | ms a chunk | ns a window |\n|---|---|---|")
    for name in ("fetch + CRC-32C + blosc (read_coded)", "dictionary lookup (_v2.decode)",
                 "ChunkReader.read (all)"):
        print(f"| {name} | {steps[name]:.2f} | {steps[name] * 1e6 / reader.chunk_windows:.0f} |")


if __name__ == "__main__":
    main()
