"""Grounded arguments: a string argument that must be made of words from the user's question.

A 135M model asked for a search query often writes one from its examples or from nowhere
("Mona Lisa" for a question about Hamlet). The grammar can rule that out: the query's schema gets
a pattern that allows only a run of the question's own topic words (no question words, no
numbers), so the model still chooses *which* words, but cannot invent any.
"""

from __future__ import annotations

import copy
import re

MAX_WORDS = 6
# Words that carry no topic: a query made of them finds nothing (numbers go to the calculator).
QUESTION_WORDS = {
    "what",
    "who",
    "whom",
    "whose",
    "which",
    "when",
    "where",
    "why",
    "how",
    "is",
    "are",
    "was",
    "were",
    "the",
    "a",
    "an",
    "and",
    "or",
    "of",
    "in",
    "on",
    "to",
    "do",
    "does",
    "did",
    "me",
    "tell",
    "please",
    "can",
    "you",
    "i",
}


def grounded(tool_schema: dict, params: tuple[str, ...] | list[str], question: str) -> dict:
    """A copy of an OpenAI tool entry whose `params` (string properties) only take question words."""
    words = sorted(
        {
            w
            for w in re.findall(r"[\w'-]+", question)
            if w.lower() not in QUESTION_WORDS and not any(c.isdigit() for c in w)
        },
        key=len,
        reverse=True,
    )
    if not params or not words:
        return tool_schema
    schema = copy.deepcopy(tool_schema)
    properties = schema["function"]["parameters"].get("properties", {})
    word = "(" + "|".join(re.escape(w) for w in words) + ")"
    for name in params:
        if properties.get(name, {}).get("type") == "string":
            properties[name]["pattern"] = f"^{word}( {word}){{0,{MAX_WORDS - 1}}}$"
    return schema
