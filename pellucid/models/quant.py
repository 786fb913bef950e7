"""Packed weights for the fast path: int4 (4 bits, a scale and zero per group of 32), int5 or int8.

Decoding one token reads every weight once, so its speed is set by how many bytes the weights
take: int4 reads 1/8 of float32. Each group of 32 weights along the input dimension is stored as
w = (q - 8) * scale + zero with q in 0..15 — exactly GGUF's Q4_1 layout (w = q * d + m, so
scale = d and zero = m + 8d), which is why re-quantizing a Q4_1 model's weights by each group's
min and max gives back its very integers. torch's CPU kernel `_weight_int4pack_mm_for_cpu`
multiplies activations by these packed weights without unpacking them to memory. A matrix
that int4 would change by more than MAX_INT4_ERROR (one stored with 5 or more bits) is int5
where its weights lie on a 5-bit grid and rowdot's kernels run (Int5DotLinear), else kept as
int8 with a scale per output channel (`_weight_int8pack_mm`), and so is the LM head; unless it is
the embedding table (tied), outweighs the decoder and rowdot's kernels run: then it is int4, its
likeliest logits rechecked against the table (Int4Head, packed_model.packed_head).

These kernels do one pass over the weights per row, so they win for a few rows (decode) and lose
to a GEMM for many (pre-fill, big batches): past DENSE_ROWS rows (UNPACK_ROWS where the matrix
must be unpacked first) a packed layer multiplies by its matrix unpacked to dense form — bf16
where the CPU multiplies bf16 natively (AVX-512 BF16, AMX), float32 elsewhere (on AVX2, oneDNN's
bf16 GEMM runs at a tenth of its float32 speed). A pre-fill unpacks each matrix just before its
product and drops it after (models/unpack.py), so memory holds one copy of the model; a batch of
many decoding rows, which repeats its steps, keeps the dense copies (packed_model.make_dense).

torch's int4 packing follows the vector width its kernels were dispatched for: it interleaves
blocks of 64 output channels with AVX-512, of 32 with AVX2 (`channel_block()`); without either,
matrices stay int8. On AVX2 without AVX-512, where torch's kernels multiply in float32 and
decoding fell behind llama.cpp, and on AVX-512 with VNNI, rows go instead to pellucid's own
integer kernels (models/rowdot.py): int4 matrices take their layout (Int4DotLinear). These beat
float32 GEMMs (AVX2) and bf16 ones without AMX at any row count, so no dense copies are kept
(`rowdot_rows()`); int8 matrices take them too, for a few rows, and on AVX2 for all
(`rowdot.int8_every_row()`); the LM head for all without AMX. A model whose decoder is int4
(SmolLM2) then has every product of a decode step by rowdot at every row count, whose sums for
a row do not depend on the rows beside it: a greedy reply is the same alone, beside its guesses
or in any batch.

The model's projections that read the same input (Q/K/V, gate/up) are one matrix each already
(models/layers.py): one kernel call instead of three or two per layer.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor, nn

from pellucid.cpu import cpu_flags, onednn_amx
from pellucid.models import fbgemm, rowdot, unpack
from pellucid.models.dense import dense_dtype, dense_mm, unpack_dtype
from pellucid.models.grid import GROUP, quantize_groups

INNER_K_TILES = 8  # the CPU packing's tile parameter
DENSE_ROWS = 8  # above this many rows, a dense GEMM beats the int4 kernel (measured)
# ... and above this many, it beats it even counting the time to unpack the matrix first
# (measured: benchmarks/results/comments.md)
UNPACK_ROWS = 48
# rowdot's integer kernel beat float32 GEMMs (AVX2) and bf16 ones without AMX (AVX-512 VNNI) at
# every row count measured, up to a 512-token pre-fill (benchmarks/results/comments.md): its
# layers take it for any count below this, and keep no dense copies
ROWDOT_ROWS = 1 << 16
MAX_INT4_ERROR = 0.02  # relative (Frobenius) error above which a matrix is kept in int8
# ... or in int5, for weights that lie on a 5-bit grid (~0.2%). Gemma's fused Q/K/V, whose V its
# file keeps in Q8_0, lie 1.5% off it: in int5 those cost NLL +0.46% of float32 where int8 cost
# +0.12% (benchmarks/results/comments.md)
MAX_INT5_ERROR = 0.01
# each row's likeliest logits that an int4 LM head computes again from the bf16 table (Int4Head)
RECHECK = 64


# What the CPU can do is read at first use, not at import: the layers built then keep what they
# need of it as attributes (a compiled graph must not call this while it is traced).
@functools.cache
def channel_block() -> int | None:
    """Output channels interleaved per block of torch's int4 packing (see Int4Linear.dequantize),
    by ATen's CPU capability (which ATEN_CPU_CAPABILITY can lower); None: no vectorized int4
    kernel, so no int4 in torch's layout."""
    return {"AVX512": 64, "AVX2": 32}.get(torch.backends.cpu.get_cpu_capability())


def packed_format() -> str:
    """The packed model's name in the weight cache: bump when a layout changes (it differs by
    CPU: torch's int4 packing, or the dot8 layout of rowdot's kernel). v4: norms and biases are
    float32 (packed_model.quantize); v5: a tied head is int4 with rowdot (Int4Head); v6: Q4_K
    and Q4_0 matrices are int4 (quantize_groups finds their grid); v7: Q5_0 and Q5_K matrices
    are int5 with rowdot (Int5DotLinear)."""
    return f"packed-v7-{'dot8' if rowdot.available() else f'n{channel_block() or 0}'}"


@functools.cache
def rowdot_rows() -> int:
    """The most rows rowdot's int4 kernel multiplies before a dense GEMM takes over: every count
    (ROWDOT_ROWS), unless oneDNN multiplies bf16 on AMX tiles, which beat it on many rows (32
    sequences at 3.2x llama.cpp's on bf16 copies): then as many as torch's int4 kernel takes."""
    return UNPACK_ROWS if onednn_amx() else ROWDOT_ROWS


def int4_class() -> type[PackedLinear]:
    """The int4 layer of this machine: rowdot's layout where its kernel is the fast path."""
    return Int4DotLinear if rowdot.available() else Int4Linear


def int4_packable(out_features: int, in_features: int, layer: type | None = None) -> bool:
    """Whether an int4 layer (`layer`, this machine's by default) can hold an (out, in) matrix:
    whole groups of GROUP inputs, whole blocks of its layout's output channels."""
    block = (layer or int4_class()).channels()
    return block is not None and in_features % GROUP == 0 and out_features % block == 0


def require_int4_shape(layer: type, out_features: int, in_features: int) -> None:
    if not int4_packable(out_features, in_features, layer):
        raise ValueError(
            f"int4 needs in % {GROUP} == 0 and out % {layer.channels()} == 0, "
            f"got a {out_features}x{in_features} matrix"
        )


class PackedLinear(nn.Module):
    """y = x @ W.T (+ bias) for x (..., in_features) with W kept packed, y in x's dtype (float32
    on the fast path; bf16 works too); a subclass says how to multiply a few rows by the packed
    form (`packed_mm`) and how to unpack it (`dequantize`)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("bias", None)  # (out,) float32, for layouts with biased projections
        # the dense matrix, kept by make_dense; a buffer (not saved), so that a compiled graph
        # names it by its module rather than storing its own copy of it as a constant
        self.register_buffer("dense", None, persistent=False)

    @classmethod
    def from_weight(cls, w: Tensor, bias: Tensor | None = None) -> PackedLinear:
        """Pack (out, in) weights. On the meta device: an empty layer of the right shapes, for
        load_state_dict."""
        out_f, in_f = w.shape
        layer = cls(in_f, out_f)
        if bias is not None:
            layer.bias = bias.detach().float()
        if not w.is_meta:
            layer.pack(w.detach().float())
        return layer

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, self.in_features)
        n = rows.shape[0]
        if n > DENSE_ROWS and (self.dense is not None or n > self.packed_rows()):
            y = dense_mm(rows, self.dense_matrix(), self.bias)
            return y.view(*x.shape[:-1], self.out_features)
        y = self.packed_mm(rows).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else (y + self.bias).to(y.dtype)

    def dense_matrix(self) -> Tensor:
        """The (out, in) matrix for a product of many rows: the copy kept by make_dense where
        there is one, else unpacked now for this product alone (in `unpack_dtype()`). Without
        the unpacking kernel, torch ops would unpack at several times the product's cost: the
        copy is then made once and kept."""
        if self.dense is None and not unpack.available():
            self.dense = self.unpacked()
        if self.dense is not None:
            return self.dense
        return self.unpacked(unpack_dtype(), scratch=True)

    def pack(self, w: Tensor) -> None:
        """Fill the packed buffers from float32 (out, in) weights."""
        raise NotImplementedError

    def packed_rows(self) -> int:
        """The most rows the packed kernel multiplies where no dense copy is kept."""
        return UNPACK_ROWS

    def keeps_dense(self) -> bool:
        """Whether a batch of many decoding rows should keep a dense copy (make_dense)."""
        return True

    def packed_mm(self, rows: Tensor) -> Tensor:
        raise NotImplementedError

    def dequantize(self) -> Tensor:
        """The bf16 (out, in) matrix, in torch ops: the reference form."""
        raise NotImplementedError

    def unpacked(self, dtype: torch.dtype | None = None, scratch: bool = False) -> Tensor:
        """The (out, in) matrix in `dtype` (dense_dtype() by default), by the kernel where it
        runs (models/unpack.py; `scratch`: in a buffer the next unpacking of the same shape
        overwrites)."""
        raise NotImplementedError


class Int4Linear(PackedLinear):
    """4-bit weights in groups of 32 along the input, for the decoder's projections."""

    @staticmethod
    def channels() -> int | None:
        """Output channels per block of the packing (None: no int4 here)."""
        return channel_block()

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features)
        require_int4_shape(Int4Linear, out_features, in_features)
        self.register_buffer(
            "packed", torch.empty(out_features, in_features // 2, dtype=torch.uint8)
        )
        # (in/GROUP, out, 2): the scale and zero of each group, as the kernel wants them
        self.register_buffer(
            "scales_zeros", torch.empty(in_features // GROUP, out_features, 2, dtype=torch.bfloat16)
        )

    def pack(self, w: Tensor) -> None:
        q, scale, low = quantize_groups(w)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.int(), INNER_K_TILES)
        zero = low + 8 * scale
        self.scales_zeros = torch.stack([scale, zero], -1).transpose(0, 1).contiguous().bfloat16()

    def packed_mm(self, rows: Tensor) -> Tensor:
        # the scales in the rows' dtype, as the kernel asks (bf16 widen to float32 exactly)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            rows.contiguous(), self.packed, GROUP, self.scales_zeros.to(rows.dtype)
        )

    def unpacked(self, dtype: torch.dtype | None = None, scratch: bool = False) -> Tensor:
        dtype = dtype or dense_dtype()
        if not unpack.available():  # in the kernel's layout: (in, out), seen transposed
            return self.dequantize().to(dtype).t().contiguous().t()
        shape = (self.out_features, self.in_features)
        return unpack.int4_dense(
            self.packed, self.scales_zeros, shape, channel_block(), GROUP, dtype, scratch
        )

    def dequantize(self) -> Tensor:
        """The bf16 (out, in) matrix. The CPU packing interleaves blocks of channel_block() (64)
        output channels: byte k*32 + c of a block holds channel c (low nibble) and c + 32
        (high) of input k."""
        out_f, in_f, block = self.out_features, self.in_features, channel_block()
        blocks = self.packed.view(out_f // block, in_f, block // 2)
        q = torch.cat([blocks & 15, blocks >> 4], -1).transpose(1, 2).reshape(out_f, in_f)
        scale, zero = self.scales_zeros.unbind(-1)  # (in/GROUP, out) each
        w = (q.view(out_f, -1, GROUP).to(torch.bfloat16) - 8) * scale.t()[..., None]
        return (w + zero.t()[..., None]).view(out_f, in_f)


class Int4DotLinear(PackedLinear):
    """4-bit weights in groups of 32 along the input, w = q * scale + min, laid out for rowdot's
    integer dot products (models/rowdot.c, where it is the fast path: see rowdot.available):
    output channels in blocks of 8, one per 32-bit lane, each lane holding 4 inputs of its
    channel per step (the layout is drawn in rowdot.c)."""

    @staticmethod
    def channels() -> int:
        """Output channels per block: one per 32-bit lane of an AVX2 vector."""
        return 8

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features)
        require_int4_shape(Int4DotLinear, out_features, in_features)
        self.rowdot_rows = rowdot_rows()  # read now: a compiled graph must not call it
        blocks, groups = out_features // 8, in_features // GROUP
        # (blocks, groups, step, channel * 4 + input): 32 bytes per step of 8 inputs
        self.register_buffer("packed", torch.empty(blocks, groups, 4, 32, dtype=torch.uint8))
        # (blocks, groups, scale|min, channel)
        self.register_buffer("params", torch.empty(blocks, groups, 2, 8, dtype=torch.bfloat16))

    def pack(self, w: Tensor) -> None:
        q, scale, low = quantize_groups(w)
        self.pack_groups(q.to(torch.uint8), scale, low)

    def pack_groups(self, q: Tensor, scale: Tensor, low: Tensor) -> None:
        """Fill packed and params from quantize_groups' results: q (out, in) uint8 (its low 4
        bits are packed), scale and low (out, in/GROUP)."""
        blocks, groups = self.out_features // 8, self.in_features // GROUP
        # (block, channel, group, step, half, input) -> (block, group, step, half, channel, input)
        q = (q & 15).view(blocks, 8, groups, 4, 2, 4).permute(0, 2, 3, 4, 1, 5)
        self.packed = (q[:, :, :, 0] | q[:, :, :, 1] << 4).reshape(blocks, groups, 4, 32)
        params = torch.stack([scale, low], -1).view(blocks, 8, groups, 2)
        self.params = params.permute(0, 2, 3, 1).contiguous().bfloat16()

    def packed_mm(self, rows: Tensor) -> Tensor:
        return rowdot.int4_rows_mm(rows, self.packed, self.params)

    def packed_rows(self) -> int:
        return self.rowdot_rows

    def keeps_dense(self) -> bool:
        return self.rowdot_rows < ROWDOT_ROWS  # with AMX: copies for batches, as Int4Linear

    def unpacked(self, dtype: torch.dtype | None = None, scratch: bool = False) -> Tensor:
        shape = (self.out_features, self.in_features)
        return unpack.int4_dot_dense(
            self.packed, self.params, shape, dtype or dense_dtype(), scratch
        )

    def integers(self) -> Tensor:
        """The weights' integers q, (blocks, channel, group, GROUP) uint8."""
        blocks, groups = self.out_features // 8, self.in_features // GROUP
        bytes_ = self.packed.view(blocks, groups, 4, 1, 8, 4)
        q = torch.cat([bytes_ & 15, bytes_ >> 4], 3)  # (block, group, step, half, channel, input)
        return q.permute(0, 4, 1, 2, 3, 5).reshape(blocks, 8, groups, GROUP)

    def dequantize(self) -> Tensor:
        scale, low = self.params.permute(0, 3, 1, 2).float().unbind(-1)  # (block, channel, group)
        # in float32, rounded once: q * scale nearly cancels min at the group's zero crossing
        w = self.integers().float() * scale[..., None] + low[..., None]
        return w.reshape(self.out_features, self.in_features).bfloat16()


class Int5DotLinear(Int4DotLinear):
    """5-bit weights in groups of 32 along the input, w = q * scale + min with q in 0..31: the
    int4 layout holds q's low 4 bits, `high` a plane of their 5th (rowdot.c's int5 layout), and
    the same kernel adds the two. For matrices whose weights lie on a 5-bit grid (GGUF's Q5_0,
    Q5_K: Gemma 3's MLP inputs and half its Q/K/V), which int4 moves by ~8% and int8 holds in
    8/5 of the bytes (a decode step reads every byte once)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features)
        blocks, groups = out_features // 8, in_features // GROUP
        # (blocks, groups, channel * 4 + input): bit 2 * step + half of each byte
        self.register_buffer("high", torch.empty(blocks, groups, 32, dtype=torch.uint8))

    def pack(self, w: Tensor) -> None:
        q, scale, low = quantize_groups(w, bits=5)
        q = q.to(torch.uint8)
        self.pack_groups(q, scale, low)
        blocks, groups = self.out_features // 8, self.in_features // GROUP
        # (block, channel, group, step, half, input) -> (block, group, channel, input, step, half)
        fifth = (q >> 4).view(blocks, 8, groups, 4, 2, 4).permute(0, 2, 1, 5, 3, 4)
        weights = 1 << torch.arange(8, dtype=torch.uint8)  # bit 2 * step + half
        self.high = (fifth.reshape(blocks, groups, 32, 8) * weights).sum(-1, dtype=torch.uint8)

    def integers(self) -> Tensor:
        blocks, groups = self.out_features // 8, self.in_features // GROUP
        bits = self.high[..., None] >> torch.arange(8, dtype=torch.uint8) & 1  # (.., 32, 8)
        # (block, group, channel, input, step, half) -> (block, channel, group, step, half, input)
        fifth = bits.view(blocks, groups, 8, 4, 4, 2).permute(0, 2, 1, 4, 5, 3)
        return super().integers() | fifth.reshape(blocks, 8, groups, GROUP) << 4

    def packed_mm(self, rows: Tensor) -> Tensor:
        return rowdot.int5_rows_mm(rows, self.packed, self.high, self.params)

    def unpacked(self, dtype: torch.dtype | None = None, scratch: bool = False) -> Tensor:
        shape = (self.out_features, self.in_features)
        return unpack.int4_dot_dense(
            self.packed, self.params, shape, dtype or dense_dtype(), scratch, self.high
        )


class Int4Head(Int4DotLinear):
    """A tied LM head in int4 (rowdot's layout), each row's RECHECK largest logits computed again
    from the bf16 embedding table it shares (lm_head.c): 5/8 of an int8 head's bytes, and the
    head is most of what a token reads where the vocabulary is large (Gemma 3's 262k rows). int4
    alone moves every logit; rechecked, only those too unlikely to be sampled keep the int4
    error. Logits are float32."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features)
        # the embedding's bf16 (vocab, dim) table, set by packed_model.share_embedding; a plain
        # attribute, which a compiled step reads as the model's own tensor
        self.table: Tensor | None = None

    def packed_mm(self, rows: Tensor) -> Tensor:
        return rowdot.int4_head_mm(rows, self.packed, self.params, self.table, RECHECK)


class Int8Linear(PackedLinear):
    """8-bit weights with one scale per output channel: for the LM head (it picks the next token
    among the whole vocabulary, and int4 there costs 2.4% of perplexity where int8 costs 0.4%)
    and for matrices int4 would change too much."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features)
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scales", torch.empty(out_features, dtype=torch.bfloat16))
        self.fbgemm = False  # set by use_fbgemm: a few rows go to fbgemm
        self.logits = False  # the LM head: float32 out of the kernels that can
        # rowdot's kernel, where it is the fast path (it steps by 4 channels and rounds rows in
        # groups of 32): for every row count on AVX2 (and the LM head without AMX: quantize),
        # else up to UNPACK_ROWS rows
        self.rowdot = rowdot.available() and out_features % 4 == 0 and in_features % GROUP == 0
        every = self.rowdot and rowdot.int8_every_row()
        self.rowdot_rows = ROWDOT_ROWS if every else UNPACK_ROWS
        self.inductor_loop = "avx512f" in cpu_flags()  # see packed_mm
        # torch's int8 kernel reads 16 inputs at a time and crashes on other widths (a trained
        # model's SwiGLU width of 8/3 · dim, say 344): those take the dequantized product
        self.aten = in_features % 16 == 0

    def use_fbgemm(self) -> None:
        """Multiply a few rows by fbgemm from now on (see models/fbgemm.py): 8-bit activations,
        for the LM head only. Packing takes seconds for a big head; where fbgemm cannot run,
        nothing changes."""
        if not self.fbgemm:
            self.fbgemm = fbgemm.prepack(self, self.weight, self.scales)

    def packed_rows(self) -> int:
        return self.rowdot_rows

    def keeps_dense(self) -> bool:
        return self.rowdot_rows < ROWDOT_ROWS

    def pack(self, w: Tensor) -> None:
        scale = (w.abs().amax(1) / 127).clamp(min=1e-12)  # (out,)
        self.weight = (w / scale[:, None]).round().to(torch.int8)
        self.scales = scale.bfloat16()

    def packed_mm(self, rows: Tensor) -> Tensor:
        # The branches test the layer first and the rows' count last, and never for exactly one
        # row: a compiled step of 1-8 rows (engine/aot_decode.py) must take one branch for all
        # of them, so that a row's logits are the same alone and beside others (its guesses,
        # a batch-mate).
        if self.fbgemm and rows.shape[0] <= DENSE_ROWS:
            # float32: the head's logits are not rounded to bf16 on the way out
            return fbgemm.fbgemm_linear(rows, self.weight)
        if self.rowdot:
            y = rowdot.int8_rows_mm(rows, self.weight, self.scales)  # float32
            return y if self.logits else y.to(rows.dtype)
        if self.inductor_loop and torch.compiler.is_compiling() and rows.shape[0] <= DENSE_ROWS:
            # A few rows, compiled, where rowdot is not the fast path (AVX-512 without VNNI):
            # inductor's own loop over the int8 matrix beats the kernel for one row (measured:
            # benchmarks/results/comments.md); with AVX2 it takes 3.5x as long.
            y = (self.weight * rows.float()[:, None, :]).sum(-1)  # (n, out)
            return (y * self.scales.float()).to(rows.dtype)
        if not self.aten:
            return rows @ self.dequantize().to(rows.dtype).t()
        return torch.ops.aten._weight_int8pack_mm(rows, self.weight, self.scales.to(rows.dtype))

    def dequantize(self) -> Tensor:
        return self.weight.to(torch.bfloat16) * self.scales[:, None]

    def unpacked(self, dtype: torch.dtype | None = None, scratch: bool = False) -> Tensor:
        dtype = dtype or dense_dtype()
        if not unpack.available():
            return self.dequantize().to(dtype)
        return unpack.int8_dense(self.weight, self.scales, dtype, scratch)


def packed(w: Tensor, bias: Tensor | None = None, kind: str | None = None) -> PackedLinear:
    """Int4 when 4 bits lose (almost) nothing: the weights already lie on a 4-bit grid, as a
    Q4_1, Q4_0 or Q4_K file's do (relative error ~0.3-0.6%, bf16 rounding of the scales and
    mins). Else, where rowdot's kernels run, int5 when 5 bits lose as little (a Q5_0 or Q5_K
    file's matrices: ~0.2%; MAX_INT5_ERROR). Otherwise int8 — Gemma's Q5_0/Q6_K matrices
    re-quantized to int4 err by ~8% and cost 22% of perplexity; its Q6_K and Q8_0 ones to int5,
    by ~3.7%.
    `kind` ("int4"/"int5"/"int8") forces the choice: for empty skeletons of a cached model."""
    if kind is not None:
        layer = {"int4": int4_class(), "int5": Int5DotLinear}.get(kind, Int8Linear)
        return layer.from_weight(w, bias)
    if not int4_packable(*w.shape):  # the CPU packing's shape rules
        return Int8Linear.from_weight(w, bias)
    kinds = [(int4_class(), MAX_INT4_ERROR)]
    if rowdot.available():
        kinds.append((Int5DotLinear, MAX_INT5_ERROR))
    for layer_class, limit in kinds:
        layer = layer_class.from_weight(w, bias)
        if relative_error(layer, w) < limit:
            return layer
    return Int8Linear.from_weight(w, bias)


def relative_error(layer: PackedLinear, w: Tensor) -> float:
    """How far the layer's matrix lies from w: relative (Frobenius) error."""
    err = (layer.dequantize().float() - w.float()).norm() / w.float().norm().clamp(min=1e-12)
    return err.item()
