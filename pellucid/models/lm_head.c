/* A tied LM head in 4 bits, its likeliest logits recomputed from the bf16 embedding table.

   Decoding one token reads the whole head, and a large vocabulary makes it most of the bytes a
   token reads (Gemma 3's 262,144 x 640 head: 168 MB in int8, more than its 18 layers). In int4
   (rowdot.c's dot8 layout) it takes 105 MB, but 4 bits alone move the logits enough to cost
   perplexity. Only the likeliest few logits decide what is sampled, so each row's top `k` by
   the int4 product are computed again exactly: float32 row times the bf16 table, which a tied
   head keeps in memory anyway (it is the embedding). The rest keep their int4 values.

   The `k` are each row's largest, ties to the lower index: a total order, so the set does not
   depend on threads or batch. Each exact dot product runs in one fixed order, so a row's logits
   are the same alone, beside others, eager or from a compiled step (which calls this too). */

#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HEAD_AVX2 1
#endif

void int4_rows_mm(const void *x, int x_bf16, const uint8_t *packed, const uint16_t *params,
                  void *y, int y_bf16, int64_t n, int64_t out_f, int64_t in_f);

/* A min-heap of k (value, index) pairs, the worst at the root: worse = smaller value, or the
   same value at a higher index. */
static inline int worse(float va, int64_t ia, float vb, int64_t ib) {
    return va < vb || (va == vb && ia > ib);
}

static void sift_down(float *val, int64_t *idx, int64_t k, int64_t at) {
    for (;;) {
        int64_t child = 2 * at + 1, worst = at;
        if (child < k && worse(val[child], idx[child], val[worst], idx[worst]))
            worst = child;
        if (child + 1 < k && worse(val[child + 1], idx[child + 1], val[worst], idx[worst]))
            worst = child + 1;
        if (worst == at)
            return;
        const float v = val[at];
        const int64_t i = idx[at];
        val[at] = val[worst], idx[at] = idx[worst];
        val[worst] = v, idx[worst] = i;
        at = worst;
    }
}

/* A later value replaces the root where it is larger (at a higher index, equal is worse). */
static inline void offer(float *val, int64_t *idx, int64_t k, float v, int64_t i) {
    if (v > val[0]) {
        val[0] = v, idx[0] = i;
        sift_down(val, idx, k, 0);
    }
}

/* The indices of the k largest of v[0..len) into idx (in no order); k <= len. */
static void top_k(const float *v, int64_t len, int64_t k, int64_t *idx, float *val) {
    for (int64_t i = 0; i < k; i++)
        val[i] = v[i], idx[i] = i;
    for (int64_t i = k / 2 - 1; i >= 0; i--)
        sift_down(val, idx, k, i);
    int64_t i = k;
#ifdef HEAD_AVX2
    /* most of the vocabulary is below the heap's root: skip 8 at a time */
    for (; i + 8 <= len; i += 8) {
        const __m256 above = _mm256_cmp_ps(_mm256_loadu_ps(v + i), _mm256_set1_ps(val[0]),
                                           _CMP_GT_OQ);
        if (_mm256_movemask_ps(above))
            for (int64_t j = i; j < i + 8; j++)
                offer(val, idx, k, v[j], j);
    }
#endif
    for (; i < len; i++)
        offer(val, idx, k, v[i], i);
}

/* A float32 or bf16 row times a bf16 row of the table, in one fixed order. */
static float exact_dot(const void *x, int x_bf16, const uint16_t *w, int64_t in_f) {
    int64_t j = 0;
    float sum = 0.0f;
#ifdef HEAD_AVX2
    __m256 acc = _mm256_setzero_ps();
    for (; j + 8 <= in_f; j += 8)
        acc = _mm256_fmadd_ps(load8(x, j, x_bf16), bf16x8(w + j), acc);
    float lanes[8];
    _mm256_storeu_ps(lanes, acc);
    for (int l = 0; l < 8; l++)
        sum += lanes[l];
#endif
    for (; j < in_f; j++)
        sum += load_value(x, j, x_bf16) * bf16_to_float(w[j]);
    return sum;
}

/* rows x (n, in) float32 or bf16 -> logits y (n, out) float32: the int4 product (dot8 layout,
   packed/params as int4_rows_mm takes them), then each row's k largest recomputed from table
   (out, in) bf16. */
void int4_head_mm(const void *x, int x_bf16, const uint8_t *packed, const uint16_t *params,
                  const uint16_t *table, int64_t k, float *y, int64_t n, int64_t out_f,
                  int64_t in_f) {
    int4_rows_mm(x, x_bf16, packed, params, y, 0, n, out_f, in_f);
    if (k > out_f)
        k = out_f;
    if (k <= 0)
        return;
    const int64_t width = x_bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) if (n > 1)
    for (int64_t r = 0; r < n; r++) {
        int64_t *idx = malloc(k * sizeof(int64_t));
        float *val = malloc(k * sizeof(float));
        float *logits = y + r * out_f;
        const char *row = (const char *)x + r * in_f * width;
        top_k(logits, out_f, k, idx, val);
        for (int64_t j = 0; j < k; j++)
            logits[idx[j]] = exact_dot(row, x_bf16, table + idx[j] * in_f, in_f);
        free(idx);
        free(val);
    }
}
