"""copy never commits a copy of a damaged store: a missing committed chunk, or one whose bytes
fail their CRC-32C, stops the copy before its commit, with one line naming the first damaged
chunk and how many there are; the damaged chunk is not written, so a re-run after the source is
restored reads it again and finishes the copy."""

from __future__ import annotations

import pathlib
import shutil

import fsspec
import pytest

import birdzarr
from birdzarr._errors import CorruptChunkError, MissingChunkError, NotAStoreError
from birdzarr.cli import main
from birdzarr.maintenance import _copy


def _flip(path: pathlib.Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _refusal(src: pathlib.Path, dest: object, first: str, why: str, missing: int, corrupt: int) -> str:
    return (f"{src}: committed chunk '{first}' {why}; {missing + corrupt} damaged chunk(s) in all "
            f"({missing} missing, {corrupt} failing their CRC-32C), so the copy to {dest} was not "
            f"committed. Run `birdzarr verify {src}` to list the damage, restore those chunks from "
            "another copy or convert the store again, then run this copy again to finish it.")


FAILS_CRC = "fails its CRC-32C (its bytes were changed or truncated)"


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_a_missing_committed_chunk_is_not_copied_as_verified(
    store_copy: pathlib.Path, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (store_copy / "gimu_codes" / "c" / "3" / "0" / "0").unlink()
    dest = tmp_path / "dest.zarr"
    assert main(["copy", str(store_copy), str(dest), "--quiet"]) == 2
    captured = capsys.readouterr()
    expected = _refusal(store_copy, dest, "gimu_codes/c/3/0/0", "is missing", 1, 0)
    assert captured.err == f"birdzarr copy: error: {expected}\n"
    assert captured.out == ""
    assert not (dest / "zarr.json").exists()  # not committed: nothing at DEST is a store
    with pytest.raises(NotAStoreError):
        birdzarr.open_store(dest)
    with pytest.raises(MissingChunkError) as caught:
        birdzarr.copy(store_copy, dest, progress=False)
    assert type(caught.value) is MissingChunkError
    assert str(caught.value) == expected


@pytest.mark.slow  # over a second of CPU: not in the fast loop
def test_a_changed_chunk_is_refused_and_not_written(
    store_copy: pathlib.Path, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str],
    small_store: birdzarr.Store,
) -> None:
    _flip(store_copy / "label" / "c" / "5")
    _flip(store_copy / "gimu_codes" / "c" / "12" / "0" / "0")
    _flip(store_copy / "gimu_codes" / "c" / "2" / "0" / "0")
    (store_copy / "timestamp" / "c" / "7").unlink()
    dest = tmp_path / "dest.zarr"
    expected = _refusal(store_copy, dest, "gimu_codes/c/2/0/0", FAILS_CRC, 1, 3)  # c/2 before c/12
    with pytest.raises(CorruptChunkError) as caught:
        birdzarr.copy(store_copy, dest, progress=False)
    assert str(caught.value) == expected
    assert not (dest / "zarr.json").exists()
    for damaged in ("label/c/5", "gimu_codes/c/12/0/0", "gimu_codes/c/2/0/0", "timestamp/c/7"):
        assert not (dest / damaged).exists()  # so a re-run reads them from the source again
    assert (dest / "label" / "c" / "4").exists()  # the sound objects are kept for the resume
    assert main(["copy", str(store_copy), str(dest), "--quiet"]) == 2  # the re-run checks them again
    assert capsys.readouterr().err == f"birdzarr copy: error: {expected}\n"

    # the source restored: the same command finishes the copy, which then verifies
    shutil.rmtree(store_copy)
    shutil.copytree(small_store.location.path, store_copy)
    assert main(["copy", str(store_copy), str(dest), "--quiet"]) == 0
    out = capsys.readouterr().out
    # the damaged four and the root; the rest of format 2's 213 objects: 6 per-window arrays of 30
    # chunks, 3 dictionary arrays of one, their 9 zarr.json, the root, the device table's 20
    # (2 groups, 9 arrays of one chunk: the index arrays, range_checksum and the details)
    assert ": 5 copied (" in out and "208 already present" in out
    assert birdzarr.verify(dest).ok


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_uncommitted_leftovers_are_copied_unchecked(store_copy: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """A cut-short chunk file past the committed count (a killed writer's leftover, which verify
    lists as a note) is no reason to refuse: readers never see it."""
    leftover = store_copy / "gimu_codes" / "c" / "40" / "0" / "0"
    leftover.parent.mkdir(parents=True)
    leftover.write_bytes(b"torn")
    result = birdzarr.copy(store_copy, tmp_path / "dest.zarr", progress=False)
    assert (tmp_path / "dest.zarr" / "gimu_codes" / "c" / "40" / "0" / "0").read_bytes() == b"torn"
    assert result.copied == result.objects
    assert birdzarr.verify(tmp_path / "dest.zarr").ok


def test_a_streamed_chunk_is_checked_too_and_removed_from_an_object_store(
    store_copy: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Objects larger than the in-memory limit are streamed; a chunk streamed into an object
    store is written as it comes, so one failing its CRC-32C is removed afterwards."""
    monkeypatch.setattr(_copy, "_IN_MEMORY_LIMIT", 0)  # every object streamed
    _flip(store_copy / "device" / "c" / "9")
    dest = "memory://copy-damage/dest.zarr"
    with pytest.raises(CorruptChunkError) as caught:
        birdzarr.copy(store_copy, dest, progress=False)
    assert str(caught.value) == _refusal(store_copy, dest, "device/c/9", FAILS_CRC, 0, 1)
    fs = fsspec.filesystem("memory")
    assert not fs.exists("/copy-damage/dest.zarr/device/c/9")
    assert not fs.exists("/copy-damage/dest.zarr/zarr.json")
    assert fs.exists("/copy-damage/dest.zarr/device/c/8")
    fs.rm("/copy-damage", recursive=True)
