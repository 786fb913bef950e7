"""llama.cpp as a peer for workloads its high-level `Llama` class does not run: many sequences at
once (throughput.py), and decoding without a KV cache (kv_cache.py). Through llama-cpp-python's
bindings of the C API, greedy (argmax of the logits), or sampled as llama.cpp's server samples:
a sampler chain of its own for each sequence (temperature, top-k, top-p, min-p, then the draw).

Many sequences share one context, as llama.cpp's own server batches them: `n_seq_max` = the
number of sequences, each with its own stream of KV cells (not `kv_unified`: a unified cache makes
every token attend, masked, over all the sequences' cells, which ran 32 sequences at 230 tok/s
where split streams ran 290 on a 2-core EPYC). Pre-fill packs the prompts' tokens into batches of
up to 512, then every step decodes one token for each unfinished sequence in one `llama_decode`
call, and the sequences' KV is kept from step to step.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

N_BATCH = 512  # tokens per llama_decode call


def available() -> bool:
    """Whether llama-cpp-python is installed; if not, says so on stderr (the peer is optional)."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError as e:
        print(
            f"llama.cpp peer skipped: {e} (make bench installs llama-cpp-python)", file=sys.stderr
        )
        return False
    return True


class LlamaCpp:
    """One model and one context; `decode` runs a batch and returns the token of each row that
    asked for logits: their argmax, or with `sampling` each sequence's draw."""

    def __init__(
        self,
        path: str | Path,
        seq_len: int,
        n_seqs: int,
        threads: int,
        sampling: dict[str, float] | None = None,
    ):
        """seq_len: the most tokens any one sequence holds (prompt and generated); sampling:
        temperature, top_k, top_p and min_p (0, 0, 1 and 0 leave a stage out), None greedy."""
        import llama_cpp as lc
        from llama_cpp._utils import suppress_stdout_stderr

        self.lc, self.quiet = lc, suppress_stdout_stderr
        with self.quiet(disable=False):  # llama.cpp logs every load to stderr
            lc.llama_backend_init()
            self.model = lc.llama_model_load_from_file(
                str(path).encode(), lc.llama_model_default_params()
            )
            if self.model is None:
                raise RuntimeError(f"llama.cpp could not load {path}")
            params = lc.llama_context_default_params()
            # each sequence's stream holds n_ctx / n_seq_max cells
            params.n_ctx, params.n_seq_max, params.kv_unified = seq_len * n_seqs, n_seqs, False
            params.n_batch = params.n_ubatch = N_BATCH
            params.n_threads = params.n_threads_batch = threads
            self.ctx = lc.llama_init_from_model(self.model, params)
        self.vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.batch = lc.llama_batch_init(N_BATCH, 0, 1)
        self.samplers = (
            [self._sampler(sampling, seed) for seed in range(n_seqs)] if sampling else []
        )

    def _sampler(self, sampling: dict[str, float], seed: int):
        """A chain in pellucid's order: temperature, top-k, top-p, min-p, the draw."""
        lc = self.lc
        chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
        stages = [lc.llama_sampler_init_temp(sampling["temperature"])]
        if sampling["top_k"] > 0:
            stages.append(lc.llama_sampler_init_top_k(int(sampling["top_k"])))
        if sampling["top_p"] < 1.0:
            stages.append(lc.llama_sampler_init_top_p(sampling["top_p"], 1))
        if sampling["min_p"] > 0.0:
            stages.append(lc.llama_sampler_init_min_p(sampling["min_p"], 1))
        for stage in [*stages, lc.llama_sampler_init_dist(seed)]:
            lc.llama_sampler_chain_add(chain, stage)
        return chain

    def decode(self, entries: list[tuple[int, int, int, bool]]) -> dict[int, int]:
        """entries: (token, position, sequence, wants logits) -> {sequence: its argmax}."""
        b = self.batch
        b.n_tokens = len(entries)
        for i, (token, pos, seq, logits) in enumerate(entries):
            b.token[i], b.pos[i], b.logits[i] = token, pos, logits
            b.n_seq_id[i], b.seq_id[i][0] = 1, seq
        if self.lc.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")
        picks = {}
        for i, (_, _, seq, logits) in enumerate(entries):
            if logits and self.samplers:
                picks[seq] = self.lc.llama_sampler_sample(self.samplers[seq], self.ctx, i)
            elif logits:
                row = np.ctypeslib.as_array(
                    self.lc.llama_get_logits_ith(self.ctx, i), shape=(self.vocab,)
                )
                picks[seq] = int(row.argmax())
        return picks

    def prefill(self, entries: list[tuple[int, int, int, bool]]) -> dict[int, int]:
        picks = {}
        for i in range(0, len(entries), N_BATCH):
            picks.update(self.decode(entries[i : i + N_BATCH]))
        return picks

    def generate(
        self, prompts: list[list[int]], max_tokens: list[int]
    ) -> tuple[list[list[int]], float]:
        """Generate max_tokens[i] tokens (greedy, or sampled) after each prompt, all at once,
        from an empty cache: the tokens, and the seconds they took (pre-fill included)."""
        self.clear()
        start = time.perf_counter()
        out: list[list[int]] = [[] for _ in prompts]
        firsts = self.prefill(
            [
                (tok, pos, s, pos == len(p) - 1)
                for s, p in enumerate(prompts)
                for pos, tok in enumerate(p)
            ]
        )
        for s, tok in firsts.items():
            out[s].append(tok)
        while active := [s for s in range(len(prompts)) if len(out[s]) < max_tokens[s]]:
            # the newest token goes after the prompt and the tokens generated before it
            picks = self.decode(
                [(out[s][-1], len(prompts[s]) + len(out[s]) - 1, s, True) for s in active]
            )
            for s, tok in picks.items():
                out[s].append(tok)
        return out, time.perf_counter() - start

    def clear(self) -> None:
        """Forget every sequence's keys and values."""
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)

    def close(self) -> None:
        with self.quiet(disable=False):
            for chain in self.samplers:
                self.lc.llama_sampler_free(chain)
            self.lc.llama_batch_free(self.batch)
            self.lc.llama_free(self.ctx)
            self.lc.llama_model_free(self.model)


def greedy_batch(
    path: str | Path, prompts: list[list[int]], max_tokens: list[int], threads: int
) -> tuple[list[list[int]], float]:
    """The greedy tokens of each sequence, and the seconds generating them took (not loading),
    in a context opened for this one batch."""
    llama = LlamaCpp(path, seq_len(prompts, max_tokens), len(prompts), threads)
    try:
        return llama.generate(prompts, max_tokens)
    finally:
        llama.close()


def seq_len(prompts: list[list[int]], max_tokens: list[int]) -> int:
    """The KV cells one sequence's stream needs for these requests (with a margin)."""
    return max(len(p) + m for p, m in zip(prompts, max_tokens)) + 64


def greedy_without_cache(
    path: str | Path, prompt: list[int], n: int, threads: int
) -> tuple[list[int], float]:
    """n greedy tokens, each computed from the whole text so far with an emptied KV cache (what
    decoding costs without one); the tokens and the seconds they took."""
    llama = LlamaCpp(path, seq_len([prompt], [n]), 1, threads)
    try:
        start = time.perf_counter()
        seq = list(prompt)
        for _ in range(n):
            llama.clear()
            picks = llama.prefill(
                [(tok, pos, 0, pos == len(seq) - 1) for pos, tok in enumerate(seq)]
            )
            seq.append(picks[0])
        return seq[len(prompt) :], time.perf_counter() - start
    finally:
        llama.close()
