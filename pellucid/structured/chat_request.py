"""prepare_chat: messages + tools + tool_choice + response_format -> the prompt and its grammar."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pellucid.structured.grammars import (
    response_format_grammar,
    tool_call_grammar,
    tool_choice_name,
)
from pellucid.structured.tool_calls import CALL_CLOSE, CALL_OPEN
from pellucid.structured.tool_prompt import messages_with_tools
from pellucid.tokenizer import Tokenizer
from pellucid.tokenizer.chat_template import renders_parallel_calls

# Tokens at the end of max_tokens kept for closing a constrained reply's JSON: enough for the
# quotes and brackets of a few nesting levels and the closing tag.
CLOSE_MARGIN = 32
# Sampling for a reply that must be calls, where the request names none. Greedy, as BFCL runs
# every model (temperature 0.001): a call is an answer, not prose to vary, and SmolLM2 at its
# card's 0.2 scored 36.0% on BFCL simple against 37.0% greedy. A frequency penalty, counted
# within each call: without it a small model loops inside argument values ("Santa Barbara",
# "Santa Barbara", ...; "Minnesota_2020_2021_2022...") until its tokens run out, 9 of the first
# 100 simple questions at temperature 0.2. The grammar forces the JSON around the values, so the
# penalty weighs on the values, but not on a value's first token (where it would pick a one-token
# empty string over the opening quote every value shares; sampler._penalize).
CALL_SAMPLING = {"temperature": 0.0, "frequency_penalty": 0.5, "penalties_per_block": True}


@dataclass(slots=True)
class PreparedChat:
    prompt: str  # the rendered chat, ready to tokenize with parse_special=True
    grammar: str | None  # for SamplingParams.grammar; None: unconstrained
    parse_calls: bool  # the reply may hold <tool_call> blocks to parse out
    # for SamplingParams.grammar_close_margin: 0 when the grammar allows free text ("auto"),
    # which closing tokens would cut short
    close_margin: int = 0
    # SamplingParams fields suggested for this reply, for a caller to use where its request
    # names none (CALL_SAMPLING when the reply must be calls)
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    must_call: bool = False  # tool_choice "required" or a named function

    def sampling_fields(self) -> dict[str, Any]:
        """What this chat sets in SamplingParams (`dataclasses.replace(params, **fields)`): its
        grammar, close margin, and with tools the call tags, so that a call repeated word for
        word, or forced shut by the margin, ends the reply instead of reaching the client; a
        reply that must call, whose only call was forced shut, is drawn again."""
        fields: dict[str, Any] = (
            {"distinct_blocks": (CALL_OPEN, CALL_CLOSE)} if self.parse_calls else {}
        )
        if self.must_call:
            fields["require_block"] = True
        if self.grammar is not None:
            fields |= {"grammar": self.grammar, "grammar_close_margin": self.close_margin}
        return fields


def reply_defaults(model: dict[str, Any], reply: dict[str, Any]) -> dict[str, Any]:
    """SamplingParams fields where the request names none: the model's recommended sampling,
    then the reply's own (PreparedChat.sampling_defaults). A greedy call that has to be drawn
    again (SamplingParams.require_block) is sampled at the model's temperature."""
    out = model | reply
    if reply.get("temperature") == 0:
        out["redraw_temperature"] = model.get("temperature", 1.0)
    return out


def prepare_chat(
    tokenizer: Tokenizer,
    messages: list[dict],
    *,
    tools: list[dict] | None = None,
    tool_choice: str | dict = "auto",
    parallel_tool_calls: bool | None = None,
    response_format: dict[str, Any] | None = None,
    constrained: bool = True,
) -> PreparedChat:
    """Render the prompt; `constrained=False` leaves the grammar off (to measure what it buys).
    `parallel_tool_calls` None: as `parallel_calls_by_default` says for this model.

    With tools in play (tool_choice not "none"), the tool grammar decides the reply's shape and
    response_format applies only to replies without tools.
    """
    tools = tools or []
    choice = tool_choice_name(tools, tool_choice)
    active = tools if choice != "none" else []
    if active and _template_has_tools(tokenizer):
        prompt = tokenizer.apply_chat_template(messages, tools=active)
    else:
        prompt = tokenizer.apply_chat_template(messages_with_tools(messages, active))
    if active:
        if parallel_tool_calls is None:
            parallel_tool_calls = parallel_calls_by_default(tokenizer)
        grammar = tool_call_grammar(active, tool_choice, parallel_tool_calls)
    else:
        grammar = response_format_grammar(response_format)
    if not constrained or grammar is None:
        return PreparedChat(prompt, None, bool(active))
    if choice == "auto":
        return PreparedChat(prompt, grammar, bool(active))
    return PreparedChat(
        prompt, grammar, bool(active), CLOSE_MARGIN, CALL_SAMPLING if active else {}, bool(active)
    )


def parallel_calls_by_default(tokenizer: Tokenizer) -> bool:
    """Whether a reply may hold several calls where the request does not say (a client's
    default): where the model's chat template writes out a turn of several calls, as llama.cpp's
    server decides it. A template that does not know tools (SmolLM2's, Gemma 3's) gets
    pellucid's own format, one call a reply: with more allowed, SmolLM2 added calls nobody asked
    for, the same function again with other values (benchmarks/results/comments.md). A request
    asks for several with `parallel_tool_calls`."""
    return _template_has_tools(tokenizer) and renders_parallel_calls(tokenizer.chat_template)


def _template_has_tools(tokenizer: Tokenizer) -> bool:
    return tokenizer.chat_template is not None and "tools" in tokenizer.chat_template
