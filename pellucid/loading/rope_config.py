"""RoPE's settings from a Hugging Face config.json: the base (theta) and how a long-context model
stretches its frequencies (rope scaling), in either of the two forms the files come in.

transformers 4 writes `rope_theta` and `rope_scaling` at the top level; transformers 5 writes one
`rope_parameters` dict holding both (Gemma 3: one per layer type). Scaling is turned into one
divisor per rotated pair of features (ModelConfig.rope_divisors), which is also how llama.cpp
stores Llama 3's (its `rope_freqs` tensor):
- "linear": every frequency divided by `factor` (positions squeezed by it);
- "llama3": low frequencies (wavelengths past original_context / low_freq_factor) divided by
  `factor`, high ones (wavelengths under original_context / high_freq_factor) kept, and the
  band between blended linearly in original_context / wavelength;
- "yarn" (Qwen2.5, Qwen3): the same three bands, bounded by how many turns a pair makes over the
  original context (beta_fast and beta_slow), blended linearly in the pair's index; YaRN also
  scales cos and sin by an attention factor, which multiplies every q.k by its square: that goes
  into the softmax scale (`yarn_query_scale`);
- "longrope" (Phi-3, "su" in its first configs): a divisor per pair given outright, one set for
  sequences within the original context and one for longer ones (ModelConfig.with_context picks),
  and cos and sin scaled by sqrt(1 + ln(factor) / ln(original context)), which also goes into
  the softmax scale.
Any other kind (dynamic NTK) changes the math in ways not implemented here: an error naming it,
never a silent fallback.
"""

from __future__ import annotations

import math
from typing import Any

from pellucid.errors import ModelLoadError

SUPPORTED = ("default", "linear", "llama3", "yarn", "longrope", "su")


def rope_parameters(cfg: dict[str, Any], layer_type: str | None = None) -> dict[str, Any]:
    """The RoPE dict of a config (for `layer_type`, e.g. "full_attention", where it has one per
    type), with `rope_theta` in it: transformers 5's `rope_parameters`, or 4's top-level keys.
    Phi-3 keeps LongRoPE's original context at the top level, and transformers takes it from
    there first."""
    params = cfg.get("rope_parameters")
    if params is None:  # transformers 4
        params = dict(cfg.get("rope_scaling") or {})
        if "rope_theta" in cfg:
            params["rope_theta"] = cfg["rope_theta"]
    elif layer_type is not None and layer_type in params:
        params = params[layer_type]
    if is_long_rope(params) and cfg.get("original_max_position_embeddings"):
        params = params | {
            "original_max_position_embeddings": cfg["original_max_position_embeddings"]
        }
    return params


def rope_theta(params: dict[str, Any], default: float = 10_000.0) -> float:
    return float(params.get("rope_theta", default))


def rope_kind(params: dict[str, Any]) -> str:
    return str(params.get("rope_type", params.get("type", "default")))


def is_long_rope(params: dict[str, Any]) -> bool:
    return rope_kind(params) in ("longrope", "su")


def rope_divisors(
    params: dict[str, Any], head_dim: int, max_positions: int, source: str
) -> tuple[float, ...] | None:
    """One divisor per frequency of `head_dim` rotated features (None: no scaling);
    `max_positions` is the model's context, YaRN's original one where its parameters lack it."""
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:  # where transformers 5 keeps it
        raise ModelLoadError(
            f"{source}: partial_rotary_factor = {params['partial_rotary_factor']} is not "
            "supported (RoPE rotates every feature of a head here)"
        )
    kind = rope_kind(params)
    if kind == "default":
        return None
    if kind not in SUPPORTED:
        raise ModelLoadError(
            f"{source}: rope scaling {kind!r} is not supported (pellucid implements "
            f"{', '.join(SUPPORTED[1:])}); its positions would be wrong"
        )
    if is_long_rope(params):  # two sets (long_rope), one chosen by ModelConfig.with_context
        return None
    if kind == "yarn":
        context = params.get("original_max_position_embeddings") or max_positions
        return yarn_divisors(
            head_dim,
            rope_theta(params),
            float(params.get("factor") or max_positions / context),
            float(context),
            float(params.get("beta_fast") or 32),
            float(params.get("beta_slow") or 1),
            truncate=bool(params.get("truncate", True)),
        )
    factor = float(params["factor"])
    if kind == "linear":
        return (factor,) * (head_dim // 2)
    return llama3_divisors(
        head_dim,
        rope_theta(params),
        factor,
        float(params["low_freq_factor"]),
        float(params["high_freq_factor"]),
        float(params["original_max_position_embeddings"]),
    )


def llama3_divisors(
    head_dim: int, theta: float, factor: float, low: float, high: float, context: float
) -> tuple[float, ...]:
    """Llama 3.1's scaling as divisors of the base frequencies theta^(-2i/head_dim)."""
    divisors = []
    for i in range(0, head_dim, 2):
        wavelength = 2 * math.pi * theta ** (i / head_dim)
        if wavelength < context / high:  # fast rotations: kept
            divisors.append(1.0)
        elif wavelength > context / low:  # slow ones: stretched by the whole factor
            divisors.append(factor)
        else:  # between: 1 / divisor blends 1 / factor and 1 by how many turns fit the context
            smooth = (context / wavelength - low) / (high - low)
            divisors.append(1.0 / ((1 - smooth) / factor + smooth))
    return tuple(divisors)


def yarn_divisors(
    head_dim: int,
    theta: float,
    factor: float,
    context: float,
    beta_fast: float,
    beta_slow: float,
    *,
    truncate: bool = True,
) -> tuple[float, ...]:
    """YaRN's frequencies as divisors: pairs that turn more than beta_fast times over the original
    context keep theirs, pairs that turn fewer than beta_slow times are divided by `factor`, and
    the pairs between blend the two inverse frequencies linearly in their index."""

    def pair_turning(turns: float) -> float:  # the (fractional) pair index that turns `turns` times
        return head_dim * math.log(context / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = pair_turning(beta_fast), pair_turning(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    divisors = []
    for i in range(head_dim // 2):
        interpolated = min(max((i - low) / (high - low), 0.0), 1.0)  # 0: kept, 1: divided
        divisors.append(1.0 / ((1 - interpolated) + interpolated / factor))
    return tuple(divisors)


def long_rope(
    params: dict[str, Any], head_dim: int, source: str
) -> tuple[tuple[float, ...], tuple[float, ...], int]:
    """LongRoPE's (short divisors, long divisors, original context), checked."""
    sets = []
    for key in ("short_factor", "long_factor"):
        factors = params.get(key)
        if not isinstance(factors, list) or len(factors) != head_dim // 2:
            raise ModelLoadError(
                f"{source}: rope scaling longrope needs {key}, a list of {head_dim // 2} numbers "
                f"(one per rotated pair of a {head_dim}-feature head)"
            )
        sets.append(tuple(float(f) for f in factors))
    if not params.get("original_max_position_embeddings"):
        raise ModelLoadError(
            f"{source}: rope scaling longrope needs original_max_position_embeddings"
        )
    return sets[0], sets[1], int(params["original_max_position_embeddings"])


def rope_attention_factor(params: dict[str, Any], max_positions: int) -> float:
    """How much the scaling scales cos and sin: the config's attention_factor, else YaRN's
    0.1 ln(factor) + 1 (with DeepSeek's mscale / mscale_all_dim, the ratio of two such) or
    LongRoPE's sqrt(1 + ln(factor) / ln(original context)), where factor is the context over
    the original one; 1 for other kinds."""
    kind = rope_kind(params)
    if kind != "yarn" and not is_long_rope(params):
        return 1.0
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    if is_long_rope(params):
        original = float(params["original_max_position_embeddings"])
        factor = float(params.get("factor") or max_positions / original)
        return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    context = params.get("original_max_position_embeddings") or max_positions
    factor = float(params.get("factor") or max_positions / context)
    if params.get("mscale") and params.get("mscale_all_dim"):
        return yarn_mscale(factor, float(params["mscale"])) / yarn_mscale(
            factor, float(params["mscale_all_dim"])
        )
    return yarn_mscale(factor)


def yarn_mscale(factor: float, scale: float = 1.0) -> float:
    """YaRN's factor on cos and sin for positions stretched `factor` times: 0.1 ln(factor) + 1
    (`scale` times the log: DeepSeek's mscale)."""
    return 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0
