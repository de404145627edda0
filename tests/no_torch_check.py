"""Everything but training works without PyTorch: run in an environment without torch.

``.ci/run`` runs it in a fresh virtual environment made with ``pip install -e .`` (no extras, so
no torch); tests/test_no_torch.py runs it in a subprocess with ``--block-torch``, which makes
``import torch`` fail as it does where torch is not installed. It converts generated CSV exports
(API and command line), then opens, reads, describes, verifies, appends to, copies and repairs the
store, computes statistics, runs ``birdzarr demo`` (which skips its training step with one
line), checks that ``birdzarr.WindowDataset`` raises ``MissingDependencyError`` naming the
``torch`` extra, and that torch was never imported. Prints ``no-torch check passed`` and exits 0.

    python tests/no_torch_check.py [--block-torch]
"""

from __future__ import annotations

import contextlib
import io
import pathlib
import shutil
import sys
import tempfile
from typing import Any

BLOCKED = ("torch", "torchdata")


class _BlockTorch:
    """A meta path finder that fails ``import torch`` as a missing package does."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by no_torch_check)", name=name)
        return None


def _cli(*argv: str) -> str:
    """Run the command line in this process; returns its stdout, fails on a non-zero exit."""
    from birdzarr.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    assert code == 0, f"birdzarr {' '.join(argv)}: exit {code}\n{out.getvalue()}{err.getvalue()}"
    return out.getvalue()


def run(work: pathlib.Path) -> None:
    import birdzarr

    source = birdzarr.generate_demo(work / "csv", devices=4, bursts_per_device=60, parts=2)
    later = work / "later"  # two devices held back, appended afterwards
    later.mkdir()
    devices = sorted({p.name.split("_")[0] for p in source.glob("*.csv")})
    for path in source.glob("*.csv"):
        if path.name.split("_")[0] in devices[2:]:
            shutil.move(path, later / path.name)

    api_store = birdzarr.convert(source, work / "api.zarr", chunk_windows=64, progress=False)
    assert len(api_store) > 0
    _cli("convert", str(source), str(work / "cli.zarr"), "--chunk-windows", "64", "--quiet")
    store = birdzarr.open_store(work / "cli.zarr")
    assert len(store) == len(api_store) and len(store.device_table) == 2
    assert (store.windows[0:3] == api_store.windows[0:3]).all() and store.windows[0:3].dtype == "float32"
    assert repr(store).startswith("<birdzarr.Store ")
    assert "<table>" in store._repr_html_()  # type: ignore[attr-defined]

    assert "windows" in _cli("info", str(work / "cli.zarr"))
    assert '"windows"' in _cli("info", str(work / "cli.zarr"), "--json")
    _cli("verify", str(work / "cli.zarr"), "--source", str(source), "--quiet")
    _cli("append", str(work / "cli.zarr"), str(later), "--quiet")
    appended = birdzarr.open_store(work / "cli.zarr")
    assert len(appended.device_table) == 4 and len(appended) > len(store)
    _cli("copy", str(work / "cli.zarr"), str(work / "copy.zarr"), "--quiet")
    _cli("repair", str(work / "copy.zarr"))
    _cli("verify", str(work / "copy.zarr"), "--quiet")
    assert len(birdzarr.open_store(work / "copy.zarr")) == len(appended)

    stats = birdzarr.explore.stats(appended, progress=False)
    assert stats.count == len(appended) * 20
    assert '"n_windows"' in _cli("stats", str(work / "copy.zarr"), "--json")

    demo = _cli("demo", str(work / "demo"), "--windows", "1000")
    assert 'training reads skipped: PyTorch is not installed (pip install "birdzarr[torch]")' in demo

    try:
        birdzarr.WindowDataset  # noqa: B018  (the attribute access is the test)
    except birdzarr.MissingDependencyError as exc:
        assert str(exc) == (
            "birdzarr.WindowDataset needs torch: PyTorch is not installed. Install it first the way your "
            "machine needs (for a GPU, the command pytorch.org gives for your CUDA version; the CPU "
            'build: pip install torch), then: pip install "birdzarr[torch]"'
        ), str(exc)
    else:
        raise AssertionError("birdzarr.WindowDataset without torch did not raise MissingDependencyError")

    imported = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
    assert not imported, f"torch was imported: {imported}"


def main() -> int:
    if "--block-torch" in sys.argv[1:]:
        sys.meta_path.insert(0, _BlockTorch())  # type: ignore[arg-type]
    else:
        import importlib.util

        if importlib.util.find_spec("torch") is not None:
            print("torch is installed here: give --block-torch, or run in an environment without it")
            return 2
    with tempfile.TemporaryDirectory() as directory:
        run(pathlib.Path(directory))
    print("no-torch check passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
