"""The PyTorch loader: ``WindowDataset`` (``_dataset``) over pure epoch planning (``_sampling``),
subsets (``_selection``), pools of decoded chunks (``_pool``), resident mode (``_resident``),
batch hand-off through reused shared memory (``_handoff``) and the shuffle-quality figures
(``_quality``). The only package that imports torch."""
