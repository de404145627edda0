"""Argument types of the command line: a wrong number is refused by argparse, in one line with
exit status 2, before any work starts (not deep inside, where it would look like a bug)."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """An integer of at least 1."""
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def non_negative_int(text: str) -> int:
    """An integer of at least 0."""
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer of 0 or more, got {text}")
    return value


def chunk_windows(text: str) -> int:
    """Windows a chunk: 1 to ``MAX_CHUNK_WINDOWS``."""
    from birdzarr.format._spec import MAX_CHUNK_WINDOWS

    value = _int(text)
    if not 1 <= value <= MAX_CHUNK_WINDOWS:
        raise argparse.ArgumentTypeError(f"expected an integer from 1 to {MAX_CHUNK_WINDOWS:,}, got {text}")
    return value


def dpi(text: str) -> int:
    """Dots per inch of a saved figure: 10 to 1200 (the device plot, 8.5 x 7 inches, is then
    340 MB of RGBA pixels)."""
    value = _int(text)
    if not 10 <= value <= 1200:
        raise argparse.ArgumentTypeError(f"expected an integer from 10 to 1200, got {text}")
    return value


def seed(text: str) -> int:
    """A seed of a shuffle: 0 to 2**63 - 1 (what the store records)."""
    value = _int(text)
    if not 0 <= value < 2**63:
        raise argparse.ArgumentTypeError(f"expected an integer from 0 to 2**63-1, got {text}")
    return value


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
