"""IncrementalDetokenizer: token ids in, text deltas out, never half of a UTF-8 character.

Each id stands for a fixed byte string (`Tokenizer.id_to_bytes`), so streaming is feeding those
bytes to an incremental UTF-8 decoder: O(1) per token, no window to re-decode. An emoji whose four
bytes arrive in three tokens comes out whole with the third; deltas + `flush()` == `decode(ids)`.
"""

from __future__ import annotations

import codecs

from pellucid.tokenizer.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Streams the text of one sequence of generated token ids."""

    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = False):
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self.token_ids: list[int] = []
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._parts: list[str] = []

    @property
    def text(self) -> str:
        """All text emitted so far (bytes of an unfinished character are held back)."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def step(self, token_id: int) -> str:
        """Add one token; return the text it completes ('' while a character is still partial)."""
        first = not self.token_ids
        self.token_ids.append(token_id)
        if (
            first
        ):  # decode() of one id applies the first-token rules (SentencePiece's leading space)
            data = self.tokenizer.decode_bytes([token_id], skip_special=self.skip_special)
        elif self.skip_special and self.tokenizer.is_special(token_id):
            data = b""
        else:
            data = self.tokenizer.id_to_bytes(token_id)
        return self._emit(self._utf8.decode(data))

    def flush(self) -> str:
        """End of the sequence: bytes of a character that never completed come out as U+FFFD."""
        return self._emit(self._utf8.decode(b"", final=True))

    def _emit(self, delta: str) -> str:
        if delta:
            self._parts.append(delta)
        return delta
