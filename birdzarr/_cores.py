"""How many cores this process may use: CPU affinity and the cgroup CPU quota, as SLURM and
Kubernetes set them (``os.cpu_count()`` reports the whole machine and ignores both). One answer
for every part that sizes a pool: conversion's workers, the loader's reader threads, resident
mode's load."""

from __future__ import annotations

import math
import os

CGROUP_CPU_MAX = "/sys/fs/cgroup/cpu.max"  # cgroup v2: "QUOTA PERIOD" or "max PERIOD"
CGROUP_V1_QUOTA = "/sys/fs/cgroup/cpu/cpu.cfs_quota_us"  # cgroup v1: quota (-1: none) ...
CGROUP_V1_PERIOD = "/sys/fs/cgroup/cpu/cpu.cfs_period_us"  # ... per period


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii") as handle:
            return handle.read().strip()
    except (OSError, ValueError):
        return None


def cgroup_cpu_limit(cpu_max: str = CGROUP_CPU_MAX, v1_quota: str = CGROUP_V1_QUOTA,
                     v1_period: str = CGROUP_V1_PERIOD) -> int | None:
    """Cores the cgroup CPU quota allows (rounded up, at least 1), or None without a quota."""
    text = _read(cpu_max)
    if text is not None:
        fields = text.split()
        if len(fields) == 2 and fields[0] != "max":
            try:
                quota, period = int(fields[0]), int(fields[1])
            except ValueError:
                return None
            return max(1, math.ceil(quota / period)) if quota > 0 and period > 0 else None
        return None
    quota_text, period_text = _read(v1_quota), _read(v1_period)
    try:
        quota, period = int(quota_text or "-1"), int(period_text or "0")
    except ValueError:
        return None
    return max(1, math.ceil(quota / period)) if quota > 0 and period > 0 else None


def usable_cpus() -> int:
    """Cores available to this process: the CPU affinity mask (``taskset``, SLURM's
    ``--cpus-per-task`` binding), capped by the cgroup quota (Kubernetes ``limits.cpu``,
    SLURM's cgroup plugin), at least 1."""
    try:
        count = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        count = os.cpu_count() or 1
    limit = cgroup_cpu_limit()
    return max(1, min(count, limit) if limit is not None else count)
