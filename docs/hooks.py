"""mkdocs hook: keep nav entries whose page exists, so a page still being written never breaks
the strict build. Dropped entries are logged at INFO level; `mkdocs build -v` lists them."""

from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger("mkdocs.hooks.nav")


def _existing(items: list[Any], docs_dir: str) -> list[Any]:
    kept = []
    for item in items:
        if isinstance(item, dict):
            ((title, target),) = item.items()
            if isinstance(target, list):
                children = _existing(target, docs_dir)
                if children:
                    kept.append({title: children})
                continue
        else:
            target = item
        if "://" in str(target) or os.path.exists(os.path.join(docs_dir, str(target))):
            kept.append(item)
        else:
            log.info("nav: %s does not exist yet, left out", target)
    return kept


def on_config(config: Any) -> Any:
    config["nav"] = _existing(config["nav"] or [], config["docs_dir"])
    return config
