"""`pellucid speedrun`: every stage on the packaged data at a toy size, the chat model it leaves
behind (ChatML, its end-of-turn token, the GGUF agreeing with the HF folder), held-out text kept
out of pre-training, a rerun that skips what finished, an interrupted stage that leaves nothing;
the IsoFLOP arithmetic of sizing.py on valleys of known bottoms."""

from __future__ import annotations

import json
import math

import pytest

from pellucid import LLM, SamplingParams
from pellucid.train import sharegpt, sizing, speedrun
from pellucid.train.corpora import corpus_text
from pellucid.train.evaluate import held_out_text, training_text
from pellucid.train.speedrun import IM_END, IM_START
from pellucid.train.speedrun_config import STAGES, SpeedrunConfig, SpeedrunError

TOY = {
    "minutes": 0.05,
    "vocab_size": 512,
    "block_size": 128,
    "tokenizer_chars": 300_000,
    "max_chars": 300_000,
    "sft_chats": 16,
    "held_out_chats": 4,
    "sft_epochs": 1,
    "compare": (),
    "tasks": ("bigbench:hindu_knowledge",),
    "eval_bytes": 4_000,
    "sweep": {"batch_size": 2, "block_size": 128},  # the IsoFLOP runs' steps: a quarter of theirs
}


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory):
    cfg = SpeedrunConfig(out=tmp_path_factory.mktemp("speedrun"), **TOY)
    lines: list[str] = []
    speedrun.speedrun(cfg, log=lines.append)
    return cfg, lines


@pytest.mark.slow
def test_every_stage_finishes_and_a_rerun_skips_them(toy_run):
    cfg, _ = toy_run
    written = {name: (cfg.out / name / "stage.json").stat().st_mtime_ns for name in STAGES}
    again: list[str] = []
    speedrun.speedrun(cfg, log=again.append)
    assert again == [f"[{name}] finished before: skipped" for name in STAGES]
    assert {n: (cfg.out / n / "stage.json").stat().st_mtime_ns for n in STAGES} == written
    report = (cfg.out / "report" / "report.md").read_text()
    for part in ("## Speedrun", "IsoFLOP", "bits per byte: shakespeare", "held_out as chat"):
        assert part in report
    # the size chosen is the law's at the compute its depth gets through in the minutes
    size = json.loads((cfg.out / "sizing" / "stage.json").read_text())
    law, runs = sizing.SizeLaw(**size["law"]), [sizing.SweepRun(**r) for r in size["runs"]]
    vocab = json.loads((cfg.out / "data" / "stage.json").read_text())["vocab_size"]
    assert size["depth"] == sizing.choose_depth(law, cfg.minutes * 60, vocab, runs)
    budget = sizing.flops_per_s(runs, size["depth"]) * cfg.minutes * 60
    assert size["budget_flops"] == pytest.approx(budget, rel=1e-9)


@pytest.mark.slow
def test_the_chat_model_speaks_chatml_and_stops_at_its_end_of_turn(toy_run):
    cfg, _ = toy_run
    llm = LLM(cfg.out / "chat", dtype="float32")
    tok = llm.tokenizer
    prompt = llm.chat_prompt([{"role": "user", "content": "Hi"}])
    assert tok.decode(prompt, skip_special=False) == "<|im_start|>user\nHi<|im_end|>\n" + (
        "<|im_start|>assistant\n"
    )
    im_end = tok.encode("<|im_end|>", add_special=False, parse_special=True)
    assert len(im_end) == 1 and im_end[0] in tok.eos_ids  # one control token that ends a reply
    # the GGUF export is the same model: the same greedy reply
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    gguf = LLM(cfg.out / "gguf" / "chat.gguf", dtype="float32")
    assert (
        gguf.generate([prompt], params)[0].token_ids == llm.generate([prompt], params)[0].token_ids
    )


@pytest.mark.slow
def test_what_is_scored_was_not_trained_on(toy_run):
    cfg, _ = toy_run
    text = (cfg.out / "corpus" / "pretrain.txt").read_text()
    for source in ("shakespeare", "kjv"):  # the tails bits per byte reads
        assert held_out_text(source)[:2_000] not in text
    held = [json.loads(line) for line in (cfg.out / "corpus" / "held_out.jsonl").open()]
    sft = [json.loads(line) for line in (cfg.out / "corpus" / "sft.jsonl").open()]
    assert len(sft) == TOY["sft_chats"] and len(held) == TOY["held_out_chats"]
    questions = [c["prompt"] for c in held] + [c["messages"][0]["content"] for c in sft]
    assert len(set(questions)) == len(questions)  # no question both held out and tuned on
    for question in questions:  # nor asked anywhere in pre-training (ShareGPT repeats some)
        assert f"{IM_START}user\n{question}{IM_END}" not in text


def test_an_interrupted_stage_leaves_nothing_and_says_how_to_go_on(tmp_path, monkeypatch):
    def interrupted(cfg, folder, log):
        (folder / "half.txt").write_text("half")
        raise KeyboardInterrupt

    monkeypatch.setitem(speedrun.STAGE_RUNS, "corpus", interrupted)
    cfg = SpeedrunConfig(out=tmp_path / "run", **TOY)
    with pytest.raises(SpeedrunError, match="interrupted in stage corpus.*run the same command"):
        speedrun.speedrun(cfg, log=lambda line: None)
    assert list((tmp_path / "run").iterdir()) == []


def test_held_out_and_training_text_split_each_corpus():
    for source in ("shakespeare", "kjv"):
        assert training_text(source) + held_out_text(source) == corpus_text(source)


def test_sharegpt_conversations_alternate_and_render_as_chatml():
    chats = sharegpt.conversations()
    assert len(chats) > 10_000
    assert all(
        [m["role"] for m in chat] == ["user", "assistant"] * (len(chat) // 2) for chat in chats
    )
    chat = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert (
        sharegpt.as_text(chat)
        == "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\nb<|im_end|>\n"
    )
    assert sharegpt.is_short_exchange(chat)
    assert not sharegpt.is_short_exchange([chat[0], {"role": "assistant", "content": "é"}])


def _runs(bottoms: dict[float, float]) -> list[sizing.SweepRun]:
    """Valleys loss = 3 + (log N - log bottom)² at each budget, over the sweep's depths."""
    return [
        sizing.SweepRun(d, sizing.size_of(d, 512), c, 0, 3 + math.log(sizing.size_of(d, 512) / n) ** 2, 1.0)
        for c, n in bottoms.items()
        for d in sizing.DEPTHS
    ]  # fmt: skip


def test_the_law_goes_through_each_valleys_bottom():
    lo, hi = sizing.size_of(1, 512), sizing.size_of(4, 512)
    bottoms = {c: 5 * c**0.4 for c in (1e12, 4e12, 1.6e13)}
    assert all(lo < n < hi for n in bottoms.values())  # inside the sizes tried
    law = sizing.fit_law(_runs(bottoms))
    assert law.a == pytest.approx(0.4, rel=1e-6) and law.k == pytest.approx(5, rel=1e-5)
    assert law.note == "fitted"


def test_without_two_valley_bottoms_the_size_is_chinchillas():
    chinchilla = pytest.approx((2e12 / 120) ** 0.5, rel=1e-9)
    # bottoms among the sizes, but fewer parameters for more compute: not a law
    shrinking = sizing.fit_law(_runs({1e12: sizing.size_of(3, 512), 2e12: sizing.size_of(2, 512)}))
    assert "exponent -" in shrinking.note and shrinking.size_at(2e12) == chinchilla
    # every budget's best is the smallest size: the bottoms lie below what was tried
    below = sizing.fit_law(_runs({1e12: 1e3, 2e12: 2e3}))
    assert [n for _, n in below.optima] == pytest.approx([sizing.size_of(1, 512)] * 2)
    assert below.note.startswith("0 of 2 valleys") and below.size_at(2e12) == chinchilla


def test_the_depth_chosen_wants_its_own_size_for_the_compute_it_gets_done():
    # twice the speed at depth 2 as at depth 1; the law wants N = C^0.5
    runs = [sizing.SweepRun(d, sizing.size_of(d, 512), 1.0, 0, 5.0, 1e9 * d) for d in (1, 2)]
    law = sizing.SizeLaw(1.0, 0.5, [], "")
    two = sizing.size_of(2, 512)
    seconds = two**2 / 2e9  # depth 2's compute in that time wants exactly depth 2's size
    assert sizing.choose_depth(law, seconds, 512, runs) == 2
    assert sizing.flops_per_s(runs, 7) == 2e9  # past the sweep: its deepest's speed
    assert sizing.choose_depth(law, 1e-9, 512, runs) == 1
    assert sizing.choose_depth(law, 1e12, 512, runs) == sizing.MAX_DEPTH
