"""CLI commands for looking at a store without a notebook: plot, stats."""

from __future__ import annotations

import argparse
import json
import sys

from birdzarr._errors import ArgumentError
from birdzarr.cli._args import dpi, non_negative_int, positive_int


def _cmd_plot(args: argparse.Namespace) -> int:
    from birdzarr.explore import plot_device, plot_window
    from birdzarr.store._handle import open_store

    default = f"window_{args.window}.png" if args.window is not None else f"device_{args.device}.png"
    out = _image_path(args.out or default)
    label_names = _label_names(args.label_names)
    store = open_store(args.store)
    if args.window is not None:
        figure = plot_window(store, args.window, label_names=label_names)
    else:
        figure = plot_device(store, args.device, max_windows=args.max_windows, label_names=label_names)
    figure.savefig(out, dpi=args.dpi)
    print(out)
    return 0


def _label_names(text: str | None) -> dict[int, str] | None:
    """``--label-names 3=flying,5=resting`` as ``{3: "flying", 5: "resting"}``, checked before any work."""
    if text is None:
        return None
    names: dict[int, str] = {}
    for item in text.split(","):
        label, equals, name = item.partition("=")
        try:
            number = int(label.strip())
        except ValueError:
            number = None
        if not equals or number is None or not name.strip():
            raise ArgumentError(f"--label-names {text}: {item.strip()!r} is not LABEL=NAME; give label ids "
                                "and names as 3=flying,5=resting")
        if number in names:
            raise ArgumentError(f"--label-names {text}: label {number} is named twice")
        names[number] = name.strip()
    return names


def _image_path(out: str) -> str:
    """The file ``--out`` names, checked before any work: a local path whose extension is an
    image format matplotlib writes (none: ``.png`` is added, as matplotlib would)."""
    import os

    from matplotlib.figure import Figure

    if "://" in out or "::" in out:
        raise ArgumentError(f"--out {out}: plot writes a local file; give a path (copy it elsewhere after)")
    if os.path.isdir(out):
        example = os.path.join(out, "plot.png")
        raise ArgumentError(f"--out {out}: is a directory; give a file name, e.g. {example}")
    extension = os.path.splitext(out)[1].lstrip(".").lower()
    if not extension:
        return out + ".png"
    formats = Figure().canvas.get_supported_filetypes()
    if extension not in formats:
        raise ArgumentError(f"--out {out}: no image format '.{extension}'; use one of "
                         f"{', '.join('.' + f for f in sorted(formats))}")
    return out


def _cmd_stats(args: argparse.Namespace) -> int:
    from birdzarr.explore import save_stats
    from birdzarr.explore import stats as store_stats
    from birdzarr.store._handle import open_store

    store = open_store(args.store)
    progress = not args.quiet and sys.stderr.isatty()
    stats = store_stats(store, cache=not args.recompute, progress=progress)
    if args.save:  # the numbers just computed or found, written into the store under its lock
        stats = save_stats(store, progress=progress)
    if args.json:
        print(json.dumps(stats.to_json(), indent=2))
    else:
        print(stats)
    return 0


def add_plot(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("plot", help="save a PNG of one device's windows over time, or of one window")
    p.add_argument("store", help="store path or URL")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--device", type=int, help="device id: channels over time, coloured by label")
    what.add_argument("--window", type=non_negative_int,
                      help="global window index: the 20 samples of the window")
    p.add_argument("--out", help="output file, format from its extension "
                                   "(default device_ID.png or window_N.png)")
    p.add_argument("--max-windows", type=positive_int, default=500,
                   help="with --device: windows spread over the device to show (default 500)")
    p.add_argument("--label-names", metavar="ID=NAME,...",
                   help="names of label ids for the legend or title, e.g. 3=flying,5=resting")
    p.add_argument("--dpi", type=dpi, default=110, help="resolution of the image: 10 to 1200 (default 110)")
    p.set_defaults(func=_cmd_plot)


def add_stats(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("stats", help="per-channel mean/std/min/max and histograms (cached on this machine)")
    p.add_argument("store", help="store path or URL")
    p.add_argument("--json", action="store_true", help="machine-readable output, histograms included")
    p.add_argument("--recompute", action="store_true", help="ignore cached statistics")
    p.add_argument("--save", action="store_true",
                   help="also write them into the store (its stats group), under the store's writer lock, "
                        "so every machine that opens it gets them without a pass over the data")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_stats)


COMMANDS = [add_plot, add_stats]
