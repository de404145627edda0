"""Physical units of the stored channels."""

from __future__ import annotations

from typing import TYPE_CHECKING

from birdzarr.format._spec import Curation

if TYPE_CHECKING:
    from birdzarr.explore._protocol import ReadableStore as Store

CHANNEL_UNITS = {"imu_x": "g", "imu_y": "g", "imu_z": "g", "gps_speed": "m/s"}


def gps_scale(store: Store) -> float:
    """The divisor applied to gps_speed; stored value x scale = m/s.

    Stores converted from CSV record it. Parquet sources were curated before conversion by the
    original script, which used the same constant as ``birdzarr.Curation``.
    """
    curation = store.meta.get("curation") or {}
    return float(curation.get("gps_scale", Curation().gps_scale))
