"""A whole model's packed layers (models/quant.py): a model quantized, and what its steps ask of
its packed layers as a whole: the dense copies a batch keeps, the LM head by fbgemm for a
compiled step, a tied head's table shared with the embedding.
"""

from __future__ import annotations

import torch
from torch import nn

from pellucid.models import rowdot
from pellucid.models.dense import dense_dtype
from pellucid.models.llama import LlamaModel
from pellucid.models.quant import (
    Int4DotLinear,
    Int4Head,
    Int8Linear,
    PackedLinear,
    int4_packable,
    packed,
    rowdot_rows,
)


@torch.no_grad()
def quantize(model: LlamaModel, stored: set[str] | None = None) -> LlamaModel:
    """Replace every projection of the decoder by a packed layer of the same name (int4, int5 or
    int8, as few bits as lose almost nothing: quant.packed), and the LM head by `packed_head`;
    the embedding table becomes bf16. `stored`: the state-dict keys of a cached packed model,
    which say which matrices are int4 or int5 (for a skeleton on the meta device).

    The rest stays as given, float32 (norms): the activations between the products are float32,
    as llama.cpp keeps them, and only the products round their rows (to int8 for rowdot, bf16 for
    a GEMM). With bf16 between them, each of the 30 layers' sums and norms rounded to 8 bits: KL
    from the float32 model 0.0069 against 0.0063 where rowdot takes every product, BFCL simple
    from Python 147 of 400 against 150 (benchmarks/results/comments.md). The embedding table is
    read one row per token, widened as it enters the residual stream (LlamaModel.hidden_states):
    bf16 halves it (Gemma's 262k rows: 335 MB), and when the head shares it (tied embeddings) it
    is also the head's bf16 matrix for many rows.
    """

    def kind(name: str) -> str | None:
        if stored is None:
            return None
        return (
            "int5" if f"{name}.high" in stored else "int4" if f"{name}.packed" in stored else "int8"
        )

    for name, module in list(model.layers.named_modules()):
        for child, lin in list(module.named_children()):
            if type(lin) is nn.Linear:
                key = f"layers.{name}.{child}"
                setattr(module, child, packed(lin.weight, lin.bias, kind(key)))
    head = model.lm_head = packed_head(model, stored)
    if isinstance(head, Int8Linear) and head.rowdot:
        # As many rows as rowdot's int4 layers take (every count unless AMX): its sums for a row
        # do not depend on the rows beside it, so a greedy reply does not change with its batch
        # (the bf16 table past DENSE_ROWS changed 7 of 12 SmolLM2 replies), and it was faster up
        # to 48 rows, ~1% slower past them (benchmarks/results/comments.md). The head takes
        # only the rows that sample, never a whole pre-fill.
        head.rowdot_rows = rowdot_rows()
    model.embed_tokens.to(torch.bfloat16)  # after the head, packed from its float32 weights
    share_embedding(model)
    return model


def packed_head(model: LlamaModel, stored: set[str] | None = None) -> PackedLinear:
    """The LM head packed (after the decoder's layers): int4 where it is the embedding table
    (tied), rowdot's kernels run and the head in int8 would outweigh the decoder, so that most
    of what a token reads is the head; else int8. An int4 head also gives each row's likeliest
    logits exactly (Int4Head). Gemma 3's 262k-row head was 168 MB of the 269 MB a token read;
    in int4, 105 MB. SmolLM2's is 28 MB against its decoder's 66: there int4 saved little, and
    the replies it changed moved its BFCL score (benchmarks/results/comments.md). (`stored`: as
    quantize's.)"""
    w = model.lm_head.weight
    if stored is not None:
        int4 = "lm_head.packed" in stored
    else:
        decoder = sum(b.numel() * b.element_size() for b in model.layers.buffers())
        int4 = model.cfg.tie_embeddings and rowdot.available() and w.numel() > decoder
        int4 = int4 and int4_packable(*w.shape, Int4DotLinear)
    if int4:
        return Int4Head.from_weight(w)
    head = Int8Linear.from_weight(w)
    head.logits = True
    return head


def make_dense(model: LlamaModel) -> None:
    """Give every packed layer that keeps one (not rowdot's) its dense matrix now, kept from
    then on: for steps of many decoding rows, which repeat (a batch), so that they do not unpack
    every matrix every step, and for a compiled graph, which must not find a copy missing."""
    for module in model.modules():
        if isinstance(module, PackedLinear) and module.dense is None and module.keeps_dense():
            module.dense = module.unpacked()


def use_fbgemm_head(model: LlamaModel) -> None:
    """An int8 LM head multiplies a few rows by fbgemm from now on (models/fbgemm.py): what a
    compiled decode step calls, torch.compile's or one compiled ahead (the op finds the packed
    head by the weight it is handed). Not where rowdot's int8 kernel runs: reading the head in
    memory order, it took less time than fbgemm for one row and a fraction for 2-8 (fbgemm
    reads the head once a row), with no second copy of the head to pack and hold
    (benchmarks/results/comments.md)."""
    if isinstance(head := model.lm_head, Int8Linear) and not head.rowdot:
        head.use_fbgemm()


def share_embedding(model: LlamaModel) -> None:
    """A tied head's bf16 matrix for many rows, where it keeps one (with AMX), is the embedding
    table itself: no second copy; so is the table an int4 head rechecks its logits against.
    (Call again after load_state_dict(assign=True) replaces the table.) Where the dense copies
    are float32, the head makes its own, as the decoder's layers do."""
    head = model.lm_head
    if isinstance(head, Int4Head):
        head.table = model.embed_tokens.weight.detach()
    if model.cfg.tie_embeddings and dense_dtype() == torch.bfloat16 and head.keeps_dense():
        # detached: a plain tensor attribute, not a second parameter
        head.dense = model.embed_tokens.weight.detach()
