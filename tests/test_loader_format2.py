"""The loader on a version-2 store (birdzarr.format._v2): the same batches as from the version-1
store it was made from, streamed and resident, and resident mode holding the codes."""

from __future__ import annotations

import pathlib
import shutil

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import birdzarr
from birdzarr.format import _v2
from birdzarr.loader._resident import CODE_BIAS, HeldCodes
from tests.format1_support import standard_format1
from tests.format2_support import to_format2

_CHUNK = 1024


@pytest.fixture(scope="module")
def stores(parquet_source: tuple[pathlib.Path, dict[int, np.ndarray]],
           tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, str]]:
    """Per store order, a version-1 store (``standard``: float32 in core codecs, written from a
    conversion by tests/format1_support.py) and its version-2 copy, coded by the whole-array
    encoder: ``{order: (v1 url, v2 url)}``."""
    directory, _ = parquet_source
    made = {}
    for order in ("device", "shuffled"):
        base = tmp_path_factory.mktemp(f"format2-{order}")
        shuffled = {"shuffle": True, "seed": 11} if order == "shuffled" else {}
        birdzarr.convert(directory, base / "converted.zarr", chunk_windows=_CHUNK, progress=False,
                         **shuffled)  # type: ignore[arg-type]
        v1 = birdzarr.open_store(standard_format1(base / "converted.zarr", base / "v1.zarr"))
        assert v1.format_version == 1
        shutil.copytree(base / "v1.zarr", base / "v2.zarr")
        to_format2(base / "v2.zarr")
        made[order] = (v1.url, str(base / "v2.zarr"))
    return made


def _dataset(url: str, **options: object) -> birdzarr.WindowDataset:
    options.setdefault("batch_size", 700)
    options.setdefault("seed", 3)
    options.setdefault("with_ldt", True)
    options.setdefault("allow_device_order", True)
    options.setdefault("progress", False)
    return birdzarr.WindowDataset(url, **options)  # type: ignore[arg-type]


Batches = list[tuple[torch.Tensor, torch.Tensor]]


def _same(a: Batches, b: Batches) -> None:
    """Equal batches, bit for bit: x (as bit patterns), label, device and time."""
    assert len(a) == len(b) > 0
    for (xa, la), (xb, lb) in zip(a, b, strict=True):
        assert torch.equal(xa.view(torch.int32), xb.view(torch.int32))
        assert torch.equal(la, lb)


def _epochs(ds: birdzarr.WindowDataset, epochs: tuple[int, ...], workers: int) -> Batches:
    got = []
    for epoch in epochs:
        ds.set_epoch(epoch)
        if workers:
            loader = DataLoader(ds, batch_size=None, num_workers=workers, multiprocessing_context="fork")
            got += [(x.clone(), ldt.clone()) for x, ldt in loader]
        else:
            got += [(x.clone(), ldt.clone()) for x, ldt in ds]
    return got


@pytest.mark.slow
def test_the_version2_copy_holds_no_gimu_array(stores: dict[str, tuple[str, str]]) -> None:
    _, v2 = stores["shuffled"]
    names = {p.name for p in pathlib.Path(v2).iterdir() if p.is_dir()}
    assert "gimu" not in names and set(_v2.ARRAYS) <= names


@pytest.mark.slow
@pytest.mark.parametrize("order", ["device", "shuffled"])
def test_streamed_batches_equal_the_version1_store(stores: dict[str, tuple[str, str]], order: str) -> None:
    """Shuffled streaming, two epochs, two DataLoader workers: every batch of the version-2 copy
    equals the version-1 store's, bit for bit, and so does a resume from a state_dict."""
    v1, v2 = stores[order]
    expected = _epochs(_dataset(v1), (0, 1), workers=2)
    _same(_epochs(_dataset(v2), (0, 1), workers=2), expected)
    # resume epoch 1 of the version-2 store after 4 batches read by 2 workers
    head = _dataset(v2)
    head.set_epoch(1)
    seen = 0
    for _ in DataLoader(head, batch_size=None, num_workers=2, multiprocessing_context="fork"):
        seen += 1
        if seen == 4:
            break
    resumed = _dataset(v2)
    resumed.load_state_dict(head.state_dict(batches_seen=seen))
    tail = list(DataLoader(resumed, batch_size=None, num_workers=2, multiprocessing_context="fork"))
    first_epoch = len(_dataset(v1))
    _same([(x, ldt) for x, ldt in tail], expected[first_epoch + 4 :])


def _array(url: str, name: str) -> np.ndarray:
    """A whole array of the store, read by zarr-python."""
    import zarr

    return np.asarray(zarr.open_array(f"{url}/{name}", mode="r", zarr_format=3)[:])


def _held_bytes(url: str, devices: set[int] | None, n: int, *, gps_once: bool = True) -> int:
    """What resident mode must hold for ``n`` windows of ``devices`` (None: all), from the store's
    own dictionary arrays: 120 B of codes, 4 B of row, 4 (or 80) B of gps_speed a window, the
    entries of the rows those devices use (float32) and their offsets (int32, 3 starts a row
    repeated for the 20 samples)."""
    values, start, owner = (_array(url, name) for name in (_v2.VALUES, _v2.START, _v2.DEVICE))
    rows = np.flatnonzero(np.isin(owner, list(devices))) if devices is not None else np.arange(len(owner))
    entries = int(_v2.entry_counts(start, len(values))[rows].sum())
    return n * (120 + 4 + (4 if gps_once else 80)) + entries * 4 + len(rows) * 60 * 4


@pytest.mark.parametrize("order", ["device", "shuffled"])
@pytest.mark.slow  # over a second of CPU: not in the fast loop
def test_resident_cpu_holds_the_codes_and_gives_the_version1_batches(
    stores: dict[str, tuple[str, str]], order: str
) -> None:
    v1, v2 = stores[order]
    coded = _dataset(v2, resident="cpu")
    held = coded.resident
    assert held is not None and held.coded is not None, "a version-2 store stays coded in memory"
    n = len(held)
    assert held.x.dtype == torch.int16 and tuple(held.x.shape) == (n, 20, 3)
    assert tuple(held.coded.gps.shape) == (n,), "gps_speed, one value a window here, held once"
    assert held.coded.nbytes == _held_bytes(v2, None, n)  # 128 B a window + the dictionaries
    assert held.nbytes == held.coded.nbytes + n * 16  # + the packed ldt
    assert n * 128 <= 0.4 * n * 320
    got = _epochs(coded, (0, 1), workers=0)
    # the version-1 store's resident batches (the same permutations), from dict16 codes and float32
    _same(got, _epochs(_dataset(v1, resident="cpu"), (0, 1), workers=0))
    _same(got, _epochs(_dataset(v1, resident="cpu", resident_codes=False), (0, 1), workers=0))
    # and what each store reads for the windows each batch names (the version-2 store through
    # ChunkReader.read's decode, as streaming reads it)
    v1_store, v2_store = birdzarr.open_store(v1), birdzarr.open_store(v2)
    per_epoch = len(coded)
    for epoch in (0, 1):
        coded.set_epoch(epoch)
        for batch in range(per_epoch):
            x, ldt = got[epoch * per_epoch + batch]
            idx = coded.batch_indices(batch)
            assert np.array_equal(x.numpy().view(np.uint32), v1_store.windows[idx].view(np.uint32))
            assert np.array_equal(x.numpy().view(np.uint32), v2_store.windows[idx].view(np.uint32))
            assert np.array_equal(ldt.numpy(), np.stack([v1_store.labels[idx], v1_store.window_devices[idx],
                                                         v1_store.timestamps[idx]], axis=1))


@pytest.mark.slow
def test_resident_workers_share_the_codes_and_keep_the_order(stores: dict[str, tuple[str, str]]) -> None:
    _, v2 = stores["shuffled"]
    ds = _dataset(v2, resident="cpu", batch_size=900, seed=2)
    in_process = _epochs(ds, (1,), workers=0)
    assert ds.resident is not None and ds.resident.coded is not None
    assert all(t.is_shared() for t in (ds.resident.coded.codes, ds.resident.coded.gps, ds.resident.coded.row))
    _same(_epochs(ds, (1,), workers=2), in_process)


@pytest.mark.slow
def test_resident_holds_only_the_dictionary_rows_of_the_selected_devices(
    stores: dict[str, tuple[str, str]],
) -> None:
    v1, v2 = stores["device"]
    devices = {entry.device_id for entry in birdzarr.open_store(v1).device_table[:3]}
    ds = _dataset(v2, resident="cpu", devices=devices)
    held = ds.resident
    assert held is not None and held.coded is not None
    assert held.coded.nbytes == _held_bytes(v2, devices, len(held))
    assert int(held.coded.row.max()) + 1 == held.coded.offsets.shape[0] == 3
    expected = _epochs(_dataset(v1, resident="cpu", devices=devices), (0,), workers=0)
    _same(_epochs(ds, (0,), workers=0), expected)


@pytest.mark.slow
def test_the_torch_gather_a_gpu_runs_equals_the_store(stores: dict[str, tuple[str, str]]) -> None:
    """On a GPU the same torch ops decode (HeldCodes.decode): run here on the CPU, with rows in
    random order, against the version-1 store's windows and the documented numpy decode."""
    v1, v2 = stores["shuffled"]
    ds = _dataset(v2, resident="cpu")
    held = ds.resident
    assert held is not None and held.coded is not None
    rows = torch.from_numpy(np.random.default_rng(0).permutation(len(held))[:900])
    idx = held.global_index[rows.numpy()]
    v1_store = birdzarr.open_store(v1)
    expected = v1_store.windows[idx]
    assert np.array_equal(held._gather_with_torch(rows).numpy().view(np.uint32), expected.view(np.uint32))
    # the batch a GPU-held selection yields (ResidentSelection.gather, as device_batch calls it)
    x, ldt = held.gather(ds._resident_plan(), 2, channel_first=True)
    batch = ds.batch_indices(2)
    channel_first = v1_store.windows[batch].transpose(0, 2, 1)
    assert np.array_equal(x.numpy().view(np.uint32), channel_first.view(np.uint32))
    assert ldt is not None and np.array_equal(ldt[:, 2].numpy(), v1_store.timestamps[batch])
    codes, row, gps, values, start = (_array(v2, name) for name in (_v2.CODES, _v2.ROW, _v2.GPS, _v2.VALUES,
                                                                     _v2.START))
    documented = _v2.decode_reference(codes[idx], row[idx], gps[idx], values, start)
    assert np.array_equal(documented.view(np.uint32), expected.view(np.uint32))


def test_a_gps_speed_that_varies_within_a_window_is_held_in_every_sample(
    tmp_path: pathlib.Path,
) -> None:
    """One window whose gps_speed changes mid-window: the load starts again with gps_speed in
    every sample (204 B a window), and every value is exact."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from birdzarr.demo import _synthetic

    src = tmp_path / "src"
    src.mkdir()
    windows = {3: _synthetic.curated_windows(3000, seed=3), 4: _synthetic.curated_windows(2000, seed=4)}
    windows[4][1900, 10:, 3] += np.float32(0.5)
    for device, w in windows.items():
        offsets = pa.array(np.arange(0, len(w) * 80 + 1, 80, dtype=np.int32))
        column = pa.ListArray.from_arrays(offsets, pa.array(w.reshape(-1), type=pa.float32()))
        pq.write_table(pa.table({"gimu": column}), src / f"{device}.parquet")
    birdzarr.convert(src, tmp_path / "c.zarr", chunk_windows=1024, progress=False)
    truth = birdzarr.open_store(standard_format1(tmp_path / "c.zarr", tmp_path / "s.zarr")).windows[:]
    assert np.array_equal(truth.view(np.uint32), np.concatenate([windows[3], windows[4]]).view(np.uint32))
    to_format2(tmp_path / "s.zarr")
    ds = _dataset(str(tmp_path / "s.zarr"), resident="cpu", with_ldt=False)
    held = ds.resident
    assert held is not None and held.coded is not None
    assert tuple(held.coded.gps.shape) == (5000, 20)
    assert held.coded.nbytes == _held_bytes(str(tmp_path / "s.zarr"), None, 5000, gps_once=False)
    for batch, x in enumerate(ds):
        idx = ds.batch_indices(batch)
        assert np.array_equal(x.numpy().view(np.uint32), truth[idx].view(np.uint32))


@pytest.mark.slow
def test_resident_codes_false_holds_float32(stores: dict[str, tuple[str, str]]) -> None:
    v1, v2 = stores["shuffled"]
    ds = _dataset(v2, resident="cpu", resident_codes=False)
    assert ds.resident is not None and ds.resident.coded is None and ds.resident.x.dtype == torch.float32
    _same(_epochs(ds, (0,), workers=0), _epochs(_dataset(v1, resident="cpu"), (0,), workers=0))


@pytest.mark.slow
def test_refused_before_loading_when_the_codes_do_not_fit(
    stores: dict[str, tuple[str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The budget counts 128 B a window (+16 with ldt) and every dictionary row (int64 offsets)."""
    from birdzarr.loader import _resident as resident_module

    _, v2 = stores["device"]
    monkeypatch.setattr(resident_module, "memory_limit", lambda: (1_000_000, "the job's memory limit (test)"))
    values, start = _array(v2, _v2.VALUES), _array(v2, _v2.START)
    needed = 30_000 * (128 + 16) + len(values) * 4 + len(start) * 60 * 8
    with pytest.raises(birdzarr.ResidentMemoryError) as refused:
        _dataset(v2, resident="cpu")
    assert str(refused.value).startswith(
        f"{birdzarr.open_store(v2).url}: holding the selection (30,000 windows as 16-bit dictionary codes) "
        f"needs {needed / 2**20:.1f} MiB, but the job's memory limit (test) is 1.0 MiB. Stream instead")


@pytest.mark.slow
def test_the_host_decode_in_slices_equals_the_whole_batch(stores: dict[str, tuple[str, str]]) -> None:
    """With several torch threads the host decodes 512 windows at a time (never waking torch's
    intra-op threads); with one, the whole batch at once: the same values."""
    _, v2 = stores["device"]
    held = _dataset(v2, resident="cpu").resident
    assert held is not None and held.coded is not None
    rows = torch.from_numpy(np.random.default_rng(1).permutation(len(held))[:1300])  # 2 slices and a part
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        sliced = held.coded.decode(rows)
        torch.set_num_threads(1)
        whole = held.coded.decode(rows)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(sliced.view(torch.int32), whole.view(torch.int32))
    assert torch.equal(held.coded.decode(rows[:0]), torch.empty((0, 20, 4)))


@pytest.mark.slow
def test_a_selection_reads_the_device_table_index_not_its_entries(
    small_store: birdzarr.Store, tmp_path: pathlib.Path
) -> None:
    """Devices, a device split and their ranges come from the device table's index arrays: with
    the entries' group document unreadable, a default store still trains on exactly the windows
    of the chosen devices (at 100K devices the entries are ~75 MB of JSON that every rank and
    worker would otherwise parse)."""
    path = tmp_path / "s.zarr"
    shutil.copytree(small_store.location.path, path)
    table = birdzarr.open_store(path).root["committed"]["device_table"]
    ids = birdzarr.open_store(path).device_columns["device_id"].tolist()
    (path / table / "zarr.json").write_text("{not json")
    with pytest.raises(birdzarr.BirdzarrError, match="is damaged"):
        _ = birdzarr.open_store(path).device_table
    chosen = ids[1:4]
    ds = _dataset(str(path), devices=chosen, shuffle=False, batch_size=4096)
    store = birdzarr.open_store(path)
    expected = np.flatnonzero(np.isin(store.window_devices[:], chosen))
    x = np.concatenate([np.asarray(batch[0]) for batch in ds])  # (x, ldt) batches, store order
    assert np.array_equal(x.view(np.uint32), store.windows[expected].view(np.uint32))
    split = _dataset(str(path), split="train", split_by="device", val_fraction=0.25, split_seed=3,
                     shuffle=False, batch_size=4096)
    assert len(split) > 0


@pytest.mark.slow
def test_a_selection_decodes_only_its_windows_and_streams_the_version1_batches(
        stores: dict[str, tuple[str, str]]) -> None:
    """A selection keeping about a third of every chunk of a shuffled store: a pool holds only the
    selected windows of its piece of each chunk, packed at the start of its slot, with their
    labels, devices and times; the batches equal the version-1 store's, bit for bit."""
    from birdzarr.loader._pool import PoolBuffers
    from birdzarr.loader._sampling import Pool

    v1, v2 = stores["shuffled"]
    store, old = birdzarr.open_store(v2), birdzarr.open_store(v1)
    devices = np.unique(store.window_devices[:])[::3].tolist()
    ds = _dataset(v2, devices=devices)
    _same(_epochs(ds, (0,), workers=0), _epochs(_dataset(v1, devices=devices), (0,), workers=0))

    selection, width = ds.selection, store.chunk_windows
    counts = selection.counts()
    chunks = np.array([0, 7, store.reader.n_chunks - 1])
    lo = np.array([0, 5, 0])
    hi = counts[chunks]
    pool = PoolBuffers(store.reader, selection, with_ldt=True, threads=2)
    try:
        loaded = pool.load(Pool(chunks, lo, hi, np.array([int((hi - lo).sum())])))
    finally:
        pool.close()
    wanted = np.concatenate([selection.selected_indices(None, int(c))[a:b]
                             for c, a, b in zip(chunks, lo, hi, strict=True)])
    packed = np.concatenate([slot * width + np.arange(b - a)  # only the piece [lo, hi) is decoded
                             for slot, (a, b) in enumerate(zip(lo, hi, strict=True))])
    assert 0 < len(wanted) < 0.5 * len(chunks) * width
    assert np.array_equal(loaded.rows, packed)
    assert np.array_equal(loaded.gimu[loaded.rows].view(np.uint32), old.windows[wanted].view(np.uint32))
    assert loaded.ldt is not None
    assert np.array_equal(loaded.ldt["device"][loaded.rows], _array(v2, "device")[wanted])
    assert np.array_equal(loaded.ldt["timestamp"][loaded.rows], _array(v2, "timestamp")[wanted])
    assert np.array_equal(loaded.ldt["label"][loaded.rows], _array(v2, "label")[wanted])


@pytest.mark.parametrize("order", ["device", "shuffled"])
@pytest.mark.slow
def test_the_host_decode_equals_the_torch_ops_and_the_store(
    stores: dict[str, tuple[str, str]], order: str
) -> None:
    """``HeldCodes.decode_host`` (numpy, what DataLoader workers and the training process run with
    resident='cpu') gives the torch ops' values (``decode``, what a GPU runs) and the store's, bit
    for bit: rows in random order, into a new array, into a strided ``out``, and no rows."""
    v1, v2 = stores[order]
    held = _dataset(v2, resident="cpu").resident
    assert held is not None and held.coded is not None
    rows = np.random.default_rng(4).permutation(len(held))[:1300]
    expected = birdzarr.open_store(v1).windows[held.global_index[rows]].view(np.uint32)
    assert np.array_equal(held.coded.decode(torch.from_numpy(rows)).numpy().view(np.uint32), expected)
    assert np.array_equal(held.coded.decode_host(rows).view(np.uint32), expected)
    wide = np.zeros((len(rows), 20, 6), np.float32)  # out not C-contiguous: decoded, then copied in
    assert held.coded.decode_host(rows, out=wide[:, :, 1:5]) is not None
    assert np.array_equal(wide[:, :, 1:5].view(np.uint32), expected)
    assert not wide[:, :, [0, 5]].any()
    assert held.coded.decode_host(rows[:0]).shape == (0, 20, 4)


def _synthetic_held(n_rows: int, n: int, seed: int) -> tuple[HeldCodes, np.ndarray]:
    """A HeldCodes of ``n`` windows over ``n_rows`` dictionary rows of 2, 3 and 4 entries, and
    its windows as the documented lookup gives them."""
    rng = np.random.default_rng(seed)
    sizes = np.array([2, 3, 4])
    start = (np.arange(n_rows)[:, None] * sizes.sum() + np.r_[0, np.cumsum(sizes)[:-1]]).astype(np.int64)
    values = rng.standard_normal(n_rows * int(sizes.sum())).astype(np.float32)
    row = rng.integers(0, n_rows, n).astype(np.int32)
    row[:2] = [n_rows - 1, n_rows // 2]
    codes = (rng.integers(0, 2**16, (n, 20, 3)) % sizes).astype(np.uint16)
    gps = rng.standard_normal(n).astype(np.float32)
    held = HeldCodes(torch.from_numpy((codes ^ np.uint16(CODE_BIAS)).view(np.int16)), torch.from_numpy(gps),
                     torch.from_numpy(row), torch.from_numpy(values),
                     torch.from_numpy(np.tile((start + CODE_BIAS).astype(np.int32), (1, 20))))
    expected = np.empty((n, 20, 4), np.float32)
    expected[:, :, :3] = values[start[row][:, None, :] + codes]
    expected[:, :, 3] = gps[:, None]
    return held, expected


def test_the_host_decode_is_exact_past_65536_dictionary_rows() -> None:
    """Dictionary rows past 2**16 (rows held as int32, offsets past 16 bits): the host decode
    gives the same values as the torch ops and the documented lookup."""
    held, expected = _synthetic_held(70_000, 3000, seed=2)
    assert int(held.row.max()) >= 2**16
    picked = np.random.default_rng(3).permutation(3000)
    assert np.array_equal(held.decode_host(picked).view(np.uint32),
                          expected[picked].view(np.uint32))
    assert np.array_equal(held.decode(torch.from_numpy(picked)).numpy().view(np.uint32),
                          expected[picked].view(np.uint32))


def test_a_huge_host_batch_decodes_exactly_and_keeps_no_temporaries() -> None:
    """The host decode keeps its temporaries per thread up to 16 MiB each (batches up to ~70,000
    windows); a larger batch (here 90,000 rows, some repeated) decodes as exactly, in new memory."""
    from birdzarr.loader import _resident

    held, expected = _synthetic_held(50, 2000, seed=4)
    small = np.random.default_rng(5).permutation(2000)
    assert np.array_equal(held.decode_host(small).view(np.uint32), expected[small].view(np.uint32))
    kept = _resident._SCRATCH.index
    rows = np.random.default_rng(6).integers(0, 2000, 90_000)
    assert np.array_equal(held.decode_host(rows).view(np.uint32), expected[rows].view(np.uint32))
    assert _resident._SCRATCH.index is kept, "the huge batch's index was not kept"
    assert kept.nbytes <= _resident._SCRATCH_LIMIT


@pytest.mark.slow
def test_a_resident_selection_reads_only_its_windows_of_each_chunk(
    stores: dict[str, tuple[str, str]],
) -> None:
    """A device subset of a shuffled store keeps part of every chunk: loading gathers only those
    windows from each decompressed chunk (``read_coded(chunk, selected)``, the same codes, rows and
    gps_speed as the whole chunk's at those positions), and the batches are the version-1 store's."""
    v1, v2 = stores["shuffled"]
    store = birdzarr.open_store(v2)
    devices = np.unique(store.window_devices[:])[::3].tolist()
    reader = store.reader
    for chunk in (0, reader.n_chunks - 1):
        first, stop = reader.chunk_span(chunk)
        selected = np.flatnonzero(np.isin(store.window_devices[first:stop], devices))
        assert 0 < len(selected) < stop - first
        whole = reader.read_coded(chunk)
        part = reader.read_coded(chunk, selected)
        for got, full in zip(part, whole, strict=True):
            assert np.array_equal(got, full[selected])
    ds = _dataset(v2, resident="cpu", devices=devices)
    held = ds.resident
    assert held is not None and held.coded is not None
    kept = np.flatnonzero(np.isin(store.window_devices[:], devices))
    assert np.array_equal(np.sort(held.global_index), kept)
    expected = _epochs(_dataset(v1, resident="cpu", devices=devices), (0,), workers=0)
    _same(_epochs(ds, (0,), workers=0), expected)
