"""BlockFilter: tagged blocks (tool calls) leave whole, and a repeated or forced one ends the reply."""

from __future__ import annotations

from pellucid.engine.block_filter import BlockFilter

TAGS = ("<tool_call>", "</tool_call>")
A = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
B = '<tool_call>\n{"name": "f", "arguments": {"x": 2}}\n</tool_call>'


def run(text: str, forced_from: int | None = None) -> tuple[list[str], BlockFilter]:
    """Feed one character at a time (every cut through a tag is tried); `forced_from`: the
    character at which the close margin begins."""
    f, out = BlockFilter(TAGS), []
    for i, ch in enumerate(text):
        out.append(f.feed(ch, forced=forced_from is not None and i >= forced_from))
        if f.ended:
            return out, f
    out.append(f.flush())
    return out, f


def test_blocks_are_released_whole_and_text_around_them_flows() -> None:
    out, f = run(f"Sure.\n{A}\n{B} done")
    assert "".join(out) == f"Sure.\n{A}\n{B} done" and f.ended is None
    assert A in out and B in out  # each block left in one piece, when its closing tag arrived
    assert not any("<tool" in piece and piece not in (A, B) for piece in out)


def test_a_word_for_word_repeat_ends_the_reply_before_it() -> None:
    out, f = run(f"{A}\n{B}\n{A}\n{B}")
    assert "".join(out) == f"{A}\n{B}\n" and f.ended == "stop"
    assert f.flush() == ""  # nothing held comes out after the end


def test_a_block_the_close_margin_forced_shut_is_dropped() -> None:
    text = f"{A}\n{B}"
    out, f = run(text, forced_from=len(A) + 30)  # the margin begins inside the second call
    assert "".join(out) == f"{A}\n" and f.ended == "length"


def test_an_unclosed_block_is_left_out_but_a_lone_tag_start_is_text() -> None:
    out, f = run(f'{A}\n<tool_call>\n{{"name": ')  # cut off at max_tokens inside a call
    assert "".join(out) == f"{A}\n" and f.ended is None
    out, f = run("a < b <tool")
    assert "".join(out) == "a < b <tool"


def test_without_tags_text_passes_through() -> None:
    f = BlockFilter(None)
    assert f.feed(A + A) == A + A and f.flush() == "" and f.ended is None


def test_a_closing_tag_inside_a_json_string_does_not_end_the_block() -> None:
    code = '<tool_call>\n{"name": "py", "arguments": {"code": "print(\\"}}</tool_call>\\")"}}\n</tool_call>'
    out, f = run(f"{code}\n{code}")
    assert "".join(out) == f"{code}\n" and f.ended == "stop"  # whole, then its repeat ends it
    # forced shut after the tag inside the string: the block is still the one being forced
    out, f = run(code, forced_from=code.index("</tool_call>") + 14)
    assert "".join(out) == "" and f.ended == "length"


def test_where_the_json_of_an_open_block_stands() -> None:
    f = BlockFilter(TAGS)
    seen = []
    for ch in '<tool_call>\n{"name": "f", "arguments": {"x": "a\\"b"}}':
        f.feed(ch)
        seen.append(f.json_at)
    assert seen[0] is None  # no block open yet
    # "{" outside; each opening quote, then the string; an escaped quote does not close it
    assert seen[12] == "outside" and seen[13] == "string start" and seen[14] == "string"
    # the last 8 characters: "a\"b"}}
    assert seen[-8:] == ["string start"] + ["string"] * 4 + ["outside"] * 3
    # after a key's colon, and the space after it, the key's value comes next
    colon = 12 + len('{"name"')
    assert seen[colon : colon + 3] == ["value", "value", "string start"]
    assert seen[colon + 5] == "outside"  # past "f", the comma
    assert not f.lost


def test_a_closing_tag_inside_a_string_says_the_model_lost_track() -> None:
    # Fed a character at a time, so the tag arrives cut: it is still seen whole.
    out, f = run('<tool_call>\n{"name": "f", "arguments": {"x": "}}</tool_call> and on')
    assert f.lost and f.json_at == "string" and "".join(out) == ""
    _, f = run('<tool_call>\n{"name": "f", "arguments": {"x": "</tool_"}}')
    assert not f.lost  # a part of the tag is only text


def test_an_open_block_is_repeating_while_it_begins_an_earlier_one_word_for_word() -> None:
    f = BlockFilter(TAGS)
    f.feed(A[:20])
    assert not f.repeating  # open, but no earlier block to repeat
    f.feed(A[20:] + "\n")
    assert not f.repeating  # closed: nothing open
    f.feed('<tool_call>\n{"name": "f", "arguments": {"x": ')
    assert f.repeating  # so far A again: the scheduler guesses the rest of A
    f.feed("2")
    assert not f.repeating  # now B, not a repeat
