"""Generated data with realistic calibrated values (``_synthetic``, for the demo, tests and
benchmarks) and ``birdzarr demo`` (``_run``)."""
