"""Shared fixtures: small generated stores (realistic calibrated values, see birdzarr.demo._synthetic)."""

from __future__ import annotations

import pathlib
import shutil
from collections.abc import Iterator

import numpy as np
import pytest

import birdzarr
from birdzarr.demo import _synthetic


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test on moto's S3 server is ``s3`` and ``slow`` wherever it is (tests/s3_support.py)."""
    for item in items:
        if {"moto", "s3_endpoint"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.s3)
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session", autouse=True)
def _stats_cache_of_the_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Statistics are cached per machine (birdzarr.explore): never in the user's ~/.cache from tests."""
    mp = pytest.MonkeyPatch()
    mp.setenv("BIRDZARR_CACHE_DIR", str(tmp_path_factory.mktemp("birdzarr_cache")))
    yield
    mp.undo()


@pytest.fixture(scope="session")
def parquet_source(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, dict[int, np.ndarray]]:
    """12 devices, 30,000 windows, as per-device Parquet files, with the true windows."""
    directory = tmp_path_factory.mktemp("parquet")
    truth = _synthetic.make_parquet_dir(directory, n_devices=12, total_windows=30_000, seed=7)
    return directory, truth


@pytest.fixture(scope="session")
def small_store(parquet_source, tmp_path_factory) -> birdzarr.Store:  # type: ignore[no-untyped-def]
    """The parquet_source converted with 1024-window chunks (many chunks, fast tests)."""
    directory, _ = parquet_source
    dest = tmp_path_factory.mktemp("stores") / "small.zarr"
    return birdzarr.convert(directory, dest, chunk_windows=1024, progress=False)


@pytest.fixture(scope="session")
def small_store_v1(tmp_path_factory: pytest.TempPathFactory) -> birdzarr.Store:
    """A format-1 store (dict16, device order: 4 devices, 240 windows in 64-window chunks), copied
    from tests/data/format1/ (birdzarr writes format 2 only): what tests of reading version 1 start
    from. tests/format1_support.py has the others and their sources."""
    from tests.format1_support import format1_copy

    return birdzarr.open_store(format1_copy("dict16.zarr", tmp_path_factory.mktemp("stores")))


@pytest.fixture()
def store_copy(small_store: birdzarr.Store, tmp_path: pathlib.Path) -> pathlib.Path:
    """A private copy of the session's small store (1024-window chunks), free to damage."""
    dest = tmp_path / "copy.zarr"
    shutil.copytree(small_store.location.path, dest)
    return dest
