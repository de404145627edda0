"""Kill a converting or appending process at many moments; the store must survive every one.

The writer's process is forked from a forkserver that has already imported birdzarr (so each
kill costs milliseconds, not an interpreter start). In the child, zarr's LocalStore write
function is wrapped: at the k-th object write the child SIGKILLs itself, either before the write,
after it, or halfway through it (a torn ``.partial`` temp file is left on disk, as a kill during
``write()`` would). Object writes are the only moments at which the on-disk state changes, so
spreading k over all writes of a run covers every distinct state a kill can leave.

Every kill point is certain to be reached. The commit is found by what is written (the root
``zarr.json`` carrying the counted run's ``committed`` count and generation), never by its number,
and a numbered point k means "the k-th write before the commit": a run that reaches its commit
after fewer writes than the counted run did is killed just before the commit write, the last
moment a k-th write could have had. A child that exits 0 therefore completed a run without ever
writing that commit: a bug, not bad luck.

After each kill: the store opens (or, for a first conversion, reports an unfinished conversion),
``verify`` passes, the committed content is exactly the one before (or exactly the new one, if the
kill came after the commit), and re-running the same command gives chunk files and arrays
identical to an uninterrupted run.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import pathlib
import shutil
import signal
import time
from typing import Any

import numpy as np
import pytest

import birdzarr
from birdzarr._errors import IncompleteStoreError
from birdzarr.convert import append
from birdzarr.demo import _synthetic
from birdzarr.format import _v2
from birdzarr.format._spec import ATTRS_KEY
from birdzarr.maintenance._repair import repair
from birdzarr.maintenance._verify import verify

pytestmark = pytest.mark.slow

CHUNK = 64
MODES = ("before", "after", "torn")
COMMIT = "commit"  # the kill point at the commit write itself, found by its content


# -- the child ---------------------------------------------------------------------------------


class _WriteHook:
    """Counts every object write of this process (zarr's atomic LocalStore writes and the plain
    file writes of the converter's fast chunk path) and SIGKILLs the process at ``kill_at``.

    ``kill_at`` is either a write number k or :data:`COMMIT`. The commit (the root ``zarr.json``
    whose ``committed`` has the count and generation ``commit`` of the counted run) is recognised
    by its content, so a :data:`COMMIT` point is hit whatever the number of writes before it; an
    early write of some other ``committed`` (a bug) is not taken for it. A numbered point that the
    run has not reached when it comes to the commit fires just before the commit write (mode
    "before"): the number of writes may differ from the counted run's (thread scheduling), and the
    state a late k-th write would have left is then the one just before the commit. Before dying
    the hook writes what it did to ``report`` (JSON), for the parent's messages.
    """

    def __init__(self, kill_at: int | str | None, mode: str = "before", *,
                 commit: tuple[int, int] | None = None, report: str | None = None) -> None:
        import threading

        import zarr.storage._local as local
        from fsspec.implementations.local import LocalFileSystem

        self.kill_at, self.mode, self.report, self.count = kill_at, mode, report, 0
        self.fired = False
        self._guard = threading.Lock()
        self._commit = commit
        zarr_put, pipe_file = local._put, LocalFileSystem.pipe_file

        def put(path: pathlib.Path, value: Any, exclusive: bool = False) -> int:
            def torn() -> None:  # a kill inside write(): half a temp file, never renamed
                raw = value.to_bytes()
                path.parent.mkdir(parents=True, exist_ok=True)
                path.with_suffix(".torn0000.partial").write_bytes(raw[: len(raw) // 2])

            commit = self._commit is not None and path.name == "zarr.json" and (
                _committed(value.to_bytes()) == self._commit
            )
            return self._write(lambda: zarr_put(path, value, exclusive=exclusive), torn, commit)

        def pipe(fs: Any, path: str, value: bytes, *args: Any, **kwargs: Any) -> Any:
            def torn() -> None:  # a kill inside write() of a plain file: the file is cut short
                with open(path, "wb") as handle:
                    handle.write(value[: len(value) // 2])

            return self._write(lambda: pipe_file(fs, path, value, *args, **kwargs), torn, False)

        local._put = put
        LocalFileSystem.pipe_file = pipe  # type: ignore[method-assign]

    def _write(self, write: Any, torn: Any, commit: bool) -> Any:
        with self._guard:
            self.count += 1
            now = self.count
            if self.fired or self.kill_at is None:
                fire, mode = False, self.mode
            elif commit:  # a COMMIT point, or a numbered point not reached before the commit
                fire, mode = True, self.mode if self.kill_at == COMMIT else "before"
            else:
                fire, mode = now == self.kill_at, self.mode
            self.fired |= fire
        if not fire:
            return write()
        try:
            if self.report:
                done = {"write": now, "commit": commit, "mode": mode}
                pathlib.Path(self.report).write_text(json.dumps(done))
            if mode == "after":
                write()  # may raise (zarr's exclusive writes fail on purpose): die anyway
            elif mode == "torn":
                torn()
        finally:
            os.kill(os.getpid(), signal.SIGKILL)


def _committed(zarr_json: bytes) -> tuple[int, int] | None:
    """(count, generation) committed by a ``zarr.json``; None for an array's or an uncommitted
    group's (only the root group carries birdzarr's attributes)."""
    meta = json.loads(zarr_json).get("attributes", {}).get(ATTRS_KEY)
    committed = meta.get("committed") if isinstance(meta, dict) else None
    return (committed["n_windows"], committed["generation"]) if committed else None


def _run(command: str, source: str, dest: str) -> None:
    if command == "convert":
        birdzarr.convert(source, dest, chunk_windows=CHUNK, progress=False, workers=2)
    else:
        append(dest, source, progress=False, workers=2)


def _run_until_killed(command: str, source: str, dest: str, commit: tuple[int, int],
                      kill_at: int | str, mode: str, report: str) -> None:
    """Run convert/append; SIGKILL this process at ``kill_at`` (see :class:`_WriteHook`)."""
    _WriteHook(kill_at, mode, commit=commit, report=report)
    _run(command, source, dest)
    os._exit(0)  # the run completed without writing a commit: the parent reports it


def _count_writes(command: str, source: str, dest: str) -> tuple[int, tuple[int, int]]:
    """Object writes of an uninterrupted run, counted in a child like the killed ones, and the
    (count, generation) it committed: what identifies the commit write of the killed runs."""
    ctx = _context()
    queue = ctx.SimpleQueue()
    child = ctx.Process(target=_counting_child, args=(command, source, dest, queue))
    child.start()
    child.join()
    assert child.exitcode == 0
    commit = _committed(pathlib.Path(dest, "zarr.json").read_bytes())
    assert commit is not None
    return int(queue.get()), commit


def _counting_child(command: str, source: str, dest: str, queue: Any) -> None:
    hook = _WriteHook(None)
    _run(command, source, dest)
    queue.put(hook.count)


_CTX: Any = None


def _context() -> Any:
    global _CTX
    if _CTX is None:
        _CTX = multiprocessing.get_context("forkserver")
        # Everything a run imports, so that each forked writer starts in milliseconds.
        _CTX.set_forkserver_preload([
            "numpy", "pandas", "pyarrow.compute", "pyarrow.csv", "pyarrow.parquet", "zarr",
            "zarr.storage._local",
            "fsspec.implementations.local", "numcodecs", "birdzarr", "birdzarr.convert",
            "birdzarr.store._handle", "test_crash",
        ])
    return _CTX


def _kill(command: str, source: str, dest: str, commit: tuple[int, int], kill_at: int | str,
          mode: str) -> dict[str, Any]:
    """Run a writer killed at ``kill_at``; returns what the hook did (which write, commit, mode)."""
    report = pathlib.Path(f"{dest}.kill.json")
    report.unlink(missing_ok=True)
    args = (command, source, dest, commit, kill_at, mode, str(report))
    child = _context().Process(target=_run_until_killed, args=args)
    child.start()
    child.join(timeout=60)
    if child.exitcode is None:
        child.kill()
        child.join()
        pytest.fail(f"writer killed at {kill_at} ({mode}) still ran after 60 s")
    assert child.exitcode == -signal.SIGKILL, (kill_at, mode, child.exitcode)
    done: dict[str, Any] = json.loads(report.read_text())
    report.unlink()
    return done


# -- what a store holds --------------------------------------------------------------------------


def _per_window_arrays(store: birdzarr.Store) -> tuple[str, ...]:
    """The arrays of one entry per window: format 2's coded ones (the default) or format 1's gimu."""
    coded = (_v2.CODES, _v2.GPS, _v2.ROW) if store.format_version == 2 else ("gimu",)
    return (*coded, "device", "timestamp", "label")


def _snapshot(dest: pathlib.Path) -> dict[str, Any]:
    """Committed content: root attributes (minus times), committed windows, every chunk's bytes."""
    store = birdzarr.open_store(dest)
    n = len(store)
    meta = json.loads(json.dumps(store.meta))
    for key in ("committed", "report"):
        meta.pop(key, None)
    group: Any = store.group
    arrays = {name: group[name][:n] for name in _per_window_arrays(store)}
    arrays["windows"] = store.windows[:n]  # the decoded windows, whatever the format
    if store.format_version == 2:  # the dictionary, to its committed size
        sizes = store.meta["committed"]["dictionary"]
        for name, size in ((_v2.VALUES, sizes["values"]), (_v2.START, sizes["rows"]),
                           (_v2.DEVICE, sizes["rows"])):
            arrays[name] = group[name][:size]
    chunks = {}
    for name in arrays.keys() - {"windows"}:
        root = dest / name / "c"
        for path in sorted(root.rglob("*")):
            if path.is_file():
                chunks[str(path.relative_to(dest))] = path.read_bytes()
    shapes = {name: group[name].shape[0] for name in arrays.keys() - {"windows"}}
    return {"n": n, "generation": store.meta["committed"]["generation"], "meta": meta,
            "arrays": arrays, "chunks": chunks, "shapes": shapes}


def _committed_view(snapshot: dict[str, Any]) -> tuple[Any, ...]:
    """What a reader can see: count, table and committed windows (not bytes past the count)."""
    return snapshot["n"], snapshot["generation"], json.dumps(snapshot["meta"], sort_keys=True)


def _assert_same_arrays(a: dict[str, Any], b: dict[str, Any]) -> None:
    for name in a["arrays"]:
        assert np.array_equal(a["arrays"][name].view(np.uint8), b["arrays"][name].view(np.uint8)), name


def _assert_rerun_matches(dest: pathlib.Path, expected: dict[str, Any], context: object) -> None:
    """A re-run after a kill: verified, and chunk files and arrays identical to an uninterrupted run."""
    again = _snapshot(dest)
    assert verify(dest).ok
    assert again["chunks"] == expected["chunks"], context
    assert again["shapes"] == expected["shapes"], context  # what zarr-python readers see
    _assert_same_arrays(again, expected)
    assert _committed_view(again) == _committed_view(expected)


def _kill_points(total: int, count: int) -> list[tuple[int | str, str]]:
    """``count`` distinct (k, mode) pairs: spread over the ``total - 1`` writes a counted run made
    before its commit, then just before and just after the commit write."""
    ks = np.unique(np.linspace(1, total - 1, count - 2).round().astype(int)).tolist()
    spread: list[tuple[int | str, str]] = [(k, MODES[i % len(MODES)]) for i, k in enumerate(ks)]
    return [*spread, (COMMIT, "before"), (COMMIT, "after")]


# -- the loops ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("crash")
    _synthetic.make_parquet_dir(root / "parquet", n_devices=4, total_windows=1_500, seed=3)
    raws = _synthetic.make_csv_dir(root / "csv_all", n_devices=4, bursts_per_device=80, parts=2, seed=4)
    # The first conversion gets part 0 of three devices; the append brings their part 1 (new parts
    # of existing devices) and a device the store has never seen.
    (root / "csv_base").mkdir()
    (root / "csv_more").mkdir()
    devices = sorted(raws)
    for path in sorted((root / "csv_all").iterdir()):
        device, part = (int(x) for x in path.stem.split("_"))
        target = "csv_base" if part == 0 and device != devices[-1] else "csv_more"
        shutil.copy(path, root / target / path.name)
    return {"parquet": root / "parquet", "csv_base": root / "csv_base", "csv_more": root / "csv_more",
            "csv_all": root / "csv_all"}


KILL_POINTS_PER_LOOP = 12  # two loops: 24 kills, plus the repair case


def test_killed_first_conversion_never_looks_committed(
    sources: dict[str, pathlib.Path], tmp_path: pathlib.Path
) -> None:
    source = str(sources["parquet"])
    reference = tmp_path / "reference.zarr"
    total, commit = _count_writes("convert", source, str(reference))
    expected = _snapshot(reference)
    assert verify(reference).ok
    points = _kill_points(total, KILL_POINTS_PER_LOOP)
    for i, (k, mode) in enumerate(points):
        dest = tmp_path / f"k{i}.zarr"
        killed = _kill("convert", source, str(dest), commit, k, mode)
        committed = False
        if dest.exists() and (dest / "zarr.json").exists():
            try:
                store = birdzarr.open_store(dest)
            except IncompleteStoreError:
                pass  # killed before the commit: an unfinished conversion, never a partial store
            else:  # killed after the commit's write: the conversion is complete
                assert verify(store.url).ok
                committed = True
        elif dest.exists():
            with pytest.raises(IncompleteStoreError):
                birdzarr.open_store(dest)  # only the dead writer's lock file is there
        # committed exactly when the commit write itself completed
        assert committed == (k == COMMIT and mode == "after"), (k, mode, killed)
        if committed:  # re-running would refuse (StoreExistsError) like for any existing store
            repair(dest)  # removes the dead writer's stale lock
        else:
            if i % 2 == 0:  # half the time, clean up with repair before re-running
                assert "unfinished conversion" in repair(dest).format()
                assert not dest.exists()
            birdzarr.convert(source, dest, chunk_windows=CHUNK, progress=False, workers=2)
        _assert_rerun_matches(dest, expected, (k, mode))
        assert not (dest / ".birdzarr.lock").exists()
        shutil.rmtree(dest)
    assert len(points) == KILL_POINTS_PER_LOOP  # every point was reached and survived (above)


def test_killed_append_keeps_the_previous_commit(
    sources: dict[str, pathlib.Path], tmp_path: pathlib.Path
) -> None:
    base = tmp_path / "base.zarr"
    birdzarr.convert(sources["csv_base"], base, chunk_windows=CHUNK, progress=False)
    before = _snapshot(base)
    reference = tmp_path / "reference.zarr"
    shutil.copytree(base, reference)
    total, commit = _count_writes("append", str(sources["csv_more"]), str(reference))
    after = _snapshot(reference)
    assert after["n"] > before["n"] and after["generation"] == 2
    # verify --source derives each batch (conversion, append) from its own files, as written
    assert verify(reference, source=sources["csv_all"]).ok
    points = _kill_points(total, KILL_POINTS_PER_LOOP)
    for i, (k, mode) in enumerate(points):
        dest = tmp_path / f"k{i}.zarr"
        shutil.copytree(base, dest)
        killed = _kill("append", str(sources["csv_more"]), str(dest), commit, k, mode)
        now = _snapshot(dest)
        assert verify(dest).ok, verify(dest).format()
        # the new commit exactly when the commit itself was written, else the previous one
        visible = after if (k == COMMIT and mode == "after") else before
        assert _committed_view(now) == _committed_view(visible), (k, mode, killed)
        _assert_same_arrays(now, visible)
        append(dest, sources["csv_more"], progress=False)  # re-run: completes the job
        _assert_rerun_matches(dest, after, (k, mode))
        shutil.rmtree(dest)
    assert len(points) == KILL_POINTS_PER_LOOP


def test_repair_removes_leftovers_of_a_killed_append(
    sources: dict[str, pathlib.Path], tmp_path: pathlib.Path
) -> None:
    from birdzarr.store._tail import leftovers

    dest = tmp_path / "store.zarr"
    birdzarr.convert(sources["csv_base"], dest, chunk_windows=CHUNK, progress=False)
    before = _snapshot(dest)
    shutil.copytree(dest, tmp_path / "counted.zarr")
    total, commit = _count_writes("append", str(sources["csv_more"]), str(tmp_path / "counted.zarr"))
    # the last write before the commit (or, should this run write less, just before the commit):
    # arrays resized and data written past the committed count
    _kill("append", str(sources["csv_more"]), str(dest), commit, total - 1, "torn")
    (dest / _v2.CODES / "zarr.0123abcd.partial").write_bytes(b"{")  # as a kill inside a metadata write
    found = leftovers(birdzarr.open_store(dest).location, before["n"])
    assert any("shape" in item for item in found) and any("temp" in item for item in found), found
    assert any("stale lock" in item for item in found), found
    report = repair(dest)
    assert report.committed_windows == before["n"]
    assert any("stale lock" in a for a in report.actions), report.actions
    assert leftovers(birdzarr.open_store(dest).location, before["n"]) == []
    repaired = _snapshot(dest)
    assert _committed_view(repaired) == _committed_view(before)
    _assert_same_arrays(repaired, before)
    assert not list(dest.rglob("*.partial"))
    assert not (dest / ".birdzarr.lock").exists()
    assert "nothing to repair" in repair(dest).format()


# -- worker processes ----------------------------------------------------------------------------


def _convert_with_stuck_workers(source: str, dest: str, markers: str) -> None:
    """A conversion in worker processes (run as its own process) whose workers each announce
    themselves (a file named after their pid) and then stop before writing anything."""
    import importlib

    segments = importlib.import_module("birdzarr.convert._segments")
    segments.PROCESS_MIN_BYTES = 0
    segments.MIN_SEGMENT_CHUNKS = 0
    # a segment a device: no group of small devices sharing dictionary entries to keep together
    importlib.import_module("birdzarr.format._rows").SHARED_ROW_WINDOWS = 0

    def stuck(*args: Any) -> Any:  # the first call a worker makes for its segment
        pathlib.Path(markers, str(os.getpid())).write_text("")
        signal.pause()  # until killed

    segments.resolve = stuck  # the workers are forked from this process: they see the patch
    birdzarr.convert(source, dest, workers=2, chunk_windows=CHUNK, progress=False)


def _ended(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie has ended
    except FileNotFoundError:
        return True


def test_worker_processes_end_with_a_killed_conversion(
    sources: dict[str, pathlib.Path], tmp_path: pathlib.Path
) -> None:
    """Killing the converting process ends its worker processes too, so none writes into the
    destination afterwards (a new conversion may be replacing it by then)."""
    dest, markers = tmp_path / "s.zarr", tmp_path / "markers"
    markers.mkdir()
    driver = _context().Process(target=_convert_with_stuck_workers,
                                args=(str(sources["parquet"]), str(dest), str(markers)))
    driver.start()
    try:
        deadline = time.monotonic() + 60
        while len(list(markers.iterdir())) < 2 and driver.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)  # polling for the event: both workers have announced themselves
        workers = [int(p.name) for p in markers.iterdir()]
        assert len(workers) == 2, driver.exitcode
        assert not any(_ended(pid) for pid in workers)
    finally:  # a failed check must not leave the driver (and pytest) waiting forever
        driver.kill()
        driver.join()
    deadline = time.monotonic() + 30
    while not all(_ended(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert all(_ended(pid) for pid in workers), "a worker process outlived the killed conversion"
    with pytest.raises(IncompleteStoreError):
        birdzarr.open_store(dest)
    birdzarr.convert(sources["parquet"], dest, workers=2, chunk_windows=CHUNK, progress=False)
    assert verify(dest).ok
