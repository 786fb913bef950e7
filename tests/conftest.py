"""Shared fixtures: each real model is loaded once per test session (loading Gemma takes ~15 s)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pellucid import LLM, catalog

DATA = Path(__file__).parent / "data"
torch.set_num_threads(2)


def load_reference(name: str) -> dict:
    return json.loads((DATA / f"public_{name}.json").read_text())


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return catalog.resolve("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2() -> LLM:
    return LLM("smollm2-135m", dtype="float32")


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
