"""The convert, info and demo commands through ``birdzarr.cli.main``."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

import birdzarr
from birdzarr.cli import main
from birdzarr.format import _v2


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_convert_then_info(
    parquet_source: tuple[pathlib.Path, dict[int, np.ndarray]],
    tmp_path: pathlib.Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    directory, truth = parquet_source
    dest = tmp_path / "s.zarr"
    assert main(["convert", str(directory), str(dest), "--quiet", "--chunk-windows", "2048"]) == 0
    out = capsys.readouterr().out
    assert "30,000 from 12 devices" in out and "ratio" in out
    assert len(birdzarr.open_store(dest)) == 30_000

    assert main(["info", str(dest)]) == 0
    out = capsys.readouterr().out
    assert "birdzarr v2" in out and "codec uint16 codes + dictionaries (core Zarr v3 codecs)" in out
    assert main(["info", str(dest), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["windows"] == 30_000 and info["devices"] == 12
    assert info["format_version"] == 2
    assert info["layout"]["chunk_windows"] == 2048 and "codec" not in info["layout"]
    assert sorted(info["bytes_arrays"]) == sorted(_v2.ARRAYS)
    assert info["bytes_raw"] == 30_000 * 320
    assert 0 < info["bytes_stored"] < info["bytes_raw"] / 2  # calibrated data compresses > 2x

    # a second convert to the same place is refused with the hint, exit code 2
    assert main(["convert", str(directory), str(dest), "--quiet"]) == 2
    assert "--overwrite" in capsys.readouterr().err
    # info on a format-1 store (read, never written)
    from tests.format1_support import format1_copy

    old = format1_copy("standard.zarr", tmp_path)
    assert main(["info", str(old)]) == 0
    assert "birdzarr v1" in capsys.readouterr().out


def test_convert_bad_rows_skip(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "src"
    source.mkdir()
    lines = [f"3,2014-01-01 10:00:00,{i},-1,0.1,0.2,0.3,1.0\n" for i in range(40)]
    lines[4] = "3,2014-01-01 10:00:00,4,-1,0.1,oops,0.3,1.0\n"
    (source / "3_0.csv").write_text("".join(lines))
    assert main(["convert", str(source), str(tmp_path / "a.zarr"), "--quiet"]) == 2
    assert "line 5" in capsys.readouterr().err
    assert main(["convert", str(source), str(tmp_path / "a.zarr"), "--quiet", "--on-bad-rows", "skip"]) == 0
    assert "bad lines 1" in capsys.readouterr().out


def test_info_errors(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", str(tmp_path / "nothing")]) == 2
    assert "no store at" in capsys.readouterr().err


@pytest.mark.slow
def test_demo(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", str(tmp_path / "demo"), "--windows", "3000"]) == 0
    out = capsys.readouterr().out
    assert out.count("store        ") == 3  # the summaries of the Parquet, CSV and --shuffle stores
    assert "codec uint16 codes + dictionaries (core Zarr v3 codecs), shuffled True (seed 1)" in out
    assert "3,000 from 24 devices" in out
    # one shuffled read of each training path: the --shuffle store streamed, the other resident
    assert "train.zarr (converted with --shuffle, streamed): 1 batches" in out
    assert "from_parquet.zarr (device order, resident='cpu'): 1 batches" in out
    assert out.count("device mix ") == 2 and out.count("pair co-occurrence 1.0 ") == 2
    assert birdzarr.open_store(tmp_path / "demo" / "train.zarr").shuffled
    assert main(["demo", str(tmp_path / "demo"), "--windows", "3000"]) == 0  # again: its own directory
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    assert main(["demo", str(tmp_path / "mine"), "--windows", "3000"]) == 2
    assert "holds files the demo did not make" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["notes.txt"]
    assert (
        birdzarr.open_store(tmp_path / "demo" / "from_csv.zarr").meta["curation"]["applied_by"] == "birdzarr"
    )


def test_a_csv_named_by_a_non_integer_device_gets_one_message(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "src"
    source.mkdir()
    lines = [f"12,2014-01-01 10:00:00,{i},-1,0.1,0.2,0.3,1.0\n" for i in range(20)]
    (source / "gull-A12_0.csv").write_text("".join(lines))
    expected = ("'gull-A12_0.csv': 'gull-A12' is not a device id; device ids are integers (at most 9 "
                "digits), and CSV exports are named {device}_{part}.csv")
    errors = []
    for given in ([str(source)], [str(source), "--skip-unknown-files"], [str(source / "gull-A12_0.csv")]):
        assert main(["convert", *given, str(tmp_path / "s.zarr"), "--quiet"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and expected in err
        errors.append(err.split(": ", 1)[1])
    assert len(set(errors)) == 1  # the same words on every path
    assert not (tmp_path / "s.zarr").exists()
    (source / "gull-A12_0.csv").rename(source / "12_0.csv")
    assert main(["convert", str(source), str(tmp_path / "s.zarr"), "--quiet"]) == 0
