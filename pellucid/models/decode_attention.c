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

   A sequence's newest token and its guesses read the same keys, up to one more each: those
   rows go together, each key converted once for all their query heads, and the values a span
   at a time into floats for them (benchmarks/results/comments.md). Work is split over (rows,
   run of CHUNK keys, K/V head) among OpenMP's threads (torch's own, see kernels.py); a row
   alone goes through its run's heads in one item, the first prefetching whole slots (every
   head's K and V), which come from memory: a layer's cache is far from the last one's in a
   step. Each (row, head, run) keeps its highest score, its sum of exp(score - highest) and its
   weighted values, and each row's runs are merged rescaled to the row's highest score
   (flash-decoding's merge), so one long row keeps both cores busy. A row's results are the
   same bit for bit alone or beside others: each of its sums runs in the same order, with the
   same fused products, in any company.

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
#define PREFETCH 16  /* keys ahead */
#define MAX_ROWS 8   /* rows of one sequence an item attends */
#define QUERY_BLOCK 8  /* queries whose dot products with a key are summed at once */
#define VALUE_CHUNKS 8 /* vectors of a query's weighted values summed at once */
#define VALUE_FLOATS 4096 /* values converted to floats at a time: 16 KB */

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

/* a * b + c, rounded once where the CPU fuses them (twice where it cannot). Spelled out in the
   sums a row's query heads share with others' (scores, weighted values): left to the compiler,
   which products it fused differed between two inlined copies of one loop (for 1 query and
   for 8), and a row's results then with the rows beside it. */
static inline vf fmadd(vf a, vf b, vf c) {
#if defined(__AVX512F__)
    return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__) && VW == 8
    return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    return a * b + c;
#endif
}

static inline vf splat(float x) { /* x in every lane (a loop of GCC's was a chain of inserts) */
#if defined(__AVX512F__)
    return (vf)_mm512_set1_ps(x);
#elif defined(__AVX__) && VW == 8
    return (vf)_mm256_set1_ps(x);
#else
    vf v;
    for (int i = 0; i < VW; i++)
        v[i] = x;
    return v;
#endif
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
    vf p = fmadd(f, splat(1.52527338e-5f), splat(1.54035304e-4f));
    p = fmadd(p, f, splat(1.33335581e-3f));
    p = fmadd(p, f, splat(9.61812911e-3f));
    p = fmadd(p, f, splat(5.55041087e-2f));
    p = fmadd(p, f, splat(2.40226507e-1f));
    p = fmadd(p, f, splat(6.93147181e-1f));
    p = fmadd(p, f, splat(1.0f));
    return (vf)((vi)p + (__builtin_convertvector(n, vi) << 23));
}

/* Dot products of QN queries (QN, hd), already scaled, with keys at byte offsets at[0..n) ->
   scores s (QN rows of CHUNK). QN a constant where this is inlined, so the QN running sums stay
   in registers; each key is converted once for them. `prefetch`: also fetch the K and V of a
   later key (`bytes` of each), which come from memory. */
static inline __attribute__((always_inline)) void score_block(
    const float *q, const char *k, const char *v, int bf16, const int64_t *at, int64_t n,
    int64_t hd, int prefetch, int64_t bytes, const int QN, float *s) {
    const int64_t elem = bf16 ? 2 : 4;
    for (int64_t i = 0; i < n; i++) {
        if (prefetch && i + PREFETCH < n)
            for (int64_t c = 0; c < bytes; c += 64) {
                __builtin_prefetch(k + at[i + PREFETCH] + c);
                __builtin_prefetch(v + at[i + PREFETCH] + c);
            }
        vf acc[QUERY_BLOCK];
        for (int g = 0; g < QN; g++)
            acc[g] = (vf){0};
        for (int64_t c = 0; c < hd; c += VW) {
            const vf key = load_vec(k + at[i] + c * elem, bf16);
            for (int g = 0; g < QN; g++) {
                vf qc;
                memcpy(&qc, q + g * hd + c, sizeof qc);
                acc[g] = fmadd(qc, key, acc[g]);
            }
        }
        for (int g = 0; g < QN; g++)
            s[g * CHUNK + i] = hsum(acc[g]);
    }
}

#define SCORES(QN)                                                                           \
    case QN:                                                                                 \
        score_block(q, k, v, bf16, at, n, hd, prefetch, bytes, QN, s);                       \
        break;

static void score_any(const float *q, const char *k, const char *v, int bf16, const int64_t *at,
                      int64_t n, int64_t hd, int prefetch, int64_t bytes, int QN, float *s) {
    switch (QN) {
        SCORES(1) SCORES(2) SCORES(3) SCORES(4) SCORES(5) SCORES(6) SCORES(7) SCORES(8)
    }
}

/* The exps of a query's n scores (a row of s), padded to whole vectors, relative to their
   highest -> *m that highest, *l their sum. */
static void softmax_numerators(float *s, int64_t n, float *m, float *l) {
    const int64_t padded = (n + VW - 1) / VW * VW;
    float high = s[0];
    for (int64_t i = 1; i < n; i++)
        high = s[i] > high ? s[i] : high;
    for (int64_t i = n; i < padded; i++)
        s[i] = high - 1000.0f; /* weighs ~1e-38 */
    vf sum = {0};
    for (int64_t i = 0; i < padded; i += VW) {
        vf e;
        memcpy(&e, &s[i], sizeof e);
        e = vexp(e - high);
        memcpy(&s[i], &e, sizeof e);
        sum += e;
    }
    *m = high;
    *l = hsum(sum);
}

/* Dims [c0, c0 + NC * VW) of one query's weighted values: o (+)= sum over i < n of w[i] *
   vals[i] (vals (n, hd) float32), added to o's sums where `more` (the next keys of a run).
   NC a constant where this is inlined: NC sums in registers, each weight broadcast once for
   them. */
static inline __attribute__((always_inline)) void weigh_values(const float *w,
                                                               const float *vals, int64_t n,
                                                               int64_t hd, int64_t c0,
                                                               const int NC, int more,
                                                               float *o) {
    vf acc[VALUE_CHUNKS];
    for (int j = 0; j < NC; j++)
        if (more)
            memcpy(&acc[j], o + c0 + j * VW, sizeof acc[j]);
        else
            acc[j] = (vf){0};
    for (int64_t i = 0; i < n; i++)
        for (int j = 0; j < NC; j++) {
            vf value;
            memcpy(&value, vals + i * hd + c0 + j * VW, sizeof value);
            acc[j] = fmadd(splat(w[i]), value, acc[j]);
        }
    for (int j = 0; j < NC; j++)
        memcpy(o + c0 + j * VW, &acc[j], sizeof acc[j]);
}

static void weigh_all(const float *w, const float *vals, int64_t n, int64_t hd, int more,
                      float *o) {
    int64_t c = 0;
    for (; c + VALUE_CHUNKS * VW <= hd; c += VALUE_CHUNKS * VW)
        weigh_values(w, vals, n, hd, c, VALUE_CHUNKS, more, o);
    if (c + 4 * VW <= hd)
        weigh_values(w, vals, n, hd, c, 4, more, o), c += 4 * VW;
    if (c + 2 * VW <= hd)
        weigh_values(w, vals, n, hd, c, 2, more, o), c += 2 * VW;
    if (c + VW <= hd)
        weigh_values(w, vals, n, hd, c, 1, more, o);
}

/* One row's G query heads' weighted values (their weights w: G rows of CHUNK) straight from
   the cache, each value converted once for the G: o (G, hd) = sum over i < n of w[g][i] *
   value i. The same sums as weigh_values', in the same order. G a constant where this is
   inlined, so its sums stay in registers. */
static inline __attribute__((always_inline)) void weigh_row(const float *w, const char *v,
                                                            int bf16, const int64_t *at,
                                                            int64_t n, int64_t hd, const int G,
                                                            float *o) {
    const int64_t elem = bf16 ? 2 : 4;
    for (int64_t c = 0; c < hd; c += VW) {
        vf acc[MAX_GROUP];
        for (int g = 0; g < G; g++)
            acc[g] = (vf){0};
        for (int64_t i = 0; i < n; i++) {
            const vf value = load_vec(v + at[i] + c * elem, bf16);
            for (int g = 0; g < G; g++)
                acc[g] = fmadd(splat(w[g * CHUNK + i]), value, acc[g]);
        }
        for (int g = 0; g < G; g++)
            memcpy(o + g * hd + c, &acc[g], sizeof acc[g]);
    }
}

#define ROW(G)                                                                               \
    case G:                                                                                  \
        weigh_row(w, v, bf16, at, n, hd, G, o);                                              \
        break;

static void weigh_row_any(const float *w, const char *v, int bf16, const int64_t *at, int64_t n,
                          int64_t hd, int G, float *o) {
    switch (G) {
        ROW(1) ROW(2) ROW(3) ROW(4) ROW(5) ROW(6) ROW(7) ROW(8)
    }
}

/* The first key row b sees, and one past its last. */
static inline void key_range(const int64_t *ctx, int64_t b, int64_t window, int64_t *lo,
                             int64_t *hi) {
    *hi = ctx[b];
    *lo = window > 0 && ctx[b] > window ? ctx[b] - window : 0;
}

/* What one call attends, for its work items. */
typedef struct {
    const float *q;
    const char *k, *v;
    int bf16, G;
    const int64_t *tables, *ctx, *first; /* first: each row's first run (below) */
    int64_t width, H, Hkv, hd, block_size, window, slot_bytes, per_run;
    float scale, *partial;
} Attention;

/* Rows b and b + 1 read the same keys, from the same first: a sequence's newest token and its
   guesses, which a step lays side by side. */
static int same_keys(const Attention *a, int64_t b) {
    int64_t lo0, hi0, lo1, hi1;
    key_range(a->ctx, b, a->window, &lo0, &hi0);
    key_range(a->ctx, b + 1, a->window, &lo1, &hi1);
    return lo0 == lo1 && memcmp(a->tables + b * a->width, a->tables + (b + 1) * a->width,
                                (size_t)a->width * sizeof *a->tables) == 0;
}

/* A thread's scratch, kept between calls (grown where a call needs more). */
static float *scratch(int64_t floats) {
    static __thread float *buffer;
    static __thread int64_t size;
    if (floats > size) {
        free(buffer);
        buffer = malloc((size_t)floats * sizeof *buffer);
        size = floats;
    }
    return buffer;
}

/* The weighted values of `count` rows (their weights s: count * G rows of CHUNK, row i's
   over its first n[i] keys) into their partials m, a span of keys at a time: converted into floats
   (vals) once for every query head, and a span stays in L1 beside the keys' and values' own
   lines. */
static void weigh_rows(const Attention *a, const float *s, const int64_t *at, const int64_t *n,
                       int64_t count, int64_t most, int64_t span, float *vals, float *const *m) {
    const int64_t hd = a->hd, G = a->G, elem = a->bf16 ? 2 : 4;
    for (int64_t i0 = 0; i0 < most; i0 += span) {
        const int64_t i1 = i0 + span < most ? i0 + span : most;
        for (int64_t i = i0; i < i1; i++)
            for (int64_t c = 0; c < hd; c += VW) {
                const vf value = load_vec(a->v + at[i] + c * elem, a->bf16);
                memcpy(vals + (i - i0) * hd + c, &value, sizeof value);
            }
        for (int64_t row = 0; row < count; row++) {
            if (n[row] <= i0) /* the row's keys end before the span */
                continue;
            const int64_t end = n[row] < i1 ? n[row] : i1;
            for (int64_t g = 0; g < G; g++)
                weigh_all(s + (row * G + g) * CHUNK + i0, vals, end - i0, hd, i0 > 0,
                          m[row] + 2 * G + g * hd);
        }
    }
}

/* One work item: K/V head h, run r of the keys of rows [b0, b1), which share them. Each row
   that sees keys of the run attends them to its own last; its results go to its partials.
   `ahead`: bytes of each later key's K and V to prefetch, from the item's head on. */
static void attend_item(const Attention *a, int64_t b0, int64_t b1, int64_t r, int64_t h,
                        int64_t ahead) {
    const int64_t hd = a->hd, G = a->G, elem = a->bf16 ? 2 : 4, bs = a->block_size;
    int64_t lo, hi;
    key_range(a->ctx, b0, a->window, &lo, &hi);
    const int64_t start = (lo / CHUNK + r) * CHUNK, j0 = start > lo ? start : lo;
    int64_t seeing[MAX_ROWS], n[MAX_ROWS], count = 0, most = 0; /* the rows that see the run */
    for (int64_t b = b0; b < b1; b++) {
        key_range(a->ctx, b, a->window, &lo, &hi);
        if (hi > j0) {
            seeing[count] = b;
            n[count] = (start + CHUNK < hi ? start + CHUNK : hi) - j0;
            most = n[count] > most ? n[count] : most;
            count++;
        }
    }
    int64_t at[CHUNK]; /* byte offset of each key's head in the pool */
    const int64_t *table = a->tables + b0 * a->width;
    for (int64_t j = j0; j < j0 + most; j++)
        at[j - j0] = (table[j / bs] * bs + j % bs) * a->slot_bytes + h * hd * elem;

    const int64_t Q = count * G; /* the rows' query heads of K/V head h, row by row */
    const int64_t span = VALUE_FLOATS / hd > 1 ? VALUE_FLOATS / hd : 1;
    float *qs = scratch(Q * hd + Q * CHUNK + span * hd), *s = qs + Q * hd, *vals = s + Q * CHUNK;
    for (int64_t row = 0; row < count; row++)
        for (int64_t i = 0; i < G * hd; i++)
            qs[row * G * hd + i] = a->q[(seeing[row] * a->H + h * G) * hd + i] * a->scale;
    for (int64_t q0 = 0; q0 < Q; q0 += QUERY_BLOCK)
        score_any(qs + q0 * hd, a->k, a->v, a->bf16, at, most, hd, q0 == 0 && ahead, ahead,
                  (int)(Q - q0 < QUERY_BLOCK ? Q - q0 : QUERY_BLOCK), s + q0 * CHUNK);
    float *m[MAX_ROWS]; /* each row's partial: m (G), l (G), o (G, hd) */
    for (int64_t row = 0; row < count; row++) {
        const int64_t b = seeing[row], runs = a->first[b + 1] - a->first[b];
        m[row] = a->partial + (a->first[b] * a->Hkv + h * runs + r) * a->per_run;
        for (int64_t g = 0; g < G; g++)
            softmax_numerators(s + (row * G + g) * CHUNK, n[row], m[row] + g, m[row] + G + g);
    }
    if (count == 1) /* one row: each value converted once for its few heads, as they go */
        weigh_row_any(s, a->v, a->bf16, at, n[0], hd, (int)G, m[0] + 2 * G);
    else
        weigh_rows(a, s, at, n, count, most, span, vals, m);
}

void paged_decode_attention(const float *q, const void *k, const void *v, int bf16,
                            const int64_t *tables, int64_t width, const int64_t *ctx, int64_t B,
                            int64_t H, int64_t Hkv, int64_t hd, int64_t block_size,
                            int64_t window, float scale, float *out) {
    const int G = (int)(H / Hkv);
    const int64_t elem = bf16 ? 2 : 4;
    /* row b's runs of CHUNK keys, from the run holding its first key: [first[b], first[b + 1]) */
    int64_t *first = malloc((size_t)(B + 1) * sizeof *first);
    first[0] = 0;
    for (int64_t b = 0; b < B; b++) {
        int64_t lo, hi;
        key_range(ctx, b, window, &lo, &hi);
        first[b + 1] = first[b] + (hi + CHUNK - 1) / CHUNK - lo / CHUNK;
    }
    /* per (row, K/V head, run): m (G), l (G), o (G, hd); row b's at first[b] * Hkv */
    const int64_t per_run = (int64_t)G * (hd + 2);
    const Attention a = {q,  (const char *)k, (const char *)v, bf16, G, tables, ctx, first,
                         width, H, Hkv, hd, block_size, window, Hkv * hd * elem, per_run, scale,
                         malloc((size_t)(first[B] * Hkv * per_run) * sizeof(float))};
    /* rows that read the same keys, up to MAX_ROWS, go together: rows [group[i], group[i + 1]);
       work items: each group's runs (its longest row's) times the K/V heads, from item[i] */
    int64_t *group = malloc((size_t)(B + 1) * sizeof *group);
    int64_t *item = malloc((size_t)(B + 1) * sizeof *item);
    int64_t groups = 0;
    group[0] = item[0] = 0;
    for (int64_t b = 1; b <= B; b++)
        if (b == B || !same_keys(&a, b - 1) || b - group[groups] == MAX_ROWS) {
            int64_t runs = 0;
            for (int64_t i = group[groups]; i < b; i++)
                runs = first[i + 1] - first[i] > runs ? first[i + 1] - first[i] : runs;
            item[groups + 1] = item[groups] + runs * (b - group[groups] > 1 ? Hkv : 1);
            group[++groups] = b;
        }

#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t it = 0; it < item[groups]; it++) {
            int64_t i = 0, above = groups; /* the group: item[i] <= it < item[i + 1] */
            while (above - i > 1) {
                const int64_t mid = (i + above) / 2;
                if (item[mid] <= it)
                    i = mid;
                else
                    above = mid;
            }
            const int64_t at = it - item[i];
            if (group[i + 1] - group[i] > 1) /* rows enough to keep an item busy on one head */
                attend_item(&a, group[i], group[i + 1], at / Hkv, at % Hkv, hd * elem);
            else /* one row: an item a run, its heads one after another, the first fetching
                    whole slots (every head's K and V) */
                for (int64_t h = 0; h < Hkv; h++)
                    attend_item(&a, group[i], group[i + 1], at, h, h == 0 ? a.slot_bytes : 0);
        }

#pragma omp for schedule(static)
        for (int64_t bh = 0; bh < B * Hkv; bh++) { /* each row's runs merged, per K/V head */
            const int64_t b = bh / Hkv, h = bh % Hkv, runs = first[b + 1] - first[b];
            const float *part = a.partial + (first[b] * Hkv + h * runs) * per_run;
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
    free(a.partial);
    free(group);
    free(item);
    free(first);
}
