"""SamplingParams: how one request picks its tokens, with vLLM/OpenAI names and defaults.

Validated on construction, so a bad request fails at `add_request` (an HTTP 400 in the server)
and never inside a decode step.
"""

import math
from dataclasses import dataclass, field

from pellucid.engine.probes import Intervention


@dataclass(slots=True)
class TraceOptions:
    """What a traced request records beyond tokens, timings, sampling stages and KV use.

    The request's steps run as an untraced one's would. Attention and the logit lens need the
    inside of the forward pass: its pre-fill keeps the queries at the chosen layers and each
    layer's hidden state as it runs, and the positions it decoded get one more pass once it is
    done (an LM-head pass per layer for the lens when read), so they are asked for separately.
    """

    top_k: int = 5  # alternatives kept after each sampling stage
    attention_layers: list[int] = field(default_factory=list)  # layers whose weights are kept
    attention_heads: list[int] | None = None  # None: every head of those layers
    logit_lens: bool = False  # top tokens read from every layer through the final norm + LM head
    lens_top_k: int = 3

    def __post_init__(self) -> None:
        require(
            is_int(self.top_k) and self.top_k >= 1,
            f"trace top_k must be an integer >= 1, got {self.top_k!r}",
        )
        require(
            is_int(self.lens_top_k) and self.lens_top_k >= 1,
            f"trace lens_top_k must be an integer >= 1, got {self.lens_top_k!r}",
        )
        for name in ("attention_layers", "attention_heads"):
            values = getattr(self, name)
            require(
                values is None or all(is_int(v) and v >= 0 for v in values),
                f"trace {name} must be a list of integers >= 0, got {values!r}",
            )

    def check(self, n_layers: int, n_heads: int) -> None:
        """Raise ValueError if a layer or head asked for does not exist in the model."""
        bad = [layer for layer in self.attention_layers if layer >= n_layers]
        require(
            not bad,
            f"trace attention_layers {bad} do not exist: the model has layers 0..{n_layers - 1}",
        )
        bad = [h for h in self.attention_heads or [] if h >= n_heads]
        require(
            not bad,
            f"trace attention_heads {bad} do not exist: the model has heads 0..{n_heads - 1}",
        )


# vLLM's rule: below this temperature a row is decoded greedily. Dividing logits by a smaller
# number risks float32 overflow, and the distribution is an argmax in all but name anyway.
GREEDY_TEMPERATURE = 1e-5


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0  # 0 = greedy (argmax)
    top_p: float = 1.0  # keep the smallest set of tokens whose probability sums to >= top_p
    top_k: int = 0  # keep the k most likely tokens; 0 or -1 = off
    min_p: float = 0.0  # keep tokens with p >= min_p * p_max
    repetition_penalty: float = 1.0  # HF/llama.cpp/vLLM: on prompt + output tokens, > 1 discourages
    presence_penalty: float = 0.0  # OpenAI: minus this once for every token generated so far
    frequency_penalty: float = 0.0  # OpenAI: minus this times how often a token was generated
    seed: int | None = None  # set: this request's tokens are reproducible, whatever its batch
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None = none; n = chosen token's logprob + n top alternatives
    trace: bool | TraceOptions = False  # True: record how this request was generated (explain)
    # Only text this grammar accepts can be generated: llguidance's Lark dialect, where
    # `%json {...}` inlines a JSON schema (structured/ builds them for tools and response_format).
    grammar: str | None = None
    # The last this-many tokens of max_tokens, and every token once the reply has lost its way
    # (SamplerState.close_now), may only close what the grammar has open (JSON strings, arrays,
    # objects) or stop, so a looping model's JSON still ends valid, and soon; 0 = off.
    grammar_close_margin: int = 0
    # (open, close) tags of blocks such as tool calls: each is held back until it closes, and one
    # that repeats an earlier block, or that the close margin forced shut, ends the reply before
    # it (finish_reason "stop" / "length"; see block_filter.py).
    distinct_blocks: tuple[str, str] | None = None
    # With distinct_blocks: presence and frequency penalties count only the tokens since the last
    # block closed. A penalty meant against loops inside one call would otherwise push the next
    # call off an exact repeat (which ends the reply) onto a near one ("city": "" after "Paris").
    penalties_per_block: bool = False
    # With distinct_blocks: the reply must hold a block (tool_choice "required"). One whose first
    # block was forced shut is drawn again from the prompt (Sequence.redraw) while it can be
    # done unseen; after that the forced block is kept, with finish_reason "length".
    require_block: bool = False
    # The temperature of such a new draw; None: the reply's own (so a greedy one is not drawn
    # again: it would come out the same).
    redraw_temperature: float | None = None
    # Speculative decoding (engine/drafter.py): guesses of the next tokens, taken from n-grams
    # already in the sequence, checked in the same forward pass. None: where the engine finds
    # they pay; True: whenever a guess exists; False: never. The tokens are the same either way.
    speculative: bool | None = None
    # Changes to this request's own forward passes (models/probes.py: ablate, steer, patch),
    # made inside the engine's batched steps; its KV is shared only with requests under the
    # same ones. A request with any runs the eager step.
    interventions: list[Intervention] = field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        require(
            is_int(self.max_tokens) and self.max_tokens >= 1,
            f"max_tokens must be an integer >= 1, got {self.max_tokens!r}",
        )
        require(
            is_number(self.temperature) and self.temperature >= 0,
            f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}",
        )
        require(
            self.redraw_temperature is None
            or (is_number(self.redraw_temperature) and self.redraw_temperature >= 0),
            f"redraw_temperature must be None or >= 0, got {self.redraw_temperature!r}",
        )
        require(
            is_number(self.top_p) and 0 < self.top_p <= 1,
            f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}",
        )
        require(
            is_int(self.top_k) and self.top_k >= -1,
            f"top_k must be an integer >= 1, or 0 / -1 for off, got {self.top_k!r}",
        )
        require(
            is_number(self.min_p) and 0 <= self.min_p <= 1,
            f"min_p must be in [0, 1] (0 = off), got {self.min_p!r}",
        )
        require(
            is_number(self.repetition_penalty) and self.repetition_penalty > 0,
            f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty!r}",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            require(
                is_number(value) and -2 <= value <= 2,
                f"{name} must be in [-2, 2] (0 = off), got {value!r}",
            )
        self._check_lists_and_options()

    def _check_lists_and_options(self) -> None:
        require(
            self.seed is None or is_int(self.seed),
            f"seed must be an integer or None, got {self.seed!r}",
        )
        require(
            all(isinstance(s, str) and s for s in self.stop),
            f"stop must be a string or a list of non-empty strings, got {self.stop!r}",
        )
        require(
            all(is_int(t) and t >= 0 for t in self.stop_token_ids),
            f"stop_token_ids must be token ids (integers >= 0), got {self.stop_token_ids!r}",
        )
        require(
            self.logprobs is None or (is_int(self.logprobs) and self.logprobs >= 0),
            f"logprobs must be None or an integer >= 0, got {self.logprobs!r}",
        )
        require(
            self.grammar is None or (isinstance(self.grammar, str) and self.grammar.strip()),
            f"grammar must be None or a non-empty grammar string, got {self.grammar!r}",
        )
        require(
            is_int(self.grammar_close_margin) and self.grammar_close_margin >= 0,
            f"grammar_close_margin must be an integer >= 0, got {self.grammar_close_margin!r}",
        )
        require(
            self.distinct_blocks is None
            or (
                isinstance(self.distinct_blocks, (tuple, list))
                and len(self.distinct_blocks) == 2
                and all(isinstance(t, str) and t for t in self.distinct_blocks)
            ),
            "distinct_blocks must be None or two non-empty strings (open tag, close tag), "
            f"got {self.distinct_blocks!r}",
        )
        require(
            self.speculative is None or isinstance(self.speculative, bool),
            f"speculative must be None, True or False, got {self.speculative!r}",
        )
        require(
            isinstance(self.interventions, (list, tuple))
            and all(isinstance(iv, Intervention) for iv in self.interventions),
            "interventions must be a list of Interventions (pellucid.interventions: ablate, "
            f"steer, patch), got {self.interventions!r}",
        )
        require(
            isinstance(self.trace, (bool, TraceOptions)),
            f"trace must be True, False or a TraceOptions, got {self.trace!r}",
        )

    @property
    def trace_options(self) -> TraceOptions | None:
        """None for an untraced request; `trace=True` means the default TraceOptions."""
        if self.trace is True:
            return TraceOptions()
        return self.trace if isinstance(self.trace, TraceOptions) else None

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        """True when sampling needs this request's token history."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


def require(ok: bool, message: str) -> None:
    """A request's check: a ValueError with `message`, which says what to give, unless `ok`."""
    if not ok:
        raise ValueError(message)


def is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)  # True is an int in Python; not here


def is_number(x: object) -> bool:
    return (is_int(x) or isinstance(x, float)) and math.isfinite(x)  # no NaN, no inf
