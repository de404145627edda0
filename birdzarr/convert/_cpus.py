"""How many cores this process may use: CPU affinity and the cgroup CPU quota, as SLURM and
Kubernetes set them (``os.cpu_count()`` reports the whole machine and ignores both)."""

from __future__ import annotations

import math
import os
import warnings

from birdzarr._checks import require_int
from birdzarr._errors import ArgumentError, BirdzarrWarning

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


# Workers beyond the usable cores only overlap waiting (object stores); far beyond, each adds
# its memory (docs/conversion.md#memory) and processes for nothing: 10,000 did not finish
MAX_WORKERS_PER_CORE = 4


def resolve_workers(workers: int | None) -> int:
    """``workers`` as given (must be positive), or all usable cores when None or 0; at most
    ``MAX_WORKERS_PER_CORE`` per usable core (with a warning)."""
    if workers is None:
        return usable_cpus()
    workers = require_int("workers", workers)  # "2" would fail later, comparing str with int
    if workers == 0:
        return usable_cpus()
    if workers < 0:
        raise ArgumentError(f"workers must be positive (or None for all usable cores), got {workers}")
    if workers <= MAX_WORKERS_PER_CORE:  # within the cap on any machine: no need to read the limits
        return workers
    cores = usable_cpus()
    if workers > MAX_WORKERS_PER_CORE * cores:
        warnings.warn(f"workers={workers} is more than {MAX_WORKERS_PER_CORE} per usable core ({cores}): "
                      f"using {MAX_WORKERS_PER_CORE * cores}, as more only add memory",
                      BirdzarrWarning, stacklevel=2)
        return MAX_WORKERS_PER_CORE * cores
    return workers


def cpu_seconds() -> float:
    """CPU seconds (user + system) of this process and of its finished child processes."""
    import resource

    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


def cpu_report(seconds: float, cpu_before: float, workers: int) -> dict[str, float | int]:
    """What the conversion report records about CPU use: CPU seconds since ``cpu_before`` and
    the cores that makes on average over ``seconds`` of wall time."""
    cpu = cpu_seconds() - cpu_before
    return {"cpu_seconds": round(cpu, 3), "cores_used": round(cpu / seconds, 2) if seconds > 0 else 0.0,
            "workers": workers, "usable_cores": usable_cpus()}
