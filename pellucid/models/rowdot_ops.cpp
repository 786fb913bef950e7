/* rowdot's kernels as torch ops (pellucid::int4_rows_mm, pellucid::int8_rows_mm, declared in
   rowdot.py): so that a compiled decode step calls them without Python in between, which cost
   more per call than some of the products take (benchmarks/results/comments.md). Written against torch's stable ABI, whose
   headers compile in seconds (kernels.py builds this file with rowdot.c). */

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

extern "C" {
void int4_rows_mm(const void *x, int x_bf16, const uint8_t *packed, const uint16_t *params,
                  void *y, int y_bf16, int64_t n, int64_t out_f, int64_t in_f);
void int8_rows_mm(const void *x, int x_bf16, const int8_t *weight, const uint16_t *scales,
                  void *y, int y_bf16, int64_t n, int64_t out_f, int64_t in_f);
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

/* rows (n, in) -> (n, out) float32; weight (out, in) int8, scales (out,) bf16 */
static Tensor int8_op(Tensor rows, Tensor weight, Tensor scales) {
    const Tensor x = torch::stable::contiguous(rows);
    const int64_t n = x.size(0), in_f = x.size(1), out_f = weight.size(0);
    Tensor y = torch::stable::new_empty(x, {n, out_f}, ScalarType::Float);
    int8_rows_mm(x.data_ptr(), is_bf16(x), static_cast<const int8_t *>(weight.data_ptr()),
                 static_cast<const uint16_t *>(scales.data_ptr()), y.data_ptr(), 0, n, out_f, in_f);
    return y;
}

STABLE_TORCH_LIBRARY_IMPL(pellucid, CPU, m) {
    m.impl("int4_rows_mm", TORCH_BOX(&int4_op));
    m.impl("int8_rows_mm", TORCH_BOX(&int8_op));
}
