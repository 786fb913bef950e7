"""Grammar-constrained decoding: llguidance turns a grammar into a per-row mask of allowed tokens.

    grammars = GrammarCompiler(tokenizer)       # once per engine; builds llguidance's token trie
    matcher = grammars.matcher(params.grammar)  # one per request; walks the grammar token by token
    allowed = token_masks(matchers, vocab)      # (B, V) bool for this step; the sampler sets the
                                                # rest to -inf, then each matcher consumes its token
A grammar is llguidance's Lark dialect (`%json {...}` inlines a JSON schema); see structured/.
"""

from __future__ import annotations

from collections.abc import Iterable

import llguidance
import llguidance.numpy  # not llguidance.torch: importing that loads torch.compile (seconds, MBs)
import torch
from torch import Tensor

from pellucid.tokenizer import Tokenizer

# llguidance's marker for a control token's bytes, so grammar text can never spell one by accident.
SPECIAL_PREFIX = b"\xff"
CLOSERS = b'"]}'


class GrammarCompiler:
    """Holds llguidance's view of the vocabulary (built on first use, not at every load)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._ll: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None
        self._closing: tuple[Tensor, Tensor] | None = None
        self._closers: tuple[Tensor, Tensor, Tensor, Tensor] | None = None
        self._token_pieces: list[bytes] | None = None

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        if self._ll is None:
            self._ll = llguidance.LLTokenizer(
                _Vocab(self.tokenizer), eos_token=sorted(self.tokenizer.eos_ids)
            )
        return self._ll

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        """A fresh matcher for one request; a grammar that does not compile is a ValueError."""
        # The constructor never raises: a bad grammar leaves the matcher in an error state.
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"the grammar does not compile: {matcher.get_error()}")
        return matcher

    def token_masks(self, matchers: list[llguidance.LLMatcher], vocab_size: int) -> Tensor:
        """(B, vocab_size) bool: the tokens each matcher allows next, computed in parallel."""
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        bitmask = llguidance.numpy.allocate_token_bitmask(
            len(matchers), self.ll_tokenizer.vocab_size
        )
        llguidance.numpy.fill_next_token_bitmask_par(
            self._executor, [(m, i) for i, m in enumerate(matchers)], bitmask
        )
        return unpack_bitmask(torch.from_numpy(bitmask), vocab_size)

    def closing_tokens(self, vocab_size: int) -> tuple[Tensor, Tensor]:
        """Two (vocab_size,) bool masks, to try in turn when a reply must close its JSON (see
        SamplingParams.grammar_close_margin): EOS and the tokens of only `"`, `]`, `}` that
        begin with a quote, then all tokens of only those three. Quotes first: inside a string
        `}}` is just more text, so a model left the choice would loop on it."""
        if self._closing is None or self._closing[0].shape[0] != vocab_size:
            pieces = self._pieces(vocab_size)
            closing = _mask(bool(p) and not p.strip(CLOSERS) for p in pieces)
            quote_first = closing & _mask(p.startswith(b'"') for p in pieces)
            quote_first[sorted(self.tokenizer.eos_ids)] = True
            self._closing = quote_first, closing | quote_first
        return self._closing

    def closer_tokens(self, vocab_size: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Four (vocab_size,) bool masks, of tokens whose text begins with one of `}]);,`;
        with a quote then one of those, after any spaces; with a quote; with an empty string
        `""` after any spaces (sampler.constrain's _no_string_opens_with_a_closer)."""
        if self._closers is None or self._closers[0].shape[0] != vocab_size:
            pieces, junk = self._pieces(vocab_size), [bytes([c]) for c in b"}]);,"]
            stripped = [p.lstrip() for p in pieces]
            self._closers = (
                _mask(p[:1] in junk for p in pieces),
                _mask(r[:1] == b'"' and r[1:2] in junk for r in stripped),
                _mask(p[:1] == b'"' for p in pieces),
                _mask(r.startswith(b'""') for r in stripped),
            )
        return self._closers

    def _pieces(self, vocab_size: int) -> list[bytes]:
        """Each token id's text as bytes, b"" for control tokens and for ids past the
        tokenizer's (a model whose output layer is wider): what the masks above read."""
        if self._token_pieces is None:
            tok = self.tokenizer
            self._token_pieces = [
                b"" if tok.is_special(i) else tok.id_to_bytes(i) for i in range(tok.vocab_size)
            ]
        pieces = self._token_pieces[:vocab_size]
        return pieces + [b""] * (vocab_size - len(pieces))


def _mask(values: Iterable[bool]) -> Tensor:
    return torch.tensor(list(values), dtype=torch.bool)


def unpack_bitmask(bitmask: Tensor, vocab_size: int) -> Tensor:
    """int32 words (B, W), bit j of word w = token 32*w + j, -> bool (B, vocab_size).

    Tokens past 32*W (a model whose output layer is wider than its tokenizer) are never allowed.
    """
    shifts = torch.arange(32, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # (B, W, 32); `& 1` undoes the sign of >>
    allowed = bits.reshape(bitmask.shape[0], -1).bool()  # (B, 32*W)
    if allowed.shape[1] >= vocab_size:
        return allowed[:, :vocab_size]
    pad = torch.zeros(bitmask.shape[0], vocab_size - allowed.shape[1], dtype=torch.bool)
    return torch.cat([allowed, pad], dim=1)


class _Vocab(llguidance.TokenizerWrapper):
    """What LLTokenizer reads: the bytes of every token, EOS, and our own encoder."""

    def __init__(self, tokenizer: Tokenizer):
        self.eos_token_id = tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id
        self.tokens = [
            SPECIAL_PREFIX + tokenizer.id_to_bytes(i)
            if tokenizer.is_special(i)
            else tokenizer.id_to_bytes(i)
            for i in range(tokenizer.vocab_size)
        ]
        self.special_token_ids = [i for i in range(tokenizer.vocab_size) if tokenizer.is_special(i)]
        self.is_tokenizer_wrapper = True
        self._tokenizer = tokenizer
        self._accepts_bytes = False

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text)
