"""Format 2's device table: out of the root attributes, one group per commit, read only when used.

A version-1 store keeps every device's entry, report and unfinished CSV burst in the root
``zarr.json`` (~750 bytes a device: 75 MB at 100K devices, parsed at every open by every rank and
worker). A version-2 store keeps them in the group ``device_table/<generation>``:

- the uint8 array ``details``: the UTF-8 JSON object of ``devices`` (the entries, as version 1's
  root attribute), ``report_devices`` (each device's conversion report) and, for CSV stores in
  device order, ``csv_tails``, compressed with zstd (~400 bytes of JSON a device, ~10x smaller
  stored); read the first time a reader needs an entry, never at open. The group's attributes
  say so (``{"birdzarr": {"details": "details"}}``); a store written before the array existed
  holds the object itself as the attributes (``birdzarr``), which readers accept;
- core-codec int64 arrays, an index of the entries for readers that need only these columns:
  ``device_id``, ``n_windows``, ``first_time``, ``last_time`` (one a device, ascending id) and
  ``range_device``, ``range_start``, ``range_stop`` (one a run of windows ``[start, stop)`` of
  device ``range_device``, by start; none in a shuffled store).

The root attribute ``committed.device_table`` names the committed generation's group, so a commit
writes the new group first and the root last: a run killed in between leaves the previous
generation in force (and its new group is a leftover that the next writer removes). A commit keeps
the group it replaced until the next one (birdzarr/store/_tail.py ``kept_tables``): readers read
the table lazily, after the root, and one that opened just before a commit still finds it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from birdzarr.format._spec import DeviceEntry

GROUP = "device_table"
COLUMNS = ("device_id", "n_windows", "first_time", "last_time")
RANGES = ("range_device", "range_start", "range_stop")
_CODECS = [{"name": "bytes", "configuration": {"endian": "little"}},
           {"name": "blosc", "configuration": {"cname": "zstd", "clevel": 3, "shuffle": "shuffle",
                                               "typesize": 8, "blocksize": 0}},
           {"name": "crc32c"}]
CHUNK = 2**20  # entries a chunk: one chunk up to a million devices


def path(generation: int) -> str:
    """The group of one generation's table, relative to the store root."""
    return f"{GROUP}/{generation}"


def columns(entries: list[DeviceEntry]) -> dict[str, np.ndarray]:
    """The index arrays of ``entries`` (ascending device id)."""
    entries = sorted(entries, key=lambda e: e.device_id)
    out = {
        "device_id": np.array([e.device_id for e in entries], np.int64),
        "n_windows": np.array([e.n_windows for e in entries], np.int64),
        "first_time": np.array([e.first_time for e in entries], np.int64),
        "last_time": np.array([e.last_time for e in entries], np.int64),
    }
    ranges = sorted((r.start, r.stop, e.device_id) for e in entries for r in e.ranges)
    out["range_device"] = np.array([d for _, _, d in ranges], np.int64)
    out["range_start"] = np.array([a for a, _, _ in ranges], np.int64)
    out["range_stop"] = np.array([b for _, b, _ in ranges], np.int64)
    return out


def array_metadata(length: int) -> dict[str, Any]:
    """The zarr.json of one index array of ``length`` entries."""
    return {
        "zarr_format": 3, "node_type": "array", "shape": [length], "data_type": "int64",
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [max(1, min(length, CHUNK))]}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": 0, "codecs": _CODECS, "attributes": {}, "dimension_names": ["device"],
    }


DETAILS = "details"  # the array of the details' JSON
DETAILS_CHUNK = 2**22  # bytes a chunk of it
_DETAILS_CODECS = [{"name": "bytes"},
                   {"name": "blosc", "configuration": {"cname": "zstd", "clevel": 3, "shuffle": "noshuffle",
                                                       "typesize": 1, "blocksize": 0}},
                   {"name": "crc32c"}]


def group_metadata() -> dict[str, Any]:
    """The group's zarr.json: its attributes name the array holding the details."""
    return {"zarr_format": 3, "node_type": "group", "attributes": {"birdzarr": {"details": DETAILS}}}


def details_metadata(length: int) -> dict[str, Any]:
    """The zarr.json of the ``details`` array of ``length`` bytes."""
    return {
        "zarr_format": 3, "node_type": "array", "shape": [length], "data_type": "uint8",
        "chunk_grid": {"name": "regular",
                       "configuration": {"chunk_shape": [max(1, min(length, DETAILS_CHUNK))]}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": 0, "codecs": _DETAILS_CODECS, "attributes": {}, "dimension_names": ["byte"],
    }
