"""Optional dependencies of the exploration features, with one clear message when missing."""

from __future__ import annotations

import importlib
from types import ModuleType

from birdzarr._errors import MissingDependencyError

_INSTALL_HINT = 'pip install "birdzarr[explore]"'


def require(module: str, feature: str) -> ModuleType:
    """Import ``module`` or raise ``MissingDependencyError`` naming the extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        top = module.split(".")[0]
        raise MissingDependencyError(
            f"{feature} needs {top}, which is not installed. Install the exploration extra: {_INSTALL_HINT}"
        ) from exc
