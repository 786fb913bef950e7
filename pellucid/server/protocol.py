"""Request and response bodies of the OpenAI API, as pydantic models (they make /openapi.json).

Field names, defaults and limits follow OpenAI's API reference; top_k, min_p, repetition_penalty
and ignore_eos are vLLM's extensions (the `openai` client sends them through `extra_body`).
Fields OpenAI clients send that pellucid does not use (user, metadata, store, ...) are ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, model_serializer

# Torch seeds a generator with any value in [-2**63, 2**64); n > 1 adds the choice index.
Seed = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
StopList = Annotated[list[str], Field(max_length=4)]


class StreamOptions(BaseModel):
    include_usage: bool = False  # one last chunk with `usage` and no choices


class TraceRequest(BaseModel):
    """pellucid's extension: what a trace holds beyond tokens, stage top-k, timings and KV use."""

    top_k: int = Field(5, ge=1, le=50)
    attention_layers: list[int] = []
    attention_heads: list[int] | None = None
    logit_lens: bool = False
    lens_top_k: int = Field(3, ge=1, le=20)


class SamplingRequest(BaseModel):
    """What chat and text completions share: the model and how to pick tokens."""

    model: str | None = None  # None = the loaded model
    max_tokens: int | None = Field(None, ge=1)  # None = up to the end of the context
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    n: int = Field(1, ge=1, le=128)
    seed: Seed | None = None
    stop: str | StopList | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    logit_bias: dict[str, float] | None = None  # not supported: refused when not empty
    # pellucid's extension: record how each choice was generated; the response carries it in
    # `pellucid.traces` (non-streaming), which OpenAI clients ignore.
    trace: bool | TraceRequest = False
    # pellucid's extension: speculative decoding from the reply's own n-grams; None: where the
    # engine finds it pays, True: wherever a draft is found, False: never (same tokens either way)
    speculative: bool | None = None
    # pellucid's extension: changes to this request's forward passes (head ablation, steering,
    # patching; pellucid/probing.py reads them), made inside the batched engine
    interventions: list[dict[str, Any]] | None = None


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object, as text


class ToolCallItem(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallItem] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool result: which call it answers


class FunctionSpec(BaseModel):
    # OpenAI's names ([A-Za-z0-9_-]{1,64}) and dots, common in real tool sets (BFCL's
    # "math.factorial", MCP servers'); a call comes back with the name as given.
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of type object
    strict: bool | None = None  # calls always match the schema here, strict or not


class ToolSpec(BaseModel):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class JSONSchemaFormat(BaseModel):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    # None (left out): as the model's chat template allows (structured.parallel_calls_by_default)
    parallel_tool_calls: bool | None = None


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    # 0: no completion, only the prompt (with echo and logprobs: its tokens scored, as
    # lm-evaluation-harness asks)
    max_tokens: int | None = Field(None, ge=0)
    echo: bool = False  # put the prompt before the completion
    logprobs: int | None = Field(None, ge=0, le=5)
    suffix: str | None = None  # not supported: refused when not empty
    best_of: int | None = Field(None, ge=1)  # only best_of == n (i.e. no extra candidates)


# --- responses ---------------------------------------------------------------------------
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # None when the reply is only tool calls, as OpenAI sends it
    tool_calls: list[ToolCallItem] | None = None

    @model_serializer(mode="wrap")
    def _drop_no_calls(self, handler: Any) -> dict[str, Any]:
        out = handler(self)
        if out.get("tool_calls") is None:
            out.pop("tool_calls", None)
        return out


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    pellucid: dict[str, Any] | None = None  # extension: per-choice timings; clients ignore it


class DeltaToolCall(BaseModel):
    """A whole call in one delta: its index among the reply's calls, id, name and arguments."""

    index: int
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        # OpenAI sends {"role": ...} once, then {"content": ...}, and {} with the finish reason.
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(BaseModel):
    """The legacy completions format: parallel lists, one entry per token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)  # None for echoed prompt
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)  # where each token starts in the text


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None  # in streams: only in the last chunk, with stream_options
    pellucid: dict[str, Any] | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pellucid"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


# --- pellucid's tokenizer routes (vLLM's shapes, plus the pieces) ------------------------------
class TokenizeRequest(BaseModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    pieces: list[str]  # each token's text, as `pellucid tokenize` shows it


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


# --- the explorer's routes (pellucid's extension) --------------------------------------------
class InspectRequest(BaseModel):
    """One position of a text (prompt + reply token ids): its attention rows and logit lens."""

    model: str | None = None
    tokens: list[int] = Field(min_length=1)
    position: int = Field(ge=0)
    interventions: list[dict[str, Any]] | None = None  # those the text was generated under
    top_k: int = Field(5, ge=1, le=20)


class PatchingRequest(BaseModel):
    """Activation patching: the corrupted prompt run with one clean activation at a time."""

    model: str | None = None
    clean: str = Field(min_length=1)
    corrupted: str = Field(min_length=1)
    site: Literal["resid_post", "z"] = "resid_post"
