"""Trainer: the training loop over the same LlamaModel the engine serves.

step: sample batch -> model(ids) logits (B, T, V) -> cross-entropy -> backward -> clip -> AdamW.
Every `eval_interval` steps: val loss and perplexity, an optional sample through the inference
engine, the loss-curve PNG and an atomic checkpoint. `Trainer(cfg, resume=True)` continues from
the checkpoint in `cfg.out` and takes bit-for-bit the steps the uninterrupted run would have.
"""

from __future__ import annotations

import math
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from pellucid.errors import PellucidError
from pellucid.models import build_model
from pellucid.models.llama import LlamaModel
from pellucid.train import ddp, fsdp
from pellucid.train.checkpoint import load_checkpoint, save_checkpoint
from pellucid.train.config import TrainConfig
from pellucid.train.data import TokenData
from pellucid.train.flops import flops_per_token, matmul_peak, n_params
from pellucid.train.hf_export import TOKENIZER_FILES
from pellucid.train.init import init_weights
from pellucid.train.plot import plot_losses
from pellucid.train.process import setup_process
from pellucid.train.progress import TrainProgress
from pellucid.train.schedule import lr_at

AUTOCAST = {"bfloat16": torch.bfloat16, "float32": None}


class TrainingDiverged(PellucidError):
    """The loss or the gradients stopped being finite numbers."""


@dataclass(slots=True)
class TrainResult:
    step: int
    train_losses: list[float]  # one per optimizer step, from step 0
    val: dict[int, float]  # step -> val loss
    tokens_per_s: float  # training steps only (evaluations excluded)
    train_seconds: float
    step_seconds: list[float]  # wall time of each step this run took
    tokens_per_step: int

    @property
    def median_tokens_per_s(self) -> float:
        """Typical speed: unlike the mean, not dragged down by moments other programs took the
        cores (shared machines)."""
        if not self.step_seconds:
            return math.nan
        ordered = sorted(self.step_seconds)
        return self.tokens_per_step / ordered[len(ordered) // 2]


class Trainer:
    def __init__(self, cfg: TrainConfig, *, resume: bool = False, verbose: bool = True):
        ckpt = load_checkpoint(Path(cfg.out)) if resume else None
        if ckpt is not None:
            cfg = TrainConfig.from_dict(ckpt["config"])
        self.cfg = cfg
        self.out = Path(cfg.out)
        self.dist = setup_process(cfg)
        self.data = TokenData.open(cfg.data)
        self.model_cfg = cfg.model_config(self.data.vocab_size)
        self.model: LlamaModel = build_model(self.model_cfg)  # on the CPU, in float32
        self.batch_gen = torch.Generator().manual_seed(cfg.seed)
        init_weights(self.model, torch.Generator().manual_seed(cfg.seed))
        if cfg.fsdp:  # before the optimizer: it holds the shards
            fsdp.shard(self.model, self.dist)
        self.optimizer = make_optimizer(self.model, cfg)
        self.step = 0
        self.history: dict[str, list] = {"train": [], "val": []}
        if ckpt is not None:
            self._restore(ckpt)
        self.ddp_model = self.model if cfg.fsdp else ddp.wrap(self.model, self.dist)
        if cfg.compile:
            self.ddp_model = torch.compile(self.ddp_model)
        self.autocast = AUTOCAST[cfg.dtype]
        if self.autocast is not None:
            self.model.attend_explicitly(cfg.block_size)
        self.verbose = verbose and self.dist.is_main
        self.peak: float | None = None  # measured matmul FLOP/s, for the MFU on the progress bar
        if self.dist.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
            # The run folder carries its tokenizer: export keeps working if the data moves.
            for name in TOKENIZER_FILES:
                if (Path(cfg.data) / name).is_file():
                    shutil.copy(Path(cfg.data) / name, self.out / name)

    # --- the loop ---------------------------------------------------------------------------
    def run(self, stop_at: int | None = None) -> TrainResult:
        """Train to max_iters (or stop after step `stop_at`, checkpointed, for a later resume)."""
        cfg, last = self.cfg, min(stop_at or self.cfg.max_iters, self.cfg.max_iters)
        progress = TrainProgress(cfg.max_iters, self.step, cfg.log_interval, self.verbose)
        progress.note(self._describe())
        if self.verbose and self.peak is None:  # once per Trainer: run() may be called in parts
            self.peak = matmul_peak(self.autocast or torch.float32)
        peak = self.peak or math.nan
        flops = flops_per_token(self.model_cfg, cfg.block_size)
        step_seconds: list[float] = []
        try:
            while self.step < last:
                if self.step % cfg.eval_interval == 0:
                    self._evaluate(progress)
                start = time.perf_counter()
                loss = self.train_step()
                step_seconds.append(time.perf_counter() - start)
                recent = sorted(step_seconds[-cfg.log_interval :])  # median of the last few
                tok_s = cfg.tokens_per_iter / recent[len(recent) // 2]
                progress.step(
                    self.step,
                    f"loss {loss:.4f} | lr {self._lr(self.step - 1):.2e} | "
                    f"{tok_s:,.0f} tok/s | MFU {flops * tok_s / peak:.1%}",
                )
                if cfg.ckpt_interval and self.step % cfg.ckpt_interval == 0:
                    self.save()
            if self.step == cfg.max_iters:
                self._evaluate(progress)
            self.save()
        finally:
            progress.close()
        train_s = sum(step_seconds)
        return TrainResult(
            step=self.step,
            train_losses=[loss for _, loss in self.history["train"]],
            val=dict(self.history["val"]),
            tokens_per_s=len(step_seconds) * cfg.tokens_per_iter / train_s if train_s else math.nan,
            train_seconds=train_s,
            step_seconds=step_seconds,
            tokens_per_step=cfg.tokens_per_iter,
        )

    def train_step(self) -> float:
        """One optimizer step over grad_accum micro-batches; returns the mean training loss."""
        cfg = self.cfg
        lr = self._lr(self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        total = torch.zeros(())
        for micro in range(cfg.grad_accum):
            x, y = self.next_batch()
            fsdp.set_gradient_sync(self.model, sync=micro == cfg.grad_accum - 1)
            with ddp.no_sync(self.ddp_model, skip=micro < cfg.grad_accum - 1):
                loss = self.loss(self.ddp_model, x, y)
                (loss / cfg.grad_accum).backward()
            total += loss.detach()
        loss = ddp.mean_across(total / cfg.grad_accum, self.dist).item()
        if not math.isfinite(loss):
            raise self._diverged("loss", loss, lr)
        # clip_grad_norm_ returns the norm before clipping: inf/nan there means a bad update
        max_norm = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
        norm = fsdp.full(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))
        norm = norm.item()
        if not math.isfinite(norm):
            raise self._diverged("gradient norm", norm, lr)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.history["train"].append((self.step, loss))
        self.step += 1
        return loss

    def next_batch(self) -> tuple[Tensor, Tensor]:
        """This rank's rows of the next global batch (every rank draws the same batch)."""
        x, y = self.data.batch("train", self.cfg.batch_size, self.cfg.block_size, self.batch_gen)
        rows = self.dist.rows(self.cfg.batch_size)
        return x[rows], y[rows]

    def loss(self, model: torch.nn.Module, x: Tensor, y: Tensor) -> Tensor:
        with torch.autocast(
            "cpu", dtype=self.autocast or torch.bfloat16, enabled=self.autocast is not None
        ):
            logits = model(x)  # (B, T, V), float32
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    # --- evaluation -------------------------------------------------------------------------
    @torch.no_grad()
    def estimate_loss(self, split: str) -> float:
        """Mean loss over eval_iters batches, the same batches at every evaluation."""
        gen = torch.Generator().manual_seed(self.cfg.seed + 1)
        self.model.eval()
        losses = [
            self.loss(
                self.model, *self.data.batch(split, self.cfg.batch_size, self.cfg.block_size, gen)
            ).item()
            for _ in range(self.cfg.eval_iters)
        ]
        self.model.train()
        return sum(losses) / len(losses)

    @torch.no_grad()
    def full_loss(self, split: str = "val", rows_per_batch: int = 64) -> float:
        """Loss over every token of the split (non-overlapping windows of block_size)."""
        windows = self.data.windows(split, self.cfg.block_size)
        self.model.eval()
        total = 0.0
        for chunk in windows.split(rows_per_batch):
            total += self.loss(self.model, chunk[:, :-1], chunk[:, 1:]).item() * len(chunk)
        self.model.train()
        return total / len(windows)

    def sample(self, max_tokens: int, prompt: str | None = None) -> str:
        """Export the live weights to OUT/model and generate from it with `LLM`: the same path
        (tokenizer, pre-fill, KV cache, sampler) that serves the model after training."""
        from pellucid import LLM, SamplingParams
        from pellucid.train.hf_export import export_hf

        folder = export_hf(self.model, self.out, self.out / "model")
        llm = LLM(folder, dtype="float32")  # the model as trained, not re-quantized
        ids = llm.encode(prompt if prompt is not None else self.cfg.sample_prompt)
        limit = self.cfg.block_size - len(ids)
        params = SamplingParams(
            max_tokens=min(max_tokens, limit), temperature=0.8, top_k=200, seed=self.cfg.seed
        )
        return llm.tokenizer.decode(ids) + llm.generate(ids, params)[0].text

    def _evaluate(self, progress: TrainProgress) -> None:
        val = self.estimate_loss("val")
        train = self.estimate_loss("train")
        if not self.history["val"] or self.history["val"][-1][0] != self.step:
            self.history["val"].append((self.step, val))
        progress.note(
            f"step {self.step}: train loss {train:.4f}, val loss {val:.4f}, "
            f"val perplexity {math.exp(val):.2f}"
        )
        if self.cfg.sample_tokens and self.verbose:
            progress.note(f"sample: {self.sample(self.cfg.sample_tokens)!r}")
        if self.dist.is_main:
            plot_losses(self.history, self.out / "loss.png", f"{self.out.name}: {self._size()}")

    # --- checkpoints ------------------------------------------------------------------------
    def save(self) -> None:
        if self.cfg.fsdp:  # every rank writes its shards
            fsdp.save(self.model, self.optimizer, self.facts(), self.out)
            return
        if self.dist.is_main:
            save_checkpoint(self.state(), self.out)
        ddp.barrier(self.dist)

    def state(self) -> dict:
        model, optimizer = self.model.state_dict(), self.optimizer.state_dict()
        return {"model": model, "optimizer": optimizer, **self.facts()}

    def facts(self) -> dict:
        """What a checkpoint holds besides the model's and optimizer's tensors."""
        return {
            "step": self.step,
            "batch_rng": self.batch_gen.get_state(),  # the data position: which batches come next
            "torch_rng": torch.get_rng_state(),
            "history": self.history,
            "config": self.cfg.to_dict(),
            "model_config": asdict(self.model_cfg),
            "data_meta": self.data.meta,
        }

    def _restore(self, ckpt: dict) -> None:
        if "sharded" in ckpt:  # however many ranks wrote it
            fsdp.restore(self.model, self.optimizer, Path(ckpt["sharded"]))
        else:
            self.model.load_state_dict(ckpt["model"])
            self.optimizer.load_state_dict(ckpt["optimizer"])
        self.batch_gen.set_state(ckpt["batch_rng"])
        torch.set_rng_state(ckpt["torch_rng"])
        self.step = ckpt["step"]
        self.history = {k: [tuple(e) for e in v] for k, v in ckpt["history"].items()}

    # --- helpers ----------------------------------------------------------------------------
    def _lr(self, step: int) -> float:
        c = self.cfg
        return lr_at(step, c.lr, c.min_lr, c.warmup_iters, c.decay_iters)

    def _diverged(self, what: str, value: float, lr: float) -> TrainingDiverged:
        saved = self.out / "ckpt.pt"
        where = f"the last good checkpoint is {saved}" if saved.exists() else "no checkpoint yet"
        return TrainingDiverged(
            f"the {what} became {value} at step {self.step} (lr {lr:.2e}); training stopped "
            f"before the update, {where}. Lower --lr, raise --warmup-iters, keep --grad-clip on, "
            "or train in --dtype float32"
        )

    def _size(self) -> str:
        return f"{n_params(self.model_cfg) / 1e6:.2f}M params"

    def _describe(self) -> str:
        c = self.cfg
        return (
            f"{self._size()} ({c.n_layers} layers, {c.n_heads} heads, dim {c.dim}, ffn "
            f"{self.model_cfg.ffn_dim}, vocab {self.model_cfg.vocab_size}); {c.tokens_per_iter}"
            f" tokens/step; {c.dtype}; {self.dist.world} process(es)"
            f"{', sharded (FSDP2)' if c.fsdp else ''}; step {self.step}/"
            f"{c.max_iters}"
        )


def make_optimizer(model: LlamaModel, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW; weight decay only on matrices inside the blocks, not on norms, biases, embeddings."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():  # tied lm_head.weight is the embedding: listed once
        (decay if p.dim() >= 2 and "embed" not in name else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    # fused: one kernel for all parameters, much faster than per-tensor updates on CPU
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=True)
