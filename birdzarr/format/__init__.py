"""The store format: names, constants, the device table and report schema (``_spec``), and the
codec chains and checksums (``_codec``). The lowest layer: it imports nothing of birdzarr but
the errors. docs/format.md is its specification."""
