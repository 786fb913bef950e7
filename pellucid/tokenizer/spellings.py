"""llama.cpp's rules for tokens it knows by their spelling (src/llama-vocab.cpp, as of
llama-cpp-python 0.3.36), applied to a GGUF's token types so that pellucid tokenizes and stops
as llama.cpp does, whatever type the file gives them.

- End-of-generation spellings (`<|im_end|>`, `<end_of_turn>`, `</s>`, ...) become control tokens
  and stop generation. With parse_special=False, "a</s>b" then stays text, even where the GGUF
  marks `</s>` user-defined (Gemma 3), which would otherwise be matched whole.
- Fill-in-the-middle spellings (`<|fim_prefix|>`, `<PRE>`, ...) become control tokens for each role
  the GGUF names no id for; the pad, repo and separator roles also stop generation.
- Exceptions: where `<|return|>` and `<|call|>` (or `<|calls|>` and `<|flush|>`) are present,
  `<|end|>` is a user-defined token that does not stop; where `<|tool_response>` or
  `<|plamo:eos|>` is present, `</s>` is plain text; `<|channel|>`, `<|message|>`, `<|start|>` and
  `<|constrain|>` are always user-defined (gpt-oss renders them).
"""

from __future__ import annotations

from typing import Any

from pellucid.tokenizer.token_types import CONTROL, NORMAL, USER_DEFINED

END_OF_GENERATION = (
    *("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>"),
    *("<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]"),
    *("<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>"),
)
# fill-in-the-middle roles: the GGUF key that names the role's id, and the spellings that stand
# for it where the key is absent; the last three roles also end generation
FILL_IN_THE_MIDDLE = {
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<PRE>", "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<SUF>", "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<MID>", "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}  # fmt: skip
FIM_STOPS = ("fim_pad", "fim_rep", "fim_sep")
OLD_KEYS = {"fim_pre": "prefix", "fim_suf": "suffix", "fim_mid": "middle"}  # deprecated names
ALWAYS_USER_DEFINED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")


def retype(
    tokens: list[str], types: list[int], metadata: dict[str, Any], stops: set[int]
) -> tuple[list[int], set[int]]:
    """The token types after llama.cpp's rules, and the end-of-generation ids: `stops` (the ids
    the GGUF names: EOS, end of turn, end of message) and those the spellings add."""
    types, stops = list(types), set(stops)
    index = {token: i for i, token in enumerate(tokens)}
    for token in END_OF_GENERATION:
        if token in index:
            stops.add(index[token])
            types[index[token]] = CONTROL
    for role, spellings in FILL_IN_THE_MIDDLE.items():
        role_id = metadata.get(f"tokenizer.ggml.{role}_token_id")
        if role_id is None and role in OLD_KEYS:
            role_id = metadata.get(f"tokenizer.ggml.{OLD_KEYS[role]}_token_id")
        if role_id is None:
            # llama.cpp takes the first spelling its hash map yields; vocabularies have one
            found = [index[t] for t in spellings if t in index]
            if not found:
                continue
            role_id = found[0]
            types[role_id] = CONTROL
        if role in FIM_STOPS and 0 <= int(role_id) < len(tokens):
            stops.add(int(role_id))
    for token in ALWAYS_USER_DEFINED:
        if token in index:
            types[index[token]] = USER_DEFINED
    _exceptions(index, types, stops, {tokens[i] for i in stops})
    return types, stops


def _exceptions(index: dict[str, int], types: list[int], stops: set[int], names: set[str]) -> None:
    """Where a vocabulary's other stops show that a spelling means something else there."""
    end = {"<|return|>", "<|call|>"} <= names or {"<|calls|>", "<|flush|>"} <= names
    if "<|end|>" in names and end:
        stops.discard(index["<|end|>"])
        types[index["<|end|>"]] = USER_DEFINED
    if "</s>" in names and names & {"<|tool_response>", "<|plamo:eos|>"}:
        stops.discard(index["</s>"])
        types[index["</s>"]] = NORMAL
