"""Wrong arguments are refused before any work, in one line with exit status 2 (the command line)
or a typed error that is also the built-in one (Python), and nothing is written."""

from __future__ import annotations

import pathlib
import shutil

import numpy as np
import pytest
import torch

import birdzarr
from birdzarr import DeviceNotFoundError, WindowIndexError
from birdzarr.cli import main


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["convert", "{src}", "{dest}", "--workers", "-3"],
         "birdzarr convert: error: argument --workers: expected an integer of 0 or more, got -3"),
        (["convert", "{src}", "{dest}", "--workers", "two"],
         "birdzarr convert: error: argument --workers: expected an integer, got 'two'"),
        (["convert", "{src}", "{dest}", "--chunk-windows", "0"],
         "birdzarr convert: error: argument --chunk-windows: expected an integer from 1 to 4,194,304, got 0"),
        (["convert", "{src}", "{dest}", "--shuffle", "--seed", "-1"],
         "birdzarr convert: error: argument --seed: expected an integer from 0 to 2**63-1, got -1"),
        (["append", "{store}", "{src}", "--workers", "-1"],
         "birdzarr append: error: argument --workers: expected an integer of 0 or more, got -1"),
        (["copy", "{store}", "{dest}", "--requests", "0"],
         "birdzarr copy: error: argument --requests: expected a positive integer, got 0"),
        (["plot", "{store}", "--window", "-1"],
         "birdzarr plot: error: argument --window: expected an integer of 0 or more, got -1"),
        (["plot", "{store}", "--device", "1", "--max-windows", "0"],
         "birdzarr plot: error: argument --max-windows: expected a positive integer, got 0"),
        (["demo", "{dest}", "--windows", "0"],
         "birdzarr demo: error: argument --windows: expected a positive integer, got 0"),
        (["convert", "{src}", "{dest}", "--shuffle", "--seed", str(2**63)],
         f"birdzarr convert: error: argument --seed: expected an integer from 0 to 2**63-1, got {2**63}"),
        (["convert", "{src}", "{dest}", "--chunk-windows", "4194305"],
         "birdzarr convert: error: argument --chunk-windows: expected an integer from 1 to 4,194,304, "
         "got 4194305"),
        (["plot", "{store}", "--window", "1", "--dpi", "9"],
         "birdzarr plot: error: argument --dpi: expected an integer from 10 to 1200, got 9"),
    ],
)
def test_cli_refuses_a_wrong_number_in_one_line(
    arguments: list[str], message: str, parquet_source: tuple[pathlib.Path, dict[int, np.ndarray]],
    small_store: birdzarr.Store, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str],
) -> None:
    src, dest = str(parquet_source[0]), str(tmp_path / "new")
    argv = [a.format(src=src, dest=dest, store=small_store.url) for a in arguments]
    with pytest.raises(SystemExit) as exited:  # argparse refuses it, before the command runs
        main(argv)
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == message
    assert not (tmp_path / "new").exists()


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_unknown_device_and_window_out_of_range(
    small_store: birdzarr.Store, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(DeviceNotFoundError) as unknown:
        small_store.device(424242)
    assert isinstance(unknown.value, KeyError)
    assert str(unknown.value) == (f"device 424242 is not in {small_store.url} (it holds 12 devices: "
                                  + ", ".join(str(e.device_id) for e in small_store.device_table)
                                  + "); `birdzarr info --devices` lists them")
    n = len(small_store)
    with pytest.raises(WindowIndexError, match=f"^window {n} is out of range: the store holds {n} windows$"):
        small_store.windows[n]
    with pytest.raises(IndexError, match="a window index is out of range"):
        small_store.windows[[0, n + 5]]
    refused = r"^devices=424242, 424243 are not in the store \(12 devices"
    with pytest.raises(DeviceNotFoundError, match=refused):
        birdzarr.WindowDataset(small_store.url, batch_size=8, devices=[424243, 424242])

    pytest.importorskip("matplotlib")
    assert main(["plot", small_store.url, "--device", "424242"]) == 2
    assert capsys.readouterr().err == f"birdzarr plot: error: {unknown.value}\n"
    assert main(["plot", small_store.url, "--window", str(n)]) == 2
    assert capsys.readouterr().err == (
        f"birdzarr plot: error: window {n} is out of range: the store holds {n} windows\n")


def test_shuffle_tmp_must_be_a_directory(
    parquet_source: tuple[pathlib.Path, dict[int, np.ndarray]], tmp_path: pathlib.Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    src, dest = parquet_source[0], tmp_path / "s.zarr"
    with pytest.raises(FileNotFoundError, match="no such directory, where the shuffle's temporary files"):
        birdzarr.convert(src, dest, shuffle=True, shuffle_tmp=str(tmp_path / "missing"), progress=False)
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(NotADirectoryError, match="not a directory, where the shuffle's temporary files"):
        birdzarr.convert(src, dest, shuffle=True, shuffle_tmp=str(tmp_path / "a-file"), progress=False)
    missing = str(tmp_path / "missing")
    assert main(["convert", str(src), str(dest), "--shuffle", "--shuffle-tmp", missing]) == 2
    assert capsys.readouterr().err == (
        f"birdzarr convert: error: {tmp_path / 'missing'}: no such directory, where the shuffle's "
        "temporary files were to go (--shuffle-tmp, Python: shuffle_tmp=; default $TMPDIR) "
        "(FileNotFoundError); check the path.\n")
    assert not dest.exists() and (tmp_path / "a-file").read_text() == "x"


def test_python_refuses_a_negative_seed_or_workers_before_writing(
    parquet_source: tuple[pathlib.Path, dict[int, np.ndarray]], tmp_path: pathlib.Path
) -> None:
    src, dest = parquet_source[0], tmp_path / "s.zarr"
    with pytest.raises(ValueError, match=r"^seed must be an integer in 0\.\.2\*\*63-1, got -1$"):
        birdzarr.convert(src, dest, shuffle=True, seed=-1, progress=False)
    with pytest.raises(ValueError, match="^workers must be positive"):
        birdzarr.convert(src, dest, workers=-2, progress=False)
    assert not dest.exists()


@pytest.mark.slow  # over a second of CPU: not in the fast loop
def test_append_uses_and_records_its_workers(
    parquet_source: tuple[pathlib.Path, dict[int, np.ndarray]], tmp_path: pathlib.Path
) -> None:
    files = sorted(parquet_source[0].glob("*.parquet"))
    for name, part in (("base", files[:6]), ("more", files[6:])):
        (tmp_path / name).mkdir()
        for path in part:
            shutil.copy(path, tmp_path / name / path.name)
    dest = tmp_path / "s.zarr"
    base = len(birdzarr.convert(tmp_path / "base", dest, progress=False))
    with pytest.raises(ValueError, match="^workers must be positive"):
        birdzarr.append(dest, tmp_path / "more", workers=-1, progress=False)
    assert birdzarr.open_store(dest).meta["committed"]["generation"] == 1  # nothing appended
    store = birdzarr.append(dest, tmp_path / "more", workers=1, progress=False)
    entry = store.meta["report"]["appends"][-1]
    assert entry["workers"] == 1
    assert entry["first_window"] == base and entry["windows"] == len(store) - base > 0
    assert entry["cpu_seconds"] > 0 and entry["usable_cores"] >= 1


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_an_opened_store_is_accepted_where_a_location_is(small_store: birdzarr.Store) -> None:
    assert birdzarr.open_store(small_store).location is small_store.location
    by_store = birdzarr.WindowDataset(small_store, batch_size=4096, shuffle=False)
    by_url = birdzarr.WindowDataset(small_store.url, batch_size=4096, shuffle=False)
    assert all(torch.equal(a, b) for a, b in zip(by_store, by_url, strict=True))
    assert birdzarr.verify(small_store).ok
    with pytest.raises(TypeError, match="^expected a path, a URL or a birdzarr.Store, got dict$"):
        birdzarr.open_store({"path": small_store.url})  # type: ignore[arg-type]


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_options_that_do_not_go_together_or_do_not_fit(
    parquet_source: tuple[pathlib.Path, dict[int, np.ndarray]], small_store: birdzarr.Store,
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    src, dest = str(parquet_source[0]), str(tmp_path / "s.zarr")
    for option in (["--seed", "5"], ["--shuffle-tmp", str(tmp_path)]):
        assert main(["convert", src, dest, *option]) == 2
        assert capsys.readouterr().err == ("birdzarr convert: error: --seed and --shuffle-tmp apply to "
                                           "--shuffle only: add --shuffle, or leave them out\n")
    with pytest.raises(ValueError, match="^seed and shuffle_tmp .* apply to a shuffled conversion only"):
        birdzarr.convert(src, dest, seed=5, progress=False)
    with pytest.raises(ValueError, match=r"^chunk_windows must be from 1 to 4,194,304, got 0$"):
        birdzarr.convert(src, dest, chunk_windows=0, progress=False)
    assert not (tmp_path / "s.zarr").exists()

    monkeypatch.chdir(tmp_path)  # nothing may be written here
    assert main(["demo", "foo://x", "--windows", "1000"]) == 2
    assert capsys.readouterr().err == ("birdzarr demo: error: foo://x: the demo writes its raw files and "
                                       "stores into a local directory; give a path, e.g. birdzarr demo "
                                       "./demo\n")
    assert main(["demo", "d", "--windows", "20"]) == 2
    assert capsys.readouterr().err == ("birdzarr demo: error: --windows 20: the demo generates at least "
                                       "1,000 windows (24 devices); give 1,000 or more (default 200,000)\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == []

    pytest.importorskip("matplotlib")
    assert main(["plot", small_store.url, "--window", "0", "--out", "x.foo"]) == 2
    assert capsys.readouterr().err.startswith("birdzarr plot: error: --out x.foo: no image format '.foo'; "
                                              "use one of .avif, .eps, ")
    assert main(["plot", small_store.url, "--window", "0", "--out", "s3://b/x.png"]) == 2
    assert "plot writes a local file" in capsys.readouterr().err
    assert main(["plot", small_store.url, "--window", "0", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (f"birdzarr plot: error: --out {tmp_path}: is a directory; give a "
                                       f"file name, e.g. {tmp_path / 'plot.png'}\n")
    assert main(["plot", small_store.url, "--window", "0", "--out", "w0"]) == 0
    assert capsys.readouterr().out == "w0.png\n"  # the file written, extension included
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w0.png"]


def test_a_scheduler_address_that_is_not_one() -> None:
    pytest.importorskip("distributed")
    from birdzarr.convert._dask import connect

    with pytest.raises(birdzarr.SchedulerError, match=r"^--dask-scheduler foo: not a scheduler address"):
        connect("foo")


def test_workers_beyond_four_per_core_are_lowered_with_a_warning() -> None:
    from birdzarr.convert._cpus import resolve_workers, usable_cpus

    cores = usable_cpus()
    assert resolve_workers(4 * cores) == 4 * cores
    with pytest.warns(birdzarr.BirdzarrWarning, match=f"^workers=10000 is more than 4 per usable core "
                      f"\\({cores}\\): using {4 * cores}, as more only add memory$"):
        assert resolve_workers(10_000) == 4 * cores


def test_an_empty_path_names_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(birdzarr.StoreNotFoundError, match="^an empty path names no store or source"):
        birdzarr.open_store("")
    assert main(["info", ""]) == 2  # not the current directory
    assert capsys.readouterr().err == ("birdzarr info: error: an empty path names no store or source: "
                                       "give a path or URL\n")


def test_window_views_index_as_numpy_does(small_store: birdzarr.Store) -> None:
    windows, labels = small_store.windows, small_store.labels
    first = windows[:5]
    assert windows[2, 3, 1] == first[2, 3, 1] and windows[2, :, 1].tolist() == first[2, :, 1].tolist()
    assert np.array_equal(windows[[4, 0], :, 0], first[[4, 0], :, 0])
    assert np.array_equal(windows[1:4, 2], first[1:4, 2])
    mask = np.zeros(len(small_store), dtype=bool)
    mask[[3, 1]] = True
    assert np.array_equal(windows[mask], first[[1, 3]]) and np.array_equal(labels[mask], labels[[1, 3]])
    for key in (1.5, "a", [0.5], np.ones(3, dtype=bool)):
        with pytest.raises(TypeError, match="^windows are indexed by an integer, a slice, integers or a "
                                            f"mask of all {len(small_store)} windows, not "):
            windows[key]
    # index arrays pair as numpy's do, also after an index array of windows
    for key in (([0, 1], [2, 3]), ([0, 1], slice(None), [2, 3]), ([4, 0], slice(2, 5)), (3, [0, 1], 2)):
        assert np.array_equal(windows[key], first[key]), key
    assert np.array_equal(windows[mask, [2, 3]], first[[1, 3], [2, 3]])


@pytest.fixture(scope="module")
def shuffled_store(parquet_source: tuple[pathlib.Path, dict[int, np.ndarray]],
                   tmp_path_factory: pytest.TempPathFactory) -> birdzarr.Store:
    """The parquet_source converted with shuffle=True: its device lookups scan the chunks."""
    dest = tmp_path_factory.mktemp("shuffled") / "s.zarr"
    return birdzarr.convert(parquet_source[0], dest, chunk_windows=1024, shuffle=True, seed=3, progress=False)


@pytest.mark.slow  # with its module fixture (a shuffled conversion) over 0.2 s of CPU: not in the fast loop
def test_a_device_id_is_the_same_device_everywhere(shuffled_store: birdzarr.Store) -> None:
    device = shuffled_store.device_table[0]
    as_text = str(device.device_id)  # as a table or the command line gives it
    assert shuffled_store.device(as_text) == device
    assert len(shuffled_store.device_indices(as_text)) == device.n_windows
    assert np.array_equal(shuffled_store.device_windows(as_text),
                          shuffled_store.device_windows(device.device_id))


# shuffled_store: its module fixture is a shuffled conversion, over 0.2 s of CPU: not in the fast loop
@pytest.mark.parametrize("store", ["small_store", pytest.param("shuffled_store", marks=pytest.mark.slow)])
@pytest.mark.parametrize("lookup", ["device", "device_indices", "device_windows", "plot_device"])
def test_device_lookups_refuse_a_float_device_id(
    store: str, lookup: str, request: pytest.FixtureRequest
) -> None:
    if lookup == "plot_device":
        pytest.importorskip("matplotlib")
    opened: birdzarr.Store = request.getfixturevalue(store)
    call = getattr(opened, lookup)
    device = opened.device_table[0]
    for float_id in (device.device_id + 0.5, 200.5):  # the first was truncated to the device before
        with pytest.raises(TypeError) as refused:
            call(float_id)
        assert str(refused.value) == f"device_id must be an integer, got {float_id!r}"
    # a numpy integer is an integer
    found = call(np.int64(device.device_id))
    if lookup == "device":
        assert found == device
    elif lookup == "plot_device":
        import matplotlib.pyplot as plt

        assert found.axes
        plt.close(found)
    else:
        assert len(found) == device.n_windows


def test_more_python_arguments_of_the_wrong_kind(small_store: birdzarr.Store, tmp_path: pathlib.Path) -> None:
    with pytest.raises(TypeError, match=r"^storage_options must be a dict of fsspec options, got 'x'$"):
        birdzarr.open_store(small_store.url, storage_options="x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^requests must be a positive integer, got 0$"):
        birdzarr.copy(small_store, tmp_path / "c.zarr", requests=0, progress=False)
    assert not (tmp_path / "c.zarr").exists()
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(NotADirectoryError, match="cache_dir is not a directory"):
        birdzarr.WindowDataset(small_store, cache_dir=tmp_path / "a-file")
    with pytest.raises(ValueError, match=r"^cache_max_bytes must be an integer of 0 or more, got -1$"):
        birdzarr.WindowDataset(small_store, cache_dir=tmp_path / "cache", cache_max_bytes=-1)


def test_a_format_version_that_is_not_an_integer_says_what_it_may_be(
    small_store: birdzarr.Store, tmp_path: pathlib.Path
) -> None:
    import json

    copy = tmp_path / "s.zarr"
    shutil.copytree(small_store.url, copy)
    root = json.loads((copy / "zarr.json").read_text())
    root["attributes"]["birdzarr"]["format_version"] = "1"
    (copy / "zarr.json").write_text(json.dumps(root))
    with pytest.raises(birdzarr.FormatVersionError) as refused:
        birdzarr.open_store(copy)
    assert str(refused.value) == (
        f"{copy} has birdzarr format version '1', a str where every version so far is an integer (this "
        "birdzarr supports versions 1 and 2): a newer birdzarr wrote it (upgrade: pip install -U birdzarr), "
        "or its zarr.json is damaged (restore it from a copy of the store).")


def test_conversion_options_out_of_range_are_argument_errors(
    parquet_source: tuple[pathlib.Path, dict[int, np.ndarray]], tmp_path: pathlib.Path
) -> None:
    """ArgumentError (a ValueError and a BirdzarrError): the command line reports it in one line."""
    src, dest = parquet_source[0], tmp_path / "s.zarr"
    for options in ({"workers": -1}, {"chunk_windows": 0}, {"shuffle": True, "seed": 2**63}, {"seed": 5},
                    {"on_bad_rows": "ignore"}):
        with pytest.raises(birdzarr.ArgumentError) as refused:
            birdzarr.convert(src, dest, progress=False, **options)  # type: ignore[arg-type]
        assert isinstance(refused.value, ValueError)
    assert not dest.exists()
