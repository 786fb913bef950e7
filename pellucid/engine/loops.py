"""Loops: a reply caught repeating one stretch of text, so its grammar can close what is open.

A small model inside a JSON string or array can fall into writing one stretch again and again
("Santa Barbara", "Santa Barbara", ..., "ATP_Synthesis_enzyme_protein_" over and over, or one
sentence of prose inside a string) until the context ends: thousands of tokens, minutes of
decoding, and a call no one can use. Where the grammar has a close margin (a reply of calls, a
JSON response), a row whose text ends in one stretch repeated (REPEATS times, over MIN_SPAN
characters at least) is treated as at its margin (sampler.constrain): only closing tokens stay,
what the margin shuts counts as forced, and the block filter drops a call shut that way, so the
reply ends with finish_reason "length" in seconds, keeping the calls complete before it.
"""

from __future__ import annotations

# Measured in characters, not tokens: a frequency penalty makes the model spell the same text
# with other tokens each time round, so a loop is exact only in its text.
MAX_PERIOD = 256  # characters in the repeated stretch, at most (a sentence said over and over)
REPEATS = 3  # times a stretch must come in a row to be a loop
MIN_SPAN = 160  # characters a loop spans at least: a few dozen zeros in an array are not one
KEEP = 2 * max(MIN_SPAN, REPEATS * MAX_PERIOD)  # what a caller needs to keep of the text


def is_looping(text: str) -> bool:
    """True if `text` ends in a stretch of p <= MAX_PERIOD characters repeated over its last
    max(MIN_SPAN, REPEATS * p) characters."""
    n = len(text)
    for p in range(1, MAX_PERIOD + 1):
        span = max(MIN_SPAN, REPEATS * p)
        if n < span:
            return False  # spans only grow with p
        if text[-1] != text[-1 - p]:
            continue  # the cheap test first: most periods fail it
        tail = text[n - span :]
        if tail[p:] == tail[:-p]:  # every character equals the one p before it
            return True
    return False
