"""Trace records: plain dataclasses that say how one request was generated, stage by stage.

Filled by `trace_recorder.Recorder` from engine hooks and read by the renderers (terminal, HTML, PNG)
and the server. Everything is a number, a string or a list of them, so `trace.to_dict()` is JSON.
Order follows the walk-through: tokens -> pre-fill -> attention -> KV cache -> decode steps.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(slots=True)
class TokenInfo:
    id: int
    piece: str  # readable text of the token: ' capital', '\\n', '<|im_start|>'
    special: bool  # a control token (BOS, end of turn), not text


@dataclass(slots=True)
class Tokenization:
    text: str  # the prompt as the tokens spell it
    tokens: list[TokenInfo]


@dataclass(slots=True)
class PrefillChunk:
    """One forward pass that pushed part (usually all) of the prompt through the model at once."""

    start: int  # position of its first token
    tokens: int
    seconds: float
    batch_tokens: int  # every token in that forward, this request's and others'


@dataclass(slots=True)
class Prefill:
    prompt_tokens: int
    cached_tokens: int  # found in the prefix cache: their K/V were not recomputed
    chunks: list[PrefillChunk] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return sum(c.seconds for c in self.chunks)

    @property
    def tokens_per_s(self) -> float:
        computed = sum(c.tokens for c in self.chunks)
        return computed / self.seconds if self.seconds else 0.0


@dataclass(slots=True)
class Candidate:
    id: int
    piece: str
    prob: float


@dataclass(slots=True)
class Stage:
    """The next-token distribution after one sampling stage (raw, penalties, temperature, ...)."""

    name: str
    kept: int  # tokens still possible (probability > 0)
    top: list[Candidate]


@dataclass(slots=True)
class LensLayer:
    """What the model would predict if it stopped after this layer (logit lens)."""

    layer: int
    top: list[Candidate]


@dataclass(slots=True)
class Step:
    """One generated token. Step 0 comes out of pre-fill; every later one is a decode step."""

    index: int
    token: Candidate  # prob: in the distribution it was drawn from (after every stage)
    logprob: float  # in the raw model distribution, as OpenAI's logprobs report it
    stages: list[Stage]
    lens: list[LensLayer]
    seconds: float  # the forward pass and sampling of this step, trace overhead excluded
    batch_size: int  # sequences that shared the step
    context_tokens: int  # tokens in the KV cache once this step's input is written
    kv_blocks: int  # blocks this request holds after the step
    bytes_moved: int  # weights read once + every sequence's K/V read and written
    trace_seconds: float = 0.0  # time spent recording this step (not in `seconds`)
    # Speculative decoding (engine/drafter.py): the guesses its forward pass checked, the first
    # at this token's own position, and how many the model agreed with ...
    draft: list[Candidate] = field(default_factory=list)
    draft_taken: int = 0
    # ... and, on each token those agreements gained, the step whose pass produced it: such a
    # token had no forward pass of its own (seconds 0)
    drafted_in: int | None = None

    @property
    def gb_per_s(self) -> float:
        return self.bytes_moved / self.seconds / 1e9 if self.seconds else 0.0


@dataclass(slots=True)
class KVCacheInfo:
    bytes_per_token: int  # 2 (K and V) x layers x kv heads x head dim x bytes per number
    block_size: int  # tokens per block
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int


@dataclass(slots=True)
class AttentionMap:
    """Attention weights softmax(QKᵀ·scale) of one layer, for the chosen heads.

    prompt[h][i][j]: how much prompt token i looks at token j during pre-fill (causal: j <= i).
    steps[s][h][j]: the query row of decode step s + 1 (the token generated at step s), over
    every token in the cache then.
    """

    layer: int
    heads: list[int]
    prompt: list[list[list[float]]]  # (heads, T, T)
    steps: list[list[list[float]]] = field(default_factory=list)  # (steps, heads, context)


@dataclass(slots=True)
class ModelInfo:
    name: str
    arch: str
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    dim: int
    vocab_size: int
    weight_bytes: int
    scale: float  # the softmax scale of attention, 1/sqrt(head_dim) unless the model says so
    flops_per_token: int = 0  # the matrix products of one token's pass (2 per weight)

    def shape(self) -> dict[str, int]:
        """The numbers the explorer page draws from (/v1/explorer, `explain --html`)."""
        names = ("layers", "heads", "kv_heads", "head_dim", "dim", "vocab_size", "flops_per_token")
        return {name: getattr(self, name) for name in names}


@dataclass(slots=True)
class Trace:
    model: ModelInfo
    sampling: dict  # the request's SamplingParams, as given
    tokenization: Tokenization
    prefill: Prefill
    kv: KVCacheInfo
    steps: list[Step] = field(default_factory=list)
    attention: list[AttentionMap] = field(default_factory=list)
    output_text: str = ""
    finish_reason: str | None = None
    bandwidth_limit_gbs: float | None = None  # the machine's measured copy bandwidth, if known
    flops_limit: float | None = None  # ... and its measured matrix-product FLOP/s
    # the pass, once the request was done, that found the attention and logit lens of the
    # positions its pre-fill had not kept (those it decoded; the requests beside it waited)
    analysis_seconds: float = 0.0

    @property
    def decode_steps(self) -> list[Step]:
        return self.steps[1:]

    @property
    def forward_steps(self) -> list[Step]:
        """The decode steps that ran a forward pass (not tokens gained from a draft)."""
        return [s for s in self.decode_steps if s.drafted_in is None]

    def attention_for(self, layer: int) -> AttentionMap | None:
        return next((a for a in self.attention if a.layer == layer), None)

    def to_dict(self) -> dict:
        return asdict(self)
