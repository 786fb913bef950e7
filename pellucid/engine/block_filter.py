"""Tagged blocks in a reply (tool calls): held back until they close, and ended where useless.

A small model allowed several tool calls in one reply tends to write its last call again, and
again, until it runs out of tokens; a client would run every copy. With
`SamplingParams.distinct_blocks` set to the tags, a block is released only once it has closed, and
the reply ends before a block that

    repeats an earlier block of the reply word for word    -> finish_reason "stop"
    was forced shut by the grammar's close margin          -> finish_reason "length"
    (the margin took away what the model wanted to write: it is not the call the model meant;
    it stays in `forced_block`, for a reply that must hold a call and has no other)

so neither reaches the text, the stream or the client. A block still open when the reply ends
(cut off at max_tokens) is left out too.

Reading the JSON of the open block, the filter also tells the sampler where it stands
(`json_at`: a string just opened, inside one, a value next, outside) and whether the model has
lost track (`lost`: the closing tag came inside a string), for sampler.constrain's repairs.
"""

from __future__ import annotations

from pellucid.engine.stop_strings import partial_suffix_len


class BlockFilter:
    """Feed text deltas in; get back the text that is safe to emit. `ended` says why a block
    ended the reply ("stop" for a repeat, "length" for a forced one), None while none has."""

    def __init__(self, tags: tuple[str, str] | None):
        self.open, self.close = tags or ("", "")
        self.held = ""  # an open block, or text that may be the start of its opening tag
        self.seen: set[str] = set()
        self.ended: str | None = None
        self.forced_block = ""  # the block forced shut that ended the reply, left out
        self._block: _BlockEnd | None = None  # set while `held` starts with an open block

    def feed(self, delta: str, forced: bool = False) -> str:
        """Add `delta`; `forced`: the close margin has overruled the model (SamplerState.forced_shut),
        so the block that closes now is one it forced shut."""
        if not self.open or self.ended:
            return delta
        self.held += delta
        out = []
        while True:
            if self._block is None:
                start = self.held.find(self.open)
                if start < 0:
                    keep = len(self.held) - partial_suffix_len(self.held, [self.open])
                    out.append(self.held[:keep])
                    self.held = self.held[keep:]
                    return "".join(out)
                out.append(self.held[:start])
                self.held = self.held[start:]
                self._block = _BlockEnd(len(self.open), self.close)
            end = self._block.find(self.held)
            if end < 0:
                return "".join(out)
            block, self.held, self._block = self.held[:end], self.held[end:], None
            if forced:
                self.forced_block = block
            if forced or block in self.seen:
                self.ended, self.held = "length" if forced else "stop", ""
                return "".join(out)
            self.seen.add(block)
            out.append(block)

    @property
    def json_at(self) -> str | None:
        """Where the open block's JSON stands after the text seen: "string start" (a string's
        opening quote came last), "string", "value" (outside a string, a key's colon came
        last: its value begins next), "outside" a string elsewhere, or None with no block open.
        (SamplerState.json_at; sampler.constrain and the penalties read it.)"""
        block = self._block
        if block is None:
            return None
        if not block.in_string:
            return "value" if block.last == ":" else "outside"
        return "string start" if block.opened_at == len(self.held) - 1 else "string"

    @property
    def repeating(self) -> bool:
        """An open block whose text so far begins an earlier block of the reply word for word:
        it may be heading for a repeat, which would end the reply (the scheduler then guesses
        the rest of that block, so that the model checks it in one step)."""
        return self._block is not None and any(b.startswith(self.held) for b in self.seen)

    @property
    def lost(self) -> bool:
        """The open block's closing tag came inside one of its JSON strings: the model meant
        to end the call there and has lost track of its quotes (what follows rambles on)."""
        return self._block is not None and self._block.tag_in_string

    def flush(self) -> str:
        """At the end of generation: text that only looked like a tag's start goes out; a block
        that never closed (the reply ran out of tokens inside it) does not."""
        out, self.held = self.held, ""
        return "" if self.ended or self._block is not None else out


class _BlockEnd:
    """Finds where a block of JSON ends: at the first closing tag outside a JSON string (code in
    a string argument may well spell the tag). Scans each character once, however the block
    arrives, so a long block costs linear time."""

    def __init__(self, start: int, close: str):
        self.close = close
        self.pos = start  # next character to look at
        self.in_string = self.escaped = False
        self.opened_at = -1  # where the string being read began (its quote)
        self.last = ""  # the last character read outside a string that is not white space
        self.tag_in_string = False  # the closing tag came inside a string: the model lost track

    def find(self, text: str) -> int:
        """The index just past the closing tag, or -1 while the block is still open."""
        while self.pos < len(text):
            c = text[self.pos]
            if self.in_string:
                if c == self.close[0] and not self.escaped:
                    if text.startswith(self.close, self.pos):
                        self.tag_in_string = True
                    elif self.close.startswith(text[self.pos :]):
                        return -1  # the tag may be arriving: look here again with more text
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string, self.opened_at = True, self.pos
            elif c == self.close[0]:
                if text.startswith(self.close, self.pos):
                    return self.pos + len(self.close)
                if self.close.startswith(text[self.pos :]):
                    return -1  # the tag may be arriving: look here again with more text
            if not self.in_string and not c.isspace():
                self.last = c  # a string's closing quote too
            self.pos += 1
        return -1
