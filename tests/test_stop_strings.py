"""StopStringFilter: a stop string split across any number of deltas never reaches the output."""

from __future__ import annotations

import itertools

from pellucid.engine.stop_strings import StopStringFilter


def run(deltas: list[str], stops: list[str]) -> tuple[str, bool]:
    f = StopStringFilter(stops)
    out = ""
    for d in deltas:
        out += f.feed(d)
        if f.stopped:
            return out, True
    return out + f.flush(), False


def test_stop_inside_one_delta():
    assert run(["Hello END world"], ["END"]) == ("Hello ", True)


def test_stop_split_across_every_possible_boundary():
    text, stop = "The answer is 42.\n\nQuestion: next", "\n\nQuestion:"
    for cut1, cut2 in itertools.combinations(range(1, len(text)), 2):
        deltas = [text[:cut1], text[cut1:cut2], text[cut2:]]
        assert run(deltas, [stop]) == ("The answer is 42.", True), (cut1, cut2)


def test_character_by_character_never_emits_a_stop_prefix_early():
    f = StopStringFilter(["</s>"])
    emitted = [f.feed(c) for c in "ab</"]
    assert "".join(emitted) == "ab"  # "</" is held: it may become "</s>"
    assert f.feed("x") == "</x"  # it did not; the held text is released
    assert not f.stopped


def test_held_text_is_released_at_the_end():
    assert run(["Hello wor"], ["world!"]) == ("Hello wor", False)


def test_earliest_of_several_stops_wins():
    assert run(["a STOP b HALT c"], ["HALT", "STOP"]) == ("a ", True)


def test_no_stops_passes_through():
    assert run(["x", "y"], []) == ("xy", False)
