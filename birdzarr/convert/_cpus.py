"""How many workers a conversion runs (at most ``MAX_WORKERS_PER_CORE`` a usable core:
``birdzarr._cores``) and what its report records of CPU use."""

from __future__ import annotations

import warnings

from birdzarr._checks import require_int
from birdzarr._cores import usable_cpus
from birdzarr._errors import ArgumentError, BirdzarrWarning

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
