"""64-bit hashes of windows, and the order-free device digest of a shuffled store.

A shuffled store scatters each device's windows over every chunk, in an order only its second
conversion pass knows. Its device table therefore records, per device, a digest that does not
depend on the order: the wrapping sum (mod 2**64) of a 64-bit hash of each of its rows (window,
timestamp, label). The conversion computes it as it reads the input; ``verify`` recomputes it
from the chunks in any order. docs/format.md (device table entries) specifies it, so that any
reader can check it with numpy alone.

The duplicate-window check (``birdzarr/convert/_duplicates.py``) uses the same window hash.
"""

from __future__ import annotations

import numpy as np

WORDS = 40  # a float32 (20, 4) window is 320 bytes = 40 little-endian uint64 words
_SEED = 0x5EED_B12D
_LABEL_KEY = np.uint64(0x9E3779B97F4A7C15)


def fmix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: every input bit affects every output bit (so sums of hashes of
    different multisets differ, even when rows only exchange values)."""
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


# one odd key per word and one for the timestamp: fmix64(seed + i) | 1, written out in the spec
_KEYS = fmix64(np.uint64(_SEED) + np.arange(WORDS + 1, dtype=np.uint64)) | np.uint64(1)


def window_hashes(windows: np.ndarray, timestamps: np.ndarray) -> np.ndarray:
    """One uint64 per window from its timestamp and exact float32 bits."""
    # the row length is spelled out: ``reshape(0, -1)`` cannot infer it for an empty piece
    words = np.ascontiguousarray(windows, dtype="<f4").reshape(len(windows), 2 * WORDS).view("<u8")
    with np.errstate(over="ignore"):
        mixed = words * _KEYS[:WORDS]
        mixed ^= mixed >> np.uint64(29)
        return fmix64(mixed.sum(axis=1, dtype=np.uint64) + timestamps.astype(np.uint64) * _KEYS[WORDS])


def row_hashes(windows: np.ndarray, timestamps: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """One uint64 per row: its window, timestamp and label."""
    return _with_labels(window_hashes(windows, timestamps), labels)


def _with_labels(hashes: np.ndarray, labels: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return fmix64(hashes + labels.astype(np.int64).astype(np.uint64) * _LABEL_KEY)


class RowDigest:
    """The order-free digest of rows fed in any order: the wrapping sum of their ``row_hashes``.
    Different multisets of rows give different digests with probability about 1 - 2**-64."""

    def __init__(self) -> None:
        self.value = 0

    def update(self, windows: np.ndarray, timestamps: np.ndarray, labels: np.ndarray) -> None:
        self.update_hashed(window_hashes(windows, timestamps), labels)

    def update_hashed(self, hashes: np.ndarray, labels: np.ndarray) -> None:
        """``update`` from the rows' ``window_hashes``, found already."""
        if len(hashes):
            total = _with_labels(hashes, labels).sum(dtype=np.uint64)  # wraps mod 2**64
            self.value = (self.value + int(total)) % 2**64

    def hexdigest(self) -> str:
        return digest_hex(self.value)


def digest_hex(value: int) -> str:
    """A digest as the device table records it: 16 lowercase hex digits."""
    return f"{value:016x}"
