"""The int4 fast path: packing (int4, int5, int8), the Q4_1 round trip, quality against float32,
the packed cache."""

from __future__ import annotations

import gc
import shutil
from pathlib import Path

import pytest
import torch
from helpers import reference_span, token_nlls

from pellucid import LLM
from pellucid.loading.loader import read_checkpoint
from pellucid.models import dense, fbgemm, grid, kernels, quant, rowdot, unpack
from pellucid.models.quant import (
    GROUP,
    Int4DotLinear,
    Int4Head,
    Int4Linear,
    Int5DotLinear,
    Int8Linear,
    PackedLinear,
    packed,
    packed_format,
)
from pellucid.weights import cache as weight_cache
from pellucid.weights.gguf_file import GGUFFile

NO_FBGEMM = "fbgemm does not run here (no AVX-512 VNNI, or no x86 quantized engine)"


def _steps(w: torch.Tensor, levels: int = 15) -> torch.Tensor:
    """The quantization step of each group of 32: (max - min) / levels (15 for 4 bits, 31 for
    5), shaped (out, in/32, 1)."""
    g = w.view(w.shape[0], -1, GROUP)
    return ((g.amax(-1) - g.amin(-1)) / levels)[..., None]


NO_KERNEL = "pellucid's C kernels could not be built (no C compiler)"
# torch's int4 packing (where ATen has a vectorized int4 kernel) and rowdot's, int4 and int5
# (where the kernels build); rowdot's layouts are the fast path only on AVX2 and AVX-512 VNNI,
# but they are tested wherever they run
INT4_LAYERS = [
    pytest.param(Int4Linear, marks=pytest.mark.skipif(quant.channel_block() is None, reason="no int4 kernel in ATen")),
    pytest.param(Int4DotLinear, marks=pytest.mark.skipif(kernels.library() is None, reason=NO_KERNEL)),
    pytest.param(Int5DotLinear, marks=pytest.mark.skipif(kernels.library() is None, reason=NO_KERNEL)),
]  # fmt: skip


@pytest.mark.parametrize("int4", INT4_LAYERS)
def test_int4_linear_rounds_each_weight_to_its_group_grid(int4):
    torch.manual_seed(0)
    w = torch.randn(128, 96) * 0.05
    layer = int4.from_weight(w)
    levels = 31 if int4 is Int5DotLinear else 15
    err = (layer.dequantize().float() - w).view(128, -1, GROUP).abs()
    assert (err <= _steps(w, levels) * 0.5 + 2e-3).all()  # half a step, plus bf16 rounding
    assert err.max() > 1e-3  # 4 bits really lost something: it is not a float copy
    if isinstance(layer, Int4DotLinear):  # every integer of the grid is used (the 5th bit too)
        used = layer.integers().unique()
        assert torch.equal(used, torch.arange(levels + 1, dtype=torch.uint8))


# 2 x rows in all: the int4 kernel up to UNPACK_ROWS (48), the matrix unpacked past that
@pytest.mark.parametrize("int4", INT4_LAYERS)
@pytest.mark.parametrize("rows", [1, 3, 20, 40])
def test_int4_linear_multiplies_by_its_dequantized_matrix(int4, rows):
    torch.manual_seed(1)
    w, bias = torch.randn(192, 128) * 0.05, torch.randn(192)
    layer = int4.from_weight(w, bias)
    x = torch.randn(2, rows, 128).bfloat16()
    want = x.float() @ layer.dequantize().float().T + bias.bfloat16().float()
    got = layer(x)
    assert got.shape == (2, rows, 192) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=0.05, rtol=0.02)


# A trained model's SwiGLU width (8/3 · 128 = 344) is no multiple of 16: torch's int8 kernel
# crashed the process on it (a segfault) for any step of more than 8 rows
@pytest.mark.parametrize("rows", [1, 9, 33, 64])
def test_int8_linear_of_any_input_width_multiplies_by_its_dequantized_matrix(rows):
    torch.manual_seed(2)
    layer = Int8Linear.from_weight(torch.randn(128, 344) * 0.05)
    x = torch.randn(rows, 344).bfloat16()
    want = x.float() @ layer.dequantize().float().T
    torch.testing.assert_close(layer(x).float(), want, atol=0.05, rtol=0.02)


@pytest.mark.skipif(not unpack.available(), reason=NO_KERNEL)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_unpacking_kernel_gives_the_dequantized_matrix(dtype):
    """unpack.c against `dequantize`, the same arithmetic in torch ops (which rounds to bf16
    after each step, where the kernel rounds once): int4 in torch's packing and in rowdot's,
    int5 in rowdot's, int8 per channel."""
    torch.manual_seed(3)
    w = torch.randn(192, 128) * 0.05
    shape = tuple(w.shape)
    layers = [Int4DotLinear.from_weight(w), Int5DotLinear.from_weight(w)]
    if quant.channel_block() is not None:
        layers.append(Int4Linear.from_weight(w))
    for int4 in layers:
        if isinstance(int4, Int4Linear):
            got = unpack.int4_dense(
                int4.packed, int4.scales_zeros, shape, quant.channel_block(), GROUP, dtype
            )
        else:
            high = getattr(int4, "high", None)
            got = unpack.int4_dot_dense(int4.packed, int4.params, shape, dtype, high=high)
        want = int4.dequantize().float()
        assert got.shape == want.shape and got.dtype == dtype
        scale = want.abs().max().item()
        torch.testing.assert_close(got.float(), want, rtol=2**-7, atol=2e-3 * scale)
        assert (got.float() != 0).float().mean() > 0.9  # filled, not left empty

    int8 = Int8Linear.from_weight(torch.randn(96, 160))
    exact = int8.weight.float() * int8.scales.float()[:, None]  # 8 bits times bf16: exact
    got = unpack.int8_dense(int8.weight, int8.scales, dtype)
    assert torch.equal(got, exact.to(dtype))  # one rounding, as torch's


def _rows_rounded_to_8_bits(x: torch.Tensor) -> torch.Tensor:
    """float32 rows as rowdot.c rounds them: int8 per group of 32, times the group's scale
    (its largest magnitude / 127), in the same float32 operations."""
    groups = x.view(x.shape[0], -1, GROUP)
    scale = groups.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(scale > 0, 1 / scale, 0)
    return ((groups * inverse).round() * scale).view_as(x)


@pytest.mark.skipif(kernels.library() is None, reason=NO_KERNEL)
# int4 rows in passes of 4 or 8 (AVX2, VNNI), past 8 in passes of 6 over pairs of channel
# blocks where the blocks pair up (48 channels: 6 blocks of 8), else one block at a time (40);
# int8 rows in passes of 8 over a channel (VNNI)
@pytest.mark.parametrize("rows", [1, 3, 4, 9, 13])
@pytest.mark.parametrize("channels", [48, 40])
def test_integer_dot_products_are_those_of_the_rows_rounded_to_8_bits(rows, channels):
    """rowdot.c against torch: its int4, int5 and int8 products equal the float products of the
    rounded rows with the weights, up to float32 summation order; rounding the rows changes
    the product a little, and not at all for rows already on the int8 grid."""
    torch.manual_seed(4)
    x = torch.randn(rows, 160) * 3
    x[0, :32] = 0  # a group of zeros: a scale of 0, not a division by it
    int4 = Int4DotLinear.from_weight(torch.randn(channels, 160) * 0.05)
    int5 = Int5DotLinear.from_weight(torch.randn(channels, 160) * 0.05)
    int8 = Int8Linear.from_weight(torch.randn(channels - 4, 160))
    matrices = [
        (rowdot.int4_rows_mm(x, int4.packed, int4.params), int4.unpacked(torch.float32)),
        (rowdot.int5_rows_mm(x, int5.packed, int5.high, int5.params), int5.unpacked(torch.float32)),
        (rowdot.int8_rows_mm(x, int8.weight, int8.scales), int8.weight.float() * int8.scales.float()[:, None]),
    ]  # fmt: skip
    for got, w in matrices:
        want = _rows_rounded_to_8_bits(x) @ w.T
        assert got.shape == want.shape and got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * want.abs().max().item())
        err = (got - x @ w.T).norm() / (x @ w.T).norm()
        assert 1e-4 < err < 0.02
    on_grid = _rows_rounded_to_8_bits(x)
    exact = on_grid @ int4.unpacked(torch.float32).T
    got = rowdot.int4_rows_mm(on_grid, int4.packed, int4.params)
    torch.testing.assert_close(got, exact, rtol=1e-4, atol=1e-5 * exact.abs().max().item())
    # each row's int8 product is the same bit for bit alone or beside others (the few-row
    # head's logits of a token and its guesses, engine/aot_decode.py)
    alone = [rowdot.int8_rows_mm(row[None], int8.weight, int8.scales) for row in x]
    assert torch.equal(torch.cat(alone), matrices[2][0])
    # bf16 rows give bf16 out for int4 (the decoder's dtype), float32 for int8 (logits)
    assert rowdot.int4_rows_mm(x.bfloat16(), int4.packed, int4.params).dtype == torch.bfloat16
    bf16_rows = rowdot.int5_rows_mm(x.bfloat16(), int5.packed, int5.high, int5.params)
    assert bf16_rows.dtype == torch.bfloat16
    assert rowdot.int8_rows_mm(x.bfloat16(), int8.weight, int8.scales).dtype == torch.float32


@pytest.mark.skipif(kernels.library() is None, reason=NO_KERNEL)
def test_the_ops_built_in_cpp_give_what_the_python_implementation_gives():
    """ops.cpp (what a compiled decode step calls where rowdot runs) against rowdot.py's own
    implementation of the ops, which calls the same kernels through ctypes."""
    if not kernels.torch_ops():
        pytest.skip("rowdot's torch ops could not be built (no C++ compiler or torch headers)")
    torch.manual_seed(5)
    x = torch.randn(5, 96).bfloat16()
    int4 = Int4DotLinear.from_weight(torch.randn(40, 96) * 0.05)
    int8 = Int8Linear.from_weight(torch.randn(36, 96))
    got = torch.ops.pellucid.int4_rows_mm(x, int4.packed, int4.params)
    want = rowdot._call(
        "int4_rows_mm", x, rowdot._int4_out(x, int4.packed), int4.packed, int4.params
    )
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    int5 = Int5DotLinear.from_weight(torch.randn(40, 96) * 0.05)
    got = torch.ops.pellucid.int5_rows_mm(x, int5.packed, int5.high, int5.params)
    want = rowdot._call(
        "int5_rows_mm", x, rowdot._int4_out(x, int5.packed), int5.packed, int5.high, int5.params
    )
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    got = torch.ops.pellucid.int8_rows_mm(x.t().contiguous().t(), int8.weight, int8.scales)
    want = rowdot._call(
        "int8_rows_mm", x, rowdot._int8_out(x, int8.weight), int8.weight, int8.scales
    )
    assert got.dtype == torch.float32 and torch.equal(got, want)  # (rows made contiguous first)


@pytest.mark.skipif(kernels.library() is None, reason=NO_KERNEL)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_int4_head_computes_each_rows_likeliest_logits_again_from_its_table(dtype):
    """lm_head.c: each row's int4 product, but at its k largest values (ties to the lower
    index) the row times the bf16 table; a row's logits are the same bit for bit alone or
    beside others, and the C++ op gives what the Python implementation gives."""
    torch.manual_seed(6)
    table = (torch.randn(200, 96) * 0.1).bfloat16()
    table[150:] = table[150]  # 50 equal rows: equal logits, a tie at the boundary for some k
    head = Int4Head.from_weight(table.float())
    x = (torch.randn(5, 96) * 3).to(dtype)
    approx = rowdot.int4_rows_mm(x.float(), head.packed, head.params)  # bf16 widen exactly
    exact = x.float() @ table.float().T
    for k in (7, 60, 300):
        got = rowdot.int4_head_mm(x, head.packed, head.params, table, k)
        assert got.dtype == torch.float32 and got.shape == (5, 200)
        for r in range(5):
            ranked = sorted(range(200), key=lambda i: (-approx[r, i].item(), i))
            top, rest = ranked[:k], ranked[k:]
            torch.testing.assert_close(got[r, top], exact[r, top], rtol=1e-5, atol=1e-5)
            assert torch.equal(got[r, rest], approx[r, rest])
        alone = [rowdot.int4_head_mm(row[None], head.packed, head.params, table, k) for row in x]
        assert torch.equal(torch.cat(alone), got)
        python = rowdot._head(x, head.packed, head.params, table, k)
        assert torch.equal(python, got)
    # the layer: its table is the one share_embedding hands it, RECHECK logits rechecked
    head.table = table
    assert torch.equal(
        head(x), rowdot.int4_head_mm(x, head.packed, head.params, table, quant.RECHECK)
    )


def test_a_pre_fill_unpacks_for_itself_and_a_decoding_batch_keeps_its_copies(tiny_path):
    """A pre-fill of many tokens multiplies by matrices unpacked for the product and dropped:
    no second copy of the model stays in memory. A batch of many decoding rows repeats its
    steps, so it keeps them. Without the kernel the copies are kept from the first pre-fill,
    and the replies are the same either way."""
    from pellucid import SamplingParams

    llm = LLM(tiny_path, dtype="int4")
    layers = [m for m in llm.engine.model.layers.modules() if isinstance(m, PackedLinear)]
    assert layers  # int8 here: random weights are off the 4-bit grid
    params = SamplingParams(temperature=0, max_tokens=4)
    long_prompt = "a pre-fill of many more than eight tokens " * 4
    alone = llm.generate(long_prompt, params)[0].token_ids
    assert all(m.dense is None for m in layers) == unpack.available()
    # 12 short prompts: pre-filled in one step, then 12 rows decode together
    prompts = [f"request {i}" for i in range(12)]
    eight = SamplingParams(temperature=0, max_tokens=8)
    batched = [o.token_ids for o in llm.generate(prompts, eight)]
    assert all((m.dense is not None) == m.keeps_dense() for m in layers)  # rowdot's keep none

    without = LLM(tiny_path, dtype="int4")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(unpack, "available", lambda: False)
        assert without.generate(long_prompt, params)[0].token_ids == alone
        kept = [m for m in without.engine.model.layers.modules() if isinstance(m, PackedLinear)]
        assert all(m.dense is not None for m in kept if m.keeps_dense())
        assert [o.token_ids for o in without.generate(prompts, eight)] == batched


def _rss_mib() -> float:
    status = Path("/proc/self/status").read_text()
    return int(status.split("VmRSS:")[1].split()[0]) / 1024


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads Linux's VmRSS")
def test_many_row_products_keep_no_kernel_per_row_count(monkeypatch):
    """oneDNN keeps a kernel for each row count it multiplies (~0.7 MB each for these shapes),
    and a server meets a new count with each new prompt length: its memory grew ~0.3 MiB per
    request. Padded to ROW_BUCKET rows, 150 counts cost a few buckets' kernels. The shapes are
    of no model here, so no other test in the process has made their kernels already."""
    torch.manual_seed(2)
    shapes = [(1088, 384), (448, 384), (2112, 384), (384, 1056)]  # (out, in): a decoder's kinds
    layers = [quant.int4_class().from_weight(torch.randn(o, i) * 0.05) for o, i in shapes]
    x = torch.randn(320, 1056).bfloat16()

    def growth_over_row_counts(counts: range) -> float:
        for layer in layers:
            layer(x[:20, : layer.in_features])  # the first product of its size
        before = _rss_mib()
        for n in counts:
            for layer in layers:
                layer(x[:n, : layer.in_features])
        return _rss_mib() - before

    for layer in layers:  # padded or not, the rows' products are the same
        want = x.float()[:, : layer.in_features] @ layer.dequantize().float().T
        for n in (9, 31, 32, 33, 200):
            got = layer(x[:n, : layer.in_features]).float()
            # (up to UNPACK_ROWS, the packed kernel, whose rows are rounded to 8 bits on AVX2)
            torch.testing.assert_close(got, want[:n], atol=0.04, rtol=0.02)
    assert [dense.bucket(n) for n in (9, 32, 33, 129, 200, 257, 300, 512)] == [
        32,
        32,
        64,
        192,
        256,
        384,
        384,
        512,
    ]
    bounded = growth_over_row_counts(range(9, 309, 2))  # 150 counts in 7 buckets
    assert bounded < 60, bounded  # MiB
    # oneDNN keeps a kernel per count of bf16 rows; float32 copies (AVX2) do not, and rowdot's
    # layers (no AMX) multiply every count here themselves
    if dense.dense_dtype() == torch.bfloat16 and layers[0].packed_rows() < 309:
        monkeypatch.setattr(dense, "ROW_BUCKET", 1)  # no padding: what the bound is for
        unbounded = growth_over_row_counts(range(10, 310, 2))  # 150 new counts
        assert unbounded > 4 * bounded, (bounded, unbounded)


def test_q4_1_weights_come_back_on_their_own_grid(smollm2_path):
    """SmolLM2's GGUF stores its matrices as Q4_1; re-quantizing them by each group's min and
    max recovers Q4_1's integers, so only bf16 rounding of the scales remains — unlike a matrix
    that was not on a 4-bit grid (its Q8_0 embedding), which loses up to half a step."""
    state = read_checkpoint(smollm2_path).state
    for name in ["layers.0.self_attn.qkv_proj.weight", "layers.17.mlp.down_proj.weight"]:
        w = state[name]
        err = (quant.int4_class().from_weight(w).dequantize().float() - w).view(
            w.shape[0], -1, GROUP
        )
        assert (err.abs() / _steps(w).clamp(min=1e-12)).max() < 0.15, name
    emb = state["embed_tokens.weight"]
    err = (quant.int4_class().from_weight(emb).dequantize().float() - emb).view(
        emb.shape[0], -1, GROUP
    )
    assert (err.abs() / _steps(emb).clamp(min=1e-12)).max() > 0.4


def test_a_matrix_off_the_4_bit_grid_is_kept_in_int8():
    torch.manual_seed(2)
    off_grid = torch.randn(128, 64)
    steps = torch.rand(128, 2, 1) * 0.01 + 0.001  # a scale and a minimum per group of 32
    q = torch.randint(0, 16, (128, 2, 32))
    q[..., 0], q[..., 1] = 0, 15  # each group spans the whole grid, as Q4_1's min/max do
    on_grid = (q * steps - 0.05).view(128, 64)
    assert isinstance(packed(on_grid), quant.int4_class())
    kept = packed(off_grid)
    assert isinstance(kept, Int8Linear)
    err = (kept.dequantize().float() - off_grid).norm() / off_grid.norm()
    assert err < 0.01
    # 100 outputs are not a multiple of the int4 layouts' channel blocks (64 or 32 channels in
    # torch's, 8 in rowdot's): int8, not an error
    assert isinstance(packed(on_grid[:100]), Int8Linear)


def test_groups_on_a_grid_of_fewer_steps_come_back_on_it():
    """Q4_0's integers (w = (q - 8) * d) and Q4_K's need not reach both ends of 0..15 in every
    group: min..max onto 0..15 then moves each weight by up to a third of its own step, and the
    matrix went to int8. The number of steps the group spans is found instead."""
    torch.manual_seed(3)
    d = torch.rand(128, 2, 1) * 0.01 + 0.001
    q = torch.randint(2, 13, (128, 2, 32))  # never 0 or 15
    w = ((q - 8) * d).view(128, 64)
    layer = packed(w)
    assert isinstance(layer, quant.int4_class())
    err = (layer.dequantize().float() - w).view(128, 2, 32).abs()
    assert (err <= 0.1 * d).all()  # bf16 rounding of the scale and min; min..max: ~0.33 d
    # weights off any grid (the search finds none) are kept in int8, as before
    assert isinstance(packed(w + torch.randn(128, 64) * 1e-3), Int8Linear)


@pytest.mark.skipif(not rowdot.available(), reason="int5 is rowdot's layout (AVX2, AVX-512 VNNI)")
def test_weights_on_a_5_bit_grid_are_int5_with_their_own_integers():
    """Q5_0's weights, w = (q - 16) * d with q in 0..31, whose groups need not reach 0 or 31:
    int4 moves them by ~8%, so they were int8; int5 keeps the file's integers (less each
    group's smallest) and its step, up to bf16 rounding. A matrix partly off the grid (a fused
    Q/K/V whose V the file kept in Q8_0) stays int8 (quant.MAX_INT5_ERROR)."""
    torch.manual_seed(4)
    d = torch.rand(128, 2, 1) * 0.01 + 0.001
    q = torch.randint(1, 31, (128, 2, 32))  # never 0 or 31
    w = ((q - 16) * d).view(128, 64)
    layer = packed(w)
    assert isinstance(layer, Int5DotLinear)
    integers = layer.integers().reshape(128, 2, 32)  # (out, group, input)
    assert torch.equal(integers.long(), q - q.amin(-1, keepdim=True))
    err = (layer.dequantize().float() - w).view(128, 2, 32).abs()
    assert (err <= 0.2 * d).all()  # bf16 rounding of the scale, min and result; min..max: 0.45 d
    part = w.clone()
    part[96:] = torch.randn(32, 64) * 0.05  # a quarter of the rows off the grid
    assert isinstance(packed(part), Int8Linear)


def test_a_cached_models_int5_matrices_load_as_int5(tmp_path):
    """A warm load builds the packed model's skeleton from the cached state's keys
    (packed_model.quantize(stored=...)): an int5 matrix must come back int5, or its state
    would not load and the model would be packed again from the float checkpoint."""
    from conftest import TINY

    from pellucid.models import build_model
    from pellucid.models.packed_model import quantize

    torch.manual_seed(5)
    model = build_model(TINY)
    gate_up = model.layers[0].mlp.gate_up_proj.weight
    d = torch.rand(gate_up.shape[0], gate_up.shape[1] // GROUP, 1) * 0.01 + 0.001
    q = torch.randint(0, 32, (gate_up.shape[0], gate_up.shape[1] // GROUP, GROUP))
    with torch.no_grad():
        gate_up.copy_(((q - 16) * d).view_as(gate_up))
    quantize(model)
    kinds = {n: type(m) for n, m in model.named_modules() if isinstance(m, PackedLinear)}
    assert (kinds["layers.0.mlp.gate_up_proj"] is Int5DotLinear) == rowdot.available()
    state = model.state_dict()
    with torch.device("meta"):
        skeleton = quantize(build_model(TINY), stored=set(state))
    skeleton.load_state_dict(state, assign=True)  # strict: every buffer named as stored
    assert {n: type(m) for n, m in skeleton.named_modules() if n in kinds} == kinds


def test_q4_k_weights_come_back_on_their_own_grid(gemma3_path):
    """Gemma's GGUF stores its attention outputs as Q4_K (each group of 32 has a scale and a min
    derived from its super-block's). As the gguf package dequantizes them, they pack into int4
    with only bf16 rounding left (~0.5%), where min..max onto 0..15 moved them by ~4%; its Q5_0
    projections are no 4-bit grid: int5 where rowdot's kernels run (~0.2% off), else int8."""
    file = GGUFFile(gemma3_path)  # tensors dequantized by the gguf package
    for name, kind in [("blk.0.attn_output.weight", "Q4_K"), ("blk.0.attn_q.weight", "Q5_0")]:
        assert file.tensor_type(name).name == kind
        w = file.tensor(name)
        layer = packed(w)
        err = (layer.dequantize().float() - w).norm() / w.norm()
        if kind == "Q4_K":
            assert isinstance(layer, quant.int4_class()) and err < 0.01, (name, err)
            groups = w.view(w.shape[0], -1, GROUP)
            low, high = groups.amin(-1), groups.amax(-1)
            assert grid.grid_error(groups, *grid.onto_steps(groups, low, high, 15), low) > 0.03
        else:
            assert isinstance(layer, Int5DotLinear if rowdot.available() else Int8Linear), name
            assert err < 0.005, (name, err)


@pytest.fixture(scope="module")
def smollm2_int4() -> LLM:
    return LLM("smollm2-135m", dtype="int4")


def _nlls(llm: LLM, ids: list[int], packed: bool = False) -> torch.Tensor:
    """Each next token's NLL (len(ids) - 1,). `packed`: every product by the packed kernels, as
    a decode step computes its rows (the many rows of a whole text otherwise take the dense
    matrices): on AVX2, rowdot's, each row rounded to 8 bits per group of 32 at every matrix,
    the head's too."""
    with pytest.MonkeyPatch.context() as patch:
        if packed:
            patch.setattr(quant, "DENSE_ROWS", 1 << 30)
            patch.setattr(quant, "UNPACK_ROWS", 1 << 30)
        return token_nlls(llm.logits(ids), ids)


def _assert_near_float32(nlls: torch.Tensor, reference: torch.Tensor, label: object) -> None:
    """Quality against transformers' float32 NLLs of the same tokens on the same weights (which
    pellucid's float32 path matches within 1e-3 a token: test_models): the mean within 1%, and
    nine tokens in ten within 0.5 nats, so that the agreement holds token by token, not only as
    errors that cancel in the mean. On the reference text, int4 on AVX2: SmolLM2 99%, Gemma 97%;
    Gemma's int4 head without its recheck (quant.RECHECK = 0): 86%, and its mean +1.8%."""
    assert abs(nlls.mean() - reference.mean()) / reference.mean() < 0.01, (label, nlls.mean())
    close = ((nlls - reference).abs() < 0.5).double().mean().item()
    assert close > 0.9, (label, close)


def _pass_kinds(llm: LLM, rows: int) -> tuple[bool, ...]:
    """The `packed` arguments of _nlls that compute differently on this machine: both,
    unless every packed layer already multiplies `rows` rows by its packed kernel (rowdot's, for
    any count, where oneDNN has no AMX) with no dense copy or fbgemm to take over, when a pass
    with the dense products turned off would repeat the same sums."""
    layers = [m for m in llm.model.modules() if isinstance(m, PackedLinear)]
    same = all(
        m.dense is None and rows <= m.packed_rows() and not getattr(m, "fbgemm", False)
        for m in layers
    )
    return (False,) if layers and same else (False, True)


def test_the_fast_path_keeps_its_activations_in_float32_between_products(smollm2, smollm2_int4):
    """As llama.cpp: the norms hold the checkpoint's float32 weights (not rounded to bf16) and
    the residual stream is float32; only the products round their rows, and the embedding
    table, read a row a token, is bf16."""
    fast, ref = smollm2_int4.model, smollm2.model
    assert fast.embed_tokens.weight.dtype == torch.bfloat16
    for name, weight in ref.named_parameters():
        if name.endswith("norm.weight"):
            assert torch.equal(fast.get_parameter(name), weight), name
    ids = torch.tensor([smollm2.encode("The capital of France is")])
    with torch.no_grad():
        assert fast.hidden_states(ids, torch.arange(ids.shape[1])).dtype == torch.float32


def test_fast_path_perplexity_is_within_one_percent_of_float32(smollm2_int4, reference_smollm2):
    # its head (28 MB in int8) weighs less than its decoder (66 MB): int8 (packed_head)
    assert isinstance(smollm2_int4.model.lm_head, Int8Linear)
    ids, float32 = reference_span(reference_smollm2["perplexity"])
    # pre-fill's dense products, decoding's packed ones (where they differ)
    for packed_kernels in _pass_kinds(smollm2_int4, len(ids)):
        _assert_near_float32(_nlls(smollm2_int4, ids, packed_kernels), float32, packed_kernels)


def test_gemma_fast_path_perplexity_is_within_one_percent_of_float32(reference_gemma3):
    """Gemma's GGUF stores most matrices with 5-8 bits: int5 where they lie on a 5-bit grid and
    rowdot's kernels run, else int8 (int4 cost it 22%). Its tied 262k-row head, heavier than the
    decoder, is int4 with its likeliest logits rechecked where rowdot runs (int4 alone cost
    3.5%); elsewhere int8, which decoding one token multiplies by fbgemm with 8-bit
    activations: that costs a little more, still within 1%."""
    fast = LLM("gemma3-270m", dtype="int4")
    assert isinstance(fast.model.lm_head, Int4Head) == rowdot.available()
    gate_up = fast.model.layers[0].mlp.gate_up_proj  # Q5_0 in the file
    assert isinstance(gate_up, Int5DotLinear if rowdot.available() else Int8Linear)
    ids, float32 = reference_span(reference_gemma3["perplexity"])
    # pre-fill's dense products, decoding's packed ones (where they differ)
    for packed_kernels in _pass_kinds(fast, len(ids)):
        _assert_near_float32(_nlls(fast, ids, packed_kernels), float32, packed_kernels)
    if isinstance(fast.model.lm_head, Int4Head):
        return
    fast.model.lm_head.use_fbgemm()
    if fast.model.lm_head.fbgemm:  # where fbgemm runs (models/fbgemm.py): the one-row head too
        _assert_near_float32(_nlls_with_fbgemm_head(fast, ids), float32, "fbgemm head")


def _nlls_with_fbgemm_head(llm: LLM, ids: list[int]) -> torch.Tensor:
    """As a compiled decode step computes them: the head takes one row at a time, by fbgemm. An
    int4 head (Int4Head, where rowdot runs) is replaced by the int8 head made elsewhere."""
    head = llm.model.lm_head
    if not isinstance(head, Int8Linear):
        head = Int8Linear.from_weight(llm.model.embed_tokens.weight.float())
        head.logits = True
    head.use_fbgemm()
    if not head.fbgemm:
        pytest.skip(NO_FBGEMM)
    with torch.no_grad():
        hidden = llm.model.hidden_states(torch.tensor([ids]), torch.arange(len(ids)))[0]
        logits = torch.cat([head(row[None]) for row in hidden])
    assert logits.dtype == torch.float32  # not rounded to bf16 on the way out
    return token_nlls(logits, ids)


def test_one_row_through_fbgemm_is_the_int8_product_with_8_bit_activations():
    torch.manual_seed(3)
    layer = Int8Linear.from_weight(torch.randn(320, 96) * 0.05)
    x = torch.randn(4, 96).bfloat16()
    layer.use_fbgemm()
    if not layer.fbgemm:
        pytest.skip(NO_FBGEMM)
    want = x.float() @ layer.dequantize().float().T
    rows = torch.cat([layer(row[None]) for row in x])
    assert rows.dtype == torch.float32
    err = (rows - want).norm() / want.norm()
    assert 1e-4 < err < 0.02  # 8-bit rounding of the row shows, but stays small
    # up to DENSE_ROWS rows go to fbgemm together, each rounded alone: as when one at a time
    assert torch.equal(layer(x), rows)

    # dynamo traces the call as one op, with no graph break around fbgemm's packed matrix
    # (a closure, not a default argument: `del layer` below must free the last reference)
    explained = torch._dynamo.explain(lambda row: layer(row) * 2)(x[:1])  # noqa: F821
    assert explained.graph_break_count == 0 and explained.graph_count == 1

    key = layer.weight.data_ptr()  # the packed copy goes with its layer
    assert key in fbgemm._PACKED
    del layer
    gc.collect()
    assert key not in fbgemm._PACKED


def test_fbgemm_head_perplexity_is_within_one_percent_of_float32(reference_smollm2):
    ids, float32 = reference_span(reference_smollm2["perplexity"])
    nlls = _nlls_with_fbgemm_head(LLM("smollm2-135m", dtype="int4"), ids)
    _assert_near_float32(nlls, float32, "fbgemm head")


def test_fast_path_generates_the_same_text_however_the_traffic_runs():
    """A greedy reply does not change with the traffic beside it: the same tokens, and the same
    logprobs to the last bit, alone or batched, decoded by the step compiled ahead or eagerly,
    its prompt pre-filled whole or in chunks beside others' decode rows, or after a cached
    prefix. Each row's result is independent of its neighbours: rowdot's sums for a row never
    see another (where it takes every row count of every matrix: no AMX), pre-fill attention
    takes the same stretches of queries however a prompt is cut (paged_attention.attend_prefill),
    and the compiled step rounds as the eager one does. 12 rows decode together here, past the
    few-row kernels' DENSE_ROWS (the LM head once took its bf16 table there, and 7 of these 12
    replies changed). Elsewhere batches past DENSE_ROWS take bf16 copies, whose sums depend on
    the rows: there only a few rows are checked, and with AMX only eager against compiled."""
    from pellucid import SamplingParams
    from pellucid.config import EngineConfig
    from pellucid.cpu import onednn_amx

    llm = LLM("smollm2-135m", dtype="int4")
    params = SamplingParams(temperature=0, max_tokens=32, logprobs=3)
    questions = [
        "What is the capital of France?", "Write a haiku about rain.", "Explain gravity to a child.",
        "List three prime numbers.", "How do I boil an egg?", "Name a painter and a painting.",
        "What is 17 times 23?", "Say 'good morning' in Spanish.", "Why is the sky blue?",
        "Give me a tip for learning Python.", "What do bees make?", "Describe the ocean.",
    ]  # fmt: skip
    if onednn_amx() or not rowdot.available():  # many rows take bf16 copies
        questions = questions[: quant.DENSE_ROWS]
    # a long system prompt that all share: the cache holds it after the first request
    system = "You are a careful assistant. " * 12
    prompts = [
        llm.chat_prompt([{"role": "system", "content": system}, {"role": "user", "content": q}])
        for q in questions
    ]

    def replies(llm: LLM, together: bool) -> list[tuple[list[int], list]]:
        outs = llm.generate(prompts, params) if together else [
            llm.generate([p], params)[0] for p in prompts
        ]  # fmt: skip
        return [(o.token_ids, o.logprobs) for o in outs]

    alone = replies(llm, together=False)
    assert llm.engine.block_manager.hits >= 64 * (len(prompts) - 1)  # the system prompt hit
    eager = LLM("smollm2-135m", dtype="int4", engine=EngineConfig(compiled_ahead=False))
    if onednn_amx():
        # With AMX a pre-fill step's products go by its rows (past UNPACK_ROWS oneDNN's bf16
        # GEMMs, below it rowdot): the first prompt's 94 rows alone, or 8 prompts together, take
        # the GEMMs, a 30-row chunk rowdot. Only the eager and compiled steps are compared.
        assert replies(eager, together=False) == alone
        return
    assert replies(llm, together=True) == alone
    # 48 tokens a step: each prompt pre-fills in chunks, beside the others' decode rows
    chunked = LLM("smollm2-135m", dtype="int4", engine=EngineConfig(max_num_batched_tokens=48))
    assert replies(chunked, together=True) == alone
    assert replies(eager, together=True) == alone
    assert len({tuple(a) for a, _ in alone}) == len(questions)  # real replies, each its own


def test_packed_weights_are_cached_and_loaded_without_the_float_model(
    tmp_path, smollm2_path, monkeypatch
):
    monkeypatch.setenv("PELLUCID_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "model.gguf"
    shutil.copy(smollm2_path, gguf)
    first = LLM(gguf, dtype="int4")
    assert (weight_cache.entry_dir(gguf) / f"{packed_format()}.pt").is_file()

    def refuse(*_args, **_kwargs):
        raise AssertionError("a warm int4 load must not read the float32 checkpoint")

    monkeypatch.setattr("pellucid.loading.loader.read_checkpoint", refuse)
    second = LLM(gguf, dtype="int4")
    ids = first.encode("The capital of France is")
    assert torch.equal(first.logits(ids), second.logits(ids))
