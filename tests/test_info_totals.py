"""`birdzarr info` (``Store.summary``) reads a format-2 store's root attributes only: the
conversion report's totals are recorded there at every commit, so the device table (~750 bytes of
JSON a device) is not parsed whatever the device count."""

from __future__ import annotations

import pathlib
import shutil

import pytest

import birdzarr
from birdzarr.convert import append
from birdzarr.demo import _synthetic
from birdzarr.format._spec import DeviceReport, report_totals


@pytest.fixture(scope="module")
def parts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    """Three CSV devices in two parts (part 1 of each in 'more'), with bad lines in one file."""
    root = tmp_path_factory.mktemp("totals")
    _synthetic.make_csv_dir(root / "all", n_devices=3, bursts_per_device=12, parts=2, seed=5)
    for name in ("base", "more"):
        (root / name).mkdir()
    for path in sorted((root / "all").iterdir()):
        part = int(path.stem.split("_")[1])
        shutil.copy(path, root / ("base" if part == 0 else "more") / path.name)
    bad = sorted((root / "base").iterdir())[0]
    bad.write_text(bad.read_text() + "not,a,row\n")
    return {"base": root / "base", "more": root / "more"}


def test_info_reads_the_totals_from_the_root_and_equals_the_device_reports_sums(
    parts: dict[str, pathlib.Path], tmp_path: pathlib.Path
) -> None:
    dest = tmp_path / "s.zarr"
    birdzarr.convert(parts["base"], dest, chunk_windows=64, progress=False, on_bad_rows="skip")
    for step in ("convert", "append"):
        if step == "append":
            append(dest, parts["more"], progress=False)
        store = birdzarr.open_store(dest)
        info = store.summary()
        assert "meta" not in store.__dict__ and "device_table" not in store.__dict__  # no table read
        devices = birdzarr.open_store(dest).meta["report"]["devices"]
        expected = report_totals(DeviceReport.from_json(d) for d in devices.values())
        assert {k: info["report"][k] for k in expected} == expected
        assert expected["rows_read"] == sum(d["rows_read"] for d in devices.values()) > 0
        assert expected["bad_lines"] == 1
        assert info["devices"] == len(store.device_table) == 3
        assert store.root["report"]["totals"] == expected


def test_a_store_without_recorded_totals_sums_its_device_reports(tmp_path: pathlib.Path) -> None:
    from tests.format1_support import format1_copy

    dest = format1_copy("dict16.zarr", tmp_path)
    store = birdzarr.open_store(dest)
    assert "totals" not in store.root.get("report", {})
    info = store.summary()
    assert {k: info["report"][k] for k in ("rows_read", "bad_lines")} == {
        k: report_totals(DeviceReport.from_json(d) for d in store.meta["report"]["devices"].values())[k]
        for k in ("rows_read", "bad_lines")}
    assert info["devices"] == len(store.device_table)


def test_the_text_repr_reads_no_device_entries_and_says_what_the_entries_say(
    parts: dict[str, pathlib.Path], tmp_path: pathlib.Path
) -> None:
    import numpy as np

    from birdzarr.explore._html import Overview, label_counts

    dest = tmp_path / "labelled.zarr"
    birdzarr.convert(parts["more"], dest, chunk_windows=16, progress=False)
    store = birdzarr.open_store(dest)
    text = repr(store)
    lazy = Overview.of(store)
    assert "meta" not in store.__dict__ and "device_table" not in store.__dict__
    entries = store.device_table
    totals = label_counts(entries)
    times = [t for e in entries for t in (e.first_time, e.last_time)]
    assert (lazy.first_time, lazy.last_time) == (min(times), max(times))
    assert lazy.labelled == sum(n for label, n in totals.items() if label != -1) > 0
    assert lazy.classes == len([label for label in totals if label != -1]) > 1
    assert lazy.n_devices == len(entries) == 3
    inline = ", ".join(f"{e.device_id} ({e.n_windows:,})" for e in entries)
    assert f"devices  {inline}" in text
    assert int(np.sum([e.n_windows for e in entries])) == len(store)


def test_the_html_summary_of_many_devices_reads_only_the_index_columns(
    parts: dict[str, pathlib.Path], tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from birdzarr.explore import _html

    dest = tmp_path / "s.zarr"
    birdzarr.convert(parts["more"], dest, chunk_windows=16, progress=False)
    full = birdzarr.open_store(dest)._repr_html_()  # type: ignore[attr-defined]
    assert "<th>sources</th>" in full and "<th class='num'>labelled</th>" in full
    monkeypatch.setattr(_html, "_DEVICES_WITH_DETAILS", 2)  # the store's 3 devices count as many
    monkeypatch.setattr(_html, "_DEVICES_HTML", 2)
    store = birdzarr.open_store(dest)
    html = store._repr_html_()  # type: ignore[attr-defined]
    assert "meta" not in store.__dict__ and "device_table" not in store.__dict__
    entries = store.device_table
    for e in entries[:2]:
        first, last = _html.format_time(e.first_time), _html.format_time(e.last_time)
        assert (f"<td class='num'>{e.device_id}</td><td class='num'>{e.n_windows:,}</td>"
                f"<td>{first}</td><td>{last}</td>") in html
    assert f">{entries[2].device_id}<" not in html
    assert "<th>sources</th>" not in html and "... 1 more devices" in html
    assert "Labels and sources of each device: <code>store.devices</code>." in html
