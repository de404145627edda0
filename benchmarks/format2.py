"""Format 2 candidates for the windows, core Zarr v3 codecs only: size, encode and decode cost.

    python benchmarks/format2.py                      # both corpora, both orders, 3 interleaved rounds
    python benchmarks/format2.py --windows 200000 --small-devices 5000 --repeat 1   # quick look

Corpora (generated here, calibrated as real trackers: IMU = (12-bit count - offset) / scale with a
per-device offset and non-power-of-two scale; gps_speed one continuous value per burst of 1-3
windows, 6-8 decimals, divided by gps_scale):

- ``186``: 186 devices, ``--windows`` in all, skewed sizes (birdzarr.demo._synthetic.device_sizes)
  plus one device of ``--big`` windows whose gps_speed has more than 65,535 distinct values (as
  the real 1.5 M-window device): the probe, which codes gps_speed, splits it into rows.
- ``small``: ``--small-devices`` devices of 10-50 windows (mean 30).

Each in device order and shuffled (one seeded permutation, as ``convert --shuffle`` draws it; the
format 2 encoders code in device order and permute the codes, as a converter would).

Candidates (blosc always with bit-shuffle unless named; every chunk gets a crc32c, 4 bytes):

- ``v1 default``: today's chain through birdzarr's own encoder (``ChunkCodec``): dict16 + lz4 5 in
  8192-window chunks (device order), gdict16 + lz4 5 in 32768-window chunks grouped by device
  (shuffled). The reference every ratio compares with.
- ``standard lz4`` / ``standard zstd1``: float32, transpose (2, 0, 1), blosc: v1's --codec standard.
- ``format 2``: birdzarr/format/_v2.py as chosen: imu_x/y/z as uint16 codes (transpose, blosc
  lz4 5 bit-shuffle, typesize 2), one dictionary row per device (entries sorted), gps_speed float32
  (n, 20) (blosc zstd 3, no shuffle), a uint32 row per window, dictionary arrays (blosc zstd 3).
- ``format 2, chunks grouped by device``: the same, each shuffled chunk's windows stored row after
  row (as v1's --shuffle stores hold them device after device; still the same uniform sample).
- ``codes FFF`` / ``codes SSS zstd1``: format 2 with entries in first-occurrence order, or the
  codes compressed with blosc zstd 1.
- ``probe``: the issue's probe: gps_speed coded like the IMU channels (4-channel codes, its
  entries in the dictionary, the overflow rule splitting the big device into rows).

Columns: ``MB`` stored (all arrays of the candidate, no device/timestamp/label arrays); ``x f32``
float32 bytes / stored; ``/parquet`` stored / the per-device Parquet files (pyarrow defaults);
``dict %`` the share of dictionary arrays; ``enc MB/cpu s`` float32 MB encoded (dictionaries,
codes, compression) per CPU second; ``dec ns/win`` CPU of one thread decoding every chunk (bytes in
memory, dictionaries already in memory, into a reused buffer) per window; ``dec vs v1`` that,
over v1 default's in the same corpus and order; ``B/win`` the stored bytes a window of format 2's
codes, gps_speed, row and dictionary arrays. Rounds are interleaved and the fastest counts; the
machine is shared, so compare ratios within one run. Every candidate's decode is checked bit for
bit against the input.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numcodecs
import numcodecs.blosc
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _util import machine, table  # noqa: E402

from birdzarr.demo._synthetic import device_sizes  # noqa: E402
from birdzarr.format import _v2  # noqa: E402
from birdzarr.format._codec import ChunkCodec, blosc_decode_scratch, gimu_codecs  # noqa: E402
from birdzarr.format._spec import Curation  # noqa: E402

CHUNK = 8192
VERIFY = {"on": True}  # every candidate's output is checked in the first round


# -- data ------------------------------------------------------------------------------------


def generate(sizes: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Calibrated windows (n, 20, 4) float32 of devices with the given window counts, device after
    device, and the device index of each window."""
    rng = np.random.default_rng(seed)
    n_devices, n = len(sizes), int(sizes.sum())
    device = np.repeat(np.arange(n_devices), sizes)
    offset = rng.normal(2048, 40, (n_devices, 1, 3))
    scale = rng.uniform(900.0, 1100.0, (n_devices, 1, 3))
    windows = np.empty((n, 20, 4), np.float32)
    for first in range(0, n, 200_000):  # in slices: bounded float64 temporaries
        d = device[first : first + 200_000]
        m = len(d)
        posture = rng.normal(0, 0.35, (m, 1, 3)) + np.array([0.0, 0.0, 1.0])
        motion = rng.normal(0, 0.2, (m, 20, 3)) * rng.uniform(0.05, 2.0, (m, 1, 1))
        counts = np.clip(np.round((posture + motion) * scale[d] + offset[d]), 0, 4095)
        windows[first : first + m, :, :3] = np.clip((counts - offset[d]) / scale[d], -2.0, 2.0)
    # gps_speed: one value a burst of 1-3 windows (20/40/60 rows), 6-8 decimals, never across devices
    burst_windows = rng.choice([1, 2, 3], size=n, p=[0.45, 0.35, 0.2])
    ends = np.minimum(np.cumsum(burst_windows), n)
    burst = np.searchsorted(ends, np.arange(n), side="right")
    burst = burst + np.concatenate(([0], np.cumsum(device[1:] != device[:-1])))  # new burst per device
    n_bursts = int(burst.max()) + 1
    decimals = rng.integers(6, 9, n_bursts)
    speed = np.minimum(rng.lognormal(0.0, 1.0, n_bursts), 29.0)
    speed = np.round(speed * 10.0**decimals) / 10.0**decimals / Curation().gps_scale
    windows[:, :, 3] = speed[burst][:, None].astype(np.float32)
    return windows, device


def corpus(kind: str, args: argparse.Namespace) -> tuple[np.ndarray, np.ndarray]:
    if kind == "186":
        sizes = np.append(device_sizes(185, args.windows - args.big, seed=0), args.big)
    else:
        sizes = np.random.default_rng(2).integers(10, 51, args.small_devices)
    return generate(sizes, seed=1 if kind == "186" else 3)


def parquet_bytes(windows: np.ndarray, device: np.ndarray) -> tuple[int, int]:
    """Bytes of the windows as per-device Parquet files (one list<float32> column, pyarrow
    defaults), and as one file of all devices with a device_id column."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def size(w: np.ndarray, ids: np.ndarray | None = None) -> int:
        flat = pa.array(w.reshape(-1), type=pa.float32())
        offsets = pa.array(np.arange(0, len(w) * 80 + 1, 80, dtype=np.int32))
        columns = {"gimu": pa.ListArray.from_arrays(offsets, flat)}
        if ids is not None:
            columns = {"device_id": pa.array(ids.astype(np.int32)), **columns}
        buffer = io.BytesIO()
        pq.write_table(pa.table(columns), buffer)
        return buffer.tell()

    bounds = np.flatnonzero(np.diff(device)) + 1
    per_device = sum(size(w) for w in np.split(windows, bounds))
    return per_device, size(windows, device)


# -- candidates ------------------------------------------------------------------------------


def blosc(cname: str, clevel: int, typesize: int, shuffle: int = numcodecs.Blosc.BITSHUFFLE
          ) -> numcodecs.Blosc:
    return numcodecs.Blosc(cname=cname, clevel=clevel, shuffle=shuffle, typesize=typesize)


DICT = blosc("zstd", 3, 4)  # dictionary entries and rows (as _v2.CODECS)
TABLE = blosc("zstd", 3, 8, numcodecs.Blosc.SHUFFLE)  # dict_start, dict_device


def chunked(array: np.ndarray, size: int, codec: numcodecs.Blosc) -> list[bytes]:
    """Compressed chunks of ``size`` along axis 0 (the last padded, as zarr stores it) + crc32c."""
    out = []
    for first in range(0, max(len(array), 1), size):
        piece = array[first : first + size]
        if len(piece) < size:
            piece = np.concatenate([piece, np.zeros((size - len(piece), *array.shape[1:]), array.dtype)])
        out.append(bytes(codec.encode(np.ascontiguousarray(piece))) + b"0000")
    return out


@dataclass
class Result:
    stored: int
    dictionary: int
    encode_cpu: float
    decode_cpu: float
    parts: str = ""  # format 2: bytes a window of codes / gps_speed / row / dictionaries


@dataclass
class Candidate:
    name: str
    run: Callable[[np.ndarray, np.ndarray, np.ndarray | None], Result]


def v1_default(windows: np.ndarray, device: np.ndarray, permutation: np.ndarray | None) -> Result:
    shuffled = permutation is not None
    size = 32768 if shuffled else CHUNK
    codecs = gimu_codecs("gdict16" if shuffled else "dict16")
    chain = [codecs["serializer"].to_dict(), codecs["compressors"][0].to_dict(), {"name": "crc32c"}]
    codec = ChunkCodec.parse(chain)
    assert codec is not None
    started = time.process_time()
    data, groups = (windows, device) if permutation is None else (windows[permutation], device[permutation])
    blobs, expect = [], []
    for first in range(0, len(data), size):
        chunk, group = data[first : first + size], groups[first : first + size]
        if shuffled:  # the converter stores each chunk's windows device after device
            by_device = np.argsort(group, kind="stable")
            chunk, group = chunk[by_device], group[by_device]
        expect.append(chunk)
        if len(chunk) < size:
            chunk = np.concatenate([chunk, np.zeros((size - len(chunk), 20, 4), np.float32)])
            group = np.concatenate([group, np.full(size - len(group), -1, group.dtype)])
        blobs.append(codec.encode(np.ascontiguousarray(chunk), group))
    encode_cpu = time.process_time() - started
    out = np.empty((size, 20, 4), np.float32)
    started = time.thread_time()
    for blob in blobs:
        codec.decode(blob, (size, 20, 4), out=out)
    decode_cpu = time.thread_time() - started
    for blob, chunk in zip(blobs, expect if VERIFY["on"] else [], strict=False):
        back = codec.decode(blob, (size, 20, 4))[: len(chunk)]
        assert np.array_equal(back.view(np.uint32), chunk.view(np.uint32))
    return Result(sum(map(len, blobs)), 0, encode_cpu, decode_cpu)


def standard(cname: str, clevel: int) -> Callable[..., Result]:
    chain = [{"name": "transpose", "configuration": {"order": [2, 0, 1]}},
             {"name": "bytes", "configuration": {"endian": "little"}},
             {"name": "blosc", "configuration": {"cname": cname, "clevel": clevel, "shuffle": "bitshuffle",
                                                 "typesize": 4, "blocksize": 0}},
             {"name": "crc32c"}]
    codec = ChunkCodec.parse(chain)
    assert codec is not None

    def run(windows: np.ndarray, device: np.ndarray, permutation: np.ndarray | None) -> Result:
        started = time.process_time()
        data = windows if permutation is None else windows[permutation]
        blobs = []
        for first in range(0, len(data), CHUNK):
            chunk = data[first : first + CHUNK]
            if len(chunk) < CHUNK:
                chunk = np.concatenate([chunk, np.zeros((CHUNK - len(chunk), 20, 4), np.float32)])
            blobs.append(codec.encode(np.ascontiguousarray(chunk)))
        encode_cpu = time.process_time() - started
        out = np.empty((CHUNK, 20, 4), np.float32)
        started = time.thread_time()
        for blob in blobs:
            codec.decode(blob, (CHUNK, 20, 4), out=out)
        decode_cpu = time.thread_time() - started
        if VERIFY["on"]:
            back = np.concatenate([codec.decode(b, (CHUNK, 20, 4)) for b in blobs])[: len(data)]
            assert np.array_equal(back.view(np.uint32), data.view(np.uint32))
        return Result(sum(map(len, blobs)), 0, encode_cpu, decode_cpu)

    return run


GPS_CODEC = blosc("zstd", 3, 4, numcodecs.Blosc.NOSHUFFLE)  # as _v2.CODECS


def format2(orders: str, cname: str, clevel: int, gps_codes: bool = False, grouped: bool = False
            ) -> Callable[..., Result]:
    """Format 2 (birdzarr/format/_v2.py): IMU codes + gps_speed float32 (n, 20) + rows +
    dictionaries. ``gps_codes``: the issue's probe instead, gps_speed coded like the IMU channels
    (4-channel codes, its entries in the dictionary, the overflow rule splitting rows).
    ``grouped``: a shuffled store's chunks hold their windows row after row (as v1's --shuffle
    stores hold them device after device; a chunk is still the same uniform sample)."""
    codes_codec = blosc(cname, clevel, 2)
    order = tuple(_v2.SORTED if o == "S" else _v2.FIRST for o in orders)

    def run(windows: np.ndarray, device: np.ndarray, permutation: np.ndarray | None) -> Result:
        started = time.process_time()
        if gps_codes:
            codes, row, new = _v2._encode_fresh(windows.view(np.uint32), device, order, 0)
            gps = np.empty((len(windows), 0), np.float32)
        else:
            encoded = _v2.encode(windows, device, orders=order)
            codes, row, gps, new = encoded.codes, encoded.row, encoded.gps, encoded.new
        if permutation is not None and grouped:
            chunk_of = np.arange(len(permutation)) // CHUNK
            permutation = permutation[np.lexsort((row[permutation], chunk_of))]
        if permutation is not None:  # a shuffled store: codes computed in device order, then permuted
            codes, row, gps = codes[permutation], row[permutation], gps[permutation]
        channels = codes.shape[2]
        code_blobs = chunked(np.ascontiguousarray(codes.transpose(0, 2, 1)), CHUNK, codes_codec)
        row_blobs = chunked(row.astype(np.uint32), CHUNK, DICT)
        gps_blobs = [] if gps_codes else chunked(gps, CHUNK, GPS_CODEC)
        dictionary = (chunked(new.values, _v2.VALUE_CHUNK, DICT) + chunked(new.start, _v2.ROW_CHUNK, TABLE)
                      + chunked(new.device, _v2.ROW_CHUNK, TABLE))
        encode_cpu = time.process_time() - started
        decoder = numcodecs.Blosc()
        out = np.empty((CHUNK, 20, 4), np.float32)
        started = time.thread_time()
        for i, (code_blob, row_blob) in enumerate(zip(code_blobs, row_blobs, strict=True)):
            cm = blosc_decode_scratch(memoryview(code_blob)[:-4]).view("<u2").reshape(CHUNK, channels, 20)
            rows = np.frombuffer(decoder.decode(memoryview(row_blob)[:-4]), "<u4")
            if gps_codes:  # the probe's lookup of the 4th channel
                speed = np.take(new.values, cm[:, 3] + new.start[rows, 3][:, None], mode="clip")
            else:
                speed = np.frombuffer(decoder.decode(memoryview(gps_blobs[i])[:-4]), "<f4").reshape(CHUNK, 20)
            _v2.decode(cm.transpose(0, 2, 1), rows, speed, new.values, new.start, out=out)
        decode_cpu = time.thread_time() - started
        if VERIFY["on"]:
            data = windows if permutation is None else windows[permutation]
            if gps_codes:
                back = new.values[new.start[row][:, None, :] + codes]
            else:
                back = _v2.decode_reference(codes, row, gps, new.values, new.start)
            assert np.array_equal(back.view(np.uint32), data.view(np.uint32))
        dict_bytes = sum(map(len, dictionary))
        stored = sum(map(len, code_blobs)) + sum(map(len, row_blobs)) + sum(map(len, gps_blobs)) + dict_bytes
        n = len(windows)
        parts = "/".join(f"{sum(map(len, blobs)) / n:.1f}"
                         for blobs in (code_blobs, gps_blobs, row_blobs, dictionary))
        return Result(stored, dict_bytes, encode_cpu, decode_cpu, parts)

    return run


def candidates() -> list[Candidate]:
    return [
        Candidate("v1 default (dict16 / gdict16 lz4)", v1_default),
        Candidate("standard lz4", standard("lz4", 5)),
        Candidate("standard zstd1", standard("zstd", 1)),
        Candidate("probe: codes SSSS lz4, gps coded", format2("SSSS", "lz4", 5, gps_codes=True)),
        Candidate("format 2: codes SSS lz4 + gps zstd3", format2("SSS", "lz4", 5)),
        Candidate("format 2, chunks grouped by device", format2("SSS", "lz4", 5, grouped=True)),
        Candidate("codes FFF lz4 + gps zstd3", format2("FFF", "lz4", 5)),
        Candidate("codes SSS zstd1 + gps zstd3", format2("SSS", "zstd", 1)),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=600_000, help="windows of the 186-device corpus")
    parser.add_argument("--big", type=int, default=150_000, help="windows of its largest device")
    parser.add_argument("--small-devices", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=3, help="interleaved rounds; the fastest counts")
    parser.add_argument("--corpus", choices=("186", "small", "both"), default="both")
    parser.add_argument("--only", default="", help="comma-separated substrings of candidate names")
    args = parser.parse_args()
    numcodecs.blosc.set_nthreads(1)  # per-core figures
    chosen = [c for c in candidates() if not args.only or any(s in c.name for s in args.only.split(","))]
    rows: list[dict[str, Any]] = []
    print(f"# {machine()}; load average {os.getloadavg()[0]:.1f}")
    for kind in ("186", "small") if args.corpus == "both" else (args.corpus,):
        windows, device = corpus(kind, args)
        parquet, one_file = parquet_bytes(windows, device)
        n_dev = len(np.unique(device))
        print(f"# corpus {kind}: {n_dev:,} devices, {len(windows):,} windows, {windows.nbytes / 1e6:.0f} MB "
              f"float32; per-device Parquet {parquet / 1e6:.1f} MB ({windows.nbytes / parquet:.2f}x), one "
              f"Parquet file with device_id {one_file / 1e6:.1f} MB", flush=True)
        permutation = np.random.default_rng(7).permutation(len(windows))
        best: dict[tuple[str, str], Result] = {}
        for round_ in range(args.repeat):
            VERIFY["on"] = round_ == 0
            for order in ("device", "shuffled"):
                for candidate in chosen:
                    result = candidate.run(windows, device, None if order == "device" else permutation)
                    key = (order, candidate.name)
                    old = best.get(key)
                    best[key] = result if old is None else Result(
                        result.stored, result.dictionary, min(old.encode_cpu, result.encode_cpu),
                        min(old.decode_cpu, result.decode_cpu), result.parts)
        mb = windows.nbytes / 1e6
        for order in ("device", "shuffled"):
            reference = best.get((order, chosen[0].name))
            for candidate in chosen:
                r = best[(order, candidate.name)]
                rows.append({
                    "corpus": kind, "order": order, "candidate": candidate.name,
                    "MB": r.stored / 1e6, "x f32": windows.nbytes / r.stored, "/parquet": r.stored / parquet,
                    "dict %": 100 * r.dictionary / r.stored, "enc MB/cpu s": mb / r.encode_cpu,
                    "dec ns/win": 1e9 * r.decode_cpu / len(windows),
                    "dec vs v1": r.decode_cpu / reference.decode_cpu if reference else "",
                    "B/win codes/gps/row/dict": r.parts,
                })
                print(table(rows[-1:]), flush=True)
    print()
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
