"""Where bytes live: locations (local paths, fsspec URLs, object stores) with retries and
fetchers (``_location``), the opt-in local chunk cache (``_cache``) and the writer lock
(``_lock``). Knows nothing of conversion, reading or torch."""
