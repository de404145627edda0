"""Test-only: turn a committed local version-1 store into a version-2 store holding the same windows.

``to_format2`` (made before the converter wrote format 2; a version-1 store now comes from
tests/data/format1/) decodes ``gimu`` with zarr-python, encodes the windows with
``birdzarr.format._rows.encode`` (the writers' RowCoder; the device ids of the ``device`` array as
the dictionary rows' keys), writes the six arrays of format 2 from ``_v2.array_metadata``
documents with zarr-python, deletes ``gimu``, sets ``format_version`` 2 in the root attributes
and records the dictionary's committed lengths as the converter does (``committed.dictionary``:
rows, values); nothing else changes.

It also holds what several test modules set up alike: the documented decoding lines
(``documented_decode``), a script run where birdzarr cannot be imported (``run_without_birdzarr``),
the core-codecs check of the per-window arrays (``assert_core_codecs``) and a consistent rewrite of a
format-2 store's device table (``rewrite_device_table``).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest

from birdzarr.format import _v2
from birdzarr.format._rows import encode
from birdzarr.format._spec import ATTRS_KEY, DEVICE, GIMU


def to_format2(path: str | Path) -> None:
    """Rewrite the committed local version-1 store at ``path`` in place as a version-2 store."""
    import zarr

    path = Path(path)
    root_file = path / "zarr.json"
    root = json.loads(root_file.read_text())
    meta = root["attributes"][ATTRS_KEY]
    if meta.get("format_version") != 1:
        raise ValueError(f"{path} is not a version-1 store (format_version {meta.get('format_version')!r})")
    gimu = zarr.open_array(str(path / GIMU), mode="r", zarr_format=3)
    windows = np.ascontiguousarray(np.asarray(gimu[:], dtype=np.float32))
    device = np.asarray(zarr.open_array(str(path / DEVICE), mode="r", zarr_format=3)[:], dtype=np.int64)
    if len(device) != len(windows):
        raise ValueError(f"{path}: gimu holds {len(windows)} windows, device {len(device)}")
    chunk_windows = int(gimu.chunks[0])
    encoded = encode(windows, device)
    data = {_v2.CODES: encoded.codes, _v2.GPS: encoded.gps, _v2.ROW: encoded.row,
            _v2.VALUES: encoded.new.values, _v2.START: encoded.new.start, _v2.DEVICE: encoded.new.device}
    documents = _v2.array_metadata(len(windows), len(encoded.new.values), encoded.new.n_rows,
                                   chunk_windows=chunk_windows)
    for name, document in documents.items():
        (path / name).mkdir()
        (path / name / "zarr.json").write_text(json.dumps(document))
        array = zarr.open_array(str(path / name), mode="r+", zarr_format=3)
        if data[name].size:
            array[...] = data[name]
    shutil.rmtree(path / GIMU)
    meta["format_version"] = 2
    meta["committed"]["dictionary"] = {"rows": encoded.new.n_rows, "values": len(encoded.new.values)}
    root_file.write_text(json.dumps(root, indent=2))


# -- reading a format-2 store as a reader without birdzarr does ------------------------------------


def documented_decode() -> str:
    """The decoding lines of birdzarr/format/_v2.py's docstring, as a reader copies them."""
    doc = _v2.__doc__ or ""
    block = doc[doc.index("faster)::\n\n") + len("faster)::\n\n") :]
    lines = []
    for line in block.splitlines():
        if not line.startswith("    "):
            break
        lines.append(line)
    return textwrap.dedent("\n".join(lines))


def run_without_birdzarr(lines: list[str]) -> None:
    """Run ``lines`` in a new Python process in which birdzarr cannot be imported: it must succeed
    and have loaded nothing of birdzarr."""
    script = "\n".join([
        "import sys",
        "sys.modules['birdzarr'] = None  # any import of birdzarr fails",
        "try:",
        "    import birdzarr",
        "except ImportError:",
        "    pass",
        "else:",
        "    raise SystemExit('birdzarr was importable')",
        *lines,
        "print(sorted(m for m in sys.modules if m.startswith('birdzarr')))",
    ])
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr + "\n" + script
    # only the blocked entry: nothing of birdzarr loaded
    assert done.stdout.strip() == "['birdzarr']", done.stdout


def assert_core_codecs(root: str | Path) -> None:
    """Every per-window and dictionary array of the format-2 store at ``root`` uses core Zarr v3
    codecs only, and the store has no version-1 ``gimu`` array."""
    for name in _v2.ARRAYS:
        codecs = json.loads((Path(root) / name / "zarr.json").read_text())["codecs"]
        assert {codec["name"] for codec in codecs} <= _v2.CORE_CODECS, name
    assert not (Path(root) / GIMU).exists()


# -- damaging a format-2 store consistently ----------------------------------------------------------

T = TypeVar("T")


def device_table_file(store: Path) -> Path:
    """The zarr.json of the committed device table group of a format-2 store (the default); its
    ``details`` array beside it holds the entries (``read_details``)."""
    root = json.loads((store / "zarr.json").read_text())
    return store / root["attributes"][ATTRS_KEY]["committed"]["device_table"] / "zarr.json"


def read_details(store: Path) -> dict[str, Any]:
    """The committed device table's details as written on disk: the JSON object (entries, reports,
    CSV tails) its ``details`` array holds."""
    import zarr

    array: Any = zarr.open_array(str(device_table_file(store).parent / "details"), mode="r", zarr_format=3)
    found: dict[str, Any] = json.loads(array[:].tobytes())
    return found


def write_details(store: Path, details: dict[str, Any]) -> None:
    """Rewrite the committed device table's ``details`` array with ``details``."""
    import numpy as np
    import zarr

    blob = np.frombuffer(json.dumps(details).encode(), np.uint8)
    array: Any = zarr.open_array(str(device_table_file(store).parent / "details"), mode="r+", zarr_format=3)
    array.resize(blob.shape)
    array[:] = blob


def rewrite_device_table(store: Path, edit: Callable[[list[dict[str, Any]]], T]) -> T:
    """Damage the device table as a consistent rewrite of it would: ``edit`` changes the entries in
    the committed group's ``details`` and the group's index arrays are written again from them
    (left as they were, verify would name the index arrays that disagree with the entries first);
    what ``edit`` returns."""
    import zarr

    from birdzarr.format import _device_table
    from birdzarr.format._spec import DeviceEntry

    details = read_details(store)
    devices = details["devices"]
    result = edit(devices)
    write_details(store, details)
    group = zarr.open_group(str(device_table_file(store).parent), mode="r+", zarr_format=3)
    for name, values in _device_table.columns([DeviceEntry.from_json(d) for d in devices]).items():
        array: Any = group[name]
        array.resize(values.shape)
        array[:] = values
    return result


# -- fixtures (import them into a test module to use them) --------------------------------------


@pytest.fixture(scope="session")
def v2_pair(small_store: Any) -> tuple[Any, Any]:
    """The session's small store (format 2, device order, 1024-window chunks) twice, opened
    apart: a reference and the store under test (each with its own reader and caches); tests
    that change a store copy the second."""
    import birdzarr

    return small_store, birdzarr.open_store(small_store.location.path)


@pytest.fixture(scope="session")
def v2_shuffled_pair(parquet_source: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    """The parquet_source converted with --shuffle (seed 4, 1024-window chunks), twice, opened
    apart (as ``v2_pair``)."""
    import birdzarr

    directory, _ = parquet_source
    root = tmp_path_factory.mktemp("format2_shuffled")
    store = birdzarr.convert(directory, root / "shuffled.zarr", shuffle=True, seed=4, chunk_windows=1024,
                             progress=False)
    return store, birdzarr.open_store(root / "shuffled.zarr")
