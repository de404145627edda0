"""Store format version 2, the window layout: uint16 codes + dictionaries, core Zarr v3 codecs only.

The layout birdzarr writes (version 1's ``birdzarr.dict16`` and ``birdzarr.gdict16`` codecs are
read only): imu_x/y/z are uint16 codes into one dictionary row per device, held in ordinary
arrays; gps_speed stays float32. Pure numpy and zarr.json documents, no I/O: the decode, the
layout's rules, and each array's metadata (the encoder is ``birdzarr.format._rows``).

Arrays
------
``N`` windows, ``R`` dictionary rows, ``M`` dictionary entries. Every array uses only core Zarr v3
codecs (transpose, bytes, blosc, crc32c; ``array_metadata`` gives each one's zarr.json), so
TensorStore, zarrs, zarr.js and plain zarr-python read them without birdzarr.

=================  ========  ===========  ===================================================
array              dtype     shape        meaning
=================  ========  ===========  ===================================================
``gimu_codes``     uint16    (N, 20, 3)   imu_x, imu_y, imu_z of window ``w``: entry
                                          ``code[w, s, c]`` of row ``row[w]``'s channel c
``gps_speed``      float32   (N, 20)      gps_speed (channel 3) as it is, divided by gps_scale
``gimu_row``       uint32    (N,)         the dictionary row of window ``w``
``dict_values``    float32   (M,)         the entries of every row, row after row, channel
                                          after channel within a row
``dict_start``     int64     (R, 3)       first entry of row ``r``, channel ``c``
``dict_device``    int64     (R,)         the device whose windows row ``r`` codes
=================  ========  ===========  ===================================================

Decoding windows ``[a, b)`` bit for bit (all a reader needs; ``decode`` below is the same, faster)::

    codes = z["gimu_codes"][a:b]          # uint16 (n, 20, 3)
    row = z["gimu_row"][a:b]              # uint32 (n,)
    start = z["dict_start"][:]            # int64 (R, 3)
    values = z["dict_values"][:]          # float32 (M,)
    windows = np.empty((len(row), 20, 4), np.float32)
    windows[:, :, :3] = values[start[row][:, None, :] + codes]
    windows[:, :, 3] = z["gps_speed"][a:b]

Row ``r``, channel ``c`` owns the entries from ``start[r, c]`` up to the next start in row-major
order of ``dict_start`` (``M`` after the last); every code is below its dictionary's length
(``check`` verifies it). Entries are float32 bit patterns: NaN payloads and -0.0 survive. Curation
drops non-finite windows, but -0.0 passes it (``np.clip(-0.0, -2, 2)`` is -0.0, and a Parquet
source may hold any finite value).

The rules
---------
- **A row per device**: a device's IMU values are calibrated 12-bit counts (at most 4,096 distinct
  per channel), so one dictionary row serves all its windows in either store order; a shuffled
  chunk decodes with one lookup per value and carries no dictionary of its own. The row array
  costs ~1 byte a window in a shuffled store, next to nothing in device order.
- **gps_speed is not coded**: in real exports it is one continuous value per burst (6-8
  decimals), about one distinct value per 1-3 windows, so codes would not compress and the
  dictionary would hold every speed (measured: +27 bytes a window, 30% more store); as
  float32 with zstd and no shuffle, a burst's equal values cost 2.6 (device order) to 4.2
  (shuffled) bytes a window, and speeds that vary inside a window need no rule at all.
- **Overflow, parts, append, entry order**: how a writer builds the rows (a row that would pass
  ``MAX_ENTRIES`` entries closes at the first window that would overflow it, and a device
  converted as parts, cut at its row groups, closes its row at each part's end; an append grows a
  new row from the device's latest one and never rewrites a stored one; entries in first-seen or,
  for ``--shuffle``, bit-pattern order) is ``birdzarr.format._rows``: ``RowCoder`` is the one
  encoder, ``encode`` its whole-array use. A decoder assumes none of it.
- **Many small devices**: still a row per device. At ~30 windows a device the dictionaries are
  most of the stored bytes; the cost is memory and locality for readers.
- **Device key**: ``dict_device`` records whatever integer the writer passes per window (the
  store's device index, or the device id); a window's device is ``dict_device[row[w]]``, so a
  separate per-window device array is redundant (the writer's choice).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import numpy as np

WINDOW_LENGTH = 20
N_CHANNELS = 4
N_CODED = 3  # imu_x, imu_y, imu_z are dictionary-coded; gps_speed (channel 3) is stored as float32
MAX_ENTRIES = 65535  # entries a (row, channel) dictionary may hold: codes are uint16

CODES = "gimu_codes"
GPS = "gps_speed"
ROW = "gimu_row"
VALUES = "dict_values"
START = "dict_start"
DEVICE = "dict_device"
ARRAYS = (CODES, GPS, ROW, VALUES, START, DEVICE)


@dataclass(frozen=True)
class Dictionaries:
    """The dictionary arrays as stored (or the rows a coder appends to them: ``RowCoder.new_rows``)."""

    values: np.ndarray  # float32 (M,)
    start: np.ndarray  # int64 (R, 3)
    device: np.ndarray  # int64 (R,)

    @classmethod
    def empty(cls) -> Dictionaries:
        return cls(np.empty(0, np.float32), np.empty((0, N_CODED), np.int64), np.empty(0, np.int64))

    @property
    def n_rows(self) -> int:
        return len(self.device)

    def sizes(self) -> np.ndarray:
        """Entries of each (row, channel) dictionary, int64 (R, 3)."""
        return entry_counts(self.start, len(self.values))

    def entries(self, row: int, channel: int) -> np.ndarray:
        """The float32 entries of one (row, channel) dictionary (a view)."""
        first = int(self.start[row, channel])
        return self.values[first : first + int(self.sizes()[row, channel])]

    def kept(self, used: np.ndarray) -> Dictionaries:
        """The rows flagged by ``used`` (bool (R,)), in order, holding only the entries they use:
        the entries are cut at every distinct start (each (row, channel) dictionary is one such
        span), and a span several rows share (small devices') is kept once."""
        starts = self.start.reshape(-1)
        distinct = sorted_distinct(starts)
        lengths = np.diff(np.append(distinct, np.int64(len(self.values))))
        span = np.searchsorted(distinct, self.start[used])  # (kept rows, 3)
        held = np.zeros(len(distinct), dtype=bool)
        held[span] = True
        kept = np.where(held, lengths, 0)
        return Dictionaries(self.values[np.repeat(held, lengths)], (np.cumsum(kept) - kept)[span],
                            self.device[used])

    def extend(self, part: Dictionaries) -> Dictionaries:
        """These arrays with ``part`` (a coder's new rows, whose starts count from the end of
        these values) appended: what the store holds after the append."""
        return Dictionaries(
            np.concatenate([self.values, part.values]),
            np.concatenate([self.start, part.start]),
            np.concatenate([self.device, part.device]),
        )


def sorted_distinct(values: np.ndarray) -> np.ndarray:
    """``np.unique(values)`` by a sort: numpy 2.3+'s hashing unique took 13 ms against 3.7 ms
    for the 300,000 starts of a 100,000-device store (1,473 distinct), read at every open."""
    ordered = np.sort(values, axis=None)
    if not len(ordered):
        return ordered
    return ordered[np.concatenate(([True], ordered[1:] != ordered[:-1]))]


def entry_counts(start: np.ndarray, n_values: int) -> np.ndarray:
    """Entries of each (row, channel) dictionary: from its start up to the next larger start of
    any row and channel (``n_values`` after the largest). Rows of small devices may share their
    entries (their starts are equal: docs/format.md, "Dictionary rows"); where no two starts are
    equal this is the next start in row-major order. A start outside ``[0, n_values]`` gives a
    negative count."""
    flat = np.asarray(start, dtype=np.int64).reshape(-1)
    if not len(flat):
        return flat.reshape(-1, N_CODED)
    if bool((flat[1:] > flat[:-1]).all()):  # no shared entries: the next start
        ends = np.append(flat[1:], np.int64(n_values))
        return (ends - flat).reshape(-1, N_CODED)
    distinct = sorted_distinct(flat)
    ends = np.append(distinct[1:], np.int64(n_values))[np.searchsorted(distinct, flat)]
    counts = ends - flat
    counts[(flat < 0) | (flat > n_values)] = -1
    return counts.reshape(-1, N_CODED)


def misplaced_rows(start: np.ndarray, n_values: int) -> np.ndarray:
    """Rows (bool (R,)) whose starts are not ascending across their channels or point outside
    ``dict_values``: what no writer stores (a row's channels follow each other; rows that share
    entries repeat the same starts)."""
    start = np.asarray(start, dtype=np.int64).reshape(-1, N_CODED)
    return np.asarray((start[:, 1:] < start[:, :-1]).any(axis=1) | (start < 0).any(axis=1)
                      | (start > n_values).any(axis=1))


# -- decoding --------------------------------------------------------------------------------


def decode_reference(codes: np.ndarray, row: np.ndarray, gps: np.ndarray, values: np.ndarray,
                     start: np.ndarray) -> np.ndarray:
    """The documented numpy lines, verbatim."""
    windows = np.empty((len(row), 20, 4), np.float32)
    windows[:, :, :3] = values[start[row][:, None, :] + codes]
    windows[:, :, 3] = gps
    return windows


def decode(
    codes: np.ndarray, row: np.ndarray, gps: np.ndarray, values: np.ndarray, start: np.ndarray,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Float32 windows (n, 20, 4) from their codes, rows and gps_speed: the same values as
    ``decode_reference``, into ``out`` where given (a float32 array of that shape). Codes may be
    any view (the channel-major chunk's transpose is fastest). Indices are not checked (``check``
    does, once per chunk read)."""
    n = len(row)
    if out is None:
        out = np.empty((n, WINDOW_LENGTH, N_CHANNELS), np.float32)
    # Measured against other ways on shuffled chunks (benchmarks/chunk_decode.py --variants
    # --cpu): np.take of start's rows (fancy indexing start[row] costs ~3x as much on its own),
    # the codes cast to int64 before the base is added in place (one dtype: no buffered cast),
    # and mode="wrap" (for in-range indices faster than "clip", as memory-safe for any other) take
    # 0.94x the CPU of the lookup without them; "raise", int32 indices with fancy indexing, larger
    # blocks and sorting a chunk's windows by row cost 1.0-1.25x.
    base = np.take(start, row, axis=0)  # (n, 3)
    index = np.empty((n, WINDOW_LENGTH), np.int64)
    looked_up = np.empty((n, WINDOW_LENGTH), np.float32)
    for c in range(N_CODED):
        np.copyto(index, codes[:, :, c])
        index += base[:, c : c + 1]
        # a contiguous take, then one copy into the strided channel: ~10% faster than a take
        # straight into the channel or a new array a channel
        np.take(values, index, out=looked_up, mode="wrap")
        out[:, :, c] = looked_up
    out[:, :, 3] = gps
    return out


def check(codes: np.ndarray, row: np.ndarray, start: np.ndarray, n_values: int) -> None:
    """Raise ValueError unless every window's row exists and every code falls inside its
    (row, channel) dictionary."""
    sizes = entry_counts(start, n_values)
    if misplaced_rows(start, n_values).any():
        raise ValueError("dict_start is not ascending within a row or points outside dict_values")
    row = np.asarray(row)
    if len(row) and int(row.max()) >= len(sizes):
        raise ValueError(f"gimu_row refers to row {int(row.max())}; the dictionary has {len(sizes)} rows")
    if (codes >= sizes[row][:, None, :]).any():
        raise ValueError("a gimu code is past the end of its dictionary")


# -- zarr metadata ---------------------------------------------------------------------------

CRC32C = {"name": "crc32c"}


def _blosc(cname: str, clevel: int, shuffle: str, typesize: int) -> dict[str, Any]:
    return {"name": "blosc", "configuration": {"cname": cname, "clevel": clevel, "shuffle": shuffle,
                                               "typesize": typesize, "blocksize": 0}}


BYTES = {"name": "bytes", "configuration": {"endian": "little"}}
# Codec chains: every name is a core Zarr v3 codec.
CODECS: dict[str, list[dict[str, Any]]] = {
    CODES: [{"name": "transpose", "configuration": {"order": [2, 0, 1]}}, BYTES,
            _blosc("lz4", 5, "bitshuffle", 2), CRC32C],
    # runs of equal floats (one speed a burst): zstd without shuffle finds them, bit-shuffle hides them
    GPS: [BYTES, _blosc("zstd", 3, "noshuffle", 4), CRC32C],
    ROW: [BYTES, _blosc("zstd", 3, "bitshuffle", 4), CRC32C],
    VALUES: [BYTES, _blosc("zstd", 3, "bitshuffle", 4), CRC32C],
    START: [BYTES, _blosc("zstd", 3, "shuffle", 8), CRC32C],
    DEVICE: [BYTES, _blosc("zstd", 3, "shuffle", 8), CRC32C],
}
CORE_CODECS = frozenset({"bytes", "transpose", "blosc", "zstd", "gzip", "crc32c", "sharding_indexed"})
DEFAULT_CHUNK_WINDOWS = 8192
VALUE_CHUNK = 2**20  # dictionary entries a chunk (4 MiB of float32)
ROW_CHUNK = 2**16  # dictionary rows a chunk

# Each array's zarr.json attributes (informative, as version 1's: docs/format.md spells them).
# The codes carry the units of the values they decode to; gps_speed's are version 1's fourth.
ATTRIBUTES: dict[str, dict[str, Any]] = {
    CODES: {"long_name": "imu_x, imu_y, imu_z of each window, as codes into dict_values",
            "channels": ["imu_x", "imu_y", "imu_z"], "units": ["g", "g", "g"]},
    GPS: {"long_name": "gps_speed of each window", "units": "m/s divided by gps_scale"},
    ROW: {"long_name": "the dictionary row of each window"},
    VALUES: {"long_name": "dictionary entries: imu_x, imu_y, imu_z values", "units": "g"},
    START: {"long_name": "first dict_values entry of row r, channel c",
            "channels": ["imu_x", "imu_y", "imu_z"]},
    DEVICE: {"long_name": "device (tracker) id whose windows the row codes"},
}


def array_metadata(n_windows: int, n_values: int, n_rows: int, *, chunk_windows: int = DEFAULT_CHUNK_WINDOWS
                   ) -> dict[str, dict[str, Any]]:
    """The zarr.json document of each array (by name) for the given lengths."""

    def meta(shape: tuple[int, ...], chunks: tuple[int, ...], dtype: str, fill: Any, dims: list[str],
             codecs: list[dict[str, Any]], attributes: dict[str, Any]) -> dict[str, Any]:
        return {
            "zarr_format": 3, "node_type": "array", "shape": list(shape), "data_type": dtype,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunks)}},
            "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
            "fill_value": fill, "codecs": codecs, "attributes": copy.deepcopy(attributes),
            "dimension_names": dims,
        }

    return {
        CODES: meta((n_windows, WINDOW_LENGTH, N_CODED), (chunk_windows, WINDOW_LENGTH, N_CODED),
                    "uint16", 0, ["window", "sample", "channel"], CODECS[CODES], ATTRIBUTES[CODES]),
        GPS: meta((n_windows, WINDOW_LENGTH), (chunk_windows, WINDOW_LENGTH), "float32", 0.0,
                  ["window", "sample"], CODECS[GPS], ATTRIBUTES[GPS]),
        ROW: meta((n_windows,), (chunk_windows,), "uint32", 2**32 - 1, ["window"], CODECS[ROW],
                  ATTRIBUTES[ROW]),
        VALUES: meta((n_values,), (VALUE_CHUNK,), "float32", 0.0, ["entry"], CODECS[VALUES],
                     ATTRIBUTES[VALUES]),
        START: meta((n_rows, N_CODED), (ROW_CHUNK, N_CODED), "int64", -1, ["row", "channel"],
                    CODECS[START], ATTRIBUTES[START]),
        DEVICE: meta((n_rows,), (ROW_CHUNK,), "int64", -1, ["row"], CODECS[DEVICE], ATTRIBUTES[DEVICE]),
    }
