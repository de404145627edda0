"""Kill a converting or appending process at many moments; the store must survive every one.

The writer's process is forked from a forkserver that has already imported birdzarr (so each
kill costs milliseconds, not an interpreter start). In the child, zarr's LocalStore write
function is wrapped: at the k-th object write the child SIGKILLs itself, either before the write,
after it, or halfway through it (a torn ``.partial`` temp file is left on disk, as a kill during
``write()`` would). Object writes are the only moments at which the on-disk state changes, so
spreading k over all writes of a run covers every distinct state a kill can leave.

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
from typing import Any

import numpy as np
import pytest

import birdzarr
from birdzarr import _synthetic
from birdzarr._errors import IncompleteStoreError
from birdzarr._repair import repair
from birdzarr._verify import verify
from birdzarr.convert import append

CHUNK = 64
MODES = ("before", "after", "torn")


# -- the child ---------------------------------------------------------------------------------


class _WriteHook:
    """Counts every object write of this process (zarr's atomic LocalStore writes and the plain
    file writes of the converter's fast chunk path) and SIGKILLs the process at write ``kill_at``."""

    def __init__(self, kill_at: int | None, mode: str = "before") -> None:
        import threading

        import zarr.storage._local as local
        from fsspec.implementations.local import LocalFileSystem

        self.kill_at, self.mode, self.count = kill_at, mode, 0
        self._guard = threading.Lock()
        zarr_put, pipe_file = local._put, LocalFileSystem.pipe_file

        def put(path: pathlib.Path, value: Any, exclusive: bool = False) -> int:
            def torn() -> None:  # a kill inside write(): half a temp file, never renamed
                raw = value.to_bytes()
                path.parent.mkdir(parents=True, exist_ok=True)
                path.with_suffix(".torn0000.partial").write_bytes(raw[: len(raw) // 2])

            return self._write(lambda: zarr_put(path, value, exclusive=exclusive), torn)

        def pipe(fs: Any, path: str, value: bytes, *args: Any, **kwargs: Any) -> Any:
            def torn() -> None:  # a kill inside write() of a plain file: the file is cut short
                with open(path, "wb") as handle:
                    handle.write(value[: len(value) // 2])

            return self._write(lambda: pipe_file(fs, path, value, *args, **kwargs), torn)

        local._put = put
        LocalFileSystem.pipe_file = pipe  # type: ignore[method-assign]

    def _write(self, write: Any, torn: Any) -> Any:
        with self._guard:
            self.count += 1
            now = self.count
        if now != self.kill_at:
            return write()
        try:
            if self.mode == "after":
                write()  # may raise (zarr's exclusive writes fail on purpose): die anyway
            elif self.mode == "torn":
                torn()
        finally:
            os.kill(os.getpid(), signal.SIGKILL)


def _run(command: str, source: str, dest: str) -> None:
    if command == "convert":
        birdzarr.convert(source, dest, chunk_windows=CHUNK, progress=False, workers=2)
    else:
        append(dest, source, progress=False, workers=2)


def _run_until_killed(command: str, source: str, dest: str, kill_at: int, mode: str) -> None:
    """Run convert/append; SIGKILL this process at its ``kill_at``-th object write."""
    _WriteHook(kill_at, mode)
    _run(command, source, dest)
    os._exit(0)  # k was past the last write: the run completed


def _count_writes(command: str, source: str, dest: str) -> int:
    """Object writes of an uninterrupted run, counted in a child like the killed ones."""
    ctx = _context()
    queue = ctx.SimpleQueue()
    child = ctx.Process(target=_counting_child, args=(command, source, dest, queue))
    child.start()
    child.join()
    assert child.exitcode == 0
    return int(queue.get())


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
            "birdzarr._store", "test_crash",
        ])
    return _CTX


def _kill(command: str, source: str, dest: str, kill_at: int, mode: str) -> int | None:
    child = _context().Process(target=_run_until_killed, args=(command, source, dest, kill_at, mode))
    child.start()
    child.join(timeout=60)
    return child.exitcode


# -- what a store holds --------------------------------------------------------------------------


def _snapshot(dest: pathlib.Path) -> dict[str, Any]:
    """Committed content: root attributes (minus times), committed windows, every chunk's bytes."""
    store = birdzarr.open_store(dest)
    n = len(store)
    meta = json.loads(json.dumps(store.meta))
    for key in ("committed", "report"):
        meta.pop(key, None)
    arrays = {name: store.group[name][:n] for name in ("gimu", "device", "timestamp", "label")}
    chunks = {}
    for name in arrays:
        root = dest / name / "c"
        for path in sorted(root.rglob("*")):
            if path.is_file():
                chunks[str(path.relative_to(dest))] = path.read_bytes()
    return {"n": n, "generation": store.meta["committed"]["generation"], "meta": meta,
            "arrays": arrays, "chunks": chunks}


def _committed_view(snapshot: dict[str, Any]) -> tuple[Any, ...]:
    """What a reader can see: count, table and committed windows (not bytes past the count)."""
    return snapshot["n"], snapshot["generation"], json.dumps(snapshot["meta"], sort_keys=True)


def _assert_same_arrays(a: dict[str, Any], b: dict[str, Any]) -> None:
    for name in a["arrays"]:
        assert np.array_equal(a["arrays"][name].view(np.uint8), b["arrays"][name].view(np.uint8)), name


def _kill_points(total: int, count: int) -> list[tuple[int, str]]:
    """``count`` distinct (k, mode) pairs: spread over the writes before the commit, then just
    before and just after the commit (the last write)."""
    ks = np.unique(np.linspace(1, total - 1, count - 2).round().astype(int)).tolist()
    spread = [(k, MODES[i % len(MODES)]) for i, k in enumerate(ks)]
    return [*spread, (total, "before"), (total, "after")]


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


KILL_POINTS_PER_LOOP = 12
survived: dict[str, int] = {}


def test_killed_first_conversion_never_looks_committed(
    sources: dict[str, pathlib.Path], tmp_path: pathlib.Path
) -> None:
    source = str(sources["parquet"])
    reference = tmp_path / "reference.zarr"
    total = _count_writes("convert", source, str(reference))
    expected = _snapshot(reference)
    assert verify(reference).ok
    points = _kill_points(total, KILL_POINTS_PER_LOOP)
    for k, mode in points:
        dest = tmp_path / f"k{k}.zarr"
        code = _kill("convert", source, str(dest), k, mode)
        assert code == -signal.SIGKILL, (k, mode, code)
        committed = False
        if dest.exists() and (dest / "zarr.json").exists():
            try:
                store = birdzarr.open_store(dest)
            except IncompleteStoreError:
                pass  # killed before the commit: an unfinished conversion, never a partial store
            else:  # killed after the commit's write: the conversion is complete
                assert k == total and mode == "after", (k, mode)
                assert verify(store.url).ok
                committed = True
        elif dest.exists():
            with pytest.raises(IncompleteStoreError):
                birdzarr.open_store(dest)  # only the dead writer's lock file is there
        if committed:  # re-running would refuse (StoreExistsError) like for any existing store
            repair(dest)  # removes the dead writer's stale lock
        else:
            if k % 2:  # half the time, clean up with repair before re-running
                assert "unfinished conversion" in repair(dest).format()
                assert not dest.exists()
            birdzarr.convert(source, dest, chunk_windows=CHUNK, progress=False, workers=2)
        again = _snapshot(dest)
        assert verify(dest).ok
        assert again["chunks"] == expected["chunks"], (k, mode)
        _assert_same_arrays(again, expected)
        assert _committed_view(again) == _committed_view(expected)
        assert not (dest / ".birdzarr.lock").exists()
        shutil.rmtree(dest)
    survived["convert"] = len(points)


def test_killed_append_keeps_the_previous_commit(
    sources: dict[str, pathlib.Path], tmp_path: pathlib.Path
) -> None:
    base = tmp_path / "base.zarr"
    birdzarr.convert(sources["csv_base"], base, chunk_windows=CHUNK, progress=False)
    before = _snapshot(base)
    reference = tmp_path / "reference.zarr"
    shutil.copytree(base, reference)
    total = _count_writes("append", str(sources["csv_more"]), str(reference))
    after = _snapshot(reference)
    assert after["n"] > before["n"] and after["generation"] == 2
    # verify --source derives each batch (conversion, append) from its own files, as written
    assert verify(reference, source=sources["csv_all"]).ok
    points = _kill_points(total, KILL_POINTS_PER_LOOP)
    for k, mode in points:
        dest = tmp_path / f"k{k}.zarr"
        shutil.copytree(base, dest)
        code = _kill("append", str(sources["csv_more"]), str(dest), k, mode)
        assert code == -signal.SIGKILL, (k, mode, code)
        now = _snapshot(dest)
        assert verify(dest).ok, verify(dest).format()
        if _committed_view(now) == _committed_view(after):
            assert k == total and mode == "after", (k, mode)  # the commit itself was written
            _assert_same_arrays(now, after)
        else:
            assert _committed_view(now) == _committed_view(before), (k, mode)
            _assert_same_arrays(now, before)
        append(dest, sources["csv_more"], progress=False)  # re-run: completes the job
        again = _snapshot(dest)
        assert verify(dest).ok
        assert again["chunks"] == after["chunks"], (k, mode)
        _assert_same_arrays(again, after)
        assert _committed_view(again) == _committed_view(after)
        shutil.rmtree(dest)
    survived["append"] = len(points)


def test_repair_removes_leftovers_of_a_killed_append(
    sources: dict[str, pathlib.Path], tmp_path: pathlib.Path
) -> None:
    from birdzarr._repair import leftovers

    dest = tmp_path / "store.zarr"
    birdzarr.convert(sources["csv_base"], dest, chunk_windows=CHUNK, progress=False)
    before = _snapshot(dest)
    shutil.copytree(dest, tmp_path / "counted.zarr")
    total = _count_writes("append", str(sources["csv_more"]), str(tmp_path / "counted.zarr"))
    # the last write before the commit: arrays resized and data written past the committed count
    assert _kill("append", str(sources["csv_more"]), str(dest), total - 1, "torn") == -signal.SIGKILL
    (dest / "gimu" / "zarr.0123abcd.partial").write_bytes(b"{")  # as a kill inside a metadata write
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


def test_kill_loops_cover_at_least_twenty_moments() -> None:
    if len(survived) < 2:
        pytest.skip("the kill loops did not run in this session")
    assert sum(survived.values()) >= 20, survived
