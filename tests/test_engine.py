"""The batching engine equals the naive reference: greedy tokens from a full recompute (no KV
cache, one sequence) whether a request runs alone, in a batch, in pre-fill chunks, after being
preempted, or on a prefix-cache hit; both model families."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from pellucid import SamplingParams
from pellucid.config import EngineConfig
from pellucid.engine.llm_engine import LLMEngine
from pellucid.models.quant import DENSE_ROWS

N_NEW = 6
GREEDY = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True)


@torch.inference_mode()
def reference_greedy(model, prompt: list[int], n: int = N_NEW) -> list[int]:
    """Recompute the whole sequence for every new token: the definition the engine must match."""
    ids = list(prompt)
    for _ in range(n):
        h = model.hidden_states(torch.tensor([ids]), torch.arange(len(ids)))
        ids.append(int(model.compute_logits(h[0, -1]).argmax()))
    return ids[len(prompt) :]


def run(llm, prompts: list[list[int]], config: EngineConfig) -> tuple[list[list[int]], LLMEngine]:
    engine = LLMEngine(llm.model, llm.tokenizer, llm.kv_dtype, config)
    seqs = [engine.add_request(p, GREEDY) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    assert engine.stats().kv_used_tokens == 0  # every block came back
    return [s.output_ids for s in seqs], engine


def random_smollm2(smollm2, n_layers: int) -> SimpleNamespace:
    """A model with SmolLM2's shapes but `n_layers` random layers (compiling all 30 would take
    minutes), with SmolLM2's tokenizer, as run() takes it."""
    from pellucid.models import build_model

    torch.manual_seed(0)
    model = build_model(dataclasses.replace(smollm2.config, n_layers=n_layers))
    model = model.eval().requires_grad_(False)
    for p in model.parameters():
        p.normal_(0, 0.2)
    return SimpleNamespace(model=model, tokenizer=smollm2.tokenizer, kv_dtype=torch.float32)


@pytest.fixture(scope="module", params=["tiny", pytest.param("smollm2", marks=pytest.mark.slow)])
def llm(request):
    """The tiny random model (fast tier) and SmolLM2 (a real one)."""
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def prompts(llm) -> list[list[int]]:
    texts = [
        "The capital of France is",
        "def fibonacci(n):",
        "1, 2, 3, 4,",
        "Water boils at a temperature of",
        "The quick brown fox jumps over the lazy dog. " * 6,
    ]
    return [llm.encode(t) for t in texts]


@pytest.fixture(scope="module")
def expected(llm, prompts) -> list[list[int]]:
    return [reference_greedy(llm.model, p) for p in prompts]


def test_alone(llm, prompts, expected):
    for p, want in zip(prompts, expected):
        assert run(llm, [p], EngineConfig())[0] == [want]


def test_batched(llm, prompts, expected):
    assert run(llm, prompts, EngineConfig())[0] == expected


def test_chunked_prefill(llm, prompts, expected):
    out, _ = run(llm, prompts, EngineConfig(block_size=4, max_num_batched_tokens=7))
    assert out == expected


def test_preemption(llm, prompts, expected):
    short = prompts[:4]
    at_admission = sum(blocks_of_4(len(p)) for p in short)
    # the last sampled token's K/V is never written: its sequence ends before the step that would
    at_the_end = sum(blocks_of_4(len(p) + N_NEW - 1) for p in short)
    assert at_admission < at_the_end - 2  # all start together, then outgrow the pool
    per_token = llm.model.cfg.kv_bytes_per_token(4)
    config = EngineConfig(block_size=4, kv_cache_bytes=per_token * 4 * (at_the_end - 2))
    out, engine = run(llm, short, config)
    assert engine.scheduler.num_preemptions > 0
    assert out == expected[:4]


def blocks_of_4(n_tokens: int) -> int:
    return -(-n_tokens // 4)


def test_prefix_cache_hit(llm, prompts, expected):
    engine = LLMEngine(llm.model, llm.tokenizer, llm.kv_dtype, EngineConfig(block_size=4))
    shared = prompts[4]  # a long prompt: run it, then a second request extending it
    first = engine.add_request(shared, GREEDY)
    while engine.has_unfinished():
        engine.step()
    longer = shared + llm.encode(" And then")
    second = engine.add_request(longer, GREEDY)
    while engine.has_unfinished():
        engine.step()
    assert first.output_ids == expected[4]
    # the shared prompt's full blocks hit, up to where a stretch of its pre-fill begins
    align = engine.scheduler.align
    assert second.num_cached == (len(shared) - 1) // 4 * 4 // align * align > 0
    assert second.output_ids == reference_greedy(llm.model, longer)


def test_background_compile_decodes_eagerly_then_switches(smollm2):
    """EngineConfig(compile_in_background=True): no step waits for the compiler. The graphs for
    one row and for a few compile in a worker thread on example steps of their own (a scratch
    KV pool); until then steps run eagerly; after, the serving thread uses the graphs with no
    recompile, the tokens stay the reference's, and the worker has ended (its OpenMP threads
    slowed the serving thread's while it lived)."""
    from torch._dynamo.utils import counters

    tiny = random_smollm2(smollm2, n_layers=2)
    model = tiny.model
    prompts = [smollm2.encode(t) for t in ("The sea", "Once upon a time there", "Hi")]
    expected = [reference_greedy(model, p) for p in prompts]
    config = EngineConfig(compile=True, compile_in_background=True, block_size=4)
    out, engine = run(tiny, prompts, config)  # while the worker compiles, or after
    assert out == expected
    decode = engine.model_runner.compiled_decode
    assert decode.wait(timeout=600) and decode.ready == {1, 2} and not decode.failed
    assert decode.worker is None  # ended once idle

    def serve(batch: list[list[int]]) -> list[list[int]]:
        seqs = [engine.add_request(p, GREEDY) for p in batch]
        while engine.has_unfinished():
            engine.step()
        return [s.output_ids for s in seqs]

    counters.clear()
    steps = decode.steps
    assert serve(prompts[:1]) == expected[:1]  # one row
    assert serve(prompts) == expected  # several
    assert decode.steps - steps >= 2 * (N_NEW - 1)  # the graphs served the decode steps
    assert counters["stats"]["unique_graphs"] == 0  # made by the worker, not here


def test_gemma_sliding_window_chunked_and_batched(gemma3, reference_gemma3):
    """Past Gemma's 512-token window, pre-filled in chunks, in a batch with a short prompt."""
    long_prompt = reference_gemma3["perplexity"]["token_ids"][:530]
    short_prompt = reference_gemma3["prompts"][0]["token_ids"]
    config = EngineConfig(block_size=16, max_num_batched_tokens=128)
    out, _ = run(gemma3, [long_prompt, short_prompt], config)
    assert out == [
        reference_greedy(gemma3.model, long_prompt),
        reference_greedy(gemma3.model, short_prompt),
    ]


def smollm2_prompts(smollm2) -> list[list[int]]:
    """The module's prompts for SmolLM2 alone: a test that builds its own model runs once, not
    once per `llm`."""
    texts = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,", "Hi " * 25]
    return [smollm2.encode(t) for t in texts]


def test_compiled_decode_equals_the_reference_without_recompiling(smollm2):
    """torch.compile of the decode step (EngineConfig(compile=True)): the same greedy tokens,
    alone and batched, and contexts of different lengths share one graph per kind of batch
    (one row; several rows) — no recompile as the context grows block by block. A 2-layer
    random model with SmolLM2's shapes otherwise: compiling all 30 layers would take minutes."""
    from torch._dynamo.utils import counters

    from pellucid.models import build_model

    prompts = smollm2_prompts(smollm2)
    tiny = random_smollm2(smollm2, n_layers=2)
    model, cfg = tiny.model, tiny.model.cfg
    expected = [reference_greedy(model, p) for p in prompts]
    counters.clear()
    short = prompts[0][:2]  # one block of 4 at first, then 2 and 3 as it decodes 6 tokens
    alone, engine = run(tiny, [short], EngineConfig(compile=True, block_size=4))
    assert alone == [reference_greedy(model, short)]
    assert not engine.model_runner.compiled_decode.failed  # it did not fall back to eager
    assert run(tiny, prompts, EngineConfig(compile=True, block_size=4))[0] == expected
    assert counters["stats"]["unique_graphs"] <= 2

    # A second model of the same shapes that differs in a constant the graph bakes in (each
    # norm's epsilon): it must get its own graph, not reuse the first model's.
    other = build_model(dataclasses.replace(cfg, norm_eps=1.0)).eval().requires_grad_(False)
    other.load_state_dict(model.state_dict())
    tiny_other = SimpleNamespace(model=other, tokenizer=smollm2.tokenizer, kv_dtype=torch.float32)
    expected_other = [reference_greedy(other, p) for p in prompts]
    assert expected_other != expected
    assert run(tiny_other, prompts, EngineConfig(compile=True, block_size=4))[0] == expected_other


def test_decode_compiled_ahead_is_loaded_by_later_engines(smollm2, tmp_path, monkeypatch, caplog):
    """`pellucid compile` (ModelRunner.compile_ahead): the decode step built once as a package
    per kind of step (aot_decode.py); a later engine of the same architecture loads it instead
    of compiling, and its greedy tokens stay the reference's, alone and batched. A model that
    differs in a constant the graph bakes in gets packages of its own; a damaged package is
    reported and the step runs eagerly. One random layer with SmolLM2's shapes, and the few-row
    kind only (compiling takes about half a minute per kind, on one core under `make test`): the
    many-row kind is the same build at other dims, and its package for the real SmolLM2 (built
    by `make setup`) is checked below (test_the_many_row_package_reads_the_models_dense_copies)
    and in test_quant's 12-row replies."""
    from pellucid.engine import aot_decode, compiled_decode
    from pellucid.models import build_model

    monkeypatch.setenv("PELLUCID_CACHE_DIR", str(tmp_path))
    prompts = smollm2_prompts(smollm2)
    tiny = random_smollm2(smollm2, n_layers=1)
    model, cfg = tiny.model, tiny.model.cfg
    expected = [reference_greedy(model, p) for p in prompts]
    config = EngineConfig(block_size=4)
    _, engine = run(tiny, prompts[:1], config)
    assert engine.model_runner.compiled_decode is None  # nothing built yet: eager
    # an engine that looks for the package while it is built (as LLM does once aot_build.py
    # has started the build)
    _, watching = run(tiny, prompts[:1], config)
    watching.model_runner.watch_for_packages(aot_decode.package_paths(model)[1])
    assert watching.model_runner.compiled_decode.steps == 0
    paths = engine.model_runner.compile_ahead(kinds=[1])
    assert paths == [aot_decode.package_paths(model)[1]] and paths[0].parent == tmp_path / "aot"
    monkeypatch.setattr(compiled_decode, "LOOK_EVERY", 0.0)
    seq = watching.add_request(prompts[0], GREEDY)
    while watching.has_unfinished():
        watching.step()
    assert seq.output_ids == expected[0]
    assert watching.model_runner.compiled_decode.steps == N_NEW - 1  # switched at once

    out, engine = run(tiny, prompts[:1], config)  # a new engine: loads, does not compile
    decode = engine.model_runner.compiled_decode
    assert set(decode.ahead) == {1, 2} and not decode.jit
    assert out == expected[:1]
    assert decode.steps == N_NEW - 1  # every decode step went through the package
    batched, engine = run(tiny, prompts, config)  # several rows, then fewer, then one
    assert batched == expected and engine.model_runner.compiled_decode.steps >= N_NEW - 1
    many = [p[: 3 + i] for i in range(3) for p in prompts]  # 12 rows: no package, eager
    batched, engine = run(tiny, many, config)
    assert batched == [reference_greedy(model, p) for p in many]
    assert engine.model_runner.compiled_decode.steps < N_NEW - 1  # the few-row steps only

    other = build_model(dataclasses.replace(cfg, norm_eps=1.0)).eval().requires_grad_(False)
    assert aot_decode.package_paths(other)[1] != paths[0]
    assert aot_decode.load(other) == {}

    paths[0].write_bytes(b"not a package")
    out, engine = run(tiny, prompts[:1], config)
    assert out == expected[:1] and engine.model_runner.compiled_decode is None
    assert "run `pellucid compile` again" in caplog.text


def test_a_rows_logits_on_the_few_row_package_do_not_depend_on_the_rows_beside_it(smollm2_path):
    """The default path's package for 1-8 decoding rows is one graph: a row's logits are the
    same, to the bit, alone and beside others (a request's guesses, its batch-mates), so a
    greedy reply does not change when they join. (float32 would not: its GEMM takes another
    kernel for one row.)"""
    from pellucid import LLM
    from pellucid.engine import model_runner

    llm = LLM(smollm2_path)
    runner = llm.engine.model_runner
    decode = runner.compiled_decode
    if decode is None or decode.ahead.get(1) is None:
        pytest.skip("no few-row package built for SmolLM2 here (make run builds it)")
    assert all(decode.ahead[k] is decode.ahead[1] for k in (1, 2))
    runner.scratch = model_runner._scratch(runner.pool)  # a pool no request writes
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        alone = decode(*runner.example_step(1))[0]
        for rows in range(2, DENSE_ROWS + 1):
            ids, positions, ctx = runner.example_step(rows)
            ids[0, 1:].random_(0, 1000, generator=generator)  # row 0 as alone, the rest not
            beside = decode(ids, positions, ctx)
            assert torch.equal(beside[0], alone), rows
            assert not torch.equal(beside[1], alone)  # the others are rows of their own


def test_the_many_row_package_reads_the_models_dense_copies(smollm2_path):
    """The default path's package for steps of 9-128 decoding rows (built by `make setup`)
    multiplies by the packed layers' dense copies, handed over at its first step: it stores no
    copy of its own (SmolLM2's would be 212 MB), and its logits are the eager step's (12 rows
    of random tokens): to the bit where rowdot takes every product."""
    from pellucid import LLM
    from pellucid.engine import aot_decode, model_runner
    from pellucid.models import quant, rowdot

    llm = LLM(smollm2_path)
    runner = llm.engine.model_runner
    step = runner.compiled_decode.ahead.get(9) if runner.compiled_decode else None
    if step is None:
        pytest.skip("no many-row package built for SmolLM2 here (make setup builds it)")
    assert step.loader is None and step.path.stat().st_size < 20e6
    runner.scratch = model_runner._scratch(runner.pool)  # a pool no request writes
    ids, positions, ctx = runner.example_step(12)
    ids.random_(0, 1000, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        eager = llm.model.compute_logits(llm.model.hidden_states(ids, positions, ctx)[0])
        packaged = step(ids, positions, ctx)
    assert step.loader is not None and isinstance(step, aot_decode.AotDecode)
    if rowdot.available() and quant.rowdot_rows() == quant.ROWDOT_ROWS:
        # every product is rowdot's (SmolLM2's int4 layers and its int8 head), as in the eager
        # step, and the package rounds as it does
        assert torch.equal(packaged, eager)
    # with AMX the package multiplies by bf16 copies in oneDNN's tiles: close (a wrong matrix
    # would be off by ~100%)
    err = (packaged.float() - eager.float()).norm() / eager.float().norm()
    assert err < 0.15 and torch.equal(packaged.argmax(-1), eager.argmax(-1)), err


def test_a_traced_request_keeps_its_batch_on_the_compiled_step(smollm2_path):
    """A traced request's steps read only the step's logits, so its batch stays on the step
    compiled ahead and its tokens are its untraced ones, whatever the trace asks: attention
    and the logit lens come from one pass over its positions once it is done."""
    from pellucid import LLM
    from pellucid.engine import TraceOptions

    llm = LLM(smollm2_path)
    decode = llm.engine.model_runner.compiled_decode
    if decode is None or 2 not in decode.ahead:
        pytest.skip("no package for a few rows built for SmolLM2 here (make run builds it)")
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    untraced = [o.token_ids for o in llm.generate(prompts, plain)]
    for trace in (True, TraceOptions(attention_layers=[0], logit_lens=True)):
        before = decode.steps
        params = [dataclasses.replace(plain, trace=trace), plain, plain]
        seqs = [llm.engine.add_request(llm.encode(t), p) for t, p in zip(prompts, params)]
        while llm.engine.has_unfinished():
            llm.engine.step()
        assert [s.output_ids for s in seqs] == untraced
        t = seqs[0].trace.trace
        assert len(t.steps) == 8  # pre-fill, then 7 decode steps
        assert decode.steps - before == 7, trace
        if trace is not True:
            assert len(t.attention_for(0).steps) == 7 and all(s.lens for s in t.steps)
            assert t.analysis_seconds > 0
    # the pass after the answer recomputes K/V (rounded unlike the compiled steps), and puts
    # the cache's back: the blocks it leaves hold what the steps wrote
    engine, analyse, kept = llm.engine, llm.engine._analyse, []

    def spied(seq):
        table = torch.tensor(seq.block_table)
        caches = (*engine.pool.k, *engine.pool.v)
        before = [c[table].clone() for c in caches]
        analyse(seq)
        kept.append(all(torch.equal(b, c[table]) for b, c in zip(before, caches)))

    engine._analyse = spied
    llm.generate(prompts[0], dataclasses.replace(plain, trace=TraceOptions(logit_lens=True)))
    assert kept == [True]
