"""The read-only store handle (``_handle``: ``open_store`` and ``Store``), chunk fetching and
decoding without zarr-python (``_chunks``) and the text summary (``_summary``)."""
