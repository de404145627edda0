"""Format-1 stores for tests of reading version 1: birdzarr no longer writes format 1, so tests
copy one of the small stores committed in tests/data/format1/ (README.md there says how they were
made) and compare it with what they record (expected.json) and with format-2 conversions of the
same generated sources."""

from __future__ import annotations

import json
import pathlib
import shutil
from typing import Any

import numpy as np

import birdzarr
from birdzarr.demo import _synthetic

FORMAT1 = pathlib.Path(__file__).parent / "data" / "format1"
NAMES = ("dict16.zarr", "gdict16.zarr", "standard.zarr", "raw.zarr", "varying_gps.zarr", "appended.zarr")
EXPECTED: dict[str, dict[str, Any]] = json.loads((FORMAT1 / "expected.json").read_text())

# the sources make_format1.py converted (its SOURCES), regenerated here
_PARQUET = {"dict16.zarr": (4, 240, 7), "gdict16.zarr": (4, 240, 7), "standard.zarr": (2, 60, 5)}
_CSV = {"appended.zarr": (3, 12, 11)}


def format1_copy(name: str, where: pathlib.Path) -> pathlib.Path:
    """A private copy of the committed format-1 store ``name`` (e.g. ``"dict16.zarr"``) under
    ``where``, free to change or damage; its path."""
    if name not in NAMES:
        raise ValueError(f"no format-1 fixture {name!r}; there are {NAMES}")
    dest = pathlib.Path(where) / name
    shutil.copytree(FORMAT1 / name, dest)
    return dest


def format1_source(name: str, where: pathlib.Path) -> pathlib.Path:
    """The source the fixture ``name`` was converted from, generated again under ``where``
    (for the appended store: every part, the conversion's and the append's)."""
    directory = pathlib.Path(where) / f"{name}.source"
    if name in _PARQUET:
        n_devices, total, seed = _PARQUET[name]
        _synthetic.make_parquet_dir(directory, n_devices=n_devices, total_windows=total, seed=seed)
    elif name in _CSV:
        n_devices, bursts, seed = _CSV[name]
        _synthetic.make_csv_dir(directory, n_devices=n_devices, bursts_per_device=bursts, seed=seed)
    elif name == "raw.zarr":
        directory.mkdir(parents=True)
        windows = np.zeros((3300, 20, 4), np.float32)
        bits = np.uint32(0x3F800000) + np.arange(3300 * 20, dtype=np.uint32)
        windows[:, :, 0] = bits.view(np.float32).reshape(3300, 20)
        windows[:, :, 3] = 0.25
        _synthetic.write_parquet(windows, directory / "1.parquet")
        _synthetic.write_parquet(_synthetic.curated_windows(30, seed=2), directory / "2.parquet")
    elif name == "varying_gps.zarr":
        directory.mkdir(parents=True)
        windows = {3: _synthetic.curated_windows(150, seed=3), 4: _synthetic.curated_windows(100, seed=4)}
        windows[4][90, 10:, 3] += np.float32(0.5)
        for device, w in windows.items():
            _synthetic.write_parquet(w, directory / f"{device}.parquet")
    else:
        raise ValueError(f"no format-1 fixture {name!r}; there are {NAMES}")
    return directory


def rows(store: birdzarr.Store) -> tuple[np.ndarray, ...]:
    """Every window with its device, timestamp and label, in an order that does not depend on the
    store's (by device, time, label, then the window's bytes): stores of the same windows in
    another order (shuffled, or appended) give equal arrays."""
    windows = np.ascontiguousarray(store.windows[:])
    device, stamp, label = store.window_devices[:], store.timestamps[:], store.labels[:]
    keys = windows.reshape(len(windows), -1).view(np.uint32)
    order = np.lexsort((*keys.T[::-1], label, stamp, device))
    return windows[order], device[order], stamp[order], label[order]


def standard_format1(source: pathlib.Path, dest: pathlib.Path) -> pathlib.Path:
    """A format-1 ``standard`` store (float32 ``gimu`` in core codecs, the device table in the
    root attributes) of the windows of the format-2 store at ``source``, written at ``dest`` with
    zarr-python from the chunk layout of the committed fixture standard.zarr: a format-1 store of
    any size and order for tests that compare the two formats' read paths on the same windows."""
    import zarr

    from birdzarr.format import _v2
    from birdzarr.format._spec import ATTRS_KEY

    store = birdzarr.open_store(source)
    meta = json.loads(json.dumps(store.meta))  # the device table merged back into the root
    windows = np.ascontiguousarray(store.windows[:])
    dest = pathlib.Path(dest)
    shutil.copytree(source, dest)
    for name in (*_v2.ARRAYS, "device_table"):
        shutil.rmtree(dest / name, ignore_errors=True)
    document = json.loads((FORMAT1 / "standard.zarr" / "gimu" / "zarr.json").read_text())
    document["shape"] = [len(windows), 20, 4]
    document["chunk_grid"]["configuration"]["chunk_shape"] = [store.chunk_windows, 20, 4]
    (dest / "gimu").mkdir()
    (dest / "gimu" / "zarr.json").write_text(json.dumps(document))
    zarr.open_array(str(dest / "gimu"), mode="r+", zarr_format=3)[...] = windows
    meta["format_version"] = 1
    meta["layout"] = {**meta["layout"], "codec": "standard", "compressor": {"cname": "lz4", "clevel": 5}}
    for key in ("dictionary", "device_table", "n_devices", "label_counts"):
        meta["committed"].pop(key, None)
    meta.get("report", {}).pop("totals", None)
    root = json.loads((dest / "zarr.json").read_text())
    root["attributes"][ATTRS_KEY] = meta
    (dest / "zarr.json").write_text(json.dumps(root, indent=2))
    return dest
