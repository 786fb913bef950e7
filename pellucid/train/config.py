"""TrainConfig: everything a training run needs, checked up front so mistakes fail before step 0.

Defaults are nanoGPT's CPU "baby GPT" run on shakespeare_char (4 layers, 4 heads, 128 wide, block 64,
batch 12, 2000 iterations, lr 1e-3 -> 1e-4 cosine after 100 warm-up steps, beta2 0.99, weight decay
0.1, clip 1.0), built from pellucid's Llama modules (RMSNorm, RoPE, SwiGLU) or, with arch="gpt2",
nanoGPT's own block (LayerNorm, learned positions, GELU MLP; biases off as in its train.py). The
Llama block's relatives train too, each exported as its own family: "qwen2" (biases on Q, K and
V), "qwen3" (each head's Q and K RMS-normalized) and "mistral" (attention over the last
`sliding_window` tokens).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

from pellucid.cpu import matmul_float
from pellucid.models.config import ModelConfig

DTYPES = ("bfloat16", "float32")
ARCHS = ("llama", "gpt2", "qwen2", "qwen3", "mistral")


@dataclass(slots=True)
class TrainConfig:
    data: str  # a folder written by `pellucid data prepare`
    out: str  # checkpoints, loss curve and the exported model go here
    # model family and size
    arch: str = "llama"  # "gpt2": nanoGPT's block, for like-for-like comparisons with it; or
    # a relative of Llama's: "qwen2", "qwen3", "mistral"
    bias: bool = False  # gpt2 only: biases in the linear layers and LayerNorms (GPT-2's own: on)
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None  # None: as many as n_heads (no GQA)
    dim: int = 128
    # SwiGLU has three matrices where GPT-2's MLP has two: 344 ≈ 8/3·128 keeps the parameter count
    # of nanoGPT's 4·dim MLP (0.80M with the embeddings either way).
    ffn_dim: int | None = None  # None: llama 8/3·dim rounded up to a multiple of 8, gpt2 4·dim
    rope_theta: float = 10_000.0
    sliding_window: int | None = None  # mistral (only, and needed): tokens each one attends to
    # batches
    block_size: int = 64
    batch_size: int = 12  # rows per micro-step for all processes together (split across DDP ranks)
    grad_accum: int = 1  # micro-steps per optimizer step
    # optimizer and schedule
    max_iters: int = 2000
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_iters: int = 100
    lr_decay_iters: int | None = None  # None: max_iters
    beta1: float = 0.9
    beta2: float = 0.99
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # 0 turns clipping off
    # precision and machine
    # autocast for matrix work (weights and optimizer stay float32); None: bf16 where the CPU
    # multiplies it natively, float32 elsewhere (AVX2, where oneDNN's bf16 is ~100x slower)
    dtype: str | None = None
    threads: int | None = None  # torch threads; None leaves torch's choice
    compile: bool = False  # torch.compile the model: fuses the small element-wise ops (needs a C++
    # compiler; the first steps take longer while it compiles)
    # shard parameters, gradients, optimizer state and checkpoints over the torchrun processes
    # (FSDP2, fsdp.py) instead of copying them to each (DDP)
    fsdp: bool = False
    seed: int = 1337
    # evaluation, samples, checkpoints
    eval_interval: int = 250
    eval_iters: int = 20
    log_interval: int = 10
    sample_tokens: int = 0  # >0: print a sample through the inference engine at each eval
    sample_prompt: str = "\n"
    ckpt_interval: int = 250  # 0: only at the end

    def __post_init__(self) -> None:
        positive = (
            "n_layers",
            "n_heads",
            "dim",
            "block_size",
            "batch_size",
            "grad_accum",
            "max_iters",
            "eval_interval",
            "eval_iters",
            "log_interval",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} must be a multiple of n_heads={self.n_heads}")
        if self.arch not in ARCHS:
            raise ValueError(f"arch must be one of {', '.join(ARCHS)}, got {self.arch!r}")
        if self.arch == "gpt2" and self.n_kv_heads not in (None, self.n_heads):
            raise ValueError("arch gpt2 has no grouped-query attention: leave n_kv_heads unset")
        if (self.arch == "mistral") != (self.sliding_window is not None):
            raise ValueError(
                "sliding_window is mistral's (and mistral needs one): give both or neither"
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be positive, got {self.sliding_window}")
        if self.arch != "gpt2" and (self.dim // self.n_heads) % 2:
            raise ValueError("dim / n_heads must be even: RoPE rotates pairs of features")
        if self.n_heads % (self.n_kv_heads or self.n_heads):
            raise ValueError(f"n_heads={self.n_heads} must be a multiple of n_kv_heads")
        if self.dtype is None:  # this machine's choice, made here rather than at import
            self.dtype = matmul_float()
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"need 0 <= min_lr <= lr, got min_lr={self.min_lr}, lr={self.lr}")
        if self.fsdp and (self.compile or self.sample_tokens):
            raise ValueError(
                "fsdp runs without compile and sample_tokens (a sample needs the whole model: "
                "export the run and generate from it)"
            )
        if self.warmup_iters < 0 or self.decay_iters < 0:
            raise ValueError("warmup_iters and lr_decay_iters must be >= 0")

    @property
    def decay_iters(self) -> int:
        return self.lr_decay_iters if self.lr_decay_iters is not None else self.max_iters

    @property
    def tokens_per_iter(self) -> int:
        return self.batch_size * self.grad_accum * self.block_size

    def model_config(self, vocab_size: int) -> ModelConfig:
        gpt2 = self.arch == "gpt2"
        ffn = self.ffn_dim or (4 * self.dim if gpt2 else math.ceil(8 * self.dim / 3 / 8) * 8)
        return ModelConfig(
            arch="gpt2" if gpt2 else "llama",  # the others are Llama's layout with a switch on
            vocab_size=vocab_size,
            dim=self.dim,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads or self.n_heads,
            head_dim=self.dim // self.n_heads,
            ffn_dim=ffn,
            norm_eps=1e-5,
            rope_theta=self.rope_theta,
            context_length=self.block_size,
            tie_embeddings=True,  # as nanoGPT: the output layer reuses the token embeddings
            attn_bias=(gpt2 and self.bias) or self.arch == "qwen2",
            hidden_act="gelu" if gpt2 else "silu",  # nanoGPT's nn.GELU(): exact, not tanh
            qk_norm=self.arch == "qwen3",
            sliding_window=self.sliding_window,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})
