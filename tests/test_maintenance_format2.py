"""verify, copy and repair on a format-2 store (issue 31): every chunk of every array checked and
copied (the array list comes from the store), damage named by array and key, codes checked against
their dictionaries and rows against their devices; repair rebuilds a damaged per-window chunk from
the source, and refuses in one line, changing nothing, what it cannot rebuild."""

from __future__ import annotations

import json
import pathlib
import shutil
import tempfile
from typing import Any

import numpy as np
import pytest
import zarr
from format1_support import format1_copy
from s3_support import MotoEndpoint, moto, new_bucket, s3_options  # noqa: F401  (moto: a fixture)

import birdzarr
from birdzarr._errors import BadInputError, CorruptChunkError, MissingChunkError
from birdzarr.cli import main
from birdzarr.demo import _synthetic
from birdzarr.format import _v2
from birdzarr.format._rows import encode
from birdzarr.maintenance._repair import repair
from birdzarr.maintenance._verify import verify

CHUNK = 1024  # small_store's chunk length
CORRUPT = ("cannot be decoded (crc32c checksum mismatch: the chunk's bytes were changed or truncated). "
           "The store is damaged; run `birdzarr verify`.")
MISSING = ("is missing. The store is damaged; run `birdzarr verify` on it and re-convert or restore the "
           "missing files.")


@pytest.fixture(autouse=True)
def _own_temporary_directory(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """repair names the spill directories of `convert --shuffle` in the temporary directory: an
    empty one of the test's, not the machine's (where other conversions may be running)."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))


@pytest.fixture(scope="module")
def v2_store(small_store: birdzarr.Store) -> pathlib.Path:
    """The session's small store (12 devices, 30,000 windows, 1024-window chunks), which the
    converter writes in format 2 by default."""
    assert small_store.format_version == 2
    return pathlib.Path(small_store.location.path)


@pytest.fixture()
def v2(v2_store: pathlib.Path, tmp_path: pathlib.Path) -> pathlib.Path:
    """A private copy of the format-2 store, free to damage."""
    path = tmp_path / "v2.zarr"
    shutil.copytree(v2_store, path)
    return path


@pytest.fixture(scope="module", params=[False, True], ids=["device-order", "shuffled"])
def converted_v2(request: pytest.FixtureRequest, parquet_source: tuple[pathlib.Path, dict],
                 tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """parquet_source converted by the converter straight to format 2, in each order."""
    path = tmp_path_factory.mktemp("converted") / "v2.zarr"
    store = birdzarr.convert(parquet_source[0], path, chunk_windows=CHUNK,
                             shuffle=request.param, progress=False)
    assert (store.format_version, store.shuffled) == (2, request.param)
    return path


@pytest.fixture()
def converted_copy(converted_v2: pathlib.Path, tmp_path: pathlib.Path) -> pathlib.Path:
    """A private copy of converted_v2 (in each order), free to damage."""
    path = tmp_path / "v2.zarr"
    shutil.copytree(converted_v2, path)
    return path


def _flip(path: pathlib.Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _objects(path: pathlib.Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _array(path: pathlib.Path, name: str, mode: str = "r") -> Any:
    return zarr.open_array(str(path / name), mode=mode, zarr_format=3)


def _sizes(path: pathlib.Path) -> np.ndarray:
    return _v2.entry_counts(_array(path, _v2.START)[:], _array(path, _v2.VALUES).shape[0])


# -- verify ------------------------------------------------------------------------------------------


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_an_intact_format2_store_verifies_against_its_source(
    v2_store: pathlib.Path, parquet_source: tuple[pathlib.Path, dict], capsys: pytest.CaptureFixture[str]
) -> None:
    result = verify(v2_store, source=parquet_source[0])
    assert result.ok, result.format()
    assert (result.chunks_checked, result.checksums_checked, result.devices_compared) == (30, 12, 12)
    assert main(["verify", str(v2_store), "--quiet"]) == 0
    assert capsys.readouterr().out == (f"{v2_store}: OK, checked 30,000 committed windows (generation 1): "
                                       "30 chunks, 12 checksums\n")


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_verify_names_a_damaged_codes_chunk_and_a_missing_gps_chunk(v2: pathlib.Path) -> None:
    _flip(v2 / "gimu_codes" / "c" / "2" / "0" / "0")
    (v2 / "gps_speed" / "c" / "5" / "0").unlink()
    result = verify(v2)
    assert result.problems == [
        f"{v2}: chunk 'gimu_codes/c/2/0/0' {CORRUPT}",
        f"{v2}: committed chunk 'gps_speed/c/5/0' {MISSING}",
        "device 200, windows [0, 3,331): checksum cannot be checked, a chunk is missing or damaged (above)",
        "device 207, windows [3,331, 6,658): checksum cannot be checked, a chunk is missing or damaged "
        "(above)",
    ]
    assert result.checksums_checked == 10


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_verify_names_a_damaged_dictionary_chunk_once(v2: pathlib.Path, capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    _flip(v2 / "dict_values" / "c" / "0")
    result = verify(v2)
    assert result.problems == [
        f"{v2}: chunk 'dict_values/c/0' {CORRUPT}",
        "the checksums of all 12 device ranges cannot be checked: the dictionaries are missing or damaged "
        "(above)",
    ]
    assert main(["verify", str(v2), "--quiet"]) == 1
    assert "FAILED" in capsys.readouterr().out


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_verify_finds_a_code_past_its_dictionary_in_a_crc_valid_chunk(v2: pathlib.Path) -> None:
    rows = _array(v2, _v2.ROW)[3 * CHUNK : 4 * CHUNK]
    size = int(_sizes(v2)[rows[10], 1])
    codes = _array(v2, _v2.CODES, "r+")
    chunk = codes[3 * CHUNK : 4 * CHUNK]
    chunk[10, 4, 1] = size  # one past the last entry: zarr writes it with a valid CRC-32C
    codes[3 * CHUNK : 4 * CHUNK] = chunk
    result = verify(v2)
    assert result.problems == [
        "windows 3,072..4,095 (chunks 'gimu_codes/c/3/0/0' and 'gimu_row/c/3'): 1 window(s) hold a code "
        f"past the end of their dictionary (first: window 3,082, sample 4, channel 1: code {size} of row "
        f"{int(rows[10])}, which holds {size} entries)",
        "device 200, windows [0, 3,331): checksum cannot be checked, a chunk is missing or damaged (above)",
        "device 207, windows [3,331, 6,658): checksum cannot be checked, a chunk is missing or damaged "
        "(above)",
    ]
    with pytest.raises(CorruptChunkError, match="gimu_codes/c/3/0/0"):  # the readers refuse it too
        birdzarr.open_store(v2).windows[3 * CHUNK]


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_verify_finds_a_window_coded_with_another_devices_row(v2: pathlib.Path) -> None:
    dict_device = _array(v2, _v2.DEVICE)[:]
    rows = _array(v2, _v2.ROW, "r+")
    chunk = rows[0:CHUNK]
    assert int(dict_device[chunk[5]]) == 200
    other = int(np.flatnonzero(dict_device != 200)[0])
    chunk[5] = other
    rows[0:CHUNK] = chunk
    result = verify(v2)
    assert result.problems[0] == (
        "windows 0..1,023 (chunk 'gimu_row/c/0'): 1 window(s) are coded with a dictionary row of another "
        f"device (first: window 5 of device 200, row {other}, which 'dict_device' gives to device "
        f"{int(dict_device[other])})")
    assert result.problems[1].startswith("device 200, windows [0, 3,331): checksum ")
    assert result.problems[1].endswith("(chunks 0..3 of 'gimu_codes', 'gps_speed', 'gimu_row')")
    assert len(result.problems) == 2


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_a_converted_format2_store_verifies_and_copies_in_either_order(
    converted_v2: pathlib.Path, parquet_source: tuple[pathlib.Path, dict], tmp_path: pathlib.Path
) -> None:
    result = verify(converted_v2, source=parquet_source[0])
    assert result.ok, result.format()
    assert (result.chunks_checked, result.checksums_checked, result.devices_compared) == (30, 12, 12)
    dest = tmp_path / "dest.zarr"
    birdzarr.copy(converted_v2, dest, progress=False)
    assert _objects(dest) == _objects(converted_v2)
    assert verify(dest, source=parquet_source[0]).ok


@pytest.mark.slow  # over 0.2 s of CPU with its module fixture (two conversions): not in the fast loop
def test_verify_says_once_that_damaged_dictionaries_stop_every_check(
    converted_copy: pathlib.Path, parquet_source: tuple[pathlib.Path, dict]
) -> None:
    path = converted_copy
    (path / "dict_device" / "c" / "0").unlink()
    shuffled = birdzarr.open_store(path).shuffled
    result = verify(path, source=parquet_source[0])
    assert result.problems == [
        f"{path}: committed chunk 'dict_device/c/0' {MISSING}",
        f"the checksums of all 12 {'devices' if shuffled else 'device ranges'} cannot be checked: the "
        "dictionaries are missing or damaged (above)",
        f"the devices cannot be compared with {parquet_source[0]}: the dictionaries are missing or damaged "
        "(above)",
    ]
    assert result.devices_compared == 0


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_verify_and_copy_check_the_device_table_arrays(
    converted_copy: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    path = converted_copy
    table = "device_table/1"
    assert (path / table / "zarr.json").exists()
    (path / table / "first_time" / "c" / "0").unlink()
    _flip(path / table / "n_windows" / "c" / "0")
    result = verify(path)  # the windows are still checked, against the entries themselves
    assert result.problems == [
        f"{path}: chunk '{table}/n_windows/c/0' {CORRUPT}",
        f"{path}: committed chunk '{table}/first_time/c/0' {MISSING}",
    ]
    assert result.checksums_checked == 12
    with pytest.raises(MissingChunkError, match=rf"chunk '{table}/first_time/c/0' is missing; 2 damaged"):
        birdzarr.copy(path, tmp_path / "dest.zarr", progress=False)


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_verify_finds_a_device_table_index_that_disagrees_with_its_entries(
    converted_copy: pathlib.Path
) -> None:
    path = converted_copy
    column = _array(path, "device_table/1/n_windows", "r+")
    counts = column[:]
    counts[3] += 1
    column[:] = counts  # CRC-valid, but not what the entries say
    assert verify(path).problems == [
        "device table: its index array 'device_table/1/n_windows' disagrees with the entries it indexes (in "
        "'device_table/1/details'); restore that file from a copy of the store, or convert the store again "
        "from its sources"]


# -- copy --------------------------------------------------------------------------------------------


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_copy_of_a_format2_store_copies_every_array(v2_store: pathlib.Path, tmp_path: pathlib.Path) -> None:
    dest = tmp_path / "dest.zarr"
    result = birdzarr.copy(v2_store, dest, progress=False)
    source = _objects(v2_store)
    assert _objects(dest) == source  # object by object
    assert result.copied == result.objects == len(source)
    names = {key.split("/")[0] for key in source if "/" in key}
    assert names == {*_v2.ARRAYS, "device", "timestamp", "label", "device_table"}
    assert verify(dest).ok


@pytest.mark.slow  # over a second of CPU: not in the fast loop
def test_copy_of_a_format2_store_resumes_over_its_partial_copy(v2_store: pathlib.Path, tmp_path: pathlib.Path
                                                               ) -> None:
    dest = tmp_path / "dest.zarr"
    birdzarr.copy(v2_store, dest, progress=False)
    (dest / "zarr.json").unlink()  # an interrupted copy: everything but the root
    (dest / "gimu_codes" / "c" / "3" / "0" / "0").unlink()
    again = birdzarr.copy(v2_store, dest, progress=False)
    assert (again.copied, again.skipped) == (2, again.objects - 2)
    assert _objects(dest) == _objects(v2_store)


@pytest.mark.parametrize("key", ["dict_start/c/0/0", "gimu_row/c/7"])
@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_copy_refuses_a_format2_store_with_a_damaged_chunk(v2: pathlib.Path, tmp_path: pathlib.Path,
                                                           key: str) -> None:
    _flip(v2 / key)
    dest = tmp_path / "dest.zarr"
    with pytest.raises(CorruptChunkError) as caught:
        birdzarr.copy(v2, dest, progress=False)
    assert str(caught.value).startswith(
        f"{v2}: committed chunk '{key}' fails its CRC-32C (its bytes were changed or truncated); 1 damaged "
        "chunk(s) in all (0 missing, 1 failing their CRC-32C)")
    assert not (dest / "zarr.json").exists() and not (dest / key).exists()


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_copy_refuses_a_format2_store_with_a_missing_dictionary_chunk(v2: pathlib.Path, tmp_path: pathlib.Path
                                                                      ) -> None:
    (v2 / "dict_device" / "c" / "0").unlink()
    with pytest.raises(MissingChunkError, match=r"committed chunk 'dict_device/c/0' is missing; 1 damaged"):
        birdzarr.copy(v2, tmp_path / "dest.zarr", progress=False)


def test_copy_up_to_and_down_from_s3_and_repair_there(
    converted_v2: pathlib.Path, parquet_source: tuple[pathlib.Path, dict], tmp_path: pathlib.Path,
    moto: MotoEndpoint,  # noqa: F811
) -> None:
    """On moto's S3 server (nothing mocked below HTTP): copy up and down object by object, verify
    there, and repair --source rewrites a lost chunk of the bucket's store in one PUT."""
    bucket = new_bucket(moto)
    options = s3_options(moto.url)
    remote = f"s3://{bucket}/v2.zarr"
    up = birdzarr.copy(converted_v2, remote, progress=False, dest_storage_options=options)
    assert up.copied == up.objects == len(_objects(converted_v2))
    assert verify(remote, storage_options=options).ok
    down = tmp_path / "down.zarr"
    birdzarr.copy(remote, down, progress=False, source_storage_options=options)
    assert _objects(down) == _objects(converted_v2)
    moto.client().delete_object(Bucket=bucket, Key="v2.zarr/gimu_row/c/4")
    assert not verify(remote, storage_options=options).ok
    report = repair(remote, source=parquet_source[0], storage_options=options)
    assert report.actions == ["rebuilt chunk 'gimu_row/c/4' (missing) from the source: windows 4,096..5,119"]
    rebuilt = moto.client().get_object(Bucket=bucket, Key="v2.zarr/gimu_row/c/4")["Body"].read()
    assert rebuilt == (converted_v2 / "gimu_row" / "c" / "4").read_bytes()
    assert verify(remote, storage_options=options, source=parquet_source[0]).ok


# -- repair ------------------------------------------------------------------------------------------


@pytest.mark.slow  # over a second of CPU: not in the fast loop
def test_repair_rebuilds_damaged_per_window_chunks_from_the_source(
    v2: pathlib.Path, v2_store: pathlib.Path, parquet_source: tuple[pathlib.Path, dict],
    capsys: pytest.CaptureFixture[str],
) -> None:
    _flip(v2 / "gimu_codes" / "c" / "2" / "0" / "0")
    (v2 / "gps_speed" / "c" / "5" / "0").unlink()
    (v2 / "gimu_row" / "c" / "29").unlink()  # the last, partial chunk (windows 29,696..29,999)
    assert not verify(v2).ok
    assert main(["repair", str(v2), "--source", str(parquet_source[0])]) == 0
    assert capsys.readouterr().out == (
        f"{v2}: 30,000 committed windows kept\n"
        "  - rebuilt chunk 'gimu_codes/c/2/0/0' (damaged) from the source: windows 2,048..3,071\n"
        "  - rebuilt chunk 'gps_speed/c/5/0' (missing) from the source: windows 5,120..6,143\n"
        "  - rebuilt chunk 'gimu_row/c/29' (missing) from the source: windows 29,696..29,999\n")
    assert _objects(v2) == _objects(v2_store)  # byte for byte what was written
    assert verify(v2, source=parquet_source[0]).ok
    report = repair(v2, source=parquet_source[0])  # nothing left to rebuild
    assert report.actions == []


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_repair_without_damage_or_without_source_rebuilds_nothing(
    v2: pathlib.Path, v2_store: pathlib.Path, parquet_source: tuple[pathlib.Path, dict]
) -> None:
    assert repair(v2, source=parquet_source[0]).format() == (
        f"{v2}: 30,000 committed windows kept; nothing to repair.")
    (v2 / "gps_speed" / "c" / "5" / "0").unlink()
    assert repair(v2).actions == []  # without --source: leftovers only, as before
    assert not (v2 / "gps_speed" / "c" / "5" / "0").exists()


def test_repair_refuses_a_damaged_dictionary_chunk_in_one_line(
    v2: pathlib.Path, v2_store: pathlib.Path, parquet_source: tuple[pathlib.Path, dict],
    capsys: pytest.CaptureFixture[str],
) -> None:
    _flip(v2 / "dict_values" / "c" / "0")
    (v2 / "gimu_codes" / "c" / "4" / "0" / "0").unlink()
    before = _objects(v2)
    assert main(["repair", str(v2), "--source", str(parquet_source[0])]) == 2
    assert capsys.readouterr().err == (
        f"birdzarr repair: error: {v2}: dictionary chunk 'dict_values/c/0' is damaged (it fails its "
        "CRC-32C or does not decode); the dictionary arrays cannot be rebuilt from the windows of a chunk "
        "(every chunk's codes index them): convert the store again from its sources (`birdzarr convert "
        f"SOURCE {v2} --overwrite`), or restore it from a copy.\n")
    assert _objects(v2) == before
    shutil.copy(v2_store / "dict_values" / "c" / "0", v2 / "dict_values" / "c" / "0")
    (v2 / "dict_start" / "c" / "0" / "0").unlink()
    with pytest.raises(MissingChunkError, match=r"chunk 'dict_start/c/0/0' is missing; the dictionary arr"):
        repair(v2, source=parquet_source[0])


def _source_with(parquet_source: tuple[pathlib.Path, dict], tmp_path: pathlib.Path, device: int,
                 window: int, value: np.float32) -> pathlib.Path:
    """A copy of the Parquet source with one imu_x value of one device's window replaced."""
    source = tmp_path / "src"
    shutil.copytree(parquet_source[0], source)
    windows = parquet_source[1][device].copy()
    windows[window, 0, 0] = value
    _synthetic.write_parquet(windows, source / f"{device}.parquet")
    return source


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_repair_refuses_a_window_no_row_of_its_device_holds(
    v2: pathlib.Path, v2_store: pathlib.Path, parquet_source: tuple[pathlib.Path, dict],
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str],
) -> None:
    odd = np.float32(0.123456789)
    assert not np.isin(np.float32(odd), _array(v2, _v2.VALUES)[:]).any()
    source = _source_with(parquet_source, tmp_path, 200, 2100, odd)
    (v2 / "gimu_row" / "c" / "2").unlink()
    (v2 / "gimu_codes" / "c" / "2" / "0" / "0").unlink()
    before = _objects(v2)
    assert main(["repair", str(v2), "--source", str(source)]) == 2
    assert capsys.readouterr().err == (
        f"birdzarr repair: error: {v2}: chunk 'gimu_row/c/2' cannot be rebuilt: window 2,100 of device 200 "
        f"(from the source) holds values that none of the device's 1 dictionary row(s) holds (first: imu_x "
        f"{float(odd)!r}; 1 window(s) of this chunk); the source is not what the store was converted from "
        "(check --source), or convert the store again from its sources. Nothing was changed.\n")
    assert _objects(v2) == before
    # with the chunk's rows intact, the same source is refused against the row they name
    shutil.copy(v2_store / "gimu_row" / "c" / "2", v2 / "gimu_row" / "c" / "2")
    with pytest.raises(BadInputError) as caught:
        repair(v2, source=source)
    assert str(caught.value) == (
        f"{v2}: chunk 'gimu_codes/c/2/0/0' cannot be rebuilt: window 2,100 of device 200 (from the source) "
        "holds values that its dictionary row 0 (from 'gimu_row/c/2') lacks; the source is not what the "
        "store was converted from (check --source), or convert the store again from its sources. Nothing "
        "was changed.")


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_repair_refuses_a_source_whose_windows_differ_from_the_checksums(
    v2: pathlib.Path, parquet_source: tuple[pathlib.Path, dict], tmp_path: pathlib.Path
) -> None:
    # another value the row holds: codes can be made, but they are not the windows written
    other = np.float32(_array(v2, _v2.VALUES)[int(_array(v2, _v2.START)[0, 0]) + 1])
    windows = parquet_source[1][200]
    assert windows[2100, 0, 0] != other
    source = _source_with(parquet_source, tmp_path, 200, 2100, other)
    _flip(v2 / "gimu_codes" / "c" / "2" / "0" / "0")
    before = _objects(v2)
    with pytest.raises(BadInputError) as caught:
        repair(v2, source=source)
    assert str(caught.value).startswith(
        f"{v2}: the windows the source gives for device 200, windows [0, 3,331) do not match the checksum "
        "recorded at write time (")
    assert str(caught.value).endswith("): --source is not what the store was converted from. Nothing was "
                                      "changed.")
    assert _objects(v2) == before


def _two_row_store(small_store: birdzarr.Store, path: pathlib.Path, split: int) -> None:
    """A copy of small_store where device 200 (windows 0..3,330) has two dictionary rows: its
    first ``split`` windows were coded first, the rest as an append that brought new values."""
    shutil.copytree(small_store.location.path, path)
    windows = np.asarray(small_store.windows[:])
    device = np.asarray(_array(path, "device")[:], dtype=np.int64)
    first = encode(windows[:split], device[:split])
    rest = encode(windows[split:], device[split:], previous=first.new)
    dicts = first.new.extend(rest.new)
    data = {_v2.CODES: np.concatenate([first.codes, rest.codes]),
            _v2.ROW: np.concatenate([first.row, rest.row]), _v2.VALUES: dicts.values,
            _v2.START: dicts.start, _v2.DEVICE: dicts.device}
    documents = _v2.array_metadata(len(windows), len(dicts.values), dicts.n_rows, chunk_windows=CHUNK)
    for name, array in data.items():
        shutil.rmtree(path / name)
        (path / name).mkdir()
        (path / name / "zarr.json").write_text(json.dumps(documents[name]))
        _array(path, name, "r+")[...] = array
    root = json.loads((path / "zarr.json").read_text())  # the commit counts the dictionaries
    counted = {"rows": dicts.n_rows, "values": len(dicts.values)}
    root["attributes"]["birdzarr"]["committed"]["dictionary"] = counted
    (path / "zarr.json").write_text(json.dumps(root))


@pytest.mark.slow  # over a second of CPU: not in the fast loop
def test_repair_chooses_the_first_row_of_the_device_holding_all_values(
    small_store: birdzarr.Store, tmp_path: pathlib.Path, parquet_source: tuple[pathlib.Path, dict]
) -> None:
    path = tmp_path / "two.zarr"
    _two_row_store(small_store, path, split=2000)
    dict_device = _array(path, _v2.DEVICE)[:]
    assert np.flatnonzero(dict_device == 200).tolist() == [0, 1]  # the append added a row
    assert verify(path, source=parquet_source[0]).ok
    rows_before = _array(path, _v2.ROW)[CHUNK : 2 * CHUNK]
    assert set(rows_before[: 2000 - CHUNK].tolist()) == {0}  # windows 1,024..1,999: the first row
    assert set(rows_before[2000 - CHUNK :].tolist()) == {1}  # 2,000..2,047: the appended row
    codes_before = (path / "gimu_codes" / "c" / "1" / "0" / "0").read_bytes()
    (path / "gimu_row" / "c" / "1").unlink()
    report = repair(path, source=parquet_source[0])
    assert report.actions == ["rebuilt chunk 'gimu_row/c/1' (missing) from the source: windows 1,024..2,047"]
    # expected: row 0 where it holds every value of the window, else row 1
    values, start = _array(path, _v2.VALUES)[:].view(np.uint32), _array(path, _v2.START)[:]
    sizes = _sizes(path)
    window_bits = np.asarray(small_store.windows[CHUNK : 2 * CHUNK]).view(np.uint32)
    in_row0 = np.ones(CHUNK, bool)
    for c in range(3):
        in_row0 &= np.isin(window_bits[:, :, c], values[start[0, c] : start[0, c] + sizes[0, c]]).all(axis=1)
    assert in_row0[: 2000 - CHUNK].all() and not in_row0.all()  # both rows are chosen
    assert np.array_equal(_array(path, _v2.ROW)[CHUNK : 2 * CHUNK], np.where(in_row0, 0, 1))
    # the append rule keeps every old code's meaning, so the codes chunk is unchanged
    assert (path / "gimu_codes" / "c" / "1" / "0" / "0").read_bytes() == codes_before
    assert verify(path, source=parquet_source[0]).ok


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_repair_rebuilds_chunks_of_either_order_as_the_converter_wrote_them(
    converted_v2: pathlib.Path, converted_copy: pathlib.Path, parquet_source: tuple[pathlib.Path, dict]
) -> None:
    path = converted_copy
    (path / "gps_speed" / "c" / "3" / "0").unlink()
    _flip(path / "gimu_row" / "c" / "7")
    _flip(path / "gps_speed" / "c" / "29" / "0")
    (path / "gimu_row" / "c" / "29").unlink()
    report = repair(path, source=parquet_source[0])
    assert report.actions == [
        "rebuilt chunk 'gps_speed/c/3/0' (missing) from the source: windows 3,072..4,095",
        "rebuilt chunk 'gimu_row/c/7' (damaged) from the source: windows 7,168..8,191",
        "rebuilt chunk 'gps_speed/c/29/0' (damaged) from the source: windows 29,696..29,999",
        "rebuilt chunk 'gimu_row/c/29' (missing) from the source: windows 29,696..29,999",
    ]
    assert report.notes == []  # every window told apart by its intact codes
    assert _objects(path) == _objects(converted_v2)  # in a shuffled store too: each window in its place


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_repair_of_a_shuffled_store_places_windows_nothing_tells_apart_in_source_order(
    converted_v2: pathlib.Path, converted_copy: pathlib.Path, parquet_source: tuple[pathlib.Path, dict]
) -> None:
    path = converted_copy
    for name in ("gimu_codes/c/2/0/0", "gimu_row/c/2", "gps_speed/c/2/0"):  # all of chunk 2 lost
        (path / name).unlink()
    report = repair(path, source=parquet_source[0])
    assert [line.split(" (")[0] for line in report.actions] == [
        "rebuilt chunk 'gimu_codes/c/2/0/0'", "rebuilt chunk 'gps_speed/c/2/0'",
        "rebuilt chunk 'gimu_row/c/2'"]
    assert verify(path, source=parquet_source[0]).ok  # the same windows, times and labels
    store, before = birdzarr.open_store(path), birdzarr.open_store(converted_v2)
    chunk = slice(2 * CHUNK, 3 * CHUNK)
    assert np.array_equal(np.asarray(store.array_view("device")[chunk]),
                          np.asarray(before.array_view("device")[chunk]))
    if not store.shuffled:
        assert report.notes == [] and _objects(path) == _objects(converted_v2)
        return
    # without timestamps (this Parquet source has none) a chunk's lost windows of one device are
    # told apart by nothing recorded: placed in source order, and said so
    now, then = np.asarray(store.windows[chunk]), np.asarray(before.windows[chunk])
    moved = now.view(np.uint32) != then.view(np.uint32)
    notes = report.notes
    assert len(notes) == 1 and notes[0].endswith(
        " rebuilt window(s) could not be told apart from other windows of their device by time, label or an "
        "intact part (windows of one burst, or a source without times): they were placed in source order, so "
        "such windows may hold each other's place in the shuffled order; the store holds exactly its "
        "windows, times and labels")
    assert int(notes[0].split(" ")[0].replace(",", "")) >= int(moved.any(axis=(1, 2)).sum()) > 0


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_repair_refuses_a_source_that_fails_the_recorded_checksum_or_digest(
    converted_copy: pathlib.Path, parquet_source: tuple[pathlib.Path, dict], tmp_path: pathlib.Path
) -> None:
    path = converted_copy
    store = birdzarr.open_store(path)
    dicts = store.reader.dictionaries()
    row = int(np.flatnonzero(dicts.device == 207)[0])
    entries = dicts.entries(row, 0)  # another value of the dictionary: it codes, but is not the window
    other = entries[entries != parquet_source[1][207][5, 0, 0]][0]
    source = _source_with(parquet_source, tmp_path, 207, 5, other)
    index = int(np.flatnonzero([np.any(store.reader.read("device", i) == 207) for i in range(30)])[0])
    (path / "gps_speed" / "c" / str(index) / "0").unlink()
    before = _objects(path)
    with pytest.raises(BadInputError) as caught:
        repair(path, source=source)
    entry = store.device(207)
    if store.shuffled:  # each device against its order-free digest
        assert str(caught.value).startswith(f"{path}: device 207: the windows its sources give do not match "
                                            "the digest recorded at write time (")
        assert str(caught.value).endswith(f", not {entry.scattered_digest}): --source is not what the store "
                                          "was converted from. Nothing was changed.")
    else:  # each range the rebuilt chunk touches against its checksum
        (r,) = entry.ranges
        assert str(caught.value).startswith(
            f"{path}: the windows the source gives for device 207, windows [{r.start:,}, {r.stop:,}) do not "
            "match the checksum recorded at write time (")
        assert str(caught.value).endswith(f", not {r.checksum}): --source is not what the store was "
                                          "converted from. Nothing was changed.")
    assert _objects(path) == before


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_verify_names_and_repair_removes_what_an_interrupted_format2_append_leaves(
    converted_copy: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    path = converted_copy
    n_values = _array(path, _v2.VALUES).shape[0]
    rows = _array(path, _v2.DEVICE, "r+")
    rows.resize((15,))
    rows[12:] = [7, 8, 9]  # rows an append wrote before it was killed, uncommitted
    values = _array(path, _v2.VALUES, "r+")
    values.resize((n_values + 2**20 + 5,))  # and a whole chunk of entries past the last one
    values[-5:] = 1.0
    shutil.copytree(path / "device_table" / "1", path / "device_table" / "2")  # its table, uncommitted
    before = birdzarr.open_store(path).windows[:]
    hint = "(invisible to readers; `birdzarr repair` removes it)"
    assert verify(path).notes == [
        f"uncommitted leftover: array 'dict_values' holds {n_values + 2**20 + 5:,} entries; the commit "
        f"counts {n_values:,} {hint}",
        f"uncommitted leftover: array 'dict_device' holds 15 rows; the commit counts 12 {hint}",
        "uncommitted leftover: device table group 'device_table/2' is neither the committed generation's "
        f"nor the one it replaced {hint}",
    ]
    assert repair(path).actions == [
        f"resized 'dict_values' from {n_values + 2**20 + 5:,} to the committed {n_values:,} entries",
        "resized 'dict_device' from 15 to the committed 12 rows",
        "removed 'device_table/2', a device table the commit does not name",
    ]
    result = verify(path)
    assert result.ok and result.notes == []
    assert sorted(p.name for p in (path / "dict_values" / "c").iterdir()) == ["0"]
    assert not (path / "device_table" / "2").exists()
    assert np.array_equal(birdzarr.open_store(path).windows[:].view(np.uint32), before.view(np.uint32))


@pytest.fixture(scope="module")
def csv_source(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """CSV exports with times and labels: 6 devices, 2 parts each (6,028 windows)."""
    directory = tmp_path_factory.mktemp("csv")
    _synthetic.make_csv_dir(directory, n_devices=6, bursts_per_device=600, seed=3)
    return directory


@pytest.mark.slow  # over a second of CPU: not in the fast loop
def test_repair_rebuilds_device_timestamp_and_label_chunks_of_a_device_ordered_store(
    csv_source: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    path = tmp_path / "csv.zarr"
    birdzarr.convert(csv_source, path, chunk_windows=CHUNK, progress=False)
    written = _objects(path)
    damaged = ["timestamp/c/1", "label/c/2", "device/c/3", "gimu_codes/c/4/0/0"]
    for key in damaged:
        _flip(path / key)
    assert len(verify(path).problems) >= 4
    assert repair(path, source=csv_source).actions == [
        "rebuilt chunk 'timestamp/c/1' (damaged) from the source: windows 1,024..2,047",
        "rebuilt chunk 'label/c/2' (damaged) from the source: windows 2,048..3,071",
        "rebuilt chunk 'device/c/3' (damaged) from the source: windows 3,072..4,095",
        "rebuilt chunk 'gimu_codes/c/4/0/0' (damaged) from the source: windows 4,096..5,119",
    ]
    assert _objects(path) == written


@pytest.mark.slow  # over a second of CPU: not in the fast loop
def test_repair_of_a_shuffled_csv_store_places_windows_by_time_and_label(
    csv_source: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    path = tmp_path / "csv.zarr"
    birdzarr.convert(csv_source, path, chunk_windows=CHUNK, shuffle=True, progress=False)
    written = birdzarr.open_store(path).windows[:]
    (path / "gimu_codes" / "c" / "2" / "0" / "0").unlink()
    report = repair(path, source=csv_source)
    assert report.actions == ["rebuilt chunk 'gimu_codes/c/2/0/0' (missing) from the source: windows "
                              "2,048..3,071"]
    assert verify(path, source=csv_source).ok
    now = birdzarr.open_store(path).windows[:]
    moved = (now.view(np.uint32) != written.view(np.uint32)).any(axis=(1, 2))
    assert not moved[: 2 * CHUNK].any() and not moved[3 * CHUNK :].any()  # only chunk 2 was written
    # windows of one burst share time, label and gps_speed: those may trade places, and are counted
    (note,) = report.notes
    assert int(note.split(" ")[0].replace(",", "")) >= int(moved.sum())


def test_repair_with_a_source_refuses_a_format1_store(
    parquet_source: tuple[pathlib.Path, dict], tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str],
) -> None:
    store_copy = format1_copy("dict16.zarr", tmp_path)
    recorded = birdzarr.open_store(store_copy).meta["report"]["source"]
    with pytest.raises(birdzarr.FormatVersionError):
        repair(store_copy, source=parquet_source[0])
    assert main(["repair", str(store_copy), "--source", str(parquet_source[0])]) == 2
    assert capsys.readouterr().err == (
        f"birdzarr repair: error: {store_copy} is a format-1 store, which birdzarr reads but no longer "
        "writes, so repair --source cannot change it: write a format-2 store from its source with "
        f"`birdzarr convert {recorded} NEW_STORE` and use that one.\n")
