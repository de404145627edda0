"""The store format: names, constants, the device table and report schema (``_spec``), the
codec chains and checksums (``_codec``), and the window hashes behind a shuffled store's device
digest (``_digest``). The lowest layer: it imports nothing of birdzarr but
the errors and the argument checks (``_checks``). docs/format.md is its specification."""
