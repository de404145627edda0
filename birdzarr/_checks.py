"""Small checks of Python API arguments, shared by the public entry points.

The command line's argparse types already refuse wrong input; these guard the Python API, where
a truthy string such as ``overwrite="no"`` would otherwise act as True and replace a store. They
raise ``TypeError`` for a wrong type (a wrong call, as in zarr-python and numpy) and
``ArgumentError`` (a ``ValueError``) for a value out of range, naming the argument and what it
must be, before anything is read or written.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from birdzarr._errors import ArgumentError


def require_bool(name: str, value: Any) -> bool:
    """``value`` as a bool; only ``True``/``False`` (numpy's ``bool_`` too) are accepted."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise TypeError(f"{name} must be True or False, got {value!r}")


def require_int(name: str, value: Any, *, minimum: int | None = None) -> int:
    """``value`` as an int: a Python or numpy integer (not a bool, a float or a string), at
    least ``minimum`` when given."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ArgumentError(f"{name} must be an integer of {minimum} or more, got {value}")
    return int(value)


def require_number(name: str, value: Any) -> float:
    """``value`` as a finite float: a Python or numpy real number (not a bool or a string)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    number = float(value)
    if not math.isfinite(number):
        raise ArgumentError(f"{name} must be a finite number, got {number}")
    return number


def refuse_float(name: str, value: Any) -> None:
    """Refuse a float where an integer is meant and ``int()`` would truncate it silently (an id
    that may also come as a string, ``"200"``, from a table or the command line)."""
    if isinstance(value, (float, np.floating)):
        raise TypeError(f"{name} must be an integer, got {value!r}")
