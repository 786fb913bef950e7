"""The two generating endpoints: chat completions and (legacy) text completions, streamed as
server-sent events in OpenAI's chunk format or answered as one JSON object.

A client that goes away aborts its sequences: streams through `HandleStream`, which aborts when
the response ends however it ends, and whole answers through a watcher of `http.disconnect`.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from pellucid.engine import RequestOutput, TokenLogprob
from pellucid.server import params as P
from pellucid.server import responses as R
from pellucid.server.async_engine import RequestHandle
from pellucid.server.errors import APIError, error_body
from pellucid.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessageOut,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    Delta,
    DeltaToolCall,
    FunctionCall,
    ToolCallItem,
)
from pellucid.server.state import ServerState
from pellucid.structured import ToolCallStream, parse_tool_calls
from pellucid.tokenizer import Tokenizer


class HandleStream(StreamingResponse):
    """An SSE response that aborts its request's unfinished sequences when it ends: finished,
    failed, or cancelled by Starlette because the client disconnected."""

    def __init__(self, events: AsyncIterator[str], handle: RequestHandle):
        super().__init__(
            events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
        self.handle = handle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.handle.abort()


# --- chat ----------------------------------------------------------------------------------
async def chat(state: ServerState, body: ChatCompletionRequest, request: Request) -> Response:
    prompt = P.chat_prompt(state.llm, body)
    edits = await P.interventions(state.llm, body, prompt)
    sampling = P.sampling_params(
        state.llm, body, prompt, P.chat_max_tokens(body), P.chat_logprobs(body), edits
    )
    handle = state.submit([prompt], [sampling])
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    if body.stream:
        return HandleStream(_chat_events(state, body, handle, rid, created, prompt), handle)
    finals = await _gather(state, handle, request)
    if finals is None:
        return Response(status_code=499)  # the client closed the request: nobody reads this
    tok = state.llm.tokenizer
    choices = [_choice(i, out, prompt.parse_calls, tok) for i, out in sorted(finals.items())]
    used = sum(len(o.token_ids) for o in finals.values())
    return JSONResponse(
        ChatCompletionResponse(
            id=rid,
            created=created,
            model=state.model_name,
            choices=choices,
            usage=R.usage(len(prompt.ids), used),
            pellucid=R.timings(list(finals.values())) | R.traces(handle.traces),
        ).model_dump()
    )


def _choice(index: int, out: RequestOutput, parse_calls: bool, tok: Tokenizer) -> ChatChoice:
    """One finished choice; with tools on, its <tool_call> blocks become `tool_calls`, and a
    reply that called tools ends with "tool_calls" rather than "stop", as OpenAI's does."""
    message, reason = ChatMessageOut(content=out.text), out.finish_reason
    if parse_calls:
        reply = parse_tool_calls(out.text)
        calls = [
            ToolCallItem(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
            for c in reply.tool_calls
        ]
        message = ChatMessageOut(
            content=reply.content or (None if calls else ""), tool_calls=calls or None
        )
        if calls and reason == "stop":
            reason = "tool_calls"
    logprobs = R.chat_logprobs(tok, out.logprobs) if out.logprobs is not None else None
    return ChatChoice(index=index, message=message, finish_reason=reason, logprobs=logprobs)


async def _chat_events(
    state: ServerState,
    body: ChatCompletionRequest,
    handle: RequestHandle,
    rid: str,
    created: int,
    prompt: P.Prompt,
) -> AsyncIterator[str]:
    tok = state.llm.tokenizer
    # With tools on, text passes through a splitter: plain text streams on, each call goes out
    # whole as one `tool_calls` delta once its closing tag arrives.
    splitters = {i: ToolCallStream() for i in range(body.n)} if prompt.parse_calls else {}
    calls_sent = dict.fromkeys(range(body.n), 0)

    def chunk(index: int, delta: Delta, **fields: object) -> str:
        choice = ChatChunkChoice(index=index, delta=delta, **fields)
        return R.sse(
            ChatCompletionChunk(id=rid, created=created, model=state.model_name, choices=[choice])
        )

    for i in range(body.n):
        yield chunk(i, Delta(role="assistant", content=""))
    used = 0
    try:
        async for index, out in handle:
            logprobs = R.chat_logprobs(tok, out.logprobs) if out.logprobs else None
            text, calls = out.delta, []
            if index in splitters:
                text, calls = splitters[index].feed(out.delta)
                if out.finished:
                    text += splitters[index].flush()
            if text or logprobs:
                yield chunk(index, Delta(content=text), logprobs=logprobs)
            if calls:
                first = calls_sent[index]
                calls_sent[index] += len(calls)
                yield chunk(
                    index,
                    Delta(
                        tool_calls=[
                            DeltaToolCall(
                                index=first + k,
                                id=c.id,
                                function=FunctionCall(name=c.name, arguments=c.arguments),
                            )
                            for k, c in enumerate(calls)
                        ]
                    ),
                )
            if out.finished:
                used += len(out.token_ids)
                reason = out.finish_reason
                if calls_sent[index] and reason == "stop":
                    reason = "tool_calls"
                yield chunk(index, Delta(), finish_reason=reason)
    except Exception as e:  # noqa: BLE001 - headers are sent: report it in the stream
        yield _error_event(state, e)
    else:
        wants_usage = body.stream_options is not None and body.stream_options.include_usage
        usage = R.usage(len(prompt.ids), used) if wants_usage else None
        for event in R.closing_events(
            "chat.completion.chunk", rid, created, state.model_name, usage, handle.traces
        ):
            yield event
    yield R.SSE_DONE


# --- text completions ----------------------------------------------------------------------
async def text(state: ServerState, body: CompletionRequest, request: Request) -> Response:
    P.check_best_of(body)
    prompts = P.completion_prompts(state.llm, body)
    scored = None  # the prompts' own tokens' logprobs, for echo with logprobs
    if body.echo and body.logprobs is not None:
        ids = [p.ids for p in prompts]
        scored = await asyncio.to_thread(state.llm.prompt_logprobs, ids, body.logprobs)
    if body.max_tokens == 0:
        return _prompt_only(state, body, prompts, scored)
    sampling = [
        P.sampling_params(
            state.llm,
            body,
            p,
            body.max_tokens,
            body.logprobs,
            await P.interventions(state.llm, body, p),
        )
        for p in prompts
    ]
    handle = state.submit(prompts, sampling)
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    choice_prompts = [p for p in prompts for _ in range(body.n)]  # choice index -> its prompt
    choice_scores = [s for s in scored or [None] * len(prompts) for _ in range(body.n)]
    if body.stream:
        events = _text_events(state, body, handle, rid, created, choice_prompts, choice_scores)
        return HandleStream(events, handle)
    finals = await _gather(state, handle, request)
    if finals is None:
        return Response(status_code=499)
    choices = []
    for i, out in sorted(finals.items()):
        prompt = choice_prompts[i]
        head = prompt.text if body.echo else ""
        logprobs = None
        if out.logprobs is not None:
            echo_ids = prompt.ids if body.echo else None
            logprobs = R.completion_logprobs(
                state.llm.tokenizer, out.logprobs, 0, echo_ids, choice_scores[i]
            )
        choices.append(
            CompletionChoice(
                index=i, text=head + out.text, logprobs=logprobs, finish_reason=out.finish_reason
            )
        )
    used = sum(len(o.token_ids) for o in finals.values())
    return JSONResponse(
        CompletionResponse(
            id=rid,
            created=created,
            model=state.model_name,
            choices=choices,
            usage=R.usage(sum(len(p.ids) for p in prompts), used),
            pellucid=R.timings(list(finals.values())) | R.traces(handle.traces),
        ).model_dump()
    )


def _prompt_only(
    state: ServerState,
    body: CompletionRequest,
    prompts: list[P.Prompt],
    scored: list[list[TokenLogprob]] | None,
) -> Response:
    """max_tokens 0: nothing is generated; each choice is its prompt (with echo), scored (with
    logprobs), finish_reason "length". Streamed, each choice is one chunk."""
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    choices = []
    for i, prompt in enumerate(prompts):
        logprobs = None
        if body.logprobs is not None:
            echo_ids = prompt.ids if body.echo else None
            score = scored[i] if scored is not None else None
            logprobs = R.completion_logprobs(state.llm.tokenizer, [], 0, echo_ids, score)
        text = prompt.text if body.echo else ""
        for k in range(body.n):
            choices.append(
                CompletionChoice(
                    index=i * body.n + k, text=text, logprobs=logprobs, finish_reason="length"
                )
            )
    usage = R.usage(sum(len(p.ids) for p in prompts), 0)

    def response(chosen: list[CompletionChoice], with_usage: bool) -> CompletionResponse:
        return CompletionResponse(
            id=rid,
            created=created,
            model=state.model_name,
            choices=chosen,
            usage=usage if with_usage else None,
        )

    if not body.stream:
        return JSONResponse(response(choices, True).model_dump())
    events = [R.sse(response([c], False)) for c in choices]
    if body.stream_options is not None and body.stream_options.include_usage:
        events += R.closing_events("text_completion", rid, created, state.model_name, usage, {})
    return StreamingResponse(iter([*events, R.SSE_DONE]), media_type="text/event-stream")


async def _text_events(
    state: ServerState,
    body: CompletionRequest,
    handle: RequestHandle,
    rid: str,
    created: int,
    choice_prompts: list[P.Prompt],
    choice_scores: list[list[TokenLogprob] | None],
) -> AsyncIterator[str]:
    tok = state.llm.tokenizer
    offsets = [0] * len(choice_prompts)  # characters sent so far per choice, for text_offset

    def chunk(index: int, text: str, logprobs: object = None, reason: str | None = None) -> str:
        choice = CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=reason)
        return R.sse(
            CompletionResponse(id=rid, created=created, model=state.model_name, choices=[choice])
        )

    if body.echo:
        for i, prompt in enumerate(choice_prompts):
            lp = None
            if body.logprobs is not None:
                lp = R.completion_logprobs(tok, [], 0, prompt.ids, choice_scores[i])
            offsets[i] = len(prompt.text)
            yield chunk(i, prompt.text, lp)
    used = 0
    try:
        async for index, out in handle:
            lp = None
            if out.logprobs:
                lp = R.completion_logprobs(tok, out.logprobs, offsets[index])
            offsets[index] += len(out.delta)
            if out.finished:
                used += len(out.token_ids)
            if out.delta or lp or out.finished:
                yield chunk(index, out.delta, lp, R.finish_reason(out))
    except Exception as e:  # noqa: BLE001 - headers are sent: report it in the stream
        yield _error_event(state, e)
    else:
        usage = None
        if body.stream_options is not None and body.stream_options.include_usage:
            prompt_tokens = sum(len(p.ids) for p in choice_prompts[:: body.n])
            usage = R.usage(prompt_tokens, used)
        for event in R.closing_events(
            "text_completion", rid, created, state.model_name, usage, handle.traces
        ):
            yield event
    yield R.SSE_DONE


def _error_event(state: ServerState, e: Exception) -> str:
    """The event that ends a stream whose headers are sent: a cut-off, a timeout, a failure."""
    refusal = state.error_for(e)
    if refusal is None:
        return R.sse(error_body(f"generation failed: {e}", "server_error"))
    return R.sse(error_body(refusal.message, "server_error", code=refusal.code))


# --- whole answers -------------------------------------------------------------------------
async def _gather(
    state: ServerState, handle: RequestHandle, request: Request
) -> dict[int, RequestOutput] | None:
    """Each choice's final output with all its logprobs; None if the client went away first."""
    collect = asyncio.create_task(_collect(handle))
    gone = asyncio.create_task(_disconnected(request))
    try:
        done, _ = await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        collect.cancel()
        handle.abort()
    if collect not in done:
        return None
    try:
        return collect.result()
    except ValueError as e:  # the engine refused what the checks let through (PromptError too)
        raise APIError(400, str(e)) from e
    except Exception as e:  # a timeout in the queue, a shutdown, a stopped engine: 503
        refusal = state.error_for(e)
        if refusal is None:
            raise
        raise refusal from e


async def _collect(handle: RequestHandle) -> dict[int, RequestOutput]:
    finals: dict[int, RequestOutput] = {}
    logprobs: dict[int, list] = {}
    async with handle:
        async for index, out in handle:
            if out.logprobs is not None:
                logprobs.setdefault(index, []).extend(out.logprobs)
            if out.finished:
                finals[index] = out
    for index, out in finals.items():
        if out.logprobs is not None:
            out.logprobs = logprobs.get(index, [])
    return finals


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body is read: only that can come)."""
    while (await request.receive())["type"] != "http.disconnect":
        await asyncio.sleep(0.1)  # not expected; avoid spinning if a server sends more
