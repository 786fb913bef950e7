"""llama.cpp serving many sequences at once, as a throughput peer: its C API through
llama-cpp-python (whose `Llama` class runs one sequence at a time).

All prompts share one context with a unified KV cache (as pellucid's pool is shared); pre-fill
packs the prompts' tokens into batches of up to 512, then every step decodes one token for each
unfinished sequence in one `llama_decode` call, greedily (argmax of its logits).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

N_BATCH = 512  # tokens per llama_decode call during pre-fill


def greedy_batch_tok_s(path: str | Path, prompts: list[list[int]], max_tokens: list[int],
                       threads: int) -> float:
    """Generate max_tokens[i] greedy tokens after each prompt, all at once; output tokens per
    second of wall time, pre-fill included (as pellucid's throughput.py counts)."""
    outputs, seconds = greedy_batch(path, prompts, max_tokens, threads)
    return sum(map(len, outputs)) / seconds


def greedy_batch(path: str | Path, prompts: list[list[int]], max_tokens: list[int],
                 threads: int) -> tuple[list[list[int]], float]:
    """The greedy tokens of each sequence, and the seconds generating them took (not loading)."""
    import llama_cpp as lc
    from llama_cpp._utils import suppress_stdout_stderr

    with suppress_stdout_stderr(disable=False):  # llama.cpp logs every load to stderr
        lc.llama_backend_init()
        model = lc.llama_model_load_from_file(str(path).encode(), lc.llama_model_default_params())
    if model is None:
        raise RuntimeError(f"llama.cpp could not load {path}")
    ctx_params = lc.llama_context_default_params()
    ctx_params.n_ctx = sum(len(p) + m for p, m in zip(prompts, max_tokens)) + 64 * len(prompts)
    ctx_params.n_batch = ctx_params.n_ubatch = N_BATCH
    ctx_params.n_seq_max = len(prompts)
    ctx_params.kv_unified = True
    ctx_params.n_threads = ctx_params.n_threads_batch = threads
    with suppress_stdout_stderr(disable=False):
        ctx = lc.llama_init_from_model(model, ctx_params)
    vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    batch = lc.llama_batch_init(N_BATCH, 0, 1)
    try:
        start = time.perf_counter()
        outputs = _generate(lc, ctx, batch, vocab, prompts, max_tokens)
        return outputs, time.perf_counter() - start
    finally:
        with suppress_stdout_stderr(disable=False):
            lc.llama_batch_free(batch)
            lc.llama_free(ctx)
            lc.llama_model_free(model)


def _generate(lc, ctx, batch, vocab: int, prompts: list[list[int]],
              max_tokens: list[int]) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in prompts]  # the tokens generated for each sequence
    prompt_len = [len(p) for p in prompts]

    def decode(entries: list[tuple[int, int, int, bool]]) -> None:
        """entries: (token, position, sequence, wants logits); argmax for those that want them."""
        batch.n_tokens = len(entries)
        for i, (token, pos, seq, logits) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.logits[i] = token, pos, logits
            batch.n_seq_id[i], batch.seq_id[i][0] = 1, seq
        if lc.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        for i, (_, _, seq, logits) in enumerate(entries):
            if logits:
                row = np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, i), shape=(vocab,))
                out[seq].append(int(row.argmax()))

    pending = [(tok, pos, s, pos == len(p) - 1) for s, p in enumerate(prompts)
               for pos, tok in enumerate(p)]
    for i in range(0, len(pending), N_BATCH):  # pre-fill: the first token of each comes out
        decode(pending[i : i + N_BATCH])
    while True:
        active = [s for s in range(len(prompts)) if len(out[s]) < max_tokens[s]]
        if not active:
            return out
        # the newest token goes after the prompt and the tokens generated before it
        decode([(out[s][-1], prompt_len[s] + len(out[s]) - 1, s, True) for s in active])
