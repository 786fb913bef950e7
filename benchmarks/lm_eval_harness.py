"""lm-evaluation-harness scores a model through `pellucid serve`, as its users run it against
vLLM: the `local-completions` model (prompt tokens' logprobs from `/v1/completions` with `echo`,
`logprobs` and `max_tokens`), its tokenizer read from the server (`/tokenizer_info`,
`/tokenize`), on a multiple-choice task given as a local YAML over a local JSONL (no hub).

The check: every log-likelihood lm-eval reads through the server equals the one pellucid computes
itself for the same tokens (`LLM.prompt_logprobs`), and so does the accuracy. The task's
questions are written below (world capitals and simple facts): a harness check, not a benchmark
of the model's knowledge.

    .venv/bin/pip install 'lm-eval[api]==0.4.13'
    .venv/bin/python benchmarks/lm_eval_harness.py [--model smollm2-135m]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # run as a script from anywhere

from common import save

QUESTIONS = [
    ("The capital of France is", [" Paris", " Rome", " Berlin", " Madrid"], 0),
    ("The capital of Italy is", [" Paris", " Rome", " Vienna", " Lisbon"], 1),
    ("The capital of Germany is", [" Munich", " Hamburg", " Berlin", " Bonn"], 2),
    ("The capital of Japan is", [" Osaka", " Kyoto", " Seoul", " Tokyo"], 3),
    ("The capital of Spain is", [" Madrid", " Barcelona", " Seville", " Porto"], 0),
    ("The capital of Egypt is", [" Alexandria", " Cairo", " Giza", " Tunis"], 1),
    ("The capital of Canada is", [" Toronto", " Vancouver", " Ottawa", " Montreal"], 2),
    ("The capital of Australia is", [" Sydney", " Melbourne", " Perth", " Canberra"], 3),
    ("Water freezes at a temperature of", [" 0 degrees Celsius", " 50 degrees Celsius"], 0),
    ("The largest planet in the solar system is", [" Mercury", " Jupiter", " Mars"], 1),
    ("A week has", [" five days", " six days", " seven days", " ten days"], 2),
    ("The opposite of hot is", [" warm", " loud", " bright", " cold"], 3),
    ("Bees make", [" honey", " milk", " silk", " wool"], 0),
    ("The sun rises in the", [" west", " east", " north", " south"], 1),
    ("Two plus two equals", [" three", " five", " four", " six"], 2),
    ("The color of grass is usually", [" blue", " red", " purple", " green"], 3),
]

TASK = """task: pellucid_facts
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def write_task(folder: Path) -> None:
    data = folder / "facts.jsonl"
    data.write_text(
        "".join(
            json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS
        )
    )
    (folder / "pellucid_facts.yaml").write_text(TASK.format(data=data))


def serve(llm, name: str) -> tuple[str, object]:
    """`create_app(llm)` on a free loopback port, in a thread."""
    import uvicorn

    from pellucid.server import create_app

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(llm, model_name=name), log_level="warning"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", server


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    args = ap.parse_args()
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the JSON builder is local: no hub
    import lm_eval
    from lm_eval.tasks import TaskManager

    from pellucid import LLM

    llm = LLM(args.model)
    url, server = serve(llm, args.model)
    with tempfile.TemporaryDirectory() as tmp:
        write_task(Path(tmp))
        start = time.perf_counter()
        result = lm_eval.simple_evaluate(
            model="local-completions",
            model_args=f"base_url={url}/v1/completions,model={args.model},"
            "tokenizer_backend=remote,num_concurrent=1,max_retries=1",
            tasks=["pellucid_facts"],
            task_manager=TaskManager(include_path=tmp),
            log_samples=True,
        )
        seconds = time.perf_counter() - start
    server.should_exit = True
    samples = result["samples"]["pellucid_facts"]
    # pellucid's own log-likelihoods of the same tokens: context, then continuation, each
    # tokenized alone as lm-eval's remote tokenizer does (no special tokens added)
    tok = llm.tokenizer
    worst, own_correct = 0.0, 0
    for sample in samples:
        doc = sample["doc"]
        context = tok.encode(doc["question"], add_special=False, parse_special=True)
        scores = []
        # filtered_resps: one (log-likelihood, is_greedy) per choice
        for choice, (theirs, _) in zip(doc["choices"], sample["filtered_resps"], strict=True):
            cont = tok.encode(choice, add_special=False, parse_special=True)
            (rows,) = llm.prompt_logprobs([context + cont])
            ours = sum(r.logprob for r in rows[len(context) - 1 :])
            worst = max(worst, abs(ours - float(theirs)))
            scores.append(ours)
        own_correct += max(range(len(scores)), key=scores.__getitem__) == doc["answer"]
    acc = result["results"]["pellucid_facts"]["acc,none"]
    own = own_correct / len(samples)
    print(
        f"lm-eval local-completions through pellucid serve: acc {acc:.3f} on {len(samples)} "
        f"questions in {seconds:.1f} s; pellucid's own scoring: acc {own:.3f}; largest "
        f"log-likelihood difference {worst:.2e}"
    )
    assert acc == own and worst < 1e-3, "the harness read something else than pellucid scores"
    save(
        "lm_eval_harness",
        {
            "model": args.model,
            "workload": f"{len(samples)} multiple-choice questions (local YAML + JSONL), "
            "lm-eval 0.4.13 local-completions, remote tokenizer",
            "acc_through_server": acc,
            "acc_pellucid_direct": own,
            "max_loglikelihood_difference": worst,
            "seconds": round(seconds, 2),
        },
    )


if __name__ == "__main__":
    main()
