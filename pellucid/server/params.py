"""From an OpenAI request to what the engine takes: prompt token ids and one SamplingParams per choice.

Everything a user can get wrong is caught here, before the engine sees it, and raised as an
`APIError` 400 whose message says what to change (the context limit included).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from pellucid.engine import Intervention, SamplingParams, TraceOptions
from pellucid.errors import PromptError
from pellucid.llm import LLM
from pellucid.probing import interventions_from_json
from pellucid.server.errors import bad_request
from pellucid.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SamplingRequest,
    TraceRequest,
)
from pellucid.structured import prepare_chat, reply_defaults


@dataclass(slots=True)
class Prompt:
    ids: list[int]
    text: str  # what `echo` puts before the completion
    parse_calls: bool = False  # tools are on: <tool_call> blocks in the reply become tool_calls
    # SamplingParams fields for tool calls / response_format: grammar, close margin, call tags
    sampling: dict[str, Any] = field(default_factory=dict)
    defaults: dict[str, Any] = field(default_factory=dict)  # for what the request leaves out


def chat_prompt(llm: LLM, request: ChatCompletionRequest) -> Prompt:
    messages = [_message_dict(m, i) for i, m in enumerate(request.messages)]
    tools = [t.model_dump(exclude_none=True) for t in request.tools or []]
    choice = request.tool_choice or ("auto" if tools else "none")
    if not isinstance(choice, str):
        choice = choice.model_dump()
    try:
        chat = prepare_chat(
            llm.tokenizer,
            messages,
            tools=tools,
            tool_choice=choice,
            parallel_tool_calls=request.parallel_tool_calls,
            response_format=_response_format(request),
        )
    except PromptError as e:  # e.g. a base model without a chat template
        raise bad_request(str(e), "messages") from e
    except ValueError as e:  # a tool_choice naming no tool, a bad schema, a call's arguments
        raise bad_request(str(e), _param_of(str(e), bool(tools))) from e
    except TypeError as e:  # the template choked on these messages
        raise bad_request(
            f"the model's chat template could not render the messages: {e}", "messages"
        ) from e
    ids = llm.encode_chat(chat.prompt)
    check_prompt(llm, ids, "messages")
    if chat.grammar is not None:
        try:  # compile once here, so a schema llguidance refuses is a 400, not a failed stream
            llm.engine.grammars.matcher(chat.grammar)
        except ValueError as e:
            raise bad_request(
                f"the tools' or response_format's JSON schema: {e}",
                "tools" if tools else "response_format",
            ) from e
    return Prompt(ids, "", chat.parse_calls, chat.sampling_fields(), chat.sampling_defaults)


def _param_of(message: str, has_tools: bool) -> str:
    """Which request field a prepare_chat error is about, for the error's `param`."""
    for param in ("tool_choice", "messages", "response_format"):
        if param in message:
            return param
    return "tools" if has_tools else "response_format"


def _response_format(request: ChatCompletionRequest) -> dict | None:
    rf = request.response_format
    if rf is None:
        return None
    if rf.type == "json_schema" and rf.json_schema is None:
        raise bad_request(
            "response_format json_schema needs a 'json_schema' object with 'name' and 'schema'",
            "response_format",
        )
    return rf.model_dump(by_alias=True, exclude_none=True)


def completion_prompts(llm: LLM, request: CompletionRequest) -> list[Prompt]:
    if request.suffix:
        raise bad_request("suffix (fill-in-the-middle) is not supported", "suffix")
    raw = request.prompt
    one = isinstance(raw, str) or (raw and isinstance(raw[0], int))  # text, or one list of ids
    items: list[str | list[int]] = [raw] if one else list(raw)
    if not items:
        raise bad_request(
            "prompt is empty: give a string, a list of strings or token ids", "prompt"
        )
    prompts = []
    for item in items:
        if isinstance(item, str):
            _check_text(item, "prompt")
        try:
            ids = llm.encode(item)
        except PromptError as e:
            raise bad_request(str(e), "prompt") from e
        check_prompt(llm, ids, "prompt")
        text = item if isinstance(item, str) else llm.tokenizer.decode(ids)
        prompts.append(Prompt(ids, text))
    return prompts


def check_prompt(llm: LLM, ids: list[int], param: str) -> None:
    limit = llm.engine.max_model_len
    if len(ids) >= limit:
        raise bad_request(
            f"This model's maximum context length is {limit} tokens, and the prompt has "
            f"{len(ids)} (at least one token must be left to generate): shorten the {param}.",
            param,
            "context_length_exceeded",
        )
    try:
        llm.engine.check_prompt(ids)
    except PromptError as e:
        raise bad_request(str(e), param) from e


async def interventions(llm: LLM, request: SamplingRequest, prompt: Prompt) -> list[Intervention]:
    """The request's `interventions`, read and checked; those worked out from activations (a
    mean ablation, steering from two prompts, a patch from another prompt) run their passes on
    the engine from a worker thread, between the server's steps, without holding up the loop."""
    if not request.interventions:
        return []
    try:
        return await asyncio.to_thread(
            interventions_from_json, llm, request.interventions, prompt.ids
        )
    except (ValueError, PromptError) as e:
        raise bad_request(str(e), "interventions") from e


def sampling_params(
    llm: LLM,
    request: SamplingRequest,
    prompt: Prompt,
    max_tokens: int | None,
    logprobs: int | None,
    edits: list[Intervention] | None = None,
) -> list[SamplingParams]:
    """One SamplingParams per choice; with a seed, choice i uses seed + i (distinct, reproducible)."""
    if request.logit_bias:
        raise bad_request("logit_bias is not supported", "logit_bias")
    limit, used = llm.engine.max_model_len, len(prompt.ids)
    if max_tokens is not None and used + max_tokens > limit:
        raise bad_request(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{used + max_tokens} tokens ({used} in the prompt, {max_tokens} for the completion). "
            "Reduce the prompt or max_tokens.",
            "max_tokens",
            "context_length_exceeded",
        )
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    # What the request names wins over the defaults of this reply (calls), then of the model
    named = {
        name: getattr(request, name)
        for name in (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
        )
        if getattr(request, name) is not None
    }
    given = reply_defaults(llm.sampling_defaults, prompt.defaults) | named
    if "presence_penalty" in named or "frequency_penalty" in named:
        given.pop("penalties_per_block", None)  # the request's own penalty: OpenAI's meaning
    if "temperature" in named:
        given.pop("redraw_temperature", None)  # a new draw samples as the request asked
    params = []
    for i in range(request.n):
        seed = None if request.seed is None else request.seed + i
        try:
            params.append(
                SamplingParams(
                    max_tokens=max_tokens or limit - used,
                    stop=stop,
                    seed=seed,
                    logprobs=logprobs,
                    ignore_eos=request.ignore_eos,
                    trace=_trace_options(llm, request.trace),
                    speculative=request.speculative,
                    interventions=edits or [],
                    **prompt.sampling,
                    **given,
                )
            )
        except ValueError as e:
            raise bad_request(str(e)) from e
    return params


def _trace_options(llm: LLM, trace: bool | TraceRequest) -> bool | TraceOptions:
    if not isinstance(trace, TraceRequest):
        return trace
    try:
        options = TraceOptions(**trace.model_dump())
        options.check(llm.model.cfg.n_layers, llm.model.cfg.n_heads)
    except ValueError as e:
        raise bad_request(str(e), "trace") from e
    return options


def chat_max_tokens(request: ChatCompletionRequest) -> int | None:
    return request.max_completion_tokens or request.max_tokens


def chat_logprobs(request: ChatCompletionRequest) -> int | None:
    if request.top_logprobs is not None and not request.logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
    return (request.top_logprobs or 0) if request.logprobs else None


def check_best_of(request: CompletionRequest) -> None:
    if request.best_of is not None and request.best_of != request.n:
        raise bad_request("best_of is not supported (only best_of equal to n)", "best_of")


def _message_dict(message: ChatMessage, index: int) -> dict:
    content = message.content
    if isinstance(content, list):
        content = "".join(part.text for part in content)
    content = content or ""
    _check_text(content, f"messages.{index}.content")
    # Chat templates know system/user/assistant; "developer" is OpenAI's newer name for system.
    role = "system" if message.role == "developer" else message.role
    out = {"role": role, "content": content}
    if message.name:
        _check_text(message.name, f"messages.{index}.name")
        out["name"] = message.name
    if message.tool_calls:
        out["tool_calls"] = [c.model_dump() for c in message.tool_calls]
    if message.tool_call_id:
        out["tool_call_id"] = message.tool_call_id
    return out


def _check_text(text: str, param: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate (JSON "\ud800") has no UTF-8 form
        raise bad_request(f"{param} is not valid Unicode text: {e.reason}", param) from e
