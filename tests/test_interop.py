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
from birdzarr.maintenance._copy import copy_store

ARRAYS = ("gimu", "device", "timestamp", "label")


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint8)


@pytest.fixture(scope="module")
def standard_store(parquet_source: Any, tmp_path_factory: pytest.TempPathFactory) -> birdzarr.Store:
    directory, _ = parquet_source
    dest = tmp_path_factory.mktemp("interop") / "standard.zarr"
    return birdzarr.convert(directory, dest, codec="standard", chunk_windows=4096, progress=False)


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
def test_xarray_opens_the_store(
    codec: str, small_store: birdzarr.Store, standard_store: birdzarr.Store, csv_store: birdzarr.Store
) -> None:
    """The call docs/format.md gives: no warning, the arrays' names and units, CF-decoded times."""
    xr = pytest.importorskip("xarray")
    store = small_store if codec == "dict16" else standard_store
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
    assert np.array_equal(timed["timestamp"].values, csv_store.timestamps[:].astype("datetime64[s]"))


def test_xarray_warns_without_consolidated_false(small_store: birdzarr.Store) -> None:
    """Why the documented call passes consolidated=False: stores have no consolidated metadata
    (not part of the Zarr v3 specification), and xarray warns before falling back."""
    xr = pytest.importorskip("xarray")
    with pytest.warns(RuntimeWarning, match="consolidated metadata"):
        xr.open_zarr(small_store.location.path)


@pytest.mark.slow
def test_dict16_decodes_in_plain_zarr_through_the_entry_point(small_store: birdzarr.Store) -> None:
    """zarr finds birdzarr.dict16 through the `zarr.codecs` entry point, without `import birdzarr`."""
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
    assert np.array_equal(bits(np.asarray(store.gimu[:50])), bits(small_store.windows[:50]))  # zarr, too
    # Writing is refused and leaves nothing behind: ReadOnlyLocationError where birdzarr checks
    # first (copy; convert once it calls _storage.require_writable), else the server's 501.
    directory, _ = parquet_source
    with pytest.raises(Exception):  # noqa: B017
        birdzarr.convert(directory, f"{http_server}/new.zarr", progress=False)
    assert not (Path(small_store.location.path).parent / "new.zarr").exists()
    with pytest.raises(ReadOnlyLocationError):
        copy_store(small_store.location, f"{http_server}/copy.zarr", progress=False)
