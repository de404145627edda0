"""Reading a format-2 store's device table (birdzarr/format/_device_table.py), only when it is used.

``open_store`` reads the root ``zarr.json`` alone, whatever the number of devices. The entries,
reports and CSV tails are read the first time something needs them (``details``); the index
columns (ids, window counts, times, ranges) are three to seven small objects (``columns``), read
without zarr-python (no event loop before DataLoader workers fork, as ``_chunks.py``).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from birdzarr._errors import CorruptChunkError
from birdzarr.format import _device_table as device_table
from birdzarr.format._codec import ChunkCodec
from birdzarr.storage._location import Location, read_object
from birdzarr.storage._root import RESTORE_HINT
from birdzarr.store._chunks import read_array_meta


def table_path(root: dict[str, Any]) -> str | None:
    """The committed device table group of a format-2 store's root attributes (None: format 1,
    whose table is in the root attributes)."""
    where = (root.get("committed") or {}).get("device_table")
    return str(where) if where else None


def details_in_array(location: Location, where: str) -> bool:
    """Whether the table at ``where`` holds its details in the ``details`` array (else, a store
    written before it, in the group's attributes)."""
    return _group_attributes(location, where).get(device_table.DETAILS) == device_table.DETAILS


def details(location: Location, where: str) -> dict[str, Any]:
    """The table's ``devices``, ``report_devices`` and ``csv_tails`` (the ``details`` array's JSON,
    or the group's attributes)."""
    found = _group_attributes(location, where)
    if found.get(device_table.DETAILS) != device_table.DETAILS:
        return found  # written before the details array: the attributes hold them
    data = _plain(location, f"{where}/{device_table.DETAILS}", "uint8")
    try:
        held = json.loads(data.tobytes())
    except ValueError as exc:
        raise CorruptChunkError(f"{location.display}: '{where}/{device_table.DETAILS}' is damaged "
                                f"({type(exc).__name__}: {exc}); {RESTORE_HINT}.") from None
    if not isinstance(held, dict):
        raise CorruptChunkError(f"{location.display}: '{where}/{device_table.DETAILS}' holds no device "
                                f"table; {RESTORE_HINT}.")
    return held


def _group_attributes(location: Location, where: str) -> dict[str, Any]:
    """The ``birdzarr`` attributes of the table's group."""
    key = f"{where}/zarr.json"
    raw = read_object(location, key)
    try:
        document = json.loads(raw)
        found = document["attributes"]["birdzarr"]
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptChunkError(f"{location.display}: '{key}' is damaged ({type(exc).__name__}: {exc}); "
                                f"{RESTORE_HINT}.") from None
    if not isinstance(found, dict):
        raise CorruptChunkError(f"{location.display}: '{key}' holds no device table; {RESTORE_HINT}.")
    return found


def merged(location: Location, root: dict[str, Any]) -> dict[str, Any]:
    """The root attributes with the device table put back where format 1 keeps it (``devices``,
    ``report.devices``, ``csv_tails``): what every reader of a store's attributes expects."""
    where = table_path(root)
    if where is None:
        return root
    found = details(location, where)
    full = dict(root)
    full["devices"] = found.get("devices", [])
    full["report"] = {**(root.get("report") or {}), "devices": found.get("report_devices", {})}
    if found.get("csv_tails") is not None:
        full["csv_tails"] = found["csv_tails"]
    return full


def columns(location: Location, where: str) -> dict[str, np.ndarray]:
    """The index arrays (``device_table.COLUMNS`` and ``RANGES``) of the table at ``where``."""
    return {name: _plain(location, f"{where}/{name}", "int64")
            for name in (*device_table.COLUMNS, *device_table.RANGES)}


def _plain(location: Location, key: str, dtype: str) -> np.ndarray:
    """A one-dimensional array of the table's, every chunk read and decoded (core codecs)."""
    meta = read_array_meta(location, key)  # damaged or missing: the readers' one-line error
    length = int(meta["shape"][0])
    chunk = int(meta["chunk_grid"]["configuration"]["chunk_shape"][0])
    codec = ChunkCodec.parse(meta["codecs"], dtype=dtype)
    assert codec is not None and codec.kind == "plain", "the device table's arrays use core codecs"
    parts = []
    for index in range(-(-length // chunk)):
        data = read_object(location, f"{key}/c/{index}")
        try:
            parts.append(np.array(codec.decode(data, (chunk,)), dtype))
        except (ValueError, RuntimeError) as exc:
            raise CorruptChunkError(f"{location.display}: chunk '{key}/c/{index}' cannot be decoded "
                                    f"({exc}); {RESTORE_HINT}.") from None
    return np.concatenate(parts)[:length] if parts else np.empty(0, dtype)
