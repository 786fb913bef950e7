"""Stop strings: end generation when one appears, and never show any part of it to the user.

Text that might be the start of a stop string is held back until the next tokens decide, so a
stop string split across several tokens never leaks into a stream.
"""

from __future__ import annotations


class StopStringFilter:
    """Feed text deltas in; get back the text that is safe to emit, and whether a stop was hit."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.held = ""  # text received but not yet emitted
        self.stopped = False

    def feed(self, delta: str) -> str:
        """Add `delta`; return what can be released now (everything before a stop, if one hit)."""
        if not self.stops:
            return delta
        text = self.held + delta
        cut = self._first_stop(text)
        if cut is not None:
            self.stopped, self.held = True, ""
            return text[:cut]
        keep = partial_suffix_len(text, self.stops)
        self.held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """At the end of generation the held text is known not to start a stop string."""
        out, self.held = self.held, ""
        return out

    def _first_stop(self, text: str) -> int | None:
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        return min(hits) if hits else None


def partial_suffix_len(text: str, tags: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags`: text
    that may yet become a tag, so it is held back."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best
