/* Decode attention over the paged KV cache: each row (a sequence's newest token, or one of its
   guesses) attends to its sequence's keys and values where they lie in the pool, reached
   through its block table (see paged_attention.py).

   Why a kernel: one query against many keys is a matrix-vector product, and written with
   tensors (inductor's loops over blocks, or SDPA over a gathered copy) it ran at ~10 GFLOP/s,
   a tenth of the cores' rate; at 2,048 tokens of context one row's attention took longer than
   its share of the weights (benchmarks/results/comments.md). Here the keys and values are
   read once, where they lie, by vectors of 16 floats (8 on AVX2): each key's dot products
   with the query heads that share its K/V head (grouped-query attention), then a softmax with
   a polynomial exp, then the values weighted.

   Work is split over (row, run of CHUNK keys) among OpenMP's threads (torch's own, see
   kernels.py); an item goes through its keys once per K/V head, the first time prefetching
   whole slots (every head's K and V), which come from memory: a layer's cache is far from the
   last one's in a step. Each (row, head, run) keeps its highest score, its sum of
   exp(score - highest) and its weighted values, and each row's runs are merged rescaled to the
   row's highest score (flash-decoding's merge), so one long row keeps both cores busy.

   q (B, H, hd) float32; k, v (blocks, block_size, Hkv, hd) bf16 or float32; tables (B, width)
   int64 block numbers; ctx (B,) int64: the keys row b sees are positions [0, ctx[b]) of its
   sequence, the last window of them if window > 0; out (B, H, hd) float32. Query head i reads
   K/V head i / (H / Hkv). hd is a multiple of 16 and H / Hkv at most MAX_GROUP (the caller
   checks: paged_attention.decode_kernel_fits). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX__)
#include <immintrin.h>
#endif

/* Floats a vector: a register's worth. Vectors of 16 on AVX2 (two registers each) GCC moved
   through memory piece by piece, at every context length (benchmarks/results/comments.md). */
#if defined(__AVX512F__) || !defined(__AVX__)
#define VW 16
#else
#define VW 8
#endif
#define CHUNK 128    /* keys a work item attends */
#define MAX_GROUP 8  /* query heads a K/V head */
#define MAX_HD 256   /* dims a head */
#define PREFETCH 16  /* keys ahead */

typedef float vf __attribute__((vector_size(4 * VW)));
typedef uint32_t vu __attribute__((vector_size(4 * VW)));
typedef int32_t vi __attribute__((vector_size(4 * VW)));
typedef uint16_t vh __attribute__((vector_size(2 * VW)));

/* VW bf16 (the top halves of floats) or floats from p -> floats */
static inline vf load_vec(const char *p, int bf16) {
    if (bf16) {
        vh h;
        memcpy(&h, p, sizeof h);
        return (vf)(__builtin_convertvector(h, vu) << 16);
    }
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float hsum(vf v) {
#if defined(__AVX512F__)
    return _mm512_reduce_add_ps((__m512)v);
#elif defined(__AVX__)
    __m256 a;
    memcpy(&a, &v, sizeof a);
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
#else
    float total = 0.0f;
    for (int i = 0; i < VW; i++)
        total += v[i];
    return total;
#endif
}

/* e^x for x <= 0: x = (n + f) ln 2 with n whole and |f| <= 1/2; 2^f by its Taylor series to
   the 7th power (relative error ~1e-8 at |f| = 1/2), 2^n into the exponent's bits. Below -86
   the result is ~1e-38, not 0: scores that low weigh nothing next to the row's highest (1). */
static inline vf vexp(vf x) {
    const vf lowest = (vf){0} - 86.0f;
    const vi low = x < lowest;
    x = (vf)(((vi)x & ~low) | ((vi)lowest & low));
    const vf t = x * 1.44269504088896341f;
    const vf n = (t + 12582912.0f) - 12582912.0f; /* round to nearest: 1.5 * 2^23 */
    const vf f = t - n;
    vf p = f * 1.52527338e-5f + 1.54035304e-4f;
    p = p * f + 1.33335581e-3f;
    p = p * f + 9.61812911e-3f;
    p = p * f + 5.55041087e-2f;
    p = p * f + 2.40226507e-1f;
    p = p * f + 6.93147181e-1f;
    p = p * f + 1.0f;
    return (vf)((vi)p + (__builtin_convertvector(n, vi) << 23));
}

/* One work item: query heads q (G, hd), already scaled, against keys [j0, j1) of one K/V head
   (at byte `head` of a slot) -> the highest score m (G), the sum l (G) of exp(score - m), and
   the values weighted by those exps o (G, hd). G is a constant where this is inlined, so the
   G running sums stay in registers. */
static inline __attribute__((always_inline)) void attend_run(
    const float *q, const char *k, const char *v, int bf16, const int64_t *table,
    int64_t block_size, int64_t slot_bytes, int64_t head, int64_t hd, int64_t j0, int64_t j1,
    const int G, float *m, float *l, float *o) {
    const int64_t elem = bf16 ? 2 : 4, n = j1 - j0, padded = (n + VW - 1) / VW * VW;
    int64_t at[CHUNK]; /* byte offset of each key's head in the pool */
    float s[MAX_GROUP][CHUNK];
    for (int64_t j = j0; j < j1; j++)
        at[j - j0] = (table[j / block_size] * block_size + j % block_size) * slot_bytes + head;

    for (int64_t i = 0; i < n; i++) { /* scores */
        if (head == 0 && i + PREFETCH < n) /* a later key's whole slot, keys and values: */
            for (int64_t c = 0; c < slot_bytes; c += 64) { /* the other heads' too */
                __builtin_prefetch(k + at[i + PREFETCH] + c);
                __builtin_prefetch(v + at[i + PREFETCH] + c);
            }
        vf acc[MAX_GROUP];
        for (int g = 0; g < G; g++)
            acc[g] = (vf){0};
        for (int64_t c = 0; c < hd; c += VW) {
            const vf key = load_vec(k + at[i] + c * elem, bf16);
            for (int g = 0; g < G; g++) {
                vf qc;
                memcpy(&qc, q + g * hd + c, sizeof qc);
                acc[g] += qc * key;
            }
        }
        for (int g = 0; g < G; g++)
            s[g][i] = hsum(acc[g]);
    }
    for (int g = 0; g < G; g++) { /* softmax's numerators */
        float high = s[g][0];
        for (int64_t i = 1; i < n; i++)
            high = s[g][i] > high ? s[g][i] : high;
        for (int64_t i = n; i < padded; i++)
            s[g][i] = high - 1000.0f; /* weighs ~1e-38 */
        vf sum = {0};
        for (int64_t i = 0; i < padded; i += VW) {
            vf e;
            memcpy(&e, &s[g][i], sizeof e);
            e = vexp(e - high);
            memcpy(&s[g][i], &e, sizeof e);
            sum += e;
        }
        m[g] = high;
        l[g] = hsum(sum);
    }
    for (int64_t c = 0; c < hd; c += VW) { /* values */
        vf acc[MAX_GROUP];
        for (int g = 0; g < G; g++)
            acc[g] = (vf){0};
        for (int64_t i = 0; i < n; i++) {
            const vf value = load_vec(v + at[i] + c * elem, bf16);
            for (int g = 0; g < G; g++)
                acc[g] += s[g][i] * value;
        }
        for (int g = 0; g < G; g++)
            memcpy(o + g * hd + c, &acc[g], sizeof acc[g]);
    }
}

#define RUN(G)                                                                                 \
    case G:                                                                                    \
        attend_run(q, k, v, bf16, table, block_size, slot_bytes, head, hd, j0, j1, G, m, l, o); \
        break;

static void attend_run_any(const float *q, const char *k, const char *v, int bf16,
                           const int64_t *table, int64_t block_size, int64_t slot_bytes,
                           int64_t head, int64_t hd, int64_t j0, int64_t j1, int G, float *m,
                           float *l, float *o) {
    switch (G) {
        RUN(1) RUN(2) RUN(3) RUN(4) RUN(5) RUN(6) RUN(7) RUN(8)
    }
}

/* The first key row b sees, and one past its last. */
static inline void key_range(const int64_t *ctx, int64_t b, int64_t window, int64_t *lo,
                             int64_t *hi) {
    *hi = ctx[b];
    *lo = window > 0 && ctx[b] > window ? ctx[b] - window : 0;
}

void paged_decode_attention(const float *q, const void *k, const void *v, int bf16,
                            const int64_t *tables, int64_t width, const int64_t *ctx, int64_t B,
                            int64_t H, int64_t Hkv, int64_t hd, int64_t block_size,
                            int64_t window, float scale, float *out) {
    const int G = (int)(H / Hkv);
    const int64_t elem = bf16 ? 2 : 4, slot_bytes = Hkv * hd * elem;
    /* work items: row b's runs of CHUNK keys, from the run holding its first key; runs
       [first[b], first[b + 1]) are row b's. An item attends its keys for every K/V head, so
       it reads whole slots, one after another. */
    int64_t *first = malloc((size_t)(B + 1) * sizeof *first);
    first[0] = 0;
    for (int64_t b = 0; b < B; b++) {
        int64_t lo, hi;
        key_range(ctx, b, window, &lo, &hi);
        first[b + 1] = first[b] + (hi + CHUNK - 1) / CHUNK - lo / CHUNK;
    }
    /* per (row, K/V head, run): m (G), l (G), o (G, hd); row b's at first[b] * Hkv */
    const int64_t per_run = (int64_t)G * (hd + 2);
    float *partial = malloc((size_t)(first[B] * Hkv * per_run) * sizeof *partial);

#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t it = 0; it < first[B]; it++) {
            int64_t b = 0, above = B; /* the row: first[b] <= it < first[b + 1] */
            while (above - b > 1) {
                const int64_t mid = (b + above) / 2;
                if (first[mid] <= it)
                    b = mid;
                else
                    above = mid;
            }
            int64_t lo, hi;
            key_range(ctx, b, window, &lo, &hi);
            const int64_t runs = first[b + 1] - first[b], r = it - first[b];
            const int64_t j0 = (lo / CHUNK + r) * CHUNK > lo ? (lo / CHUNK + r) * CHUNK : lo;
            const int64_t j1 = j0 / CHUNK * CHUNK + CHUNK < hi ? j0 / CHUNK * CHUNK + CHUNK : hi;
            for (int64_t h = 0; h < Hkv; h++) {
                float qs[MAX_GROUP * MAX_HD];
                for (int64_t i = 0; i < G * hd; i++)
                    qs[i] = q[(b * H + h * G) * hd + i] * scale;
                float *m = partial + ((first[b] * Hkv) + h * runs + r) * per_run;
                attend_run_any(qs, (const char *)k, (const char *)v, bf16, tables + b * width,
                               block_size, slot_bytes, h * hd * elem, hd, j0, j1, G, m, m + G,
                               m + 2 * G);
            }
        }

#pragma omp for schedule(static)
        for (int64_t bh = 0; bh < B * Hkv; bh++) { /* each row's runs merged, per K/V head */
            const int64_t b = bh / Hkv, h = bh % Hkv, runs = first[b + 1] - first[b];
            const float *part = partial + (first[b] * Hkv + h * runs) * per_run;
            for (int g = 0; g < G; g++) {
                float high = -INFINITY, total = 0.0f;
                for (int64_t r = 0; r < runs; r++)
                    high = fmaxf(high, part[r * per_run + g]);
                float *dst = out + (b * H + h * G + g) * hd;
                memset(dst, 0, (size_t)hd * sizeof *dst);
                for (int64_t r = 0; r < runs; r++) {
                    const float *m = part + r * per_run, *o = m + 2 * G + g * hd;
                    const float w = expf(m[g] - high);
                    total += m[G + g] * w;
                    for (int64_t i = 0; i < hd; i++)
                        dst[i] += w * o[i];
                }
                for (int64_t i = 0; i < hd; i++)
                    dst[i] /= total;
            }
        }
    }
    free(partial);
    free(first);
}
