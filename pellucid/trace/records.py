"""Records of `pellucid explain`'s experiments beside the traced run (the run's own records are
engine/trace_records.py): generation without the KV cache, a few training steps on a copy.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from pellucid.engine.trace_records import Trace


@dataclass(slots=True)
class NoCacheComparison:
    """The same tokens generated twice: with the KV cache, and recomputing every token each step."""

    tokens: int  # tokens generated in each run
    cached_s: float
    uncached_s: float
    cached_flops: int
    uncached_flops: int
    same_tokens: bool  # the two runs chose the same tokens (they should: same maths)

    @property
    def slowdown(self) -> float:
        return self.uncached_s / self.cached_s if self.cached_s else 0.0

    @property
    def flops_ratio(self) -> float:
        return self.uncached_flops / self.cached_flops if self.cached_flops else 0.0


@dataclass(slots=True)
class TrainingStep:
    step: int
    loss: float  # mean cross-entropy of predicting each next token of the sentence
    target_prob: float  # probability the model gives the sentence's last token, before the step
    grad_norm: float  # L2 norm of the gradient over all weights
    update_norm: float  # L2 norm of the change gradient descent made to the weights


@dataclass(slots=True)
class TrainingWalk:
    """A few gradient steps on one sentence, on a copy of the weights, next to plain inference."""

    sentence: str
    tokens: list[str]
    learning_rate: float
    steps: list[TrainingStep]
    final_loss: float
    final_target_prob: float
    weights_changed: int  # tensors of the copy that training changed
    weights_total: int
    inference_unchanged: bool  # the served weights are bit-identical after generating
    seconds: float


@dataclass(slots=True)
class Explanation:
    """Everything `pellucid explain` shows: one traced run plus the optional extra experiments."""

    trace: Trace
    layer: int  # the attention head shown
    head: int
    focus: int  # the prompt token whose attention is described
    no_cache: NoCacheComparison | None = None
    training: TrainingWalk | None = None

    def to_dict(self) -> dict:
        return asdict(self)
