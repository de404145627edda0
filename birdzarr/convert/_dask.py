"""Connecting to a Dask cluster for ``birdzarr convert --dask-scheduler``.

A conversion with a ``distributed.Client`` (``convert(..., client=...)`` or ``--dask-scheduler
tcp://host:8786``) runs the same tasks as a local conversion in worker processes, on the
cluster's workers instead (``birdzarr/convert/_engine.py``: ``cluster_engine``, through
``client.get_executor()``), in both orders; the store is byte-identical to a local conversion's.
What the workers must reach: the input, the destination, and for ``shuffle=True`` the spill
directory (``shuffle_tmp``) at the same path as this process (docs/scaling.md#dask).
"""

from __future__ import annotations

from typing import Any


def connect(address: str) -> Any:
    """A ``distributed.Client`` for ``--dask-scheduler``; a clear error without the extra."""
    try:
        from distributed import Client
    except ImportError:
        from birdzarr._errors import MissingDependencyError

        raise MissingDependencyError(
            "--dask-scheduler needs Dask's distributed scheduler: pip install 'birdzarr[dask]'"
        ) from None
    from birdzarr._errors import SchedulerError

    try:
        return Client(address)
    except ValueError as exc:  # distributed's parsing of the address
        raise SchedulerError(f"--dask-scheduler {address}: not a scheduler address ({exc}); give "
                             "tcp://HOST:PORT, as `dask scheduler` prints it") from None
    except OSError as exc:  # nothing answered (distributed's connect timeout)
        raise SchedulerError(f"--dask-scheduler {address}: no scheduler answered ({exc}); check that it "
                             "runs and that this machine can reach that host and port") from None
