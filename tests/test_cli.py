"""The `pellucid` command as a user runs it: a real subprocess, real model, real exit codes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pellucid.loading.supported import FAMILIES

pytestmark = pytest.mark.slow  # every test starts `pellucid` and loads SmolLM2


def pellucid(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pellucid", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_generate_says_paris():
    r = pellucid("generate", "The capital of France is", "--temperature", "0", "--max-tokens", "8")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "prompt tokens, pre-fill" in r.stderr and "tok/s" in r.stderr


def test_chat_session_with_reset_and_exit():
    # Not the bare question: its reply starts at a near-tie ("The" over "L" by 0.09 in float32),
    # which 8-bit rows flip to "L'Étoile, la Marseillaise..." as llama.cpp's own do. Asked for a
    # sentence, "The" leads by ~1.5 on every path.
    question = "What is the capital of France? Answer in one sentence.\n"
    script = question + "And of Germany?\n/reset\n" + question + "/exit\n"
    r = pellucid("chat", "--temperature", "0", "--max-tokens", "24", stdin=script)
    assert r.returncode == 0, r.stderr
    # Each input line is prompted with "> " (the /reset line too), so strip every prompt mark.
    replies = [line.lstrip("> ") for line in r.stdout.splitlines() if line.strip("> ")]
    assert len(replies) == 3 and "Paris" in replies[0]
    assert replies[2] == replies[0]  # after /reset the model sees the first question afresh
    assert "conversation reset" in r.stderr


def test_tokenize_json_parses_special_tokens():
    r = pellucid("tokenize", "<|im_start|>user", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["ids"][0] == 1 and out["pieces"][0] == "<|im_start|>"  # 1 is <|im_start|>


def test_errors_are_one_line_and_nonzero():
    for args in (
        ["generate", ""],
        ["generate", "hi", "--model", "no-such-model"],
        ["generate", "hi", "--top-p", "2"],
    ):
        r = pellucid(*args)
        assert r.returncode == 1
        assert r.stderr.startswith("pellucid: error: ") and r.stderr.count("\n") == 1
        assert "Traceback" not in r.stderr


def test_models_lists_the_catalog():
    r = pellucid("models")
    assert r.returncode == 0
    assert "smollm2-135m (default)" in r.stdout and "gemma3-270m" in r.stdout
    for family in FAMILIES:  # and what else loads, with how it was checked
        assert family.name in r.stdout
    assert "IQ4_XS" in r.stdout and "qwen35" in r.stdout
