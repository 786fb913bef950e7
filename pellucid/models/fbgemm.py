"""Products of a few rows with an int8 matrix by fbgemm (torch's x86 int8 GEMM library): the LM head
of a compiled decode step on a CPU with AVX-512 VNNI where pellucid's own kernels cannot be built
(no C compiler); where they can, rowdot.c's int8 kernel takes the head (packed_model.use_fbgemm_head).

Why: decoding one token multiplies one row of activations by the head's whole matrix (Gemma 3:
262,144 x 640 int8, 168 MB). Widening each int8 weight to float before multiplying, as
inductor's loop and `_weight_int8pack_mm` do, is bound by that arithmetic, not by memory.
fbgemm rounds the row to 8 bits too (one scale for the row, as llama.cpp rounds activations to
8 bits) and multiplies 8 by 8 bits into int32 with VNNI dot products, in a fraction of the time.
Only the head goes this way: its input is the final normalized hidden state, whose rounding
costs little perplexity, while Gemma's decoder matrices would lose several percent (a few
outlier channels in their inputs take the whole 8-bit range). Tested: tests/test_quant.py;
measured: benchmarks/results/comments.md.

Packing a matrix into fbgemm's layout takes up to seconds (Gemma's head; SmolLM2's 0.16 s), so
it is done only for a compiled decode step, and in a thread of its own: the op releases the GIL,
so loading goes on (the tokenizer, the first pre-fill) while it packs, and the first compiled step
waits for it only if it is not done.

fbgemm's packed matrix is a TorchScript object, which dynamo cannot put in a graph (it would
break the graph there); the custom op `pellucid::fbgemm_linear` takes the int8 weight itself and
finds its packed copy in a table by the weight's address, so a compiled step calls fbgemm like
any other kernel — and so does a step compiled ahead of time in another process
(engine/aot_decode.py), which hands the op this process's own weight.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from collections.abc import Callable
from concurrent.futures import Future

import torch
from torch import Tensor

from pellucid.cpu import cpu_flags

# The weight's address -> (the weight, fbgemm's packed copy of it, once packed). Holding the
# weight keeps its address from going to another tensor while the entry lives.
_PACKED: dict[int, tuple[Tensor, Future[torch.ScriptObject]]] = {}


def has_vnni() -> bool:
    """Without AVX-512 VNNI, fbgemm multiplies uint8 by int8 in pairs summed into int16, which
    can saturate unless activations keep to 7 bits (its reduce_range): measured on SmolLM2
    (AVX2), 7-bit rows cost the head 1.03% of perplexity, past the fast path's 1%. So there, no
    fbgemm. (Its kernels for AVX2-class VNNI are not known here, so avx_vnni does not count.)"""
    return "avx512_vnni" in cpu_flags()


def prepack(owner: object, weight: Tensor, scales: Tensor) -> bool:
    """Pack int8 (out, in) weights with one scale per output row for fbgemm_linear: True, or
    False where fbgemm does not run: a CPU without VNNI (see has_vnni), a build without torch's
    x86 quantized engine, or a process that chose another one (torch.backends.quantized.engine,
    left as it is). The packed copy lives as long as `owner` does."""
    if weight.data_ptr() in _PACKED:
        return True
    if not has_vnni() or torch.backends.quantized.engine not in ("x86", "fbgemm"):
        return False
    zeros = torch.zeros(weight.shape[0], dtype=torch.long)
    try:
        # torch marks its quantized tensors deprecated; pellucid pins torch 2.13, where they work
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            q = torch._make_per_channel_quantized_tensor(weight, scales.double(), zeros, 0)
        pack = torch.ops.quantized.linear_prepack
    except (RuntimeError, AttributeError):  # a torch without these ops: the caller's own path
        return False
    packed: Future[torch.ScriptObject] = Future()
    # A thread that ends when done: an idle live one would keep OpenMP threads that contend
    # with the decoding thread's.
    threading.Thread(target=_run, args=(packed, pack, q), name="fbgemm-prepack").start()
    _PACKED[weight.data_ptr()] = (weight, packed)
    weakref.finalize(owner, _PACKED.pop, weight.data_ptr(), None)
    return True


def _run(future: Future, fn: Callable, *args: object) -> None:
    try:
        future.set_result(fn(*args))
    except BaseException as e:  # noqa: BLE001 - raised again where the result is awaited
        future.set_exception(e)


# Declared with torch.library's low-level API: a custom_op's kernel imports dynamo on
# its first call (longer than loading the model), which a process running a step compiled ahead
# has no other reason to pay.
_LIB = torch.library.Library("pellucid", "DEF")  # the op is defined once, here
_LIB.define("fbgemm_linear(Tensor rows, Tensor weight) -> Tensor")


def fbgemm_linear(rows: Tensor, weight: Tensor) -> Tensor:
    """rows (M, in), any float dtype -> float32 (M, out): rows @ W.T for the int8 `weight`,
    packed by prepack first. Each row is rounded to uint8 with a scale of its own."""
    return torch.ops.pellucid.fbgemm_linear(rows, weight)


def _fbgemm_linear(rows: Tensor, weight: Tensor) -> Tensor:
    # One call per row: fbgemm gives all the rows of a call one scale, so a row's logits would
    # change with its batch-mates (a drafted step's guesses would round the token's own row).
    packed = _PACKED[weight.data_ptr()][1].result()
    rows = rows.float()
    return torch.cat([torch.ops.quantized.linear_dynamic(r, packed, False) for r in rows.split(1)])


_LIB.impl("fbgemm_linear", _fbgemm_linear, "CPU")


@torch.library.register_fake("pellucid::fbgemm_linear")
def _(rows: Tensor, weight: Tensor) -> Tensor:
    return rows.new_empty(rows.shape[0], weight.shape[0], dtype=torch.float32)
