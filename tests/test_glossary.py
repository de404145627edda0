"""The API reference and the glossary match ``birdzarr.__all__`` (issue 34's "Done when"): every
exported name is documented in docs/api.md at its public path, nothing is documented at a private
path, and every ``birdzarr.<name>`` the glossary or the API page names is exported."""

from __future__ import annotations

import pathlib
import re

import birdzarr

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"
API = (DOCS / "api.md").read_text()
_FORMAT = (DOCS / "format.md").read_text()
GLOSSARY = _FORMAT[_FORMAT.index("## Glossary"):]

# `::: birdzarr.x.y` directives (mkdocstrings) and `birdzarr.x` in backticks or table cells
DIRECTIVES = re.findall(r"^::: ([\w.]+)", API, flags=re.MULTILINE)
_NAMED = r"(?<![\w.])birdzarr\.(\w+)"


def test_every_exported_name_is_documented_at_its_public_path() -> None:
    documented = {path.split(".")[1] for path in DIRECTIVES if path.count(".") == 1}
    if "birdzarr.convert.convert" in DIRECTIVES:  # the function, shown as birdzarr.convert
        documented.add("convert")
    documented |= set(re.findall(r"`" + _NAMED + r"`", API))  # the constants' table
    missing = sorted(set(birdzarr.__all__) - documented)
    assert not missing, f"exported but not documented in docs/api.md: {missing}"


def test_the_api_page_documents_no_private_path() -> None:
    private = [path for path in DIRECTIVES if any(part.startswith("_") for part in path.split("."))]
    assert not private, private
    named = re.findall(r"birdzarr(?:\.\w+)*\._(?!_)\w+", API)  # a dunder (birdzarr.__all__) is public
    assert not named, named


def test_every_top_level_name_the_api_page_documents_is_exported() -> None:
    for path in DIRECTIVES:
        top = path.split(".")[1]
        if top == "explore":  # the exploration functions: birdzarr.explore's own __all__
            assert path.count(".") == 2 and path.split(".")[2] in birdzarr.explore.__all__, path
        elif path == "birdzarr.convert.convert":  # the function, shown as birdzarr.convert
            continue
        else:
            assert path.count(".") == 1 and top in birdzarr.__all__, path


def test_the_glossary_names_only_exported_names() -> None:
    named = set(re.findall(_NAMED, GLOSSARY)) - {"convert", "__all__"}  # `birdzarr.convert` is exported too
    assert named, "the glossary names the public classes it describes"
    assert named <= set(birdzarr.__all__), sorted(named - set(birdzarr.__all__))
    # the result types it lists are every result type exported
    results = {name for name in birdzarr.__all__ if name.endswith("Result")}
    assert results == {"VerifyResult", "RepairResult", "CopyResult", "AppendResult"}
    assert results <= named
    assert "convert" in birdzarr.__all__


def test_the_deprecated_names_table_lists_each_renamed_spelling() -> None:
    """Each old spelling in docs/api.md#deprecated-names; tests/test_public_names.py checks that
    each warns naming the new one."""
    table = API[API.index("## Deprecated names"):]
    for old, new in [("WindowDataset(prefetch=n)", "WindowDataset(requests=n)"),
                     ("ds.prefetch", "ds.config.requests"),
                     ("LoaderConfig.prefetch", "LoaderConfig.requests"),
                     ("birdzarr.copy(..., storage_options=...)",
                      "birdzarr.copy(..., source_storage_options=...)"),
                     ("birdzarr.RepairReport", "birdzarr.RepairResult"),
                     ("CopyResult.summary()", "CopyResult.format()")]:
        assert f"| `{old}` | `{new}` |" in table, old
    for name in ("batch_size", "shuffle", "seed", "drop_last", "channel_first", "with_ldt", "transform",
                 "transform_ldt", "reuse_batch_memory", "world_size", "rank"):
        assert f"`ds.{name}`" in table, name
