"""One writer per store: a second writer is refused with the holder's name, a killed writer's lock
is recognised as stale, and neither the lock nor the store leaks secrets; stores open read-only."""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys
import threading
from typing import Any

import numpy as np
import pytest
from s3_support import MotoEndpoint, moto, new_bucket, s3_options  # noqa: F401  (moto is a fixture)

import birdzarr
from birdzarr._errors import StoreLockedError
from birdzarr.convert import append
from birdzarr.demo import _synthetic
from birdzarr.maintenance._repair import repair
from birdzarr.storage._location import resolve
from birdzarr.storage._lock import LOCK_NAME, StoreLock, read_holder


@pytest.fixture()
def source(tmp_path: pathlib.Path) -> pathlib.Path:
    directory = tmp_path / "src"
    _synthetic.make_parquet_dir(directory, n_devices=3, total_windows=600, seed=5)
    return directory


def _write_lock(store: pathlib.Path, **fields: object) -> None:
    holder = {"host": socket.gethostname(), "pid": os.getpid(), "command": "birdzarr convert x y",
              "started_at": "2026-01-01T00:00:00+00:00", "token": "t0", **fields}
    store.mkdir(parents=True, exist_ok=True)
    (store / LOCK_NAME).write_text(json.dumps(holder))


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@pytest.mark.slow
def test_a_second_writer_is_refused_with_the_holders_name(
    source: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    dest = tmp_path / "s.zarr"
    birdzarr.convert(source, dest, chunk_windows=128, progress=False)
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time; from birdzarr.storage._lock import StoreLock; "
         "from birdzarr.storage._location import resolve; "
         "StoreLock(resolve(sys.argv[1]), 'birdzarr append holder-test').acquire(); "
         "print('held', flush=True); time.sleep(60)", str(dest)],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        before = (dest / "zarr.json").read_bytes()
        with pytest.raises(StoreLockedError, match=rf"'birdzarr append holder-test' \(pid {holder.pid} on "):
            append(dest, source, progress=False)
        with pytest.raises(StoreLockedError, match=f"pid {holder.pid}"):
            birdzarr.convert(source, dest, overwrite=True, progress=False)
        with pytest.raises(StoreLockedError, match="--break-lock"):
            repair(dest)
        assert (dest / "zarr.json").read_bytes() == before  # the refused writers touched nothing
    finally:
        holder.kill()
        holder.wait()
    # the holder was killed: its lock is now stale and the next writer takes it over
    assert read_holder(resolve(dest)) is not None and read_holder(resolve(dest)).is_stale()  # type: ignore[union-attr]
    birdzarr.convert(source, dest, overwrite=True, chunk_windows=128, progress=False)
    assert not (dest / LOCK_NAME).exists()


def test_a_refused_first_conversion_leaves_the_lock_and_destination_alone(
    source: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    dest = tmp_path / "new.zarr"
    _write_lock(dest)  # this very process holds it: alive
    with pytest.raises(StoreLockedError):
        birdzarr.convert(source, dest, progress=False)
    assert sorted(p.name for p in dest.iterdir()) == [LOCK_NAME]


@pytest.mark.slow  # over a second of CPU: not in the fast loop
def test_stale_and_torn_locks_are_taken_over(source: pathlib.Path, tmp_path: pathlib.Path) -> None:
    dest = tmp_path / "s.zarr"
    _write_lock(dest, pid=_dead_pid())
    birdzarr.convert(source, dest, chunk_windows=128, progress=False)
    assert not (dest / LOCK_NAME).exists()
    (dest / LOCK_NAME).write_bytes(b"")  # a writer killed between creating and filling its lock
    append(dest, source, progress=False)
    assert not (dest / LOCK_NAME).exists()
    _write_lock(dest, pid=_dead_pid())
    report = repair(dest)
    assert any("stale lock" in action for action in report.actions)
    assert not (dest / LOCK_NAME).exists()


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_a_lock_from_another_host_is_never_broken_silently(
    source: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    dest = tmp_path / "s.zarr"
    birdzarr.convert(source, dest, chunk_windows=128, progress=False)
    _write_lock(dest, host="node-17.hpc", pid=1234)
    with pytest.raises(StoreLockedError, match="pid 1234 on node-17.hpc"):
        append(dest, source, progress=False)
    report = repair(dest, break_lock=True)
    assert any("broke the lock" in action for action in report.actions)
    assert not (dest / LOCK_NAME).exists()


def test_exactly_one_of_many_racing_writers_wins(tmp_path: pathlib.Path) -> None:
    for stale in (False, True):
        dest = tmp_path / f"race-{stale}.zarr"
        if stale:
            _write_lock(dest, pid=_dead_pid())
        location = resolve(dest)
        barrier = threading.Barrier(8)
        winners: list[StoreLock] = []
        refused: list[Exception] = []

        def contend(
            location: Any = location, barrier: Any = barrier, winners: Any = winners, refused: Any = refused
        ) -> None:
            lock = StoreLock(location, "racer")
            barrier.wait()
            try:
                winners.append(lock.acquire())
            except StoreLockedError as exc:
                refused.append(exc)

        threads = [threading.Thread(target=contend) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(winners) == 1 and len(refused) == 7
        assert read_holder(location).token == winners[0].holder.token  # type: ignore[union-attr]
        winners[0].release()
        assert read_holder(location) is None


def test_the_lock_on_an_object_store_filesystem(source: pathlib.Path) -> None:
    location = resolve("memory://birdzarr-lock-test/s.zarr")
    first = StoreLock(location, "first").acquire()
    with pytest.raises(StoreLockedError, match="'first'"):
        StoreLock(location, "second").acquire()
    first.release()
    StoreLock(location, "third").acquire().release()


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_no_secret_reaches_the_store_or_the_lock(source: pathlib.Path, tmp_path: pathlib.Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    secret = "S3CR3T-do-not-store-9f8e7d"
    argv = ["birdzarr", "append", f"s3://AKIAEXAMPLE:{secret}@bucket/s.zarr", "src"]
    monkeypatch.setattr(sys, "argv", argv)
    dest = tmp_path / "s.zarr"
    lock = StoreLock(resolve(dest)).acquire()
    text = (dest / LOCK_NAME).read_text()
    assert secret not in text and "bucket/s.zarr" in text
    lock.release()
    options = {"secret": secret, "token": secret}
    birdzarr.convert(source, dest, chunk_windows=128, progress=False,
                     storage_options=options, source_storage_options=options)
    append(dest, source, progress=False, storage_options=options, source_storage_options=options)
    for path in dest.rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_stores_open_read_only(source: pathlib.Path, tmp_path: pathlib.Path) -> None:
    dest = tmp_path / "s.zarr"
    store = birdzarr.convert(source, dest, chunk_windows=128, progress=False)
    before = store.windows[:10].copy()
    with pytest.raises(Exception, match="(?i)read.only"):
        store.gimu[0:1] = np.zeros((1, 20, 4), dtype=np.float32)
    with pytest.raises(Exception, match="(?i)read.only"):
        store.group.attrs["x"] = 1
    assert np.array_equal(birdzarr.open_store(dest).windows[:10], before)
    assert not (dest / LOCK_NAME).exists()  # readers never lock


@pytest.mark.slow
@pytest.mark.s3
def test_the_lock_on_s3_uses_a_conditional_write(source: pathlib.Path, moto: MotoEndpoint) -> None:  # noqa: F811
    """On S3 the lock is a PUT with If-None-Match: * (moto implements it like AWS)."""
    options = s3_options(moto.url)
    url = f"s3://{new_bucket(moto)}/s.zarr"
    location = resolve(url, options)
    held = StoreLock(location, "birdzarr convert on s3").acquire()
    with pytest.raises(StoreLockedError, match="'birdzarr convert on s3'"):
        StoreLock(resolve(url, options), "second").acquire()
    held.release()
    assert read_holder(location) is None
    store = birdzarr.convert(source, url, chunk_windows=128, progress=False, storage_options=options)
    assert len(store) == 600
    assert read_holder(resolve(url, options)) is None
