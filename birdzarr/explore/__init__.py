"""Exploration: summaries, a lazy xarray view, plots and statistics of a store.

Everything here is reached through ``birdzarr.Store`` methods (``store.to_xarray()``,
``store.plot_window(i)``, ``store.stats()``, ...). matplotlib and xarray are imported only when a
feature needs them (the ``explore`` extra), so opening a store or training never pays for them.
"""
