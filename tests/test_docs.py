"""The documentation site builds with warnings as errors, and the exploration notebook runs.

The site is built without executing the notebook (BIRDZARR_DOCS_EXECUTE=false); the notebook is
executed here with nbclient instead, so a broken call fails the tests rather than the next
person who opens it.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.docs]

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "docs" / "explore.ipynb"


def test_docs_site_builds_strict(tmp_path: pathlib.Path) -> None:
    for module in ("mkdocs", "material", "mkdocstrings_handlers.python", "mkdocs_jupyter"):
        pytest.importorskip(module)
    site = tmp_path / "site"
    env = {**os.environ, "BIRDZARR_DOCS_EXECUTE": "false", "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]

    api = (site / "api" / "index.html").read_text()
    for name in ("open_store", "Store", "device_windows", "to_xarray", "plot_device", "stats",
                 "StoreStats", "WindowDataset", "set_epoch", "MissingDependencyError"):
        assert f">{name}<" in api or f"id=\"birdzarr.{name}\"" in api, name
    assert (site / "explore" / "index.html").exists()  # the notebook page
    assert (site / "exploration" / "index.html").exists()
    # Nothing on the pages may load from the internet (fonts, scripts, styles).
    for page in site.rglob("*.html"):
        loaded = re.findall(r"<(?:script|link|img)[^>]+(?:src|href)=\"(https?://[^\"]+)", page.read_text())
        assert not loaded, (page, loaded)


def test_exploration_notebook_runs(tmp_path: pathlib.Path) -> None:
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    # Kept without outputs in git: outputs are made by running it (here, or by the docs build).
    assert all(not cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code")
    # A reader copies what the notebook does: public API only (birdzarr.x, never birdzarr._x).
    code = "\n".join(cell.source for cell in notebook.cells if cell.cell_type == "code")
    assert not re.search(r"birdzarr\._|from birdzarr\.\w* ?import _|from birdzarr import _", code)
    client = nbclient.NotebookClient(
        notebook, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()  # raises CellExecutionError, naming the cell, if any cell fails

    outputs = [out for cell in notebook.cells if cell.cell_type == "code" for out in cell.outputs]
    mimes = [mime for out in outputs for mime in out.get("data", {})]
    assert mimes.count("image/png") == 3  # plot_window, plot_device, stats.plot: each shown once
    assert "text/html" in mimes  # the store's rich summary
    printed = "".join(out.get("text", "") for out in outputs if out.get("name") == "stdout")
    assert "chunk requests for the cached stats: 0" in printed
    # Nothing on stderr: no progress bar (a red box on the rendered page), no warning.
    assert [out.get("text", "") for out in outputs if out.get("name") == "stderr"] == []
    assert [out for out in outputs if out.get("output_type") == "error"] == []
    assert list(tmp_path.iterdir()) == []  # the notebook cleans up after itself
