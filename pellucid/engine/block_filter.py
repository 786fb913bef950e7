"""Tagged blocks in a reply (tool calls): held back until they close, and ended where useless.

A small model allowed several tool calls in one reply tends to write its last call again, and
again, until it runs out of tokens; a client would run every copy. With `SamplingParams.blocks`
set to the tags, a block is released only once it has closed, and the reply ends, before the
block, when that block

    repeats an earlier block of the reply word for word    -> finish_reason "stop"
    was forced shut by the grammar's close margin          -> finish_reason "length"
    (the margin took away what the model wanted to write: it is not the call the model meant)

and a block still open when the reply ends (cut off at max_tokens) is left out too.

so neither reaches the text, the stream or the client.
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

    def feed(self, delta: str, forced: bool = False) -> str:
        """Add `delta`; `forced`: the close margin has overruled the model (SamplerState.forced_shut),
        so the block that closes now is one it forced shut."""
        if not self.open or self.ended:
            return delta
        text, out = self.held + delta, []
        while (start := text.find(self.open)) >= 0:
            out.append(text[:start])
            # The first closing tag ends the block, even one inside a JSON string: two blocks
            # are then compared by the part before it, which does not change what is released.
            end = text.find(self.close, start + len(self.open))
            if end < 0:
                self.held = text[start:]
                return "".join(out)
            end += len(self.close)
            block, text = text[start:end], text[end:]
            if forced or block in self.seen:
                self.ended, self.held = "length" if forced else "stop", ""
                return "".join(out)
            self.seen.add(block)
            out.append(block)
        keep = partial_suffix_len(text, [self.open])
        self.held = text[len(text) - keep :]
        out.append(text[: len(text) - keep])
        return "".join(out)

    def flush(self) -> str:
        """At the end of generation: text that only looked like a tag's start goes out; a block
        that never closed (the reply ran out of tokens inside it) does not."""
        out, self.held = self.held, ""
        return "" if self.ended or out.startswith(self.open) else out
