"""Never destroy what is not ours, no silent partial conversion, one-line errors."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import pathlib
import subprocess
import sys
import threading
import warnings
from collections import Counter
from typing import Any

import numpy as np
import pytest
from fsspec.implementations.memory import MemoryFileSystem
from s3_support import MotoEndpoint, moto, new_bucket, s3_options  # noqa: F401  (moto: a fixture)

import birdzarr
from birdzarr._errors import (
    BadInputError,
    DestinationError,
    DuplicateWindowsWarning,
    FallbackWarning,
    MissingChunkError,
    StoreExistsError,
    StoreLockedError,
)
from birdzarr.cli import main
from birdzarr.convert._duplicates import distinct
from birdzarr.maintenance._verify import verify
from birdzarr.storage._location import Location, resolve
from birdzarr.storage._lock import StoreLock

ROW = "{device},2014-01-01 10:{minute:02d}:00,{i},-1,0.{v:03d},-0.2,0.9,3.5\n"


def _csv(device: int, minutes: range, n: int = 20) -> str:
    """Bursts of ``n`` rows, one per minute, values differing between bursts (no duplicates)."""
    return "".join(ROW.format(device=device, minute=m, i=i, v=(m * 7 + i) % 1000)
                   for m in minutes for i in range(n))


def _tree(root: pathlib.Path) -> dict[str, str]:
    """Every file under ``root`` with the SHA-256 of its bytes."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def csv_source(tmp_path: pathlib.Path) -> pathlib.Path:
    src = tmp_path / "d" / "csv"
    src.mkdir(parents=True)
    (src / "500_0.csv").write_text(_csv(500, range(0, 3)))
    (src / "500_1.csv").write_text(_csv(500, range(3, 6)))
    return src


# -- 1. overwrite replaces only a birdzarr store --------------------------------------------------


def test_overwrite_refuses_a_directory_that_is_not_a_store(
    csv_source: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = csv_source.parent
    (d / "notes.txt").write_text("notes")
    before = _tree(d)
    # DEST holds the source: refused, whatever --overwrite says, and nothing changes
    assert main(["convert", str(csv_source), str(d), "--overwrite", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"{d} contains the source {csv_source}" in err and "Traceback" not in err
    assert _tree(d) == before
    # a directory of other things: named, never replaced, and --overwrite is not suggested
    other = d.parent / "other"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    (other / "sub").mkdir()
    for flags in ([], ["--overwrite"]):
        assert main(["convert", str(csv_source), str(other), "--quiet", *flags]) == 2
        err = capsys.readouterr().err
        assert "2 entries that are not part of a birdzarr store: 'notes.txt', 'sub/'" in err
        assert "--overwrite" not in err
    assert (other / "notes.txt").read_text() == "keep me" and (other / "sub").is_dir()


def test_dest_inside_or_equal_to_source_is_refused(csv_source: pathlib.Path) -> None:
    for dest in (csv_source, csv_source / "out.zarr"):
        with pytest.raises(DestinationError, match="the source"):
            birdzarr.convert(csv_source, dest, overwrite=True, progress=False)
    assert sorted(p.name for p in csv_source.iterdir()) == ["500_0.csv", "500_1.csv"]


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_overwrite_replaces_a_store_but_not_a_store_with_other_files(
    csv_source: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    dest = tmp_path / "s.zarr"
    birdzarr.convert(csv_source, dest, progress=False)
    with pytest.raises(StoreExistsError, match="already holds a birdzarr store. Pass --overwrite"):
        birdzarr.convert(csv_source, dest, progress=False)
    assert len(birdzarr.convert(csv_source, dest, overwrite=True, progress=False)) == 6
    (dest / "README.txt").write_text("mine")
    with pytest.raises(StoreExistsError, match="'README.txt'"):
        birdzarr.convert(csv_source, dest, overwrite=True, progress=False)
    assert (dest / "README.txt").read_text() == "mine"


def test_copy_refuses_foreign_destinations_and_its_own_source(
    csv_source: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    from birdzarr.maintenance._copy import copy_store

    store = tmp_path / "s.zarr"
    birdzarr.convert(csv_source, store, progress=False)
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(StoreExistsError, match="is a file"):
        copy_store(store, afile, progress=False)
    with pytest.raises(DestinationError, match="sits inside the source"):
        copy_store(store, store / "copy", progress=False)
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "a.txt").write_text("a")
    with pytest.raises(StoreExistsError, match="'a.txt'"):
        copy_store(store, notes, overwrite=True, progress=False)
    assert afile.read_text() == "x" and (notes / "a.txt").read_text() == "a"


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_copy_takes_the_destination_lock(csv_source: pathlib.Path, tmp_path: pathlib.Path) -> None:
    from birdzarr.maintenance._copy import copy_store

    store, dest = tmp_path / "s.zarr", tmp_path / "copy.zarr"
    birdzarr.convert(csv_source, store, progress=False)
    held = StoreLock(resolve(dest), "a convert writing here").acquire()
    try:
        with pytest.raises(StoreLockedError, match="a convert writing here"):
            copy_store(store, dest, progress=False)
        assert sorted(p.name for p in dest.iterdir()) == [".birdzarr.lock"]  # nothing copied
    finally:
        held.release()
    copy_store(store, dest, progress=False)
    assert len(birdzarr.open_store(dest)) == 6 and not (dest / ".birdzarr.lock").exists()


# -- 2. an overwrite keeps the old store when the new input is bad --------------------------------


def _objects(location: Location) -> dict[str, bytes]:
    """Every object of a store (a lock included, were there one) and its bytes."""
    location.fs.invalidate_cache()
    return {p: location.fs.cat_file(p) for p in location.fs.find(location.path)}


@pytest.mark.parametrize("where", ["local", "memory",
                                   pytest.param("s3", marks=[pytest.mark.s3, pytest.mark.slow])])
@pytest.mark.slow  # over a second of CPU: not in the fast loop
def test_an_overwrite_with_bad_input_keeps_the_old_store(
    where: str, parquet_source: tuple[pathlib.Path, dict[int, np.ndarray]], tmp_path: pathlib.Path,
    request: pytest.FixtureRequest,
) -> None:
    """Bad input for an overwrite, found after part of the replacement was written, leaves the old
    store byte for byte and unlocked, on a local disk, in memory and on S3: the replacement is written
    under a sibling name and replaces the old store only once it has committed; a failed one leaves
    no sibling, and a good replacement then goes through."""
    options: dict[str, Any] = {}
    if where == "local":
        dest = str(tmp_path / "keep.zarr")
    elif where == "memory":
        dest = f"memory://safety/{tmp_path.name}/keep.zarr"
    else:
        moto: MotoEndpoint = request.getfixturevalue("moto")
        options = s3_options(moto.url)
        dest = f"s3://{new_bucket(moto)}/keep.zarr"
    directory, truth = parquet_source
    files = sorted(directory.glob("*.parquet"))
    old, good = files[:6], files[6:9]
    (tmp_path / "old").mkdir()
    (tmp_path / "bad").mkdir()
    for path in old:
        (tmp_path / "old" / path.name).write_bytes(path.read_bytes())
    for path in good:
        (tmp_path / "bad" / path.name).write_bytes(path.read_bytes())
    # fails while the replacement is written: its first devices are staged by then
    (tmp_path / "bad" / "999.parquet").write_bytes(files[9].read_bytes()[:-300])
    n_old, n_good = (sum(len(truth[int(p.stem)]) for p in part) for part in (old, good))

    def convert(source: pathlib.Path) -> birdzarr.Store:
        return birdzarr.convert(source, dest, overwrite=True, chunk_windows=1024, progress=False,
                                storage_options=options)

    convert(tmp_path / "old")
    location = resolve(dest, options)
    before = _objects(location)
    assert not [p for p in before if "lock" in p.rsplit("/", 1)[-1]]

    with pytest.raises(BadInputError, match="999.parquet: not a readable Parquet file"):
        convert(tmp_path / "bad")
    assert _objects(location) == before  # byte for byte, and no lock left behind
    assert not location.fs.glob(location.path + ".birdzarr-*")  # the staged attempt is gone
    assert len(birdzarr.open_store(dest, storage_options=options)) == n_old
    assert verify(dest, storage_options=options).ok

    (tmp_path / "bad" / "999.parquet").unlink()  # a good replacement goes through
    store = convert(tmp_path / "bad")
    assert len(store) == len(birdzarr.open_store(dest, storage_options=options)) == n_good
    assert len(store.device_table) == 3
    assert verify(dest, storage_options=options).ok
    location.fs.invalidate_cache()
    assert not location.fs.glob(location.path + ".birdzarr-*")
    assert not [p for p in _objects(location) if "lock" in p.rsplit("/", 1)[-1]]


# -- 6. the local swap has no moment without a store and a lock ------------------------------------


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "entry-moves"])
@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_local_overwrite_swap_keeps_dest_locked_or_committed(
    csv_source: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, exchange: bool
) -> None:
    """At every rename of the swap, DEST is a committed store or still locked by the swapper: a
    concurrent writer can never take it (between the two renames no DEST exists, so the lock
    must cover that moment)."""
    from birdzarr.convert import _overwrite

    dest = tmp_path / "s.zarr"
    birdzarr.convert(csv_source, dest, progress=False)
    if not exchange:  # a file system without RENAME_EXCHANGE (NFS, Lustre): the fallback path
        monkeypatch.setattr(_overwrite, "_exchange", lambda a, b: False)
    outcomes: list[str] = []
    real_rename = os.rename

    def rename(a: Any, b: Any) -> None:
        real_rename(a, b)
        try:
            lock = StoreLock(resolve(dest), "a concurrent convert").acquire()
        except StoreLockedError:
            outcomes.append("locked")
        else:
            lock.release()
            outcomes.append("TAKEN")

    monkeypatch.setattr(_overwrite.os, "rename", rename)
    assert len(birdzarr.convert(csv_source, dest, overwrite=True, progress=False, chunk_windows=2)) == 6
    assert "TAKEN" not in outcomes, outcomes
    assert (len(outcomes) > 2) == (not exchange)  # the exchange renames nothing
    assert birdzarr.open_store(dest).meta["layout"]["chunk_windows"] == 2  # the replacement
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "s.zarr"]  # no sibling left


# -- 3. every source file converted or named -------------------------------------------------------


def test_unknown_files_are_named_or_skipped_on_request(
    csv_source: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    (csv_source / "500_2.txt").write_text("x")
    (csv_source / ".DS_Store").write_bytes(b"\0")
    with pytest.raises(BadInputError, match=r"2 entries are not input files: '.DS_Store', '500_2.txt'"):
        birdzarr.convert(csv_source, tmp_path / "s.zarr", progress=False)
    assert not (tmp_path / "s.zarr").exists()
    store = birdzarr.convert(csv_source, tmp_path / "s.zarr", progress=False, skip_unknown_files=True)
    assert len(store) == 6 and store.meta["skipped_files"] == [".DS_Store", "500_2.txt"]


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_compressed_and_upper_case_parts_are_read(tmp_path: pathlib.Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    parts = [_csv(500, range(3 * k, 3 * k + 3)) for k in range(4)]
    (src / "500_0.csv").write_text(parts[0])
    (src / "500_1.CSV").write_text(parts[1])
    two = parts[2].encode()
    (src / "500_2.csv.gz").write_bytes(gzip.compress(two[:500]) + gzip.compress(two[500:]))  # two members
    zst = subprocess.run(["zstd", "-q", "-c"], input=parts[3].encode(), capture_output=True,
                         check=True).stdout
    (src / "500_10.Csv.ZST").write_bytes(zst)
    plain = tmp_path / "plain"
    plain.mkdir()
    for k, text in enumerate(parts):
        (plain / f"500_{[0, 1, 2, 10][k]}.csv").write_text(text)
    store = birdzarr.convert(src, tmp_path / "s.zarr", progress=False)
    reference = birdzarr.convert(plain, tmp_path / "ref.zarr", progress=False)
    assert len(store) == 12 and store.device(500).sources == ["500_0.csv", "500_1.CSV", "500_2.csv.gz",
                                                               "500_10.Csv.ZST"]
    assert np.array_equal(store.windows[:].view(np.uint32), reference.windows[:].view(np.uint32))
    assert verify(store.url, source=src).ok


@pytest.mark.parametrize("other", ["500_1.CSV", "500_1.csv.gz"])
def test_a_part_under_two_names_is_an_error_naming_both(csv_source: pathlib.Path, tmp_path: pathlib.Path,
                                                         other: str) -> None:
    data = (csv_source / "500_1.csv").read_bytes()
    (csv_source / other).write_bytes(gzip.compress(data) if other.endswith(".gz") else data)
    with pytest.raises(BadInputError, match=rf"'500_1.csv' and '{other}'|'{other}' and '500_1.csv'"):
        birdzarr.convert(csv_source, tmp_path / "s.zarr", progress=False)


def test_a_damaged_gzip_names_the_file(tmp_path: pathlib.Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "500_0.csv.gz").write_bytes(gzip.compress(_csv(500, range(3)).encode())[:-30])
    with pytest.raises(BadInputError, match="500_0.csv.gz: cannot be decompressed as gzip"):
        birdzarr.convert(src, tmp_path / "s.zarr", progress=False)


# -- 5. duplicates counted and warned; no 0-window store -------------------------------------------


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_a_renamed_duplicate_part_is_counted_and_warned(
    csv_source: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    dest = tmp_path / "s.zarr"
    birdzarr.convert(csv_source, dest, progress=False)
    more = tmp_path / "more"
    more.mkdir()
    (more / "500_7.csv").write_bytes((csv_source / "500_1.csv").read_bytes())  # the same part again
    (more / "500_8.csv").write_text(_csv(500, range(20, 22)))  # really new
    with pytest.warns(DuplicateWindowsWarning, match=r"3 window\(s\) repeat .* device\(s\) 500 \(3\)"):
        store = birdzarr.append(dest, more, progress=False)
    assert len(store) == 11
    assert store.meta["report"]["appends"][-1]["duplicate_windows"] == {"500": 3}


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_duplicate_rows_in_a_conversion_are_counted(tmp_path: pathlib.Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    text = _csv(500, range(3))
    (src / "500_0.csv").write_text(text + _csv(500, range(2, 3)))  # the last burst twice: 40 rows
    with pytest.warns(DuplicateWindowsWarning):
        store = birdzarr.convert(src, tmp_path / "s.zarr", progress=False)
    assert store.meta["report"]["duplicate_windows"] == {"500": 1}
    with warnings.catch_warnings():
        warnings.simplefilter("error", DuplicateWindowsWarning)  # distinct windows: no warning
        clean = tmp_path / "clean"
        clean.mkdir()
        (clean / "500_0.csv").write_text(text)
        report = birdzarr.convert(clean, tmp_path / "c.zarr", progress=False).meta["report"]
        assert "duplicate_windows" not in report


@pytest.mark.parametrize("n", [0, 1, 2, 1000])
def test_the_duplicate_check_counts_distinct_values_as_numpy_does(n: int) -> None:
    rng = np.random.default_rng(n)
    repeats = rng.integers(0, 7, size=n).astype(np.uint64)  # many repeats
    spread = rng.integers(-(2**63), 2**63 - 1, size=n, dtype=np.int64)  # almost none
    for values in (repeats, spread):
        assert np.array_equal(distinct(values), np.unique(values))


def test_skipping_every_row_commits_nothing(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "500_0.csv").write_text(_csv(500, range(2)).replace("0.9,", "bad,"))
    assert main(["convert", str(src), str(tmp_path / "s.zarr"), "--quiet", "--on-bad-rows", "skip"]) == 2
    err = capsys.readouterr().err
    assert "the input gives no windows (40 rows read, 40 bad lines" in err and "nothing was committed" in err
    assert not (tmp_path / "s.zarr").exists()


# -- 4. the plain-zarr fallback raises on a missing chunk ------------------------------------------


def test_plain_zarr_fallback_raises_on_a_missing_chunk(tmp_path: pathlib.Path) -> None:
    import zarr

    from birdzarr.store._chunks import ArrayLayout, ChunkReader

    root = tmp_path / "plain.zarr"
    group = zarr.open_group(str(root), mode="w", zarr_format=3)
    array = group.create_array("label", shape=(40,), chunks=(10,), dtype="int32", fill_value=-1,
                               compressors=None, config={"write_empty_chunks": True})
    array[:] = np.arange(40, dtype=np.int32)
    layout = ArrayLayout.from_metadata("label", json.loads((root / "label" / "zarr.json").read_text()))
    assert layout.chain == "zarr"  # no blosc: read through zarr-python
    gimu = ArrayLayout("gimu", 10, np.dtype("float32"), None, "/", 0.0)  # only its chunk size is used
    reader = ChunkReader(resolve(root), {"gimu": gimu, "label": layout}, 40)
    assert reader.read("label", 2).tolist() == list(range(20, 30))
    (root / "label" / "c" / "2").unlink()
    with pytest.raises(MissingChunkError, match="committed chunk 'label/c/2' is missing"):
        reader.read("label", 2)
    assert reader.read_range("label", 0, 20).tolist() == list(range(20))


# -- 6. loud fallbacks; the writer does not drain on an error -----------------------------------------


class _NoExclusive(MemoryFileSystem):
    """A filesystem that cannot create exclusively (as some fsspec backends)."""

    error: type[Exception] = NotImplementedError

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        if "x" in mode:
            raise self.error("mode 'x' not supported")
        return super()._open(path, mode, **kwargs)


def test_lock_fallback_is_loud_and_a_type_error_is_not_swallowed() -> None:
    fs = _NoExclusive(skip_instance_cache=True)
    location = Location(url="memory://safety/lock.zarr", fs=fs, path="/safety/lock.zarr")
    with pytest.warns(FallbackWarning, match="cannot create a file exclusively .* best effort"):
        lock = StoreLock(location, "one").acquire()
    lock.release()

    class Broken(_NoExclusive):
        error = TypeError

    broken = Location(url="memory://safety/l2", fs=Broken(skip_instance_cache=True), path="/safety/l2")
    with pytest.raises(TypeError):
        StoreLock(broken, "two").acquire()


@pytest.mark.slow
def test_obstore_fallback_is_loud(monkeypatch: pytest.MonkeyPatch) -> None:
    from birdzarr.storage import _location as _storage

    monkeypatch.setenv(_storage.FETCHER_ENV, "obstore")
    monkeypatch.setattr(_storage, "_fallbacks_warned", set())
    location = resolve("s3://bucket/x.zarr", {"anon": True, "requester_pays": True})
    with pytest.warns(FallbackWarning, match=r"storage_options \['anon', 'requester_pays'\] have no obstore"):
        assert not _storage._uses_obstore(location)
    monkeypatch.setattr(_storage, "_obstore_pid", os.getpid() + 1)  # its runtime began in a parent
    plain = resolve("s3://bucket/x.zarr", {"key": "k", "secret": "s"})
    with pytest.warns(FallbackWarning, match="before this worker forked"):
        assert not _storage._uses_obstore(plain)


def test_writer_leaving_on_an_error_writes_no_buffered_windows(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from birdzarr.convert._slabs import SlabWriter

    src = tmp_path / "src"
    src.mkdir()
    (src / "500_0.csv").write_text(_csv(500, range(3)))
    (src / "600_0.csv").write_text(_csv(600, range(3)).replace("0.9,", "bad,", 1))
    slabs: list[tuple[int, int]] = []
    original = SlabWriter._write_slab
    monkeypatch.setattr(SlabWriter, "_write_slab",
                        lambda self, a, b, data: (slabs.append((a, b)), original(self, a, b, data))[1])
    with pytest.raises(BadInputError, match="600_0.csv, line 1"):
        birdzarr.convert(src, tmp_path / "s.zarr", progress=False, workers=1)
    assert slabs == []  # device 500's buffered windows were dropped, not written and then deleted
    assert not (tmp_path / "s.zarr").exists()


# -- 7. one line instead of a traceback -------------------------------------------------------------


@pytest.mark.slow  # over a second of CPU: not in the fast loop
def test_cli_errors_are_one_line_with_exit_2(
    csv_source: pathlib.Path, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    store = tmp_path / "s.zarr"
    birdzarr.convert(csv_source, store, progress=False)
    cases = {
        ("info", str(afile)): "Not a directory",
        ("convert", str(csv_source), str(afile / "x.zarr")): f"{afile} is a file",
        ("copy", str(store), str(afile)): "is a file",
        ("info", "foo://bucket/x.zarr"): "unknown protocol foo://",
    }
    if __import__("importlib").util.find_spec("gcsfs") is None:
        cases[("info", "gs://bucket/x.zarr")] = "pip install gcsfs"
    for argv, expected in cases.items():
        assert main(list(argv)) == 2, argv
        err = capsys.readouterr().err.strip()
        assert expected in err and "Traceback" not in err and len(err.splitlines()) == 1, (argv, err)
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    assert main(["info", "s3://bucket/x.zarr"]) == 2
    err = capsys.readouterr().err
    assert "no credentials for the object store" in err and len(err.strip().splitlines()) == 1
    # --debug shows the traceback too
    assert main(["info", "foo://bucket/x.zarr", "--debug"]) == 2
    assert "Traceback" in capsys.readouterr().err


@pytest.mark.slow
def test_unreachable_endpoint_fails_fast(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """An endpoint that refuses connections gives one line and exit code 2 after bounded retries:
    botocore tries a request 3 times (3 s to connect) and s3fs twice, against s3fs's 5 x botocore's
    5 by default (7-9 s of retries; the wall time is not asserted: it measures the machine)."""
    import socket

    from s3fs import S3FileSystem

    from birdzarr.storage._location import resolve

    S3FileSystem.clear_instance_cache()  # no instance cached by another test with other credentials
    with socket.socket() as s:  # a port with nothing listening: connections are refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    assert main(["info", f"s3://bucket-{port}/x.zarr"]) == 2
    err = capsys.readouterr().err
    assert "cannot reach the storage endpoint" in err and len(err.strip().splitlines()) == 1
    assert err.strip().endswith("birdzarr gave up after a few bounded retries.")
    fs = resolve(f"s3://bucket-{port}/x.zarr").fs
    assert fs.retries == 2
    config = fs.config_kwargs
    # botocore reads max_attempts 2 (retries after the first try) as 3 tries in all
    assert config["connect_timeout"] == 3
    assert config["retries"] == {"mode": "standard", "total_max_attempts": 3}


@pytest.mark.slow
def test_broken_pipe_is_quiet(csv_source: pathlib.Path, tmp_path: pathlib.Path) -> None:
    store = tmp_path / "s.zarr"
    birdzarr.convert(csv_source, store, progress=False)
    command = "import sys; from birdzarr.cli import main; sys.exit(main())"
    process = subprocess.Popen([sys.executable, "-c", command, "info", str(store), "--json"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert process.stdout is not None and process.stderr is not None
    process.stdout.close()  # the reader is gone before the first line (as `| head -0`)
    err = process.stderr.read().decode()
    assert process.wait() == 141, err
    assert err == ""


# -- 8. progress in logs ----------------------------------------------------------------------------


def test_progress_in_a_log_is_lines_not_redraws(capsys: pytest.CaptureFixture[str]) -> None:
    from birdzarr._progress import progress_bar

    with progress_bar(True, desc="convert", total=10_000, unit=" windows") as bar:  # stderr: not a tty
        for _ in range(10_000):
            bar.update(1)
    err = capsys.readouterr().err
    assert "\r" not in err and err.endswith("\n")
    lines = err.splitlines()
    assert 1 <= len(lines) <= 3 and "10.0k/10.0k" in lines[-1], lines


# -- 9. verify -------------------------------------------------------------------------------------


def test_verify_names_each_arrays_own_first_difference(tmp_path: pathlib.Path) -> None:
    import zarr

    src = tmp_path / "src"
    src.mkdir()
    (src / "500_0.csv").write_text(_csv(500, range(6)))
    dest = tmp_path / "s.zarr"
    birdzarr.convert(src, dest, progress=False)
    group = zarr.open_group(str(dest), mode="r+", zarr_format=3)
    group["label"][4] = 9  # labels differ first at window 4
    group["timestamp"][1] = 0  # times first at window 1
    problems = verify(dest, source=src).problems
    assert any("in timestamps from the sources (first at the device's window 1)" in p for p in problems)
    assert any("in labels from the sources (first at the device's window 4)" in p for p in problems)


@pytest.mark.slow
def test_verify_source_of_a_shuffled_store_reads_each_chunk_once(
    parquet_source: Any, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from birdzarr.maintenance._verify import verify
    from birdzarr.store._chunks import ChunkReader

    directory, _ = parquet_source
    dest = tmp_path / "shuffled.zarr"
    store = birdzarr.convert(directory, dest, progress=False, shuffle=True, seed=1, chunk_windows=2048)
    fetches: list[str] = []
    original = ChunkReader._fetch
    monkeypatch.setattr(ChunkReader, "_fetch", lambda self, layout, i: (fetches.append(layout.name),
                                                                        original(self, layout, i))[1])
    assert verify(dest, source=directory).ok
    # one pass: each chunk of each per-window array once (before: once per device, 12 devices here)
    arrays = ("gimu_codes", "gps_speed", "gimu_row", "device", "timestamp", "label")  # format 2's
    assert Counter(fetches) == dict.fromkeys(arrays, store.reader.n_chunks), Counter(fetches)
    # a changed window is still found, and counted exactly
    window = np.asarray(store.windows[5:6]).copy()
    window[0, 0, 3] += 1  # its gps_speed (format 2 stores the channel as float32)
    import zarr

    zarr.open_group(str(dest), mode="r+", zarr_format=3)["gps_speed"][5:6] = window[..., 3]
    result = verify(dest, source=directory)
    assert any("1 window(s) (with their times and labels) differ" in p for p in result.problems), result


# -- 10. repair names and removes what a kill leaves ------------------------------------------------


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_repair_removes_a_killed_overwrites_sibling_and_names_shuffle_spills(
    csv_source: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from birdzarr.maintenance._repair import repair

    dest = tmp_path / "s.zarr"
    birdzarr.convert(csv_source, dest, progress=False)
    before = _tree(dest)
    sibling = tmp_path / "s.zarr.birdzarr-new-0123456789ab"
    birdzarr.convert(csv_source, sibling, progress=False)  # as a killed --overwrite leaves it
    spill = tmp_path / "tmp" / "birdzarr-shuffle-abc123"
    spill.mkdir(parents=True)
    (spill / "bucket-0").write_bytes(b"\0" * 1000)
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    monkeypatch.setattr(__import__("tempfile"), "tempdir", None)
    report = repair(dest)
    assert not sibling.exists() and _tree(dest) == before
    assert any("birdzarr-new-0123456789ab" in a for a in report.actions), report.actions
    assert any(str(spill) in n and "delete it" in n for n in report.notes), report.notes
    assert spill.exists()  # named, never deleted: it may belong to a running conversion


def test_dead_code_is_gone() -> None:
    from birdzarr.storage import _location as _storage
    from birdzarr.storage import _lock

    assert not hasattr(_lock, "lock_info") and not hasattr(_storage, "remove_tree")


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_a_concurrent_convert_waits_for_nobody(csv_source: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """Two --overwrite conversions of the same store: one wins, the other is refused by the lock
    or replaces it after; the store is always complete."""
    dest = tmp_path / "s.zarr"
    birdzarr.convert(csv_source, dest, progress=False)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            birdzarr.convert(csv_source, dest, overwrite=True, progress=False)
        except StoreLockedError:
            pass
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(birdzarr.open_store(dest)) == 6
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "s.zarr"]
