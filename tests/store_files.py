"""Test-only: two stores compared file by file, byte for byte, except the run's own facts."""

from __future__ import annotations

import json
import pathlib

# Root attributes that record when, how fast and on what a run went, not what it stored (a
# shuffle's spill pieces are cut where each worker's buffer fills; an append names its source).
VOLATILE = {"started_at", "finished_at", "committed_at", "seconds", "cpu_seconds", "cores_used", "workers",
            "usable_cores", "worker_processes", "segments", "pass_seconds", "pass_cpu_seconds",
            "spill_bytes", "source", "dask"}


def without_volatile(value: object) -> object:
    if isinstance(value, dict):
        return {k: without_volatile(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [without_volatile(v) for v in value]
    return value


def store_files(root: pathlib.Path) -> dict[str, bytes]:
    """Every file below ``root``: its relative path -> its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def assert_same_store(a: pathlib.Path, b: pathlib.Path) -> None:
    """Every file of both stores is byte-identical, except the root zarr.json, whose attributes
    are equal once the run's own facts (``VOLATILE``) are left out (and whose key order is the same)."""
    files_a, files_b = store_files(a), store_files(b)
    assert sorted(files_a) == sorted(files_b)
    for name, content in files_a.items():
        if name == "zarr.json":
            left, right = json.loads(content), json.loads(files_b[name])
            assert json.dumps(without_volatile(left)) == json.dumps(without_volatile(right))
        else:
            assert content == files_b[name], name
