"""Other readers open birdzarr stores: TensorStore (local and S3), xarray, plain zarr, static HTTP."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from format2_support import assert_core_codecs, documented_decode, run_without_birdzarr
from s3_support import (  # noqa: F401  (moto is a fixture)
    ACCESS_KEY,
    REGION,
    SECRET_KEY,
    MotoEndpoint,
    moto,
    new_bucket,
    s3_options,
)

import birdzarr
from birdzarr._errors import ReadOnlyLocationError
from birdzarr.format import _v2
from birdzarr.maintenance._copy import copy_store

pytest_plugins = ["format2_support"]  # its fixtures: v2_pair, v2_shuffled_pair

ARRAYS = ("gimu", "device", "timestamp", "label")


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint8)


@pytest.fixture(scope="module")
def standard_store(tmp_path_factory: pytest.TempPathFactory) -> birdzarr.Store:
    """A version-1 store whose gimu array uses the standard chain (transpose + blosc lz4 float32),
    copied from tests/data/format1/."""
    from tests.format1_support import format1_copy

    return birdzarr.open_store(format1_copy("standard.zarr", tmp_path_factory.mktemp("interop")))


@pytest.fixture(scope="module")
def csv_store(tmp_path_factory: pytest.TempPathFactory) -> birdzarr.Store:
    """A small store with burst times (CSV input)."""
    from birdzarr.demo import _synthetic

    root = tmp_path_factory.mktemp("interop_csv")
    _synthetic.make_csv_dir(root / "csv", n_devices=2, bursts_per_device=40, parts=1, seed=3)
    return birdzarr.convert(root / "csv", root / "csv.zarr", chunk_windows=64, progress=False)


def birdzarr_arrays(store: birdzarr.Store) -> dict[str, np.ndarray]:
    return {
        "gimu": store.windows[:], "device": store.window_devices[:],
        "timestamp": store.timestamps[:], "label": store.labels[:],
    }


def test_tensorstore_reads_a_standard_store_locally(standard_store: birdzarr.Store) -> None:
    ts = pytest.importorskip("tensorstore")
    expected = birdzarr_arrays(standard_store)
    for name in ARRAYS:
        path = f"{standard_store.location.path}/{name}/"
        spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": path}}
        array = ts.open(spec, read=True).result()
        got = array[: len(standard_store)].read().result()
        assert got.dtype == expected[name].dtype and np.array_equal(bits(got), bits(expected[name])), name
    assert array.domain.labels == ("window",)


@pytest.mark.slow
@pytest.mark.s3
def test_tensorstore_reads_a_standard_store_from_s3(
    standard_store: birdzarr.Store, moto: MotoEndpoint, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    ts = pytest.importorskip("tensorstore")
    bucket = new_bucket(moto)
    copy_store(standard_store.location, f"s3://{bucket}/standard.zarr", progress=False,
               dest_storage_options=s3_options(moto.url))
    # TensorStore takes credentials from the standard AWS environment variables
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    spec = {
        "driver": "zarr3",
        "kvstore": {"driver": "s3", "bucket": bucket, "path": "standard.zarr/gimu/", "endpoint": moto.url,
                    "aws_region": REGION, "aws_credentials": {"type": "environment"}},
    }
    got = ts.open(spec, read=True).result()[: len(standard_store)].read().result()
    assert np.array_equal(bits(got), bits(standard_store.windows[:]))
    # and birdzarr's own reader gives the same bytes from the bucket
    remote = birdzarr.open_store(f"s3://{bucket}/standard.zarr", storage_options=s3_options(moto.url))
    assert np.array_equal(bits(remote.windows[:]), bits(got))


@pytest.mark.parametrize("codec", ["dict16", "standard"])
@pytest.mark.filterwarnings("error")
@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_xarray_opens_the_store(
    codec: str, small_store_v1: birdzarr.Store, standard_store: birdzarr.Store, csv_store: birdzarr.Store
) -> None:
    """The call docs/format.md gives: no warning, the arrays' names and units, CF-decoded times
    (a version-1 store's gimu array; csv_store, in the default format, for the times)."""
    xr = pytest.importorskip("xarray")
    store = small_store_v1 if codec == "dict16" else standard_store
    ds = xr.open_zarr(store.location.path, zarr_format=3, consolidated=False)
    assert ds["gimu"].dims == ("window", "sample", "channel")
    assert ds["gimu"].attrs == {"long_name": "curated sensor windows", "channels": list(birdzarr.CHANNELS),
                                "units": ["g", "g", "g", "m/s divided by gps_scale"]}
    assert ds["device"].attrs == {"long_name": "device (tracker) id"}
    assert ds["label"].attrs == {"long_name": "behaviour label (-1 = unlabelled)"}
    n = len(store)
    assert np.array_equal(bits(ds["gimu"][:n].values), bits(store.windows[:]))
    assert np.array_equal(ds["device"][:n].values, store.window_devices[:])
    assert np.array_equal(ds["label"][:n].values, store.labels[:])
    # timestamp's units attribute is CF ("seconds since 1970-01-01T00:00:00Z"): xarray decodes it,
    # and the unknown value (INT64_MIN, all of a Parquet store) becomes NaT.
    assert ds["timestamp"].dtype.kind == "M" and np.all(np.isnat(ds["timestamp"][:n].values))
    timed = xr.open_zarr(csv_store.location.path, zarr_format=3, consolidated=False)
    # a format-2 store's coded arrays carry the units of the values they decode to
    assert timed["gimu_codes"].attrs["units"] == ["g", "g", "g"]
    assert timed["gps_speed"].attrs["units"] == "m/s divided by gps_scale"
    assert timed["dict_values"].attrs["units"] == "g"
    assert np.array_equal(timed["timestamp"].values, csv_store.timestamps[:].astype("datetime64[s]"))


def test_xarray_warns_without_consolidated_false(small_store: birdzarr.Store) -> None:
    """Why the documented call passes consolidated=False: stores have no consolidated metadata
    (not part of the Zarr v3 specification), and xarray warns before falling back."""
    xr = pytest.importorskip("xarray")
    with pytest.warns(RuntimeWarning, match="consolidated metadata"):
        xr.open_zarr(small_store.location.path)


@pytest.mark.slow
def test_dict16_decodes_in_plain_zarr_through_the_entry_point(small_store_v1: birdzarr.Store) -> None:
    """zarr finds birdzarr.dict16 through the `zarr.codecs` entry point, without `import birdzarr`
    (a version-1 store's gimu array)."""
    small_store = small_store_v1
    code = (
        "import sys, zarr, numpy as np\n"
        "a = zarr.open_array(sys.argv[1] + '/gimu', mode='r', zarr_format=3)\n"
        "assert 'birdzarr' not in sys.modules or 'birdzarr.format._codec' in sys.modules\n"
        "sys.stdout.buffer.write(np.ascontiguousarray(a[:100]).tobytes())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, small_store.location.path], capture_output=True, timeout=60
    )
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout == np.ascontiguousarray(small_store.windows[:100]).tobytes()


@pytest.fixture(scope="module")
def http_server(small_store: birdzarr.Store) -> Iterator[str]:
    """``python -m http.server`` serving the directory that holds the store."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    directory = str(Path(small_store.location.path).parent)
    server = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", directory],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while True:
        try:
            urllib.request.urlopen(url, timeout=1).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                server.kill()
                raise
            time.sleep(0.05)
    yield url
    server.terminate()
    server.wait(10)


@pytest.mark.slow
def test_static_http_server_is_read_only_and_exact(
    http_server: str, small_store: birdzarr.Store, parquet_source: Any
) -> None:
    name = Path(small_store.location.path).name
    store = birdzarr.open_store(f"{http_server}/{name}")
    assert len(store) == len(small_store) and store.location.read_only
    assert np.array_equal(bits(store.windows[:]), bits(small_store.windows[:]))
    device = int(small_store.devices["device_id"].iloc[3])
    assert np.array_equal(bits(store.device_windows(device)), bits(small_store.device_windows(device)))
    for name in (*_v2.ARRAYS, "device", "label"):  # zarr, too: the stored arrays of the default format
        assert np.array_equal(bits(np.asarray(store.group[name][:50])),  # type: ignore[index]
                              bits(np.asarray(small_store.group[name][:50]))), name  # type: ignore[index]
    # Writing is refused and leaves nothing behind: ReadOnlyLocationError where birdzarr checks
    # first (copy; convert once it calls _storage.require_writable), else the server's 501.
    directory, _ = parquet_source
    with pytest.raises(Exception):  # noqa: B017
        birdzarr.convert(directory, f"{http_server}/new.zarr", progress=False)
    assert not (Path(small_store.location.path).parent / "new.zarr").exists()
    with pytest.raises(ReadOnlyLocationError):
        copy_store(small_store.location, f"{http_server}/copy.zarr", progress=False)


# -- format 2: every array in core Zarr v3 codecs, read without birdzarr ---------------------------


_READ_WITH = {
    "tensorstore": [
        "import tensorstore as ts",
        "def read(name):",
        "    spec = {'driver': 'zarr3', 'kvstore': {'driver': 'file', 'path': root + '/' + name + '/'}}",
        "    return ts.open(spec, read=True).result().read().result()",
    ],
    "zarr": [
        "import zarr",
        "def read(name):",
        "    return zarr.open_array(root + '/' + name, mode='r', zarr_format=3)[:]",
    ],
}


@pytest.mark.slow
@pytest.mark.parametrize("reader", ["tensorstore", "zarr"])
@pytest.mark.parametrize("order", ["device order", "shuffled"])
def test_a_format_2_store_is_read_without_birdzarr_and_decoded_with_the_documented_lines(
    request: pytest.FixtureRequest, tmp_path: Path, reader: str, order: str,
) -> None:
    """TensorStore and plain zarr-python, in a process where birdzarr cannot be imported, read
    every array of a format-2 store (core codecs only) and the documented numpy lines decode
    birdzarr's float32 windows from them, bit for bit."""
    if reader == "tensorstore":
        pytest.importorskip("tensorstore")
    v1, v2 = request.getfixturevalue("v2_pair" if order == "device order" else "v2_shuffled_pair")
    root = Path(v2.location.path)
    assert_core_codecs(root)
    a, b = 1000, len(v2) - 5
    out = tmp_path / "out.npz"
    run_without_birdzarr([
        "import numpy as np",
        f"root = {str(root)!r}",
        *_READ_WITH[reader],
        f"z = {{name: read(name) for name in {(*_v2.ARRAYS, 'device', 'label')!r}}}",
        f"a, b = {a}, {b}",
        documented_decode(),
        f"np.savez({str(out)!r}, windows=windows, device=z['device'][a:b], label=z['label'][a:b])",
    ])
    got = np.load(out)
    expected = v2.windows[a:b]
    assert got["windows"].dtype == np.float32 and np.array_equal(bits(got["windows"]), bits(expected))
    assert np.array_equal(bits(expected), bits(v1.windows[a:b]))  # and the version-1 store's windows
    assert np.array_equal(got["device"], v2.window_devices[a:b])
    assert np.array_equal(got["label"], v2.labels[a:b])


@pytest.mark.slow
def test_xarray_opens_a_format_2_store_without_birdzarr(request: pytest.FixtureRequest) -> None:
    """xarray.open_zarr, with birdzarr not importable, opens every array of a format-2 store
    (a version-1 store's gimu needs birdzarr's codec) and gives the stored codes."""
    pytest.importorskip("xarray")
    _, v2 = request.getfixturevalue("v2_shuffled_pair")
    script = "\n".join([
        "import sys",
        "sys.modules['birdzarr'] = None  # any import of birdzarr fails",
        "import numpy as np, xarray",
        f"ds = xarray.open_zarr({v2.location.path!r}, zarr_format=3, consolidated=False)",
        "print(sorted(ds.data_vars), dict(ds['gimu_codes'].sizes), ds['gimu_codes'].dtype)",
        "sys.stdout.flush()",
        "sys.stdout.buffer.write(np.ascontiguousarray(ds['gimu_codes'][:100].values).tobytes())",
    ])
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr.decode()
    first, _, rest = done.stdout.partition(b"\n")
    assert first.decode() == (
        "['device', 'dict_device', 'dict_start', 'dict_values', 'gimu_codes', 'gimu_row', 'gps_speed', "
        "'label', 'timestamp'] {'window': 30000, 'sample': 20, 'channel': 3} uint16")
    assert rest == np.ascontiguousarray(v2.group["gimu_codes"][:100]).tobytes()  # type: ignore[index]


# -- the default store, decoded as docs/format.md documents it ------------------------------------

FORMAT_DOC = Path(__file__).resolve().parents[1] / "docs" / "format.md"
_DOC_PATH = "ssl20.zarr"  # the store path in docs/format.md's examples


def _format_doc_block(after: str) -> list[str]:
    """The lines of the first ```python block of docs/format.md that follows the text ``after``."""
    text = FORMAT_DOC.read_text()
    rest = text[text.index(after):]
    body = rest[rest.index("```python\n") + len("```python\n"):]
    return body[: body.index("```")].rstrip("\n").splitlines()


@pytest.fixture(scope="module")
def default_stores(
    parquet_source: Any, tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, birdzarr.Store]:
    """The parquet_source converted with birdzarr.convert's defaults, in each order."""
    directory, _ = parquet_source
    root = tmp_path_factory.mktemp("interop_default")
    return {"device order": birdzarr.convert(directory, root / "device.zarr", progress=False),
            "shuffled": birdzarr.convert(directory, root / "shuffled.zarr", shuffle=True, seed=6,
                                         progress=False)}


@pytest.mark.slow
@pytest.mark.parametrize("reader", ["tensorstore", "zarr"])
@pytest.mark.parametrize("order", ["device order", "shuffled"])
def test_a_default_store_is_decoded_without_birdzarr_by_the_lines_of_docs_format(
    default_stores: dict[str, birdzarr.Store], tmp_path: Path, reader: str, order: str,
) -> None:
    """A store birdzarr.convert writes by default (device order, and shuffle=True) is read by
    zarr-python and by TensorStore in a process where birdzarr cannot be imported; the lines of
    docs/format.md's "Decoding the windows" (zarr-python's block as it is, TensorStore's spec with
    the same numpy lines) give every committed window, equal bit for bit to birdzarr's."""
    if reader == "tensorstore":
        pytest.importorskip("tensorstore")
    store = default_stores[order]
    root = Path(store.location.path)
    assert store.format_version == 2 and store.shuffled == (order == "shuffled")
    assert_core_codecs(root)
    zarr_lines = _format_doc_block("## Decoding the windows")
    assert zarr_lines[:2] == ["import numpy as np, zarr",
                              f'z = zarr.open_group("{_DOC_PATH}", mode="r", zarr_format=3)'], zarr_lines
    if reader == "zarr":
        decode = zarr_lines
    else:
        ts_lines = _format_doc_block("TensorStore reads each array")
        assert ts_lines[0] == "import tensorstore as ts" and ts_lines[1].startswith("spec = lambda name:")
        # TensorStore's import and spec, z[name][key] through them and the root's attributes as
        # JSON; the documented numpy lines follow (zarr_lines from the third, `n = ...`), then
        # TensorStore's documented read of the codes, which must give the codes decoded
        decode = [
            "import numpy as np",
            *ts_lines[:2],
            "class _Array:",
            "    def __init__(self, name): self.array = ts.open(spec(name)).result()",
            "    def __getitem__(self, key): return self.array[key].read().result()",
            "class _Group:",
            "    attrs = json.load(open(root + '/zarr.json'))['attributes']",
            "    def __getitem__(self, name): return _Array(name)",
            "z = _Group()",
            *zarr_lines[2:],
            "decoded_codes = codes",
            *ts_lines[2:],
            "assert codes.dtype == np.uint16 and np.array_equal(codes, decoded_codes)",
        ]
    decode = [line.replace(_DOC_PATH, "{root}") for line in decode]
    out = tmp_path / "out.npz"
    run_without_birdzarr([
        "import json",
        f"root = {str(root)!r}",
        *(line.replace('"{root}"', "root").replace('f"{root}/', 'root + f"/') for line in decode),
        f"np.savez({str(out)!r}, windows=windows, a=a, b=b)",
    ])
    got = np.load(out)
    assert (int(got["a"]), int(got["b"])) == (0, len(store)) == (0, 30_000)
    expected = store.windows[:]
    assert got["windows"].dtype == np.float32 and got["windows"].shape == (30_000, 20, 4)
    assert np.array_equal(bits(got["windows"]), bits(expected))
