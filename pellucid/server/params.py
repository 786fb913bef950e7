"""From an OpenAI request to what the engine takes: prompt token ids and one SamplingParams per choice.

Everything a user can get wrong is caught here, before the engine sees it, and raised as an
`APIError` 400 whose message says what to change (the context limit included).
"""

from __future__ import annotations

from dataclasses import dataclass

from pellucid.engine.sampling_params import SamplingParams, TraceOptions
from pellucid.engine.trace_recorder import check_trace_options
from pellucid.errors import PromptError
from pellucid.llm import LLM
from pellucid.server.errors import bad_request
from pellucid.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SamplingRequest,
    TraceRequest,
)


@dataclass(slots=True)
class Prompt:
    ids: list[int]
    text: str  # what `echo` puts before the completion


def chat_prompt(llm: LLM, request: ChatCompletionRequest) -> Prompt:
    if request.tools:
        raise bad_request("tools are not supported by this server yet", "tools")
    if request.response_format is not None and request.response_format.type != "text":
        raise bad_request(
            f"response_format {request.response_format.type!r} is not supported; only 'text'",
            "response_format",
        )
    messages = [_message_dict(m, i) for i, m in enumerate(request.messages)]
    try:
        ids = llm.chat_prompt(messages)
    except PromptError as e:  # e.g. a base model without a chat template
        raise bad_request(str(e), "messages") from e
    except (TypeError, ValueError) as e:  # the template choked on these messages
        raise bad_request(
            f"the model's chat template could not render the messages: {e}", "messages"
        ) from e
    check_prompt(llm, ids, "messages")
    return Prompt(ids, "")


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


def sampling_params(
    llm: LLM,
    request: SamplingRequest,
    prompt: Prompt,
    max_tokens: int | None,
    logprobs: int | None,
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
    given = {
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
        check_trace_options(options, llm.model.cfg.n_layers, llm.model.cfg.n_heads)
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


def _message_dict(message: ChatMessage, index: int) -> dict[str, str]:
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
    return out


def _check_text(text: str, param: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate (JSON "\ud800") has no UTF-8 form
        raise bad_request(f"{param} is not valid Unicode text: {e.reason}", param) from e
