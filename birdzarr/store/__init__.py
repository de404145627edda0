"""The read-only store handle (``_handle``: ``open_store`` and ``Store``), chunk fetching and
decoding without zarr-python (``_chunks``), the text summary (``_summary``) and which windows a
selection keeps (``_selection``: device filters, seeded splits, labels, time; what the loader
trains on and ``birdzarr.subset`` writes)."""
