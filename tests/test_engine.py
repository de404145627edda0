"""The one runner (birdzarr/convert/_engine.py): tasks on any concurrent.futures.Executor, results as
they finish, a failure first, nothing started after it and every submitted task ended before the
caller goes on; the device counts and the shuffle's shared spill on an engine."""

from __future__ import annotations

import pathlib
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

import birdzarr
from birdzarr._errors import ArgumentError
from birdzarr.convert import _engine, _segments, _shuffle, _shuffle_processes
from birdzarr.convert._engine import (
    Engine,
    Runner,
    in_process_engine,
    local_engine,
    ordered,
    run_all,
    thread_engine,
)
from birdzarr.convert._sources import find_inputs
from birdzarr.demo import _synthetic
from birdzarr.format._spec import Curation
from birdzarr.storage._location import resolve


@pytest.fixture
def threads() -> Any:
    with ThreadPoolExecutor(2) as pool:
        yield Engine(pool, width=1)  # at most 2 tasks submitted at once


def test_a_failure_stops_the_run_and_the_running_tasks_end_first(threads: Engine) -> None:
    started: list[int] = []
    ended: list[int] = []
    one_started, zero_failing = threading.Event(), threading.Event()

    def task(i: int) -> int:
        started.append(i)
        if i == 0:
            assert one_started.wait(30)
            zero_failing.set()
            raise ValueError("task 0 failed")
        if i == 1:
            one_started.set()
            assert zero_failing.wait(30)
        ended.append(i)
        return i

    with pytest.raises(ValueError, match="^task 0 failed$"), Runner(threads) as runner:
        for i in range(5):
            runner.submit(i, task, i)
        for _ in runner.results():
            pass
    # task 1 was running when task 0 failed: it ended before the runner let go; 2-4 never started
    assert sorted(started) == [0, 1] and ended == [1]


def test_results_come_as_tasks_finish_and_a_result_may_call_for_more_work(threads: Engine) -> None:
    seen = []
    with Runner(threads) as runner:
        runner.submit("first", pow, 2, 10)
        for tag, result in runner.results():
            seen.append((tag, result))
            if tag == "first":
                runner.submit("then", pow, result, 2)
    assert seen == [("first", 1024), ("then", 1024**2)]
    assert runner.tasks == 2


def test_run_all_keeps_the_order_of_the_calls(threads: Engine) -> None:
    assert run_all(threads, divmod, [(7, 2), (9, 4), (1, 1)]) == [(3, 1), (2, 1), (1, 0)]


@pytest.mark.slow
def test_devices_counted_on_an_engine_equal_counting_here(tmp_path: pathlib.Path) -> None:
    """CSV devices (no footers to count from) are read and curated by tasks of consecutive
    devices on the engine's worker processes: the counts of reading them here."""
    _synthetic.make_csv_dir(tmp_path, n_devices=5, bursts_per_device=40, parts=2, seed=2)
    devices = find_inputs([resolve(tmp_path)]).devices
    here = _segments.count_devices(devices, curation=Curation(), on_bad_rows="error")
    with local_engine(2) as engine:
        counted = _segments.count_devices(devices, curation=Curation(), on_bad_rows="error", engine=engine)
    assert counted == here and len(here) == 5 and min(here) > 0


def _spill_elsewhere(devices: Any, directory: str, **kwargs: Any) -> Any:
    """Pass 1 of a worker that sees another disk: its folder is not where this process looks."""
    return _ORIGINAL_SPILL_GROUP(devices, directory + "-elsewhere", **kwargs)


_ORIGINAL_SPILL_GROUP = _shuffle_processes.spill_group


@pytest.mark.slow
def test_a_spill_directory_the_workers_do_not_share_is_refused_in_one_line(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = tmp_path / "src"
    _synthetic.make_parquet_dir(src, n_devices=6, total_windows=6_000, seed=1)
    monkeypatch.setattr(_segments, "PROCESS_MIN_BYTES", 0)  # the shuffle's tasks in worker processes
    monkeypatch.setattr(_shuffle, "BUCKET_WINDOWS", 2000)
    monkeypatch.setattr(_shuffle_processes, "spill_group", _spill_elsewhere)  # forked: the workers see it
    spill = tmp_path / "spill"
    spill.mkdir()
    refusal = (r"^the shuffle's spill directory .*birdzarr-shuffle-\w+ is not shared with the workers: "
               r"\d+ of \d+ pass-1 folders they wrote are not there from this process; give shuffle_tmp= "
               r"\(--shuffle-tmp\) a directory that every worker and this machine reach at the same path "
               r"\(docs/scaling.md#dask\)$")
    with pytest.raises(ArgumentError, match=refusal):
        birdzarr.convert(src, tmp_path / "s.zarr", workers=2, shuffle=True, seed=1, chunk_windows=1024,
                         progress=False, shuffle_tmp=str(spill))
    assert not (tmp_path / "s.zarr").exists()
    assert list(spill.iterdir()) == []


# -- results in the order of the calls (CSV parts: _pipeline.py) ----------------------------------
def test_ordered_keeps_the_order_of_the_calls_when_later_ones_finish_first() -> None:
    first_may_end = threading.Event()
    ended: list[int] = []

    def task(i: int) -> int:
        if i == 0:
            assert first_may_end.wait(30)
        ended.append(i)
        if len(ended) == 3:  # 1, 2 and 3 (of the 4 in flight with width 2) ended before 0
            first_may_end.set()
        return i * 10

    with thread_engine(2) as engine:
        assert list(ordered(engine, task, [(i,) for i in range(8)])) == [i * 10 for i in range(8)]
    assert ended[:3] == sorted(ended[:3]) and 0 not in ended[:3]


def test_ordered_raises_in_order_and_every_submitted_call_ends_first() -> None:
    before = threading.active_count()
    running: list[int] = []
    ended: list[int] = []

    def task(i: int) -> int:
        running.append(i)
        if i == 2:
            raise ValueError("call 2 failed")
        ended.append(i)
        return i

    got = []
    with thread_engine(2) as engine, pytest.raises(ValueError, match="^call 2 failed$"):
        for result in ordered(engine, task, [(i,) for i in range(50)]):
            got.append(result)
    assert got == [0, 1]  # the results before the failure, in order
    # 4 in flight (width 2) as each result was taken: calls 0-5 were submitted, and all ended
    assert sorted(running) == list(range(6)) and sorted(ended) == [0, 1, 3, 4, 5]
    assert threading.active_count() == before  # the engine's threads ended with it


def test_ordered_bounds_what_is_submitted_ahead_of_the_result_taken() -> None:
    """A consumer that stops taking results leaves at most 2 x width calls submitted beyond it."""
    calls: list[int] = []

    def task(i: int) -> int:
        calls.append(i)
        return i

    with in_process_engine() as engine:
        results = ordered(engine, task, [(i,) for i in range(1000)])
        assert next(results) == 0
        assert calls == [0, 1]  # width 1: the one taken and one more
        assert next(results) == 1 and calls == [0, 1, 2]
        results.close()
    assert calls == [0, 1, 2]


def test_an_in_process_engine_runs_each_call_when_submitted_in_this_thread() -> None:
    threads: list[threading.Thread] = []
    with in_process_engine() as engine:
        assert (engine.width, engine.in_process, engine.facts) == (1, True, {})
        future = engine.executor.submit(lambda: threads.append(threading.current_thread()) or 7)
        assert future.done() and future.result() == 7 and threads == [threading.current_thread()]
        failed = engine.executor.submit(divmod, 1, 0)
        assert isinstance(failed.exception(), ZeroDivisionError)


def test_the_engine_is_chosen_by_client_processes_and_workers_only(tmp_path: pathlib.Path) -> None:
    """Below PROCESS_MIN_BYTES, with one worker, into memory:// (worker processes would each
    write a store of their own) or without fork: threads of this process; else processes."""
    fork = _engine.fork_available()
    big = _segments.PROCESS_MIN_BYTES
    assert _engine.processes_pay(big, workers=2, dest_shared=True) == fork
    assert not _engine.processes_pay(big - 1, workers=2, dest_shared=True)
    assert not _engine.processes_pay(big, workers=1, dest_shared=True)
    assert not _engine.processes_pay(big, workers=2, dest_shared=False)
    with _engine.choose_engine(None, processes=False, workers=1) as engine:
        assert isinstance(engine.executor, _engine.InProcess) and engine.in_process
    with _engine.choose_engine(None, processes=False, workers=3) as engine:
        assert isinstance(engine.executor, ThreadPoolExecutor)
        assert (engine.width, engine.in_process) == (3, True)
    if fork:
        with _engine.choose_engine(None, processes=True, workers=2) as engine:
            assert (engine.width, engine.in_process, engine.facts) == (2, False, {"worker_processes": 2})
