"""Shared fixtures: each real model is loaded once per test session (Gemma takes ~15 s the first
time, before its weight cache holds it), and a tiny random-weight model for the fast tier.

Tiers: `make test-fast` runs the tests not marked `slow`, in about a minute and a half on 2
cores; `make test` runs all. A test is `slow` when it uses a real checkpoint (the fixtures in
REAL_MODELS, marked here at collection) or starts processes (marked where it is written).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
from helpers import KEY, MODEL, Running, client_of, serving

from pellucid import LLM, catalog
from pellucid.models import build_model
from pellucid.models.config import ModelConfig
from pellucid.train.char_tokenizer import byte_tokenizer, save_tokenizer
from pellucid.train.hf_export import export_hf
from pellucid.train.init import init_weights

DATA = Path(__file__).parent / "data"
# Each pytest-xdist worker takes its share of the cores (`make test` runs 2 workers): two workers
# of two threads each on 2 cores would oversubscribe them, and every parallel region's barrier
# would wait on a thread the other worker had descheduled. The processes tests start inherit it.
THREADS = max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
torch.set_num_threads(THREADS)
os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))
# No decode step built in the background for models without one (engine/aot_build.py): a test's
# random models would each start a compile beside the suite. The test of it turns it on.
os.environ["PELLUCID_BUILD_AHEAD"] = "0"
REAL_MODELS = {
    *("smollm2", "smollm2_short", "smollm2_path", "gemma3", "gemma3_path"),
    *("model_name", "any_llm"),
    *("smollm2_tok", "gemma3_tok", "hf_folder_copies", "model"),  # test_tokenizer's
}
# The files that take longest under `make test` (half a minute to two minutes each on 2 cores),
# longest first: they start first (the Makefile turns off xdist's own order, by count of
# tests), so that the two workers end a short file apart instead of one idling while the other
# runs a long one
LONG_FILES = (
    *("test_replicas.py", "test_engine.py", "test_speculative.py", "test_architectures.py"),
    *("test_models.py", "test_explorer.py", "test_server.py", "test_train_fsdp.py"),
    *("test_quant.py", "test_server_lifecycle.py", "test_speedrun.py", "test_server_tools.py"),
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if REAL_MODELS & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    first = {name: rank for rank, name in enumerate(LONG_FILES)}
    # a stable sort: the other files, and the tests within each file, keep their order
    items.sort(key=lambda item: first.get(item.path.name, len(LONG_FILES)))


# A Llama of 2 layers with grouped K/V heads, random weights, byte-level tokens: every path of
# the engine in milliseconds. Its outputs are meaningless; the tests compare paths with each other.
TINY = ModelConfig(
    arch="llama",
    vocab_size=256,
    dim=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=16,
    ffn_dim=128,
    norm_eps=1e-5,
    rope_theta=10_000.0,
    context_length=512,
)


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model as a Hugging Face folder, as a user would bring one."""
    folder = tmp_path_factory.mktemp("tiny")
    save_tokenizer(byte_tokenizer(), folder / "tokenizer")
    model = build_model(TINY)
    init_weights(model, torch.Generator().manual_seed(0))
    return export_hf(model, folder / "tokenizer", folder / "model")


@pytest.fixture(scope="session")
def tiny(tiny_path: Path) -> LLM:
    return LLM(tiny_path, dtype="float32")


def load_reference(name: str) -> dict:
    return json.loads((DATA / f"public_{name}.json").read_text())


@pytest.fixture(autouse=True)
def restore_threads():
    """Tiny models train fastest on one thread; put back what the rest of the suite uses."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return catalog.resolve("smollm2-135m")


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    return catalog.resolve("gemma3-270m")


@pytest.fixture(scope="session")
def smollm2() -> LLM:
    return LLM("smollm2-135m", dtype="float32")


@pytest.fixture(scope="module")
def server(smollm2: LLM) -> Iterator[Running]:
    """`pellucid serve`'s app on SmolLM2, with the tests' API key, one per test module (a module
    that needs another kind defines its own `server`)."""
    from pellucid.server import create_app

    with serving(create_app(smollm2, api_key=KEY, model_name=MODEL)) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: Running) -> openai.OpenAI:
    return client_of(server)


@pytest.fixture(scope="session")
def smollm2_short() -> LLM:
    """SmolLM2 with a 32-token context, to reach the context limit quickly."""
    return LLM("smollm2-135m", dtype="float32", max_model_len=32)


@pytest.fixture(scope="session")
def gemma3() -> LLM:
    return LLM("gemma3-270m", dtype="float32")


@pytest.fixture(scope="session")
def reference_smollm2() -> dict:
    return load_reference("smollm2")


@pytest.fixture(scope="session")
def reference_gemma3() -> dict:
    return load_reference("gemma3")


@pytest.fixture(scope="session", params=["smollm2", "gemma3"])
def model_name(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def any_llm(request, model_name: str) -> LLM:
    return request.getfixturevalue(model_name)


@pytest.fixture(scope="session")
def reference(request, model_name: str) -> dict:
    return request.getfixturevalue(f"reference_{model_name}")
