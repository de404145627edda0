"""The ``birdzarr`` command line. Each private module registers one group of subcommands."""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import sys
import traceback
import warnings
from collections.abc import Sequence

from birdzarr._errors import BirdzarrError
from birdzarr.cli import _cloud_cmds, _explore_cmds, _reliability_cmds, _store_cmds

# One module per group of subcommands; each exposes COMMANDS, a list of add_<name>(subparsers).
_MODULES = [_store_cmds, _cloud_cmds, _explore_cmds, _reliability_cmds]


def build_parser() -> argparse.ArgumentParser:
    from birdzarr import __version__

    parser = argparse.ArgumentParser(
        prog="birdzarr", description="Convert, inspect and serve bird tracker windows as Zarr v3 stores.",
        epilog="Exit status: 0 success; 1 verify found a difference or damage; 2 an error of the "
        "input, the destination, the storage or the environment (one line says what, where and "
        "what to do); 3 an unexpected error (a bug: re-run with --debug and report the traceback); "
        "130 interrupted; 141 the reader of the output went away (| head).",
    )
    parser.add_argument("--version", action="version", version=f"birdzarr {__version__}")
    parser.add_argument("--debug", action="store_true",
                        help="show the full traceback of an error (also accepted after the command)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in _MODULES:
        for add in module.COMMANDS:
            add(sub)
    return parser


# Exit codes (docs/reliability.md#exit-codes)
EXIT_OK, EXIT_DIFFERENCES, EXIT_ERROR, EXIT_BUG, EXIT_INTERRUPTED, EXIT_BROKEN_PIPE = 0, 1, 2, 3, 130, 141
_HINTS = {
    FileNotFoundError: "check the path",
    NotADirectoryError: "a part of the path is a file; stores and sources are directories or files",
    IsADirectoryError: "a directory was given where a file is needed",
    PermissionError: "check the permissions (or the credentials) for it",
    FileExistsError: "choose another destination",
}


def _one_line(exc: BaseException) -> tuple[str, int]:
    """The message and exit code for an error that ends a command."""
    from birdzarr.storage._location import environment_error, redact

    if isinstance(exc, BirdzarrError):
        return str(exc), EXIT_ERROR
    translated = environment_error(exc)
    if translated is not None:
        return str(translated), EXIT_ERROR
    if isinstance(exc, OSError):
        where = f"{redact(str(exc.filename))}: " if exc.filename else ""
        what = exc.strerror or str(exc) or type(exc).__name__
        if exc.errno == errno.ENOSPC:
            hint = "free some space or choose another destination"
        else:
            hint = next((h for cls, h in _HINTS.items() if isinstance(exc, cls)), "check the storage")
        return f"{where}{redact(what)} ({type(exc).__name__}); {hint}.", EXIT_ERROR
    if isinstance(exc, (ImportError, MemoryError)):
        return f"{redact(str(exc)) or type(exc).__name__} ({type(exc).__name__}).", EXIT_ERROR
    detail = redact(str(exc)).splitlines()[0][:300] if str(exc) else ""
    return (f"unexpected {type(exc).__name__}{': ' + detail if detail else ''}. This is probably a bug "
            "in birdzarr: re-run with --debug and report the traceback.", EXIT_BUG)


def _show_warning(message: Warning | str, category: type[Warning], *_: object, **__: object) -> None:
    print(f"birdzarr: warning: {message}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args_list or os.environ.get("BIRDZARR_DEBUG", "") not in ("", "0")
    args_list = [a for a in args_list if a != "--debug"]
    args = build_parser().parse_args(args_list)
    try:
        with warnings.catch_warnings():
            if not debug:
                warnings.showwarning = _show_warning  # one line each, not file:line plus source
            code = int(args.func(args))
            sys.stdout.flush()  # a closed pipe shows here, not at exit
            return code
    except KeyboardInterrupt:
        print(f"birdzarr {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # `birdzarr info --json | head -1`: the reader is gone; say nothing more (as cat does)
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except Exception as exc:
        if debug:
            traceback.print_exc()
        message, code = _one_line(exc)
        print(f"birdzarr {args.command}: error: {message}", file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
