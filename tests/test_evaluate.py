"""`pellucid eval`: bits per byte and multiple-choice accuracy, against the same numbers worked
out from the model's full-forward logits; generation checks against the model's own greedy
replies; malformed task files refused by file and line."""

from __future__ import annotations

import json
import math

import pytest

from pellucid import SamplingParams
from pellucid.train.evaluate import (
    EvalError,
    bits_per_byte,
    generation,
    multiple_choice,
    read_generation_task,
    read_task,
)

TEXT = "It was the best of times, it was the worst of times.\n" * 12


def test_bits_per_byte_is_the_logits_over_the_bytes(tiny, tmp_path):
    path = tmp_path / "text.txt"
    path.write_text(TEXT)
    got = bits_per_byte(tiny, str(path), window=100)
    ids = tiny.tokenizer.encode(TEXT, add_special=False, parse_special=False)
    bits = n_bytes = 0
    for at in range(0, len(ids), 100):  # the same windows, each from a full forward
        window = ids[at : at + 100]
        logprobs = tiny.logits(window).log_softmax(-1)
        bits -= sum(float(logprobs[i, window[i + 1]]) for i in range(len(window) - 1))
        n_bytes += sum(len(tiny.tokenizer.id_to_bytes(t)) for t in window[1:])
    assert got.bytes == n_bytes and got.tokens == len(ids) - math.ceil(len(ids) / 100)
    assert got.bits_per_byte == pytest.approx(bits / math.log(2) / n_bytes, rel=1e-4)


def test_multiple_choice_picks_the_likeliest_choice(tiny, tmp_path):
    docs = [
        {"question": "abc", "choices": ["d", "zz", "q"], "answer": 0},
        {"question": "hello", "choices": [" world", "!!"], "answer": 1},
    ]
    path = tmp_path / "task.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    got = multiple_choice(tiny, path)
    right = right_norm = 0
    for d in docs:
        q = tiny.tokenizer.encode(d["question"], add_special=True, parse_special=False)
        scores = []
        for c in d["choices"]:
            ids = q + tiny.tokenizer.encode(c, add_special=False, parse_special=False)
            logprobs = tiny.logits(ids).log_softmax(-1)
            scores.append(sum(float(logprobs[i - 1, ids[i]]) for i in range(len(q), len(ids))))
        right += max(range(len(scores)), key=scores.__getitem__) == d["answer"]
        per_byte = [s / len(c.encode()) for s, c in zip(scores, d["choices"])]
        right_norm += max(range(len(scores)), key=per_byte.__getitem__) == d["answer"]
    assert (got.questions, got.acc, got.acc_norm) == (2, right / 2, right_norm / 2)


def test_generation_checks_score_the_models_own_greedy_replies(tiny, tmp_path):
    """Targets made from the model's own replies (cut where the check cuts them): one exact,
    one whose target is part of its reply, one wrong, one cut by its stop string at once."""
    prompts = ["It was the best", "It was the worst", "the age of"]
    free = tiny.generate(prompts, SamplingParams(temperature=0, max_tokens=8))
    docs = [
        {"prompt": prompts[0], "targets": ["no", free[0].text.strip()], "stop": ["\n"]},
        {"prompt": prompts[1], "targets": [free[1].text.strip()[:3]]},  # contained, not equal
        {"prompt": prompts[2], "targets": ["\u00e9t\u00e9 perdu"]},
        # cut at its first character: an empty reply, which stopped
        {"prompt": prompts[0], "targets": [""], "stop": [free[0].text[:1]]},
    ]
    path = tmp_path / "gen.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    got = generation(tiny, path, max_tokens=8)
    replies = [
        tiny.generate(
            d["prompt"], SamplingParams(temperature=0, max_tokens=8, stop=d.get("stop", ["\n"]))
        )[0]
        for d in docs
    ]
    assert replies[3].text == "" and replies[3].finish_reason == "stop"
    exact = sum(r.text.strip() in [t.strip() for t in d["targets"]] for r, d in zip(replies, docs))
    stopped = sum(r.finish_reason == "stop" for r in replies)
    assert got.questions == 4 and got.exact_match == exact / 4 and got.stopped == stopped / 4
    contains = [
        any(t.strip() and t.strip() in r.text for t in d["targets"]) for r, d in zip(replies, docs)
    ]
    assert got.contains == sum(contains) / 4
    assert contains[1] and replies[1].text.strip() != docs[1]["targets"][0]  # in it, not equal
    assert exact >= 2  # the first and the last check were built to be right


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"prompt": "p", "targets": []}\n', r"gen.jsonl:1: expected"),
        ('{"prompt": "", "targets": ["a"]}\n', r"gen.jsonl:1: expected"),
        ('{"prompt": "p", "targets": ["a"], "stop": [""]}\n', r"gen.jsonl:1: expected"),
        ('{"prompt": "p", "targets": ["a"]}\n{"prompt"\n', r"gen.jsonl:2: not JSON"),
    ],
)
def test_malformed_generation_files_are_refused_by_file_and_line(tmp_path, content, message):
    path = tmp_path / "gen.jsonl"
    path.write_text(content)
    with pytest.raises(EvalError, match=message):
        read_generation_task(path)


@pytest.mark.parametrize(
    "content, message",
    [
        (
            '{"question": "q", "choices": ["a", "b"], "answer": 0}\nnot json\n',
            r"task.jsonl:2: not JSON",
        ),
        ('{"question": "q", "choices": ["a"], "answer": 0}\n', r"task.jsonl:1: expected"),
        ('{"question": "q", "choices": ["a", "b"], "answer": 2}\n', r"task.jsonl:1: expected"),
        ("\n", "no questions in it"),
    ],
)
def test_malformed_task_files_are_refused_by_file_and_line(tmp_path, content, message):
    path = tmp_path / "task.jsonl"
    path.write_text(content)
    with pytest.raises(EvalError, match=message):
        read_task(path)


def test_an_unknown_source_says_what_it_takes(tiny):
    with pytest.raises(EvalError, match="neither a corpus"):
        bits_per_byte(tiny, "no-such-corpus")


def test_the_eval_command_writes_its_table_and_json(tiny_path, tmp_path, capsys):
    from pellucid.cli import main

    text, task = tmp_path / "text.txt", tmp_path / "facts.jsonl"
    text.write_text(TEXT)
    task.write_text('{"question": "abc", "choices": ["d", "e"], "answer": 0}\n')
    checks = tmp_path / "checks.jsonl"
    checks.write_text('{"prompt": "abc", "targets": ["d"]}\n{"prompt": "x", "targets": ["y"]}\n')
    out = tmp_path / "eval.json"
    argv = ["eval", "--model", str(tiny_path), "--dtype", "float32", "--bpb", str(text)]
    assert main([*argv, "--task", str(task), str(checks), "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert [r["kind"] for r in results] == ["BitsPerByte", "MultipleChoice", "Generation"]
    assert results[0]["bits_per_byte"] > 0 and results[1]["questions"] == 1
    assert results[2]["questions"] == 2 and results[2]["chat"] is False
    assert "bits per byte" in capsys.readouterr().out
    assert main([*argv, "--task", str(tmp_path / "missing.jsonl")]) == 1  # one line, no traceback
    assert "missing.jsonl: no such task file" in capsys.readouterr().err


def test_bigbench_examples_become_questions_with_the_tasks_prefixes():
    from pellucid.train.bigbench import to_questions

    task = {  # the shape of bigbench/benchmark_tasks/*/task.json
        "name": "t",
        "example_output_prefix": "\nAnswer: ",
        "examples": [
            {"input": "Is fire cold?", "target_scores": {"Yes": 0, "No": 1}},
            {"input": "Write a poem.", "target": "roses"},  # generation: left out
        ],
    }
    assert to_questions(task) == [
        {"question": "Q: Is fire cold?\nAnswer:", "choices": [" Yes", " No"], "answer": 1}
    ]
    with pytest.raises(ValueError, match="no multiple-choice examples"):
        to_questions({"name": "g", "examples": [{"input": "x", "target": "y"}]})


def test_bigbench_generation_examples_become_few_shot_prompts():
    from pellucid.train.bigbench import to_docs, to_prompts

    task = {  # linguistic_mappings/plural_irregular_json's shape
        "name": "plural",
        "example_input_prefix": "Singular: ",
        "example_output_prefix": ". Plural: ",
        "few_shot_example_separator": ". ",
        "examples": [
            {"input": f"w{i}", "target": f"w{i}s" if i != 4 else ["w4s", "w4x"]} for i in range(5)
        ],
    }
    got = to_prompts(task, shots=3)
    shown = "Singular: w0. Plural: w0s. Singular: w1. Plural: w1s. Singular: w2. Plural: w2s. "
    assert got == [
        {"prompt": shown + "Singular: w3. Plural:", "targets": ["w3s"], "stop": ["\n", "."]},
        {"prompt": shown + "Singular: w4. Plural:", "targets": ["w4s", "w4x"], "stop": ["\n", "."]},
    ]
    assert to_docs(task) == got  # no choices in it: its generation examples
    with pytest.raises(ValueError, match="no examples with choices or targets"):
        to_prompts({"name": "few", "examples": [{"input": "x", "target": "y"}]}, shots=3)


@pytest.mark.parametrize("name", ["", "../../etc/passwd", "a//b", "./x"])
def test_a_bigbench_name_outside_its_tasks_is_refused_before_any_fetch(name):
    from pellucid.train.bigbench import task_file

    with pytest.raises(ValueError, match="not a task name"):
        task_file(name)


def test_bfcl_scores_its_own_ground_truth_right_and_a_changed_value_wrong():
    """Replies made of BFCL's ground-truth calls pass its checker through our scoring; the same
    with one value changed is still a valid call but not a right one."""
    from pellucid.structured import ToolCall
    from pellucid.train import bfcl

    category = bfcl.category("simple")
    entries = bfcl.load(category, 3)
    replies = {}
    for i, entry in enumerate(entries):
        ((name, accepted),) = entry["answer"][0].items()  # one call: arg -> accepted values
        args = {k: v[0] for k, v in accepted.items() if v[0] != ""}  # "": may be left out
        if i == 2:
            first = next(iter(args))
            args[first] += 1000  # a number, as these three take: still the schema's type
        call = ToolCall(name.replace(".", "_"), json.dumps(args))
        replies[entry["id"]] = bfcl.Reply([call], [], "stop", 10, "", 0)
    checker, language = bfcl.load_checker()
    row = bfcl.score(category, entries, replies, {}, 1.0, checker, language)
    assert (row["valid"], row["ast_correct"]) == (3, 2)
    assert row["replies"][2]["ast"].startswith("value_error")


def test_the_eval_command_runs_bfcl_with_the_grammar_on(smollm2_path, tmp_path, capsys):
    from pellucid.cli import main

    out = tmp_path / "eval.json"
    argv = ["eval", "--model", str(smollm2_path), "--bpb"]
    assert main([*argv, "--task", "bfcl:simple", "--limit", "2", "--json", str(out)]) == 0
    (result,) = json.loads(out.read_text())["results"]
    assert result["kind"] == "ToolCalling" and result["questions"] == 2
    assert result["valid"] == 1.0  # the grammar admits only calls the schema allows
    assert "tool calls" in capsys.readouterr().out
    assert main([*argv, "--task", "bfcl:simplest"]) == 1  # before the model loads
    assert "no BFCL category 'simplest'" in capsys.readouterr().err


def test_a_report_card_puts_a_trained_model_beside_another_on_the_same_tasks(
    tiny_path, tmp_path, capsys
):
    """`pellucid eval --report --compare --training-run`: report.md's eval table holds each model's
    figures as the JSON has them, the run's steps and loss curve, and sample chats for a model
    with a chat template (the tiny models have none: it says so)."""
    from helpers import prepare_tiny_corpus, tiny_config

    from pellucid.cli import main
    from pellucid.train.export import export_checkpoint
    from pellucid.train.trainer import Trainer

    prepare_tiny_corpus(tmp_path, "byte")
    Trainer(tiny_config(tmp_path / "data", tmp_path / "run", max_iters=4), verbose=False).run()
    model = export_checkpoint(tmp_path / "run", tmp_path / "model")
    text, checks = tmp_path / "text.txt", tmp_path / "checks.jsonl"
    text.write_text(TEXT)
    checks.write_text('{"prompt": "It was", "targets": [" the"]}\n')
    report, out = tmp_path / "card" / "report.md", tmp_path / "eval.json"
    argv = ["eval", "--model", str(model), "--dtype", "float32", "--bpb", str(text)]
    argv += ["--task", str(checks), "--report", str(report), "--compare", str(tiny_path)]
    assert main([*argv, "--training-run", str(tmp_path / "run"), "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    mine, other = got["results"], got["compare"][str(tiny_path)]
    card = report.read_text()
    assert "## Training" in card and "- 4 steps, " in card
    assert (report.parent / "loss.png").is_file() and "![loss](loss.png)" in card
    bpb = f"| bits per byte: text.txt (lower is better) | {mine[0]['bits_per_byte']:.4f} | "
    assert bpb + f"{other[0]['bits_per_byte']:.4f} |" in card
    assert f"checks: exact / contains / stopped (1) | {mine[1]['exact_match']:.3f}" in card
    assert card.count("No chat template in its files: not asked.") == 2  # neither has one
