"""The PyTorch loader: ``WindowDataset`` (``_dataset``) over its validated options (``_config``),
its position in the epochs and saved state (``_state``), pure epoch planning (``_sampling``)
over a store's selection (``birdzarr.store._selection``), pools of decoded chunks (``_pool``),
resident mode (``_resident``), the batch output paths (``_sink``), batch hand-off through reused
shared memory (``_handoff``) and the shuffle-quality figures (``_quality``).
The only package that imports torch."""
