"""LLM: the Python API. Load a model, then generate, stream, chat or score text with it.
In short:

    from pellucid import LLM, SamplingParams
    llm = LLM()                                    # SmolLM2-135M-Instruct from its package
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8))
    print(out[0].text)
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from pellucid import catalog
from pellucid.config import EngineConfig
from pellucid.engine import aot_build, aot_decode
from pellucid.engine.llm_engine import LLMEngine
from pellucid.engine.outputs import RequestOutput, TokenLogprob
from pellucid.engine.probes import FINAL_NORM, LOGITS, Capture, Intervention, hook_names
from pellucid.engine.sampling_params import SamplingParams
from pellucid.engine.sequence import Sequence
from pellucid.errors import PromptError
from pellucid.loading import sampling_defaults
from pellucid.loading.loader import build_from_state, load_int4, read_checkpoint
from pellucid.malloc import release_freed_memory
from pellucid.models.dense import dense_dtype
from pellucid.structured import parse_tool_calls, prepare_chat, reply_defaults
from pellucid.tokenizer import Tokenizer

Prompt = str | list[int]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The default: int4/int8 weights, float32 activations, a bf16 KV cache (models/quant.py),
# perplexity within 1% of float32. dtype="float32" is the reference, which matches
# transformers' logits.
FAST_PATH = "int4"
SCORE_ROWS = 256  # prompt positions scored per LM-head product: (256, vocab) float32 at a time


class LLM:
    def __init__(
        self,
        model: str | Path | None = None,
        *,
        dtype: str = FAST_PATH,
        max_model_len: int | None = None,
        engine: EngineConfig | None = None,
        compile: bool = False,
    ):
        if dtype not in DTYPES and dtype != FAST_PATH:
            raise ValueError(
                f"dtype must be one of {', '.join([*DTYPES, FAST_PATH])}, got {dtype!r}"
            )
        start = time.perf_counter()
        self.path = catalog.resolve(model)
        if dtype == FAST_PATH:
            self.config, metadata, self.model = load_int4(self.path)
            # activations float32 between the products (packed_model.quantize); the KV cache
            # bf16: half the bytes that decode attention reads per token, as llama.cpp's F16
            self.dtype, self.kv_dtype = torch.float32, torch.bfloat16
            self.matmul_dtype = dense_dtype()
            self.model.use_decode_kernel()
        else:
            ckpt = read_checkpoint(self.path)
            self.config, metadata, self.dtype = ckpt.config, ckpt.gguf_metadata, DTYPES[dtype]
            self.kv_dtype = self.matmul_dtype = self.dtype
            self.model = build_from_state(ckpt.config, ckpt.state, self.dtype, str(self.path))
        config = engine or EngineConfig()
        if config.compiled_ahead:
            aot_decode.start_head_packing(self.model)  # goes on while the tokenizer loads
        if metadata is not None:
            self.tokenizer = Tokenizer.from_gguf_metadata(metadata)
            from_file = sampling_defaults.from_gguf(metadata)
        else:
            self.tokenizer = Tokenizer.from_hf_folder(self.path)
            from_file = sampling_defaults.from_hf_folder(self.path)
        # The authors' sampling settings: what the server uses where a request names none
        entry = catalog.find(str(model or catalog.DEFAULT_MODEL))
        self.sampling_defaults = (entry.sampling if entry else {}) | from_file
        if max_model_len is not None:
            config.max_model_len = max_model_len
        config.compile = config.compile or compile  # torch.compile the decode step
        self.engine = LLMEngine(self.model, self.tokenizer, self.kv_dtype, config)
        if dtype == FAST_PATH and config.compiled_ahead and config.build_ahead:
            self.build_ahead()
        del metadata  # a large vocabulary's lists of strings
        release_freed_memory()  # what reading the tokenizer and the metadata freed
        self.load_s = time.perf_counter() - start

    def build_ahead(self) -> None:
        """Without a decode step compiled ahead for this model, have one built in a background
        process (engine/aot_build.py); the engine switches to it once it exists."""
        runner = self.engine.model_runner
        decode = runner.compiled_decode
        if decode is not None and (decode.jit or 1 in decode.ahead):
            return  # torch.compile's step; or the package is there
        few_rows = aot_decode.package_paths(self.model)[1]
        if aot_build.start(self.path, few_rows):
            runner.watch_for_packages(few_rows)

    # --- prompts -> token ids -------------------------------------------------------------
    def encode(self, prompt: Prompt) -> list[int]:
        """Text is tokenized as llama.cpp's server does (BOS per the model, special tokens parsed);
        a list of ints is taken as token ids."""
        if isinstance(prompt, str):
            if not prompt:
                raise PromptError("the prompt is empty: give at least one character of text")
            return self.tokenizer.encode(prompt, add_special=True, parse_special=True)
        if not all(isinstance(t, int) for t in prompt):
            raise PromptError("a prompt is a string or a list of token ids (ints)")
        return list(prompt)

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        return self.encode_chat(self.tokenizer.apply_chat_template(messages))

    def encode_chat(self, text: str) -> list[int]:
        """Token ids of an already rendered chat: its control tokens parsed, no BOS added."""
        return self.tokenizer.encode(text, add_special=False, parse_special=True)

    # --- generation -----------------------------------------------------------------------
    def generate(
        self,
        prompts: Prompt | list[Prompt],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Complete one prompt or many, all batched together; returns one finished RequestOutput
        per prompt, in order. `params` is shared, or a list with one per prompt (as vLLM's)."""
        prompts = _as_list(prompts)
        if not isinstance(params, list):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(
                f"got {len(params)} SamplingParams for {len(prompts)} prompts; "
                "give one, or one per prompt"
            )
        finals = _finals(self._outputs([(self.encode(p), sp) for p, sp in zip(prompts, params)]))
        return [finals[i] for i in sorted(finals)]  # request ids count up in the order added

    def stream(
        self, prompt: Prompt, params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """Yield one RequestOutput per generated token; `.delta` is the new text (and, when asked
        for, `.logprobs` the new token's)."""
        yield from self._outputs([(self.encode(prompt), params or SamplingParams())])

    def chat(
        self, messages: list[dict], params: SamplingParams | None = None, **tool_options: Any
    ) -> RequestOutput:
        """Answer a conversation. With `tools=[...]` (OpenAI's format) the reply's calls are
        parsed into `.tool_calls`; see `chat_stream` for the options."""
        (final,) = _finals(self.chat_stream(messages, params, **tool_options)).values()
        return final

    def chat_stream(
        self,
        messages: list[dict],
        params: SamplingParams | None = None,
        *,
        tools: list[dict] | None = None,
        tool_choice: str | dict = "auto",
        parallel_tool_calls: bool | None = None,
        response_format: dict[str, Any] | None = None,
    ) -> Iterator[RequestOutput]:
        """Stream a reply. tool_choice: "auto" | "none" | "required" | {"type": "function",
        "function": {"name": ...}}; calls always match the tools' schemas (a grammar sees to it).
        parallel_tool_calls: several calls in a reply; None, as the model's chat template allows.
        response_format: {"type": "json_object"} or {"type": "json_schema", "json_schema": ...}.
        Without `params`: the model's recommended sampling, as the server uses."""
        chat = prepare_chat(
            self.tokenizer,
            messages,
            tools=tools,
            tool_choice=tool_choice,
            parallel_tool_calls=parallel_tool_calls,
            response_format=response_format,
        )
        if params is None:  # the server's defaults: the model's, then those for a reply of calls
            params = SamplingParams(
                **reply_defaults(self.sampling_defaults, chat.sampling_defaults)
            )
        params = dataclasses.replace(params, **chat.sampling_fields())
        for out in self._outputs([(self.encode_chat(chat.prompt), params)]):
            if out.finished and chat.parse_calls:
                out.tool_calls = parse_tool_calls(out.text).tool_calls
            yield out

    def _outputs(
        self,
        requests: list[tuple[list[int], SamplingParams]],
        captures: list[Capture] | None = None,
    ) -> Iterator[RequestOutput]:
        """Run `requests` to the end, yielding their outputs as they come. Each step is taken
        under the engine's lock, never across a yield: a server on this model runs its requests
        between our steps (its steps advance ours too, and hand us their outputs)."""
        outputs: deque[RequestOutput] = deque()
        seqs: list[Sequence] = []
        captures = captures or [None] * len(requests)
        try:
            with self.engine.lock:
                for (ids, params), capture in zip(requests, captures, strict=True):
                    seqs.append(self.engine.add_request(ids, params, outputs.append, capture))
            while outputs or not all(s.is_finished for s in seqs):
                with self.engine.lock:
                    if not outputs and not all(s.is_finished for s in seqs):
                        self.engine.step()
                while outputs:
                    yield outputs.popleft()
        finally:  # the consumer stopped early (break, disconnect): free the requests
            with self.engine.lock:
                for seq in seqs:
                    self.engine.abort(seq.request_id)

    def warm_up(self) -> None:
        """With compile=True: compile the decode step now rather than during the first requests
        (a server calls this before it listens). Batches of 1, 2 and 12 rows each get their
        graph: one row, a few, and more than the packed layers' DENSE_ROWS."""
        if not self.engine.config.compile:
            return
        ids = self.encode("Hello")
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        for n in (1, 2, 12):
            self.generate([ids] * n, params)

    # --- looking inside -------------------------------------------------------------------
    def run_with_cache(
        self,
        prompt: Prompt,
        names: Iterable[str] | None = None,
        interventions: list[Intervention] | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """One pass over the prompt through the engine (paged KV cache, batched with whatever
        else it runs), under `interventions` if given: its logits (T, vocab) and the activations
        named (TransformerLens's names, listed in models/probes.py; None: all of them)."""
        return self.run_with_caches([prompt], names, [interventions or []])[0]

    def run_with_caches(
        self,
        prompts: list[Prompt],
        names: Iterable[str] | None = None,
        interventions: list[list[Intervention]] | None = None,
        last_only: bool = False,
    ) -> list[tuple[Tensor, dict[str, Tensor]]]:
        """`run_with_cache` for many prompts at once (one list of interventions per prompt),
        all batched together: what an activation-patching sweep runs. `last_only`: keep the
        last position alone (logits (1, vocab), activations (1, ...)), reading the prefix cache
        for the rest: one token's view at any context length."""
        wanted = self._hook_names(names)
        results = []
        with torch.inference_mode():
            ids = [self.encode(p) for p in prompts]
            for cache in self._captures(ids, wanted - {LOGITS}, interventions, last_only):
                logits = self.model.compute_logits(cache[FINAL_NORM].to(self.dtype))
                cache[LOGITS] = logits
                results.append((logits, {n: cache[n] for n in wanted}))
        return results

    def prompt_logprobs(self, prompts: list[Prompt], top_n: int = 0) -> list[list[TokenLogprob]]:
        """Each prompt's tokens scored by the model, batched through the engine: for token i >= 1
        its logprob given the tokens before it, and the `top_n` likeliest there (the first token
        has nothing before it: it is left out). What lm-evaluation-harness asks for."""
        out = []
        encoded = [self.encode(p) for p in prompts]
        with torch.inference_mode():
            for prompt_ids, cache in zip(encoded, self._captures(encoded, set())):
                ids = torch.tensor(prompt_ids[1:])
                predicting = cache[FINAL_NORM][: len(ids)]  # row i: what follows token i
                rows: list[TokenLogprob] = []
                for at in range(0, len(ids), SCORE_ROWS):  # (rows, vocab) a slice at a time
                    hidden = predicting[at : at + SCORE_ROWS].to(self.dtype)
                    logprobs = self.model.compute_logits(hidden).log_softmax(-1)
                    chosen = logprobs.gather(1, ids[at : at + SCORE_ROWS, None])[:, 0].tolist()
                    top = logprobs.topk(top_n) if top_n else None
                    part = ids[at : at + SCORE_ROWS].tolist()
                    for r, (token_id, logprob) in enumerate(zip(part, chosen, strict=True)):
                        alts = (
                            []
                            if top is None
                            else list(zip(top.indices[r].tolist(), top.values[r].tolist()))
                        )
                        rows.append(TokenLogprob(token_id, logprob, alts))
                out.append(rows)
        return out

    def _captures(
        self,
        prompts: list[list[int]],
        names: set[str],
        interventions: list[list[Intervention]] | None = None,
        last_only: bool = False,
    ) -> list[dict[str, Tensor]]:
        """Run each prompt as a one-token request that keeps `names` (and always the final
        norm's output, which the LM head reads) for its prompt; the kept tensors, per prompt."""
        per_prompt = interventions or [[] for _ in prompts]
        requests = [
            (ids, SamplingParams(max_tokens=1, temperature=0, interventions=list(ivs)))
            for ids, ivs in zip(prompts, per_prompt, strict=True)
        ]
        captures = [Capture(names | {FINAL_NORM}, last_only) for _ in requests]
        for _ in self._outputs(requests, captures):
            pass
        return [c.result(len(ids)) for (ids, _), c in zip(requests, captures)]

    def _hook_names(self, names: Iterable[str] | None) -> set[str]:
        valid = hook_names(self.model.cfg)
        wanted = set(valid if names is None else names)
        unknown = sorted(wanted - set(valid))
        if unknown:
            raise ValueError(
                f"no activation is named {unknown[:3]}: this model's names run from "
                f"{valid[0]!r} to {valid[-3]!r} ({len(valid)} in all; pellucid.engine.probes "
                "lists them)"
            )
        return wanted

    # --- scoring --------------------------------------------------------------------------
    @torch.inference_mode()
    def logits(self, token_ids: list[int]) -> Tensor:
        """Per-position logits (T, vocab) of one forward pass; row i predicts token i + 1."""
        self.engine.check_prompt(token_ids[:-1] or token_ids)
        return self.model(torch.tensor([token_ids]))[0]


def _finals(outputs: Iterable[RequestOutput]) -> dict[int, RequestOutput]:
    """Each request's finished output, holding the logprobs of all its tokens (every output
    carries only those of its new ones)."""
    finals: dict[int, RequestOutput] = {}
    logprobs: dict[int, list[TokenLogprob]] = {}
    for out in outputs:
        if out.logprobs is not None:
            logprobs.setdefault(out.request_id, []).extend(out.logprobs)
        if out.finished:
            if out.logprobs is not None:
                out.logprobs = logprobs.pop(out.request_id)
            finals[out.request_id] = out
    return finals


def _as_list(prompts: Prompt | list[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return list(prompts)
