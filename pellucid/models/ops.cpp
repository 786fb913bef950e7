/* pellucid's C kernels as torch ops: rowdot's products (pellucid::int4_rows_mm,
   pellucid::int5_rows_mm, pellucid::int8_rows_mm, declared in rowdot.py), the int4 LM head (pellucid::int4_head_mm,
   lm_head.c, declared there too) and decode attention
   (pellucid::paged_decode_attention, declared in paged_attention.py), so that a compiled decode
   step calls them without Python in between, which cost more per call than some of the
   products take (benchmarks/results/comments.md). Written against torch's stable ABI, whose
   headers compile in seconds (kernels.py builds this file with rowdot.c, lm_head.c and
   decode_attention.c). */

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

extern "C" {
void int4_rows_mm(const void *x, int x_bf16, const uint8_t *packed, const uint16_t *params,
                  void *y, int y_bf16, int64_t n, int64_t out_f, int64_t in_f);
void int5_rows_mm(const void *x, int x_bf16, const uint8_t *packed, const uint8_t *high,
                  const uint16_t *params, void *y, int y_bf16, int64_t n, int64_t out_f,
                  int64_t in_f);
void int8_rows_mm(const void *x, int x_bf16, const int8_t *weight, const uint16_t *scales,
                  void *y, int y_bf16, int64_t n, int64_t out_f, int64_t in_f);
void int4_head_mm(const void *x, int x_bf16, const uint8_t *packed, const uint16_t *params,
                  const uint16_t *table, int64_t k, float *y, int64_t n, int64_t out_f,
                  int64_t in_f);
void paged_decode_attention(const float *q, const void *k, const void *v, int bf16,
                            const int64_t *tables, int64_t width, const int64_t *ctx, int64_t B,
                            int64_t H, int64_t Hkv, int64_t hd, int64_t block_size,
                            int64_t window, float scale, float *out);
}

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

static bool is_bf16(const Tensor &t) { return t.scalar_type() == ScalarType::BFloat16; }

/* rows (n, in) -> (n, out) in the rows' dtype; packed (out/8, in/32, 4, 32) uint8 */
static Tensor int4_op(Tensor rows, Tensor packed, Tensor params) {
    const Tensor x = torch::stable::contiguous(rows);
    const int64_t n = x.size(0), in_f = x.size(1), out_f = packed.size(0) * 8;
    Tensor y = torch::stable::new_empty(x, {n, out_f});
    int4_rows_mm(x.data_ptr(), is_bf16(x), static_cast<const uint8_t *>(packed.data_ptr()),
                 static_cast<const uint16_t *>(params.data_ptr()), y.data_ptr(), is_bf16(y), n,
                 out_f, in_f);
    return y;
}

/* as int4_op, and high (out/8, in/32, 32) uint8: the weights' 5th bits */
static Tensor int5_op(Tensor rows, Tensor packed, Tensor high, Tensor params) {
    const Tensor x = torch::stable::contiguous(rows);
    const int64_t n = x.size(0), in_f = x.size(1), out_f = packed.size(0) * 8;
    Tensor y = torch::stable::new_empty(x, {n, out_f});
    int5_rows_mm(x.data_ptr(), is_bf16(x), static_cast<const uint8_t *>(packed.data_ptr()),
                 static_cast<const uint8_t *>(high.data_ptr()),
                 static_cast<const uint16_t *>(params.data_ptr()), y.data_ptr(), is_bf16(y), n,
                 out_f, in_f);
    return y;
}

/* rows (n, in) -> (n, out) float32; weight (out, in) int8, scales (out,) bf16 */
static Tensor int8_op(Tensor rows, Tensor weight, Tensor scales) {
    const Tensor x = torch::stable::contiguous(rows);
    const int64_t n = x.size(0), in_f = x.size(1), out_f = weight.size(0);
    Tensor y = torch::stable::new_empty(x, {n, out_f}, ScalarType::Float);
    int8_rows_mm(x.data_ptr(), is_bf16(x), static_cast<const int8_t *>(weight.data_ptr()),
                 static_cast<const uint16_t *>(scales.data_ptr()), y.data_ptr(), 0, n, out_f, in_f);
    return y;
}

/* rows (n, in) -> logits (n, out) float32; packed and params as int4_op's, table (out, in) bf16 */
static Tensor head_op(Tensor rows, Tensor packed, Tensor params, Tensor table, int64_t k) {
    const Tensor x = torch::stable::contiguous(rows);
    const int64_t n = x.size(0), in_f = x.size(1), out_f = packed.size(0) * 8;
    Tensor y = torch::stable::new_empty(x, {n, out_f}, ScalarType::Float);
    int4_head_mm(x.data_ptr(), is_bf16(x), static_cast<const uint8_t *>(packed.data_ptr()),
                 static_cast<const uint16_t *>(params.data_ptr()),
                 static_cast<const uint16_t *>(table.data_ptr()), k,
                 static_cast<float *>(y.data_ptr()), n, out_f, in_f);
    return y;
}

/* q (B, H, hd) float32; k/v cache (blocks, block_size, Hkv, hd) bf16 or float32, as is;
   tables (B, width) int64; ctx_lens (B,) int64 -> (B, H, hd) float32 */
static Tensor attention_op(Tensor q, Tensor k_cache, Tensor v_cache, Tensor tables,
                           Tensor ctx_lens, int64_t window, double scale) {
    const Tensor qc = torch::stable::contiguous(q), t = torch::stable::contiguous(tables);
    const Tensor lens = torch::stable::contiguous(ctx_lens);
    Tensor out = torch::stable::new_empty(qc, {qc.size(0), qc.size(1), qc.size(2)});
    paged_decode_attention(static_cast<const float *>(qc.data_ptr()), k_cache.data_ptr(),
                           v_cache.data_ptr(), is_bf16(k_cache),
                           static_cast<const int64_t *>(t.data_ptr()), t.size(1),
                           static_cast<const int64_t *>(lens.data_ptr()), qc.size(0), qc.size(1),
                           k_cache.size(2), k_cache.size(3), k_cache.size(1), window,
                           static_cast<float>(scale), static_cast<float *>(out.data_ptr()));
    return out;
}

STABLE_TORCH_LIBRARY_IMPL(pellucid, CPU, m) {
    m.impl("int4_rows_mm", TORCH_BOX(&int4_op));
    m.impl("int5_rows_mm", TORCH_BOX(&int5_op));
    m.impl("int8_rows_mm", TORCH_BOX(&int8_op));
    m.impl("int4_head_mm", TORCH_BOX(&head_op));
    m.impl("paged_decode_attention", TORCH_BOX(&attention_op));
}
