"""explain: one traced generation plus the experiments `pellucid explain` reports.

    from pellucid.trace.explain import explain
    ex = explain(llm, "The capital of India is", SamplingParams(max_tokens=8), compare_no_cache=True)
    ex.trace.steps[0].stages        # what each sampling stage did to the first token's odds

The no-cache run and the training walk-through use the same model: the former without a KV cache,
the latter on a copy of the weights, so the served model is provably left as it was.
"""

from __future__ import annotations

import copy
import hashlib
import math
import time

import torch
import torch.nn.functional as F

from pellucid.engine.sampler import SamplerState, sample
from pellucid.engine.sampling_params import SamplingParams, TraceOptions
from pellucid.engine.sequence import Sequence
from pellucid.engine.trace_records import Trace
from pellucid.llm import LLM
from pellucid.models.config import ModelConfig
from pellucid.trace.records import Explanation, NoCacheComparison, TrainingStep, TrainingWalk

TRAIN_TEXT = "The capital of India is New Delhi."


def explain(
    llm: LLM,
    prompt: str,
    params: SamplingParams,
    *,
    layer: int | None = None,
    head: int | None = None,
    focus: str | None = None,
    chat: bool = False,
    compare_no_cache: bool = False,
    training: bool = False,
    train_text: str = TRAIN_TEXT,
) -> Explanation:
    """Generate once with every layer's attention and the logit lens traced, then run the extras."""
    ids = llm.chat_prompt([{"role": "user", "content": prompt}]) if chat else llm.encode(prompt)
    before = weights_fingerprint(llm.model)
    # Warm up (thread pools, first-touch memory) so the first timed pass is not the slowest,
    # on a short unrelated text: nothing of this prompt may land in the prefix cache.
    llm.generate("Warm up, please.", SamplingParams(temperature=0, max_tokens=2))
    trace = traced_run(llm, ids, params)
    trace.bandwidth_limit_gbs = measure_bandwidth()
    trace.flops_limit = measure_flops(llm.matmul_dtype)
    focus_index = find_focus(trace, focus)
    if layer is None or head is None:
        best_layer, best_head = pick_head(trace, focus_index)
        layer = best_layer if layer is None else layer
        head = best_head if head is None else head
    _check_head(llm.model.cfg, layer, head)
    ex = Explanation(trace, layer, head, focus_index)
    if compare_no_cache:
        ex.no_cache = no_cache_comparison(llm, ids, params)
    if training:
        ex.training = training_walk(llm, train_text, before)
    return ex


def _run(llm: LLM, ids: list[int], params: SamplingParams) -> Sequence:
    """One request run to its end by itself, its Sequence kept (what it recorded, what it
    generated); a server on this model waits its turn."""
    with llm.engine.lock:
        seq = llm.engine.add_request(ids, params)
        while not seq.is_finished:
            llm.engine.step()
    return seq


def traced_run(llm: LLM, ids: list[int], params: SamplingParams) -> Trace:
    layers = list(range(llm.model.cfg.n_layers))
    options = TraceOptions(attention_layers=layers, logit_lens=True)
    seq = _run(llm, ids, _with(params, trace=options))
    trace = seq.trace.trace
    trace.model.name = llm.path.name
    return trace


# --- which head to show ---------------------------------------------------------------------
def find_focus(trace: Trace, word: str | None) -> int:
    """The prompt token to describe: the one spelling `word`, else the last (it sees them all)."""
    tokens = trace.tokenization.tokens
    if word is None:
        return len(tokens) - 1
    for i, tok in enumerate(tokens):
        if tok.piece.strip().lower() == word.strip().lower():
            return i
    pieces = ", ".join(repr(t.piece.strip()) for t in tokens if not t.special)
    raise ValueError(f"--focus {word!r} is not one of the prompt's tokens: {pieces}")


def pick_head(trace: Trace, focus: int) -> tuple[int, int]:
    """The (layer, head) whose attention around `focus` is least spent on the first token and on
    itself: the first token soaks up most attention in most heads (an 'attention sink')."""
    best, best_score = (0, 0), -1.0
    for amap in trace.attention:
        for h, matrix in zip(amap.heads, amap.prompt):
            looks_at = matrix[focus][1:focus]  # what focus attends to, sink and self left out
            looked_at = [row[focus] for row in matrix[focus + 1 :]]  # who attends to focus
            values = looks_at + looked_at
            score = sum(values) / len(values) if values else 0.0
            if score > best_score:
                best, best_score = (amap.layer, h), score
    return best


# --- generation without the KV cache --------------------------------------------------------
def no_cache_comparison(llm: LLM, ids: list[int], params: SamplingParams) -> NoCacheComparison:
    """Time the engine (KV cache) against a loop that recomputes every token at every step."""
    params = _with(params, trace=False)
    start = time.perf_counter()
    seq = _run(llm, ids, params)
    cached_s = time.perf_counter() - start
    n = len(seq.output_ids)
    state = SamplerState(params, ids, llm.model.cfg.vocab_size)  # same seed: same draws
    tokens = list(ids)
    start = time.perf_counter()
    with torch.inference_mode():
        for _ in range(n):  # every step pushes the whole text through the model again
            logits = llm.model(torch.tensor([tokens]))[0, -1:]  # (1, vocab)
            token = int(sample(logits, [state]).token_ids[0])
            state.update(token)
            tokens.append(token)
    uncached_s = time.perf_counter() - start
    cfg, T = llm.model.cfg, len(ids)
    cached = forward_flops(cfg, T, T) + sum(forward_flops(cfg, 1, T + i) for i in range(1, n))
    uncached = sum(forward_flops(cfg, T + i, T + i) for i in range(n))
    return NoCacheComparison(
        n, cached_s, uncached_s, cached, uncached, tokens[T:] == seq.output_ids
    )


def forward_flops(cfg: ModelConfig, new: int, context: int) -> int:
    """FLOPs of a forward pass of `new` tokens ending at `context`: each goes through every weight
    matrix and attends to the keys up to itself; only the last goes through the LM head."""
    attn_weights = cfg.dim * cfg.head_dim * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)
    per_token = 2 * cfg.n_layers * (attn_weights + 3 * cfg.dim * cfg.ffn_dim)
    keys = new * (context - new) + new * (new + 1) // 2  # summed over the new queries
    attention = 4 * cfg.n_layers * cfg.n_heads * cfg.head_dim * keys  # Q·Kᵀ and probs·V
    return new * per_token + attention + 2 * cfg.dim * cfg.vocab_size


# --- training vs inference ------------------------------------------------------------------
def training_walk(
    llm: LLM, sentence: str, served_before: str, steps: int = 4, lr: float = 2e-3
) -> TrainingWalk:
    """Plain gradient descent on one sentence, on a copy of the weights. served_before is the
    served weights' fingerprint before any generation: after generating and training, it must
    still match (inference and training-on-a-copy leave the served model as it was)."""
    start = time.perf_counter()
    ids = llm.tokenizer.encode(sentence, add_special=True, parse_special=False)
    if len(ids) < 2:
        raise ValueError(f"the training sentence {sentence!r} needs at least two tokens")
    model = copy.deepcopy(llm.model).requires_grad_(True)
    params = list(model.parameters())  # tied embeddings appear once
    x, y = torch.tensor([ids[:-1]]), torch.tensor(ids[1:])  # predict each next token
    records = []
    for step in range(steps):
        loss, target_prob = _loss(model, x, y)
        model.zero_grad(set_to_none=True)
        loss.backward()
        grads = [p.grad for p in params if p.grad is not None]
        grad_norm = math.sqrt(sum(float(g.square().sum()) for g in grads))
        update_sq = 0.0
        with torch.no_grad():  # w <- w - lr * dL/dw
            for p in params:
                if p.grad is not None:
                    delta = p.grad * -lr
                    p.add_(delta)
                    update_sq += float(delta.square().sum())
        records.append(
            TrainingStep(step, loss.item(), target_prob, grad_norm, math.sqrt(update_sq))
        )
    with torch.no_grad():
        final_loss, final_prob = _loss(model, x, y)
    original = dict(llm.model.named_parameters())
    changed = sum(not torch.equal(p, original[name]) for name, p in model.named_parameters())
    return TrainingWalk(
        sentence,
        [llm.tokenizer.id_to_piece(i) for i in ids],
        lr,
        records,
        float(final_loss),
        final_prob,
        changed,
        len(original),
        weights_fingerprint(llm.model) == served_before,
        time.perf_counter() - start,
    )


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, float]:
    logits = model(x)[0]  # (T-1, vocab), row i predicts token i + 1
    target_prob = float(torch.softmax(logits[-1].detach(), -1)[y[-1]])
    return F.cross_entropy(logits, y), target_prob


def weights_fingerprint(model: torch.nn.Module) -> str:
    """A hash of every weight's bytes: equal before and after means bit-identical weights."""
    h = hashlib.blake2b(digest_size=16)
    for name, t in sorted(model.state_dict(keep_vars=False).items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# --- the machine ----------------------------------------------------------------------------
def measure_bandwidth(mib: int = 256, repeats: int = 5) -> float:
    """GB/s of copying a large buffer (read + write): roughly the most any decode step can move."""
    src = torch.ones(mib * (1 << 20) // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * 4 / best / 1e9


def measure_flops(dtype: torch.dtype = torch.float32, n: int = 1024, repeats: int = 5) -> float:
    """FLOP/s of one square matrix product in `dtype`: roughly the most a pre-fill can reach."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def _with(params: SamplingParams, **changes: object) -> SamplingParams:
    values = {name: getattr(params, name) for name in SamplingParams.__dataclass_fields__}
    return SamplingParams(**(values | changes))


def _check_head(cfg: ModelConfig, layer: int, head: int) -> None:
    if not 0 <= layer < cfg.n_layers:
        raise ValueError(
            f"--layer {layer} does not exist: the model has layers 0..{cfg.n_layers - 1}"
        )
    if not 0 <= head < cfg.n_heads:
        raise ValueError(f"--head {head} does not exist: the model has heads 0..{cfg.n_heads - 1}")
