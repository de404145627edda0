"""matplotlib figures of one window and of one device's windows over time.

Figures are made with ``matplotlib.figure.Figure``, not pyplot: nothing is registered globally,
so loops and servers do not leak figures, and Jupyter shows a returned figure exactly once.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from birdzarr._checks import require_int
from birdzarr._errors import WindowIndexError
from birdzarr.explore._deps import require
from birdzarr.explore._html import format_time
from birdzarr.explore._units import CHANNEL_UNITS, gps_scale
from birdzarr.format._spec import CHANNELS, LABEL_UNLABELLED, TIMESTAMP_UNKNOWN, WINDOW_LENGTH

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from birdzarr.explore._protocol import ReadableStore as Store

IMU_COLOURS = ("tab:red", "tab:green", "tab:blue")
GPS_COLOUR = "tab:purple"
UNLABELLED_COLOUR = "0.6"
RANGE_COLOUR = "0.82"


def _figure(**kwargs: Any) -> Figure:
    require("matplotlib", "Plotting")
    from matplotlib.figure import Figure

    _show_figures_in_ipython(Figure)
    return Figure(layout="constrained", **kwargs)


def _show_figures_in_ipython(figure_class: type) -> None:
    """Let Jupyter render a returned Figure as an image even if pyplot was never imported.

    IPython learns to draw figures only when pyplot activates the inline backend; without this a
    notebook that just calls ``store.plot_window(i)`` would print ``<Figure size ...>``. A format
    the user already chose (``%config InlineBackend.figure_formats``) is left alone.
    """
    ipython_module = sys.modules.get("IPython")
    shell = ipython_module.get_ipython() if ipython_module is not None else None
    if shell is None:
        return
    formatters = shell.display_formatter.formatters
    for mime in ("image/png", "image/svg+xml", "image/jpeg", "application/pdf"):
        try:
            formatters[mime].lookup_by_type(figure_class)
            return
        except KeyError:
            continue
    from IPython.core.pylabtools import select_figure_formats

    select_figure_formats(shell, {"png"})


def _check_label_names(label_names: Any) -> None:
    if label_names is not None and not isinstance(label_names, Mapping):
        raise TypeError("label_names must be a mapping of label ids to names, such as {3: 'flying'}, "
                        f"got {label_names!r}")


def _label_text(label: int, label_names: Mapping[int, str] | None = None) -> str:
    if label == LABEL_UNLABELLED:
        return "unlabelled"
    name = (label_names or {}).get(label)
    return f"label {label}" if name is None else f"{name} ({label})"


def plot_window(store: Store, index: int, *, label_names: Mapping[int, str] | None = None) -> Figure:
    """The 20 samples of window ``index``: imu x/y/z in g above, GPS speed in m/s below."""
    # an integer, as store.windows[...] wants: int() would truncate 1.5 and take "3"
    given = require_int("index", index)
    n = len(store)
    index = given + n if given < 0 else given  # made non-negative once: -n-1 is refused, not wrapped
    if not 0 <= index < n:
        raise WindowIndexError(f"window {given} is out of range: the store holds {n} windows")
    _check_label_names(label_names)
    window = store.windows[index]
    device = int(store.window_devices[index])
    timestamp = int(store.timestamps[index])
    label = int(store.labels[index])
    samples = np.arange(WINDOW_LENGTH)

    fig = _figure(figsize=(8, 5.5))
    imu_ax, gps_ax = fig.subplots(2, 1, sharex=True, height_ratios=[3, 1.4])
    for channel, colour in enumerate(IMU_COLOURS):
        imu_ax.plot(samples, window[:, channel], marker=".", color=colour, label=CHANNELS[channel])
    imu_ax.set_ylabel("acceleration (g)")
    imu_ax.set_title("IMU")
    imu_ax.legend(loc="upper right", ncols=3, fontsize="small")
    imu_ax.grid(alpha=0.3)

    gps_ax.plot(samples, window[:, 3] * gps_scale(store), marker=".", color=GPS_COLOUR, label="gps_speed")
    gps_ax.set_ylabel("speed (m/s)")
    gps_ax.set_xlabel("sample within the window")
    gps_ax.set_title("GPS speed")
    gps_ax.legend(loc="upper right", fontsize="small")
    gps_ax.grid(alpha=0.3)
    gps_ax.set_xticks(samples[::2])
    gps_ax.set_xlim(-0.5, WINDOW_LENGTH - 0.5)
    # A speed that is constant over the burst would get a meaningless 1e-7 axis offset.
    gps_ax.ticklabel_format(axis="y", useOffset=False)

    when = "time unknown" if timestamp == TIMESTAMP_UNKNOWN else f"{format_time(timestamp)} UTC"
    fig.suptitle(f"window {index:,}: device {device}, {when}, {_label_text(label, label_names)}")
    return fig


def _spread(n: int, k: int) -> np.ndarray:
    """``k`` positions spread evenly over ``range(n)``, first and last included."""
    if not n:
        return np.empty(0, np.int64)
    return np.unique(np.linspace(0, n - 1, num=min(n, k)).round().astype(np.int64))


def label_colours(labels: np.ndarray) -> dict[int, Any]:
    """A colour per label, stable for a given set of labels; grey for unlabelled."""
    import matplotlib

    known = sorted(int(v) for v in np.unique(labels) if v != LABEL_UNLABELLED)
    # Grey means unlabelled, so the palettes' own greys are replaced (tab10) or left out (tab20).
    if len(known) <= 10:
        tab10 = matplotlib.colormaps["tab10"]
        palette = [tab10(i) if i != 7 else (0.0, 0.0, 0.0, 1.0) for i in range(10)]
    else:
        tab20 = matplotlib.colormaps["tab20"]
        palette = [tab20(i) for i in range(20) if i not in (14, 15)]
    colours: dict[int, Any] = {label: palette[i % len(palette)] for i, label in enumerate(known)}
    colours[LABEL_UNLABELLED] = UNLABELLED_COLOUR
    return colours


def time_formatter(locator: Any) -> Any:
    """matplotlib's ``ConciseDateFormatter`` whose offset names only what every tick shares.

    Concise ticks label each tick at the level of the tick spacing (days: ``15``, with the
    month's name on the 1st) and put the rest once beside the axis, taken from the *last* tick
    (``2012-Sep``). For ticks that cross months that offset is wrong for all but the last
    month, and the first month is never named when no tick falls on its 1st (May 15 reads
    ``15``). Here the offset keeps only the fields every tick shares (``2012``; nothing when the
    ticks cross a year) and the first tick whose label lacks the rest gets it (``May 15``,
    ``May-15 12:00``, ``Nov 2012``).
    """
    import matplotlib.dates as mdates

    class TimeFormatter(mdates.ConciseDateFormatter):  # type: ignore[misc]
        shared_offset: str | None = None  # what get_offset gives instead of the default

        def get_offset(self) -> str:
            return super().get_offset() if self.shared_offset is None else self.shared_offset

        def format_ticks(self, values: Any) -> list[str]:
            labels: list[str] = super().format_ticks(values)
            self.shared_offset = None
            if len(values) < 2 or not self.show_offset:
                return labels
            ticks = [mdates.num2date(value, tz=self._tz) for value in values]
            fields = np.array([t.timetuple()[:6] for t in ticks])
            level = next((lv for lv in range(5, -1, -1) if len(np.unique(fields[:, lv])) > 1), 5)
            if level not in (1, 2, 3, 4):
                return labels  # years (no offset) or seconds (the offset names the minute)
            same = [len(np.unique(fields[:, lv])) == 1 for lv in range(3)]  # year, month, day
            # the fields the default offset names for this level: year, + month, + day
            named = {1: 1, 2: 2, 3: 3, 4: 3}[level]
            shared = next(k for k in range(named, -1, -1) if all(same[:k]))
            if shared == named:
                return labels  # the default offset is true of every tick
            offset = ("", "%Y", "%Y-%b")[shared]
            self.shared_offset = ticks[0].strftime(offset) if offset else ""
            first = next(i for i, label in enumerate(labels) if label)
            if not _names(labels[first], ticks[first], level):
                tick, label = ticks[first], labels[first]
                labels[first] = f"{label} {tick:%Y}" if level == 1 else f"{tick:%b-%d} {label}" \
                    if level > 2 else f"{tick:%b} {label}"
            return labels

    return TimeFormatter(locator)


def _names(label: str, tick: Any, level: int) -> bool:
    """Whether a concise tick label already names the wider field (a year for month ticks, a
    month for day ticks, a day for hour or minute ticks): the 1st of a month reads ``Jun``."""
    wider = {1: f"{tick:%Y}", 2: f"{tick:%b}", 3: f"{tick:%b}", 4: f"{tick:%b}"}[level]
    return wider in label


def plot_device(
    store: Store, device_id: int, max_windows: int = 500, *, label_names: Mapping[int, str] | None = None
) -> Figure:
    """One bird over time: per-window mean of each channel coloured by label, min..max as a bar.

    At most ``max_windows`` windows, spread evenly over the device's windows in time order, are
    read (by chunk, one read per touched chunk). The x axis is the burst time (concise date
    ticks, ``time_formatter``), or, when the source had no timestamps, the global window index:
    stored order, which is the source's order in a device-ordered store and a random order in a
    shuffled one (the axis label says which).
    ``label_names`` maps label ids to names for the legend (``{3: "flying"}``).
    """
    max_windows = require_int("max_windows", max_windows)
    if max_windows < 1:
        raise ValueError(f"max_windows must be at least 1, not {max_windows}")
    _check_label_names(label_names)
    require("matplotlib", "Plotting")
    import matplotlib.dates as mdates

    all_indices = store.device_indices(device_id)  # ascending global index
    # Spread over the device in time order: on a shuffled store (or sources whose parts are
    # not in time order) global index order is not time order, and windows taken evenly in
    # stored order leave random holes that look like gaps in the recording. The burst times of
    # all the device's windows are read (8 bytes a window); without times, stored order.
    all_times = store.timestamps[all_indices]
    if len(all_times) and np.all(all_times != TIMESTAMP_UNKNOWN):
        by_time = np.argsort(all_times, kind="stable")
        all_indices, all_times = all_indices[by_time], all_times[by_time]
    positions = _spread(len(all_indices), max_windows)
    indices = all_indices[positions]
    windows = store.windows[indices]
    times = all_times[positions]
    labels = store.labels[indices]

    values = windows.astype(np.float64)
    values[:, :, 3] *= gps_scale(store)
    means, lows, highs = values.mean(axis=1), values.min(axis=1), values.max(axis=1)
    timed = bool(len(times)) and bool(np.all(times != TIMESTAMP_UNKNOWN))
    x: np.ndarray = times.astype("datetime64[s]") if timed else indices

    colours = label_colours(labels)
    # about the width of a notebook cell or a docs column, so text is not scaled down to ~6 px
    fig = _figure(figsize=(8.5, 7))
    axes = fig.subplots(len(CHANNELS), 1, sharex=True)
    for channel, (ax, name) in enumerate(zip(axes, CHANNELS, strict=True)):
        ax.vlines(x, lows[:, channel], highs[:, channel], color=RANGE_COLOUR, linewidth=1,
                  label="min..max of the 20 samples")
        for label, colour in colours.items():
            mask = labels == label
            if mask.any():
                ax.scatter(x[mask], means[mask, channel], s=10, color=colour, zorder=3,
                           label=_label_text(label, label_names))
        ax.set_ylabel(f"{name} ({CHANNEL_UNITS[name]})")
        ax.grid(alpha=0.3)
    if timed:
        # The axes share one x axis: one locator and formatter serve all four. Concise ticks
        # name the day or month once instead of repeating full dates that collide.
        locator = mdates.AutoDateLocator()
        axes[-1].xaxis.set_major_locator(locator)
        axes[-1].xaxis.set_major_formatter(time_formatter(locator))
        axes[-1].set_xlabel("burst time (UTC)")
    else:
        order = ("shuffled store: a random order, not time" if store.shuffled
                 else "stored order, as in the source")
        axes[-1].set_xlabel(f"global window index ({order}; the source has no timestamps)")
        axes[-1].ticklabel_format(axis="x", style="plain", useOffset=False)
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="outside right center", title="window mean")

    span = f", {format_time(int(times.min()))} .. {format_time(int(times.max()))} UTC" if timed else ""
    fig.suptitle(f"device {device_id}: {len(indices):,} of {len(all_indices):,} windows{span}")
    return fig
