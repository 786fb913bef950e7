"""loops.is_looping: a reply's text caught repeating one stretch, and text that is not."""

from __future__ import annotations

from pellucid.engine.loops import MIN_SPAN, is_looping

SENTENCE = "The function returns a JSON object with the type of gene mutation as a string. "


def test_one_stretch_over_and_over_is_a_loop() -> None:
    assert is_looping('{"stops": ["' + 'Santa Barbara", "' * 11)
    assert is_looping("ATP_Synthesis_enzyme_protein_" * 6)
    assert is_looping("x" * MIN_SPAN) and not is_looping("x" * (MIN_SPAN - 1))
    # A sentence said three times in a row (longer than MIN_SPAN together), but not twice
    assert is_looping("Why: " + SENTENCE * 3)
    assert not is_looping("Why: " + SENTENCE * 2 + SENTENCE[:-2] + "!")


def test_text_that_merely_repeats_a_little_is_not() -> None:
    assert not is_looping("[" + "0, " * 40)  # a few dozen zeros in an array
    prose = (
        "Pellucid decodes one token per step for each sequence, and pre-fills a prompt in one "
        "pass; its KV cache holds the keys and values of every token seen, in blocks of 16."
    )
    assert not is_looping(prose * 2)
    # Counting is not a loop (and is not caught: the text never repeats exactly)
    assert not is_looping("_".join(str(y) for y in range(2020, 2100)))
