"""From engine outputs to OpenAI's response pieces: logprobs in the chat and legacy formats,
usage, timings, and server-sent events.
"""

from __future__ import annotations

import json

from pydantic import BaseModel

from pellucid.engine import Recorder, RequestOutput, TokenLogprob
from pellucid.server.protocol import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    TopLogprob,
    Usage,
)
from pellucid.tokenizer import Tokenizer


def chat_logprobs(tok: Tokenizer, logprobs: list[TokenLogprob]) -> ChatLogprobs:
    return ChatLogprobs(
        content=[
            ChatTokenLogprob(
                **_top(tok, lp.token_id, lp.logprob).model_dump(),
                top_logprobs=[_top(tok, i, p) for i, p in lp.top],
            )
            for lp in logprobs
        ]
    )


def _top(tok: Tokenizer, token_id: int, logprob: float) -> TopLogprob:
    return TopLogprob(
        token=tok.id_to_piece(token_id),
        logprob=_finite(logprob),
        bytes=list(tok.id_to_bytes(token_id)),
    )


def completion_logprobs(
    tok: Tokenizer,
    logprobs: list[TokenLogprob],
    offset: int,
    echo_ids: list[int] | None = None,
    echo_logprobs: list[TokenLogprob] | None = None,
) -> CompletionLogprobs:
    """Legacy format; `offset` is where the first token starts in the choice's text. Echoed prompt
    tokens come first: scored where `echo_logprobs` holds their logprobs (one per token after the
    first, whose logprob is null: nothing comes before it), else all null."""
    out = CompletionLogprobs()
    scored = [None, *echo_logprobs] if echo_logprobs is not None else [None] * len(echo_ids or [])
    for token_id, lp in zip(echo_ids or [], scored, strict=True):
        logprob = None if lp is None else _finite(lp.logprob)
        top = None if lp is None else {tok.id_to_piece(i): _finite(p) for i, p in lp.top}
        offset = _append(out, tok.id_to_piece(token_id), offset, logprob, top)
    for lp in logprobs:
        top = {tok.id_to_piece(i): _finite(p) for i, p in lp.top}
        offset = _append(out, tok.id_to_piece(lp.token_id), offset, _finite(lp.logprob), top)
    return out


def _append(
    out: CompletionLogprobs,
    piece: str,
    offset: int,
    logprob: float | None,
    top: dict[str, float] | None,
) -> int:
    out.tokens.append(piece)
    out.token_logprobs.append(logprob)
    out.top_logprobs.append(top)
    out.text_offset.append(offset)
    return offset + len(piece)


def _finite(logprob: float) -> float:
    # A token the model gives probability 0 has logprob -inf, which JSON cannot carry.
    return max(logprob, -9999.0)


def usage(prompt_tokens: int, completion_tokens: int) -> Usage:
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )


def timings(outputs: list[RequestOutput]) -> dict[str, object]:
    """The pellucid extension field: how long each choice's pre-fill and decoding took."""
    return {
        "timings": [
            {
                "prompt_tokens": o.timings.prompt_tokens,
                "prefill_s": round(o.timings.prefill_s, 6),
                "decode_tokens": o.timings.decode_tokens,
                "decode_s": round(o.timings.decode_s, 6),
                "redraws": o.timings.redraws,
                "draft_tokens": o.timings.draft_tokens,
                "accepted_tokens": o.timings.accepted_tokens,
            }
            for o in outputs
        ]
    }


def traces(traces: dict[int, Recorder]) -> dict[str, object]:
    """The pellucid extension's traces: choice index -> its records (only choices that asked)."""
    return (
        {"traces": {str(i): r.trace.to_dict() for i, r in sorted(traces.items())}} if traces else {}
    )


def closing_events(
    obj: str,
    rid: str,
    created: int,
    model: str,
    usage_: Usage | None,
    traces_: dict[int, Recorder],
) -> list[str]:
    """The stream's last events before [DONE]: usage (if asked) and traces (if any), each a
    chunk with no choices, which OpenAI clients skip."""
    base = {"id": rid, "object": obj, "created": created, "model": model, "choices": []}
    events = [] if usage_ is None else [sse({**base, "usage": usage_.model_dump()})]
    if traces_:
        events.append(sse({**base, "pellucid": traces(traces_)}))
    return events


def finish_reason(out: RequestOutput) -> str | None:
    return out.finish_reason if out.finished else None


def sse(payload: BaseModel | dict) -> str:
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n"


SSE_DONE = "data: [DONE]\n\n"
