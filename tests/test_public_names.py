"""One name per concept (docs/format.md#glossary): the renamed spellings keep working for one
release with a DeprecationWarning naming the new one (docs/api.md#deprecated-names); every result
type renders with ``format()`` and ``str()``; what users receive is exported; ``info --json``
has a Python equivalent, ``store.summary()``."""

from __future__ import annotations

import json
import pathlib
import re
import tempfile
import warnings
from typing import Any

import pytest

import birdzarr
from birdzarr.cli import main


def _warns(new: str) -> Any:  # pytest.warns(...), matching the message that names ``new``
    return pytest.warns(DeprecationWarning, match=r"is deprecated and will be removed in the next release; "
                                                  f"use {re.escape(new)} instead$")


# -- renamed spellings ----------------------------------------------------------------------------

def test_the_loader_prefetch_option_is_now_requests(small_store: birdzarr.Store) -> None:
    torch = pytest.importorskip("torch")
    del torch
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # the new spelling warns of nothing
        ds = birdzarr.WindowDataset(small_store, requests=3, allow_device_order=True)
        assert ds.config.requests == 3
        assert ds.config.batch_size == 8192
    with _warns("WindowDataset(requests=...)") as caught:
        old = birdzarr.WindowDataset(small_store, prefetch=2, allow_device_order=True)
    assert caught[0].filename == __file__  # the warning points at the caller's line
    assert old.config.requests == 2
    with _warns("LoaderConfig.requests"):
        assert old.config.prefetch == 2
    with _warns("WindowDataset.config.requests"):
        assert old.prefetch == 2
    # the old name is still checked under its own name; both names at once are refused
    with _warns("WindowDataset(requests=...)"), \
            pytest.raises(birdzarr.ArgumentError, match=r"^prefetch must be positive, got 0$"):
        birdzarr.WindowDataset(small_store, prefetch=0, allow_device_order=True)
    with _warns("WindowDataset(requests=...)"), pytest.raises(
            birdzarr.ArgumentError, match=r"^prefetch is the deprecated name of requests: give one of them$"):
        birdzarr.WindowDataset(small_store, prefetch=8, requests=16, allow_device_order=True)
    with pytest.raises(birdzarr.ArgumentError, match=r"^requests must be positive, got 0$"):
        birdzarr.WindowDataset(small_store, requests=0, allow_device_order=True)


@pytest.mark.parametrize("name", ["batch_size", "shuffle", "seed", "drop_last", "channel_first", "with_ldt",
                                  "transform", "transform_ldt", "reuse_batch_memory", "world_size", "rank"])
def test_a_dataset_option_is_read_from_its_config(name: str, small_store: birdzarr.Store) -> None:
    pytest.importorskip("torch")
    ds = birdzarr.WindowDataset(small_store, batch_size=500, shuffle=False, seed=4, with_ldt=True)
    with _warns(f"WindowDataset.config.{name}") as caught:
        value = getattr(ds, name)
    assert caught[0].filename == __file__
    assert value == getattr(ds.config, name)
    assert {"batch_size": 500, "shuffle": False, "seed": 4, "with_ldt": True}.get(name, value) == value


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_copy_names_the_source_options_source_storage_options(
    small_store: birdzarr.Store, tmp_path: pathlib.Path
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        new = birdzarr.copy(small_store.url, tmp_path / "new.zarr", progress=False, source_storage_options={},
                            dest_storage_options={})
    with _warns("copy(source_storage_options=...)") as caught:
        old = birdzarr.copy(small_store.url, tmp_path / "old.zarr", progress=False, storage_options={})
    assert caught[0].filename == __file__
    assert (new.objects, new.copied) == (old.objects, old.copied) and old.copied > 0
    assert len(birdzarr.open_store(tmp_path / "old.zarr")) == len(small_store)
    with pytest.raises(
        birdzarr.ArgumentError,
        match=r"^storage_options is the deprecated spelling of source_storage_options: give one of them$",
    ):
        birdzarr.copy(small_store.url, tmp_path / "both.zarr", progress=False, storage_options={},
                      source_storage_options={})
    assert not (tmp_path / "both.zarr").exists()  # refused before anything was written
    with pytest.raises(birdzarr.ArgumentError, match=r"^requests must be a positive integer, got 0$"):
        birdzarr.copy(small_store.url, tmp_path / "none.zarr", progress=False, requests=0)


def test_repair_returns_a_repair_result() -> None:
    assert "RepairResult" in birdzarr.__all__ and "RepairReport" not in birdzarr.__all__
    with _warns("birdzarr.RepairResult"):
        old = birdzarr.RepairReport
    assert old is birdzarr.RepairResult
    with pytest.raises(AttributeError, match="has no attribute 'RepairRecord'"):
        birdzarr.RepairRecord  # noqa: B018


# -- one rendering method -------------------------------------------------------------------------

@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_every_result_renders_with_format_and_str(
    small_store: birdzarr.Store, store_copy: pathlib.Path, tmp_path: pathlib.Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # repair also names spill directories of --shuffle conversions in the temporary directory:
    # an empty one here, so a conversion running elsewhere on the machine cannot add a note
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    verified = birdzarr.verify(small_store, progress=False)
    repaired = birdzarr.repair(store_copy)
    copied = birdzarr.copy(small_store.url, tmp_path / "c.zarr", progress=False)
    appended = birdzarr.AppendResult(small_store, windows_added=1200, devices_added=[7])
    for result in (verified, repaired, copied, appended):
        assert str(result) == result.format()
    n = len(small_store)
    assert verified.format().startswith(f"{small_store.url}: OK, checked {n:,} committed windows")
    assert repaired.format() == f"{store_copy}: {n:,} committed windows kept; nothing to repair."
    assert re.fullmatch(r"\d+ objects \([\d.,]+ MB\): \d+ copied \([\d.,]+ MB, [\d.,]+ MB/s\), 0 already "
                        r"present and identical, 0 stale removed; checksums verified; committed in "
                        r"[\d.]+ s", copied.format()), copied.format()
    assert appended.format() == "appended 1,200 windows: 1 new device(s), 0 extended"
    with _warns("CopyResult.format() or str(result)") as caught:
        assert copied.summary() == copied.format()
    assert caught[0].filename == __file__


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_the_copy_command_prints_the_result_format(
    small_store: birdzarr.Store, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # the CLI uses no deprecated name
        assert main(["copy", small_store.url, str(tmp_path / "c.zarr"), "--quiet"]) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith(f"{tmp_path / 'c.zarr'}: ") and "checksums verified; committed in" in out


# -- what users receive is exported ------------------------------------------------------------------

def test_what_users_receive_is_exported(small_store: birdzarr.Store) -> None:
    entry = small_store.device(small_store.device_table[0].device_id)
    assert isinstance(entry, birdzarr.DeviceEntry)
    assert all(isinstance(r, birdzarr.DeviceReport) for r in small_store.report.values())
    assert isinstance(small_store.windows, birdzarr.WindowsView)
    pytest.importorskip("torch")
    ds = birdzarr.WindowDataset(small_store, allow_device_order=True)
    assert isinstance(ds.config, birdzarr.LoaderConfig)
    assert isinstance(ds.plan(), birdzarr.EpochPlan)
    assert isinstance(ds.stats(), birdzarr.SelectionStats)
    for name in ("LoaderConfig", "EpochPlan", "SelectionStats", "DeviceEntry", "DeviceReport",
                 "AppendResult"):
        assert name in birdzarr.__all__, name


# -- info --json in Python ----------------------------------------------------------------------------

def test_store_summary_is_what_info_json_prints(
    small_store: birdzarr.Store, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["info", small_store.url, "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    summary = small_store.summary()
    assert json.loads(json.dumps(summary, default=str)) == printed
    assert summary["windows"] == len(small_store) == small_store.n_windows
    assert summary["devices"] == small_store.n_devices == len(small_store.device_table)
    assert summary["format_version"] == small_store.format_version
