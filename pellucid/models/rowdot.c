/* Rows times a packed matrix, in 8-bit integer dot products: the products of CPUs where
   torch's int4 kernel is slow (AVX2, and AVX-512 with VNNI; see rowdot.py). Each row is
   rounded to int8 with a scale per group of 32 inputs (as llama.cpp rounds activations to Q8),
   then multiplied by 4-bit or 8-bit weights in integer arithmetic, 32 products per instruction
   pair (vpmaddubsw + vpmaddwd) or per instruction with VNNI (vpdpbusd), and each group's
   integer sum is scaled back to float.

   int4 layout ("dot8"): output channels in blocks of 8, one per 32-bit lane of a vector, each
   lane summing 4 inputs of its channel. For block b, group g (32 inputs) and step s (8 inputs
   from k = 32g + 8s) there are 32 bytes at packed[((b * in/32 + g) * 4 + s) * 32]: byte
   4c + j holds input k + j of channel c in its low nibble, input k + 4 + j in its high one.
   Weights are w = q * d + m, q in 0..15; the group's 8 scales d, then its 8 mins m, are bf16 at
   params[(b * in/32 + g) * 16].
   int5 layout: the int4 layout for q's low 4 bits (q in 0..31), and a plane of their 5th bits,
   32 bytes per block and group at high[(b * in/32 + g) * 32]: bit 2s + h of byte 4c + j is that
   of input k + 4h + j of channel c, for step s (k = 32g + 8s). 5 bits where a file's weights
   lie on a 5-bit grid (GGUF's Q5_0, Q5_K): 5/8 of int8's bytes, and within 0.3% of the file.
   int8 layout: int8 (out, in) rows with one bf16 scale per output channel.

   Rows (n, in) are bf16 or float32, as is the output (n, out). Output channels are shared
   among OpenMP's threads: the runtime torch itself uses (see kernels.py), so as many as
   torch.get_num_threads() says. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define ROWDOT_AVX2 1
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
/* vpdpbusd: 4 unsigned x signed byte products summed into each 32-bit lane, one instruction
   where AVX2 needs three (vpmaddubsw, vpmaddwd, vpaddd) */
#define ROWDOT_VNNI 1
#endif
#endif

#define GROUP 32
/* Rows multiplied per pass over a block of channels: as many as keep their sums in registers
   (AVX-512 has 32 vector registers, AVX2 16). */
#ifdef ROWDOT_VNNI
#define PASS 8
#else
#define PASS 4
#endif
#define PAIR_ROWS 6 /* rows a pass over a pair of blocks: 2 x 6 sums, 2 x 6 accumulators */
#define INT8_PASS 4  /* rows one pass over an int8 channel takes (VNNI) */
#define INT8_FOUR_ROWS 4 /* past those, rows a pass over 4 int8 channels: 16 accumulators */

/* One group of 32 values from x[at] -> 32 int8 in q, scale amax / 127 in *d and in *s the sum
   of the rounded values times d (for the int4 weights' offsets m, which multiply the plain sum):
   the sum of the values as rounded, not as given, so that the product is that of the rounded
   row with the weights, whose error is smaller than that of a mix of the two (m is as large as
   the weights). */
#ifdef ROWDOT_AVX2
static inline float max8(__m256 v) {
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}

static inline float sum8(__m256 v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

static inline void quantize_group(const void *x, int64_t at, int bf16, int8_t *q, float *d,
                                  float *s) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4], amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        v[i] = load8(x, at + 8 * i, bf16);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    }
    const float scale = max8(amax) / 127.0f;
    const __m256 inv = _mm256_set1_ps(scale > 0.0f ? 1.0f / scale : 0.0f);
    __m256i r[4]; /* rounded to nearest, ties to even, as lrintf */
    for (int i = 0; i < 4; i++)
        r[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
    /* packs work within 128-bit halves: the permute puts the 8 dwords back in order */
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]),
                                             _mm256_packs_epi32(r[2], r[3]));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(bytes, order));
    const __m256i sum4 = _mm256_add_epi32(_mm256_add_epi32(r[0], r[1]), _mm256_add_epi32(r[2], r[3]));
    __m128i h = _mm_add_epi32(_mm256_castsi256_si128(sum4), _mm256_extracti128_si256(sum4, 1));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4e));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xb1));
    *d = scale;
    *s = scale * (float)_mm_cvtsi128_si32(h);
}
#else
static inline void quantize_group(const void *x, int64_t at, int bf16, int8_t *q, float *d,
                                  float *s) {
    float v[GROUP], amax = 0.0f;
    for (int j = 0; j < GROUP; j++) {
        v[j] = load_value(x, at + j, bf16);
        amax = fmaxf(amax, fabsf(v[j]));
    }
    const float scale = amax / 127.0f, inv = scale > 0.0f ? 1.0f / scale : 0.0f;
    int32_t sum = 0;
    for (int j = 0; j < GROUP; j++) {
        q[j] = (int8_t)lrintf(v[j] * inv);
        sum += q[j];
    }
    *d = scale;
    *s = scale * (float)sum;
}
#endif

/* Rows (n, in) -> int8 xq (n, in), and per group of 32 the scale dx and scaled sum sx. */
static void quantize_rows(const void *x, int bf16, int64_t n, int64_t in_f, int8_t *xq, float *dx,
                          float *sx) {
    const int64_t groups = in_f / GROUP;
#pragma omp parallel for schedule(static) if (n * in_f >= 16384)
    for (int64_t r = 0; r < n; r++)
        for (int64_t g = 0; g < groups; g++) {
            const int64_t at = r * in_f + g * GROUP;
            quantize_group(x, at, bf16, xq + at, dx + r * groups + g, sx + r * groups + g);
        }
}

/* The rows as rounded by quantize_rows, in buffers of their own. */
typedef struct {
    int8_t *q;
    float *scale, *sum;
} Rounded;

static Rounded round_rows(const void *x, int bf16, int64_t n, int64_t in_f) {
    const int64_t groups = in_f / GROUP;
    Rounded r = {malloc(n * in_f), malloc(n * groups * sizeof(float)),
                 malloc(n * groups * sizeof(float))};
    quantize_rows(x, bf16, n, in_f, r.q, r.scale, r.sum);
    return r;
}

static void free_rounded(Rounded r) {
    free(r.q);
    free(r.scale);
    free(r.sum);
}

#ifdef ROWDOT_AVX2
static inline __m256i broadcast4(const int8_t *x) { /* 4 int8 into every 32-bit lane */
    int32_t four;
    memcpy(&four, x, 4);
    return _mm256_set1_epi32(four);
}

/* Bit t of each byte of an int5 block's high plane, as 16 or 0 (the weight's 5th bit in place).
   The shifts move 16-bit lanes: a bit carried across bytes lands below bit 4 (left shifts of at
   most 4) or above it (right shifts of at most 3), and is masked off. */
static inline __m256i fifth_bits(__m256i high, const int t) {
    const __m256i bit4 = _mm256_set1_epi8(16);
    if (t < 4)
        return _mm256_and_si256(_mm256_slli_epi16(high, 4 - t), bit4);
    return _mm256_and_si256(_mm256_srli_epi16(high, t - 4), bit4);
}

/* The weights of step s of a block (int4, or int5 where `five`): the low nibbles' and the high
   ones' as unsigned bytes. */
static inline __attribute__((always_inline)) void
step_weights(const uint8_t *w, const uint8_t *hb, int s, const int five, __m256i *lo, __m256i *hi) {
    const __m256i nibble = _mm256_set1_epi8(15);
    const __m256i bytes = _mm256_loadu_si256((const __m256i *)(w + 32 * s));
    *lo = _mm256_and_si256(bytes, nibble);
    *hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble);
    if (five) {
        const __m256i high = _mm256_loadu_si256((const __m256i *)hb);
        *lo = _mm256_or_si256(*lo, fifth_bits(high, 2 * s));
        *hi = _mm256_or_si256(*hi, fifth_bits(high, 2 * s + 1));
    }
}

/* Channel block b (8 channels) for R rows, R a constant where it is called so that the
   accumulators stay in registers; int5 where `five` (a constant too), hb its high plane. */
static inline __attribute__((always_inline)) void
int4_block(const uint8_t *w, const uint8_t *hb, const uint16_t *p, const int8_t *xq,
           const float *dx, const float *sx, int64_t in_f, const int R, const int five,
           float out[][8]) {
    const int64_t groups = in_f / GROUP;
    __m256 acc[PASS];
    for (int r = 0; r < R; r++)
        acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++, w += 128, p += 16) {
        /* with VNNI two chains a row, as vpdpbusd waits on its sum (AVX2 adds into sum only) */
        __m256i sum[PASS], sum_hi[PASS];
        for (int r = 0; r < R; r++)
            sum[r] = sum_hi[r] = _mm256_setzero_si256();
        for (int s = 0; s < 4; s++) {
            __m256i lo, hi;
            step_weights(w, five ? hb + 32 * g : NULL, s, five, &lo, &hi);
            for (int r = 0; r < R; r++) {
                const int8_t *x = xq + r * in_f + g * GROUP + 8 * s;
#ifdef ROWDOT_VNNI
                sum[r] = _mm256_dpbusd_epi32(sum[r], lo, broadcast4(x));
                sum_hi[r] = _mm256_dpbusd_epi32(sum_hi[r], hi, broadcast4(x + 4));
#else
                /* |2 * 2 * 31 * 127| fits int16: the two halves add before widening */
                const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, broadcast4(x)),
                                                       _mm256_maddubs_epi16(hi, broadcast4(x + 4)));
                sum[r] = _mm256_add_epi32(sum[r], _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
            }
        }
        const __m256 d = bf16x8(p), m = bf16x8(p + 8);
        for (int r = 0; r < R; r++) {
#ifdef ROWDOT_VNNI
            sum[r] = _mm256_add_epi32(sum[r], sum_hi[r]);
#endif
            const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(dx[r * groups + g]));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[r]), scale, acc[r]);
            acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(sx[r * groups + g]), acc[r]);
        }
    }
    for (int r = 0; r < R; r++)
        _mm256_storeu_ps(out[r], acc[r]);
}

#ifdef ROWDOT_VNNI
/* Two neighbouring channel blocks (16 channels) for R rows: each row's 4 inputs, broadcast once,
   serve both blocks, so there are half as many broadcasts per product as in int4_block (for
   many rows, where they bound it). R and `five` constants where it is called. */
static inline __attribute__((always_inline)) void
int4_pair(const uint8_t *w, const uint8_t *hb, const uint16_t *p, const int8_t *xq,
          const float *dx, const float *sx, int64_t in_f, const int R, const int five,
          float out[][16]) {
    const int64_t groups = in_f / GROUP, next = in_f * 4; /* bytes to the next block */
    __m256 acc[2][PAIR_ROWS];
    for (int r = 0; r < R; r++)
        acc[0][r] = acc[1][r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++, w += 128, p += 16) {
        __m256i sum[2][PAIR_ROWS];
        for (int r = 0; r < R; r++)
            sum[0][r] = sum[1][r] = _mm256_setzero_si256();
        for (int s = 0; s < 4; s++) {
            __m256i lo0, hi0, lo1, hi1; /* the high planes of the two blocks lie in/4 bytes apart */
            step_weights(w, five ? hb + 32 * g : NULL, s, five, &lo0, &hi0);
            step_weights(w + next, five ? hb + in_f + 32 * g : NULL, s, five, &lo1, &hi1);
            for (int r = 0; r < R; r++) {
                const int8_t *x = xq + r * in_f + g * GROUP + 8 * s;
                const __m256i xl = broadcast4(x), xh = broadcast4(x + 4);
                sum[0][r] = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(sum[0][r], lo0, xl), hi0, xh);
                sum[1][r] = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(sum[1][r], lo1, xl), hi1, xh);
            }
        }
        for (int j = 0; j < 2; j++) {
            const uint16_t *pj = p + j * groups * 16;
            const __m256 d = bf16x8(pj), m = bf16x8(pj + 8);
            for (int r = 0; r < R; r++) {
                const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(dx[r * groups + g]));
                acc[j][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[j][r]), scale, acc[j][r]);
                acc[j][r] = _mm256_fmadd_ps(m, _mm256_set1_ps(sx[r * groups + g]), acc[j][r]);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(out[r], acc[0][r]);
        _mm256_storeu_ps(out[r] + 8, acc[1][r]);
    }
}
#endif

/* 4 int8 channels (rows c..c+3 of the matrix) times one row; the channels' scales are applied
   by the caller. 4 channels at once: independent sums, and the row read once for them. */
static inline void int8_four(const int8_t *w, const int8_t *xq, const float *dx, int64_t in_f,
                             float out[4]) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                     _mm256_setzero_ps()};
    for (int64_t g = 0; g < in_f / GROUP; g++) {
        const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + g * GROUP));
        const __m256 scale = _mm256_set1_ps(dx[g]);
        for (int c = 0; c < 4; c++) {
            /* vpmaddubsw wants one side unsigned: |w| times x with w's sign (|2 * 128 * 127| fits) */
            const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + c * in_f + g * GROUP));
            /* the next 4 channels: without this, the head's 28 MB (SmolLM2) streamed from memory
               at half the speed */
            _mm_prefetch((const char *)(w + (c + 4) * in_f + g * GROUP), _MM_HINT_T0);
#ifdef ROWDOT_VNNI
            const __m256i dots = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_sign_epi8(wv, wv),
                                                     _mm256_sign_epi8(x, wv));
#else
            const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(x, wv));
            const __m256i dots = _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
#endif
            const __m256 sum = _mm256_cvtepi32_ps(dots);
            acc[c] = _mm256_fmadd_ps(sum, scale, acc[c]);
        }
    }
    for (int c = 0; c < 4; c++)
        out[c] = sum8(acc[c]);
}
#else
/* The same products in plain C, for CPUs without AVX2 (tests; rowdot.py does not pick these
   kernels there). */
static void int4_block(const uint8_t *w, const uint8_t *hb, const uint16_t *p, const int8_t *xq,
                       const float *dx, const float *sx, int64_t in_f, const int R,
                       const int five, float out[][8]) {
    const int64_t groups = in_f / GROUP;
    for (int r = 0; r < R; r++)
        for (int c = 0; c < 8; c++) {
            float acc = 0.0f;
            for (int64_t g = 0; g < groups; g++) {
                const uint8_t *bytes = w + g * 128;
                const int8_t *x = xq + r * in_f + g * GROUP;
                int32_t sum = 0;
                for (int s = 0; s < 4; s++)
                    for (int j = 0; j < 4; j++) {
                        const uint8_t b = bytes[32 * s + 4 * c + j];
                        const int h = five ? hb[32 * g + 4 * c + j] >> (2 * s) : 0;
                        sum += ((b & 15) | (h & 1) << 4) * x[8 * s + j] +
                               ((b >> 4) | (h & 2) << 3) * x[8 * s + 4 + j];
                    }
                const uint16_t *pg = p + g * 16;
                acc += bf16_to_float(pg[c]) * dx[r * groups + g] * (float)sum;
                acc += bf16_to_float(pg[8 + c]) * sx[r * groups + g];
            }
            out[r][c] = acc;
        }
}

static void int8_four(const int8_t *w, const int8_t *xq, const float *dx, int64_t in_f,
                      float out[4]) {
    for (int c = 0; c < 4; c++) {
        float acc = 0.0f;
        for (int64_t g = 0; g < in_f / GROUP; g++) {
            int32_t sum = 0;
            for (int j = 0; j < GROUP; j++)
                sum += w[c * in_f + g * GROUP + j] * xq[g * GROUP + j];
            acc += dx[g] * (float)sum;
        }
        out[c] = acc;
    }
}
#endif

#ifdef ROWDOT_VNNI
/* vpdpbusd multiplies unsigned by signed bytes: the rows come made unsigned (xu = x + 128,
   their top bits flipped, int8_vnni_mm) and each group's sum starts from minus 128 times the
   weights' sums (this), so each product is one instruction with no sign fix-up. Each lane's
   integer sum is the one int8_four makes, scaled and added in the same order. */
static inline __m256i minus_128_sums(__m256i w) {
    const __m256i zero = _mm256_setzero_si256();
    return _mm256_sub_epi32(zero, _mm256_dpbusd_epi32(zero, _mm256_set1_epi8((char)0x80), w));
}

/* 4 int8 channels times R rows (R a constant where it is called), the channels read once for
   all R: for more than INT8_PASS rows, where the arithmetic is the bound rather than the reads.
   The same sums as int8_channel below, so the same results bit for bit. */
static inline __attribute__((always_inline)) void
int8_four_rows(const int8_t *w, const uint8_t *xu, const float *dx, int64_t in_f, const int R,
               float out[][4]) {
    const int64_t groups = in_f / GROUP;
    __m256 acc[INT8_FOUR_ROWS][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < 4; c++)
            acc[r][c] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m256i wv[4], start[4];
        for (int c = 0; c < 4; c++) {
            wv[c] = _mm256_loadu_si256((const __m256i *)(w + c * in_f + g * GROUP));
            _mm_prefetch((const char *)(w + (c + 4) * in_f + g * GROUP), _MM_HINT_T0);
            start[c] = minus_128_sums(wv[c]);
        }
        for (int r = 0; r < R; r++) {
            const __m256i x = _mm256_loadu_si256((const __m256i *)(xu + r * in_f + g * GROUP));
            const __m256 scale = _mm256_set1_ps(dx[r * groups + g]);
            for (int c = 0; c < 4; c++) {
                const __m256 sum = _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(start[c], x, wv[c]));
                acc[r][c] = _mm256_fmadd_ps(sum, scale, acc[r][c]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < 4; c++)
            out[r][c] = sum8(acc[r][c]);
}

/* One int8 channel times R rows (R a constant where it is called), the channel read once for
   all R. A row's result is the same bit for bit alone or beside others: the few-row head's
   logits do not depend on its rows. One channel at a time reads the matrix in memory order:
   four at once, interleaved, streamed at half the rate, and two at once no faster
   (benchmarks/results/comments.md). */
static inline __attribute__((always_inline)) void
int8_channel(const int8_t *w, const uint8_t *xu, const float *dx, int64_t in_f, const int R,
             float out[]) {
    const int64_t groups = in_f / GROUP;
    __m256 acc[INT8_PASS];
    for (int r = 0; r < R; r++)
        acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + g * GROUP));
        const __m256i start = minus_128_sums(wv);
        for (int r = 0; r < R; r++) {
            const __m256i x = _mm256_loadu_si256((const __m256i *)(xu + r * in_f + g * GROUP));
            const __m256 sum = _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(start, x, wv));
            acc[r] = _mm256_fmadd_ps(sum, _mm256_set1_ps(dx[r * groups + g]), acc[r]);
        }
    }
    for (int r = 0; r < R; r++)
        out[r] = sum8(acc[r]);
}

/* int8_rows_mm with VNNI: up to INT8_PASS rows in one pass over each channel (the matrix read
   in memory order), more 4 channels and INT8_FOUR_ROWS rows a pass. */
static void int8_vnni_mm(const int8_t *weight, const uint16_t *scales, const int8_t *xq,
                         const float *dx, void *y, int y_bf16, int64_t n, int64_t out_f,
                         int64_t in_f) {
    const int64_t groups = in_f / GROUP;
    uint8_t *xu = malloc(n * in_f);
    for (int64_t i = 0; i < n * in_f; i++)
        xu[i] = (uint8_t)xq[i] ^ 0x80;
    if (n <= INT8_PASS) {
#pragma omp parallel for schedule(static)
        for (int64_t c = 0; c < out_f; c++) {
            const int8_t *w = weight + c * in_f;
            float out[INT8_PASS];
            switch (n) {
            case 1: int8_channel(w, xu, dx, in_f, 1, out); break;
            case 2: int8_channel(w, xu, dx, in_f, 2, out); break;
            case 3: int8_channel(w, xu, dx, in_f, 3, out); break;
            default: int8_channel(w, xu, dx, in_f, INT8_PASS, out);
            }
            for (int64_t r = 0; r < n; r++)
                store_value(y, r * out_f + c, out[r] * bf16_to_float(scales[c]), y_bf16);
        }
        free(xu);
        return;
    }
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < out_f; c += 4)
        for (int64_t r0 = 0; r0 < n; r0 += INT8_FOUR_ROWS) {
            float out[INT8_FOUR_ROWS][4];
            const int8_t *w = weight + c * in_f;
            const uint8_t *xr = xu + r0 * in_f;
            const float *d = dx + r0 * groups;
            switch (n - r0 < INT8_FOUR_ROWS ? n - r0 : INT8_FOUR_ROWS) {
            case 1: int8_four_rows(w, xr, d, in_f, 1, out); break;
            case 2: int8_four_rows(w, xr, d, in_f, 2, out); break;
            case 3: int8_four_rows(w, xr, d, in_f, 3, out); break;
            default: int8_four_rows(w, xr, d, in_f, INT8_FOUR_ROWS, out);
            }
            for (int64_t r = r0; r < n && r < r0 + INT8_FOUR_ROWS; r++)
                for (int i = 0; i < 4; i++)
                    store_value(y, r * out_f + c + i,
                                out[r - r0][i] * bf16_to_float(scales[c + i]), y_bf16);
        }
    free(xu);
}

/* int4_pair for `rows` rows (1..PAIR_ROWS): the count made a constant for the compiler. */
static inline __attribute__((always_inline)) void
pair_rows(const uint8_t *w, const uint8_t *hb, const uint16_t *p, const int8_t *xr,
          const float *dx, const float *sx, int64_t in_f, int64_t rows, const int five,
          float out[][16]) {
    switch (rows) {
    case 1: int4_pair(w, hb, p, xr, dx, sx, in_f, 1, five, out); break;
    case 2: int4_pair(w, hb, p, xr, dx, sx, in_f, 2, five, out); break;
    case 3: int4_pair(w, hb, p, xr, dx, sx, in_f, 3, five, out); break;
    case 4: int4_pair(w, hb, p, xr, dx, sx, in_f, 4, five, out); break;
    case 5: int4_pair(w, hb, p, xr, dx, sx, in_f, 5, five, out); break;
    default: int4_pair(w, hb, p, xr, dx, sx, in_f, PAIR_ROWS, five, out);
    }
}

/* Many rows: blocks in pairs (int4_pair), PAIR_ROWS rows a pass; int5 where `high` is given. */
static void int4_pairs_mm(const uint8_t *packed, const uint8_t *high, const uint16_t *params,
                          const int8_t *xq, const float *dx, const float *sx, void *y, int y_bf16,
                          int64_t n, int64_t out_f, int64_t in_f) {
    const int64_t groups = in_f / GROUP;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < out_f / 8; b += 2) {
        const uint8_t *w = packed + b * in_f * 4, *hb = high ? high + b * in_f : NULL;
        const uint16_t *p = params + b * groups * 16;
        for (int64_t r0 = 0; r0 < n; r0 += PAIR_ROWS) {
            float out[PAIR_ROWS][16];
            const int64_t at = r0 * groups, rows = n - r0 < PAIR_ROWS ? n - r0 : PAIR_ROWS;
            const int8_t *xr = xq + r0 * in_f;
            if (hb)
                pair_rows(w, hb, p, xr, dx + at, sx + at, in_f, rows, 1, out);
            else
                pair_rows(w, NULL, p, xr, dx + at, sx + at, in_f, rows, 0, out);
            for (int64_t r = r0; r < n && r < r0 + PAIR_ROWS; r++)
                for (int c = 0; c < 16; c++)
                    store_value(y, r * out_f + b * 8 + c, out[r - r0][c], y_bf16);
        }
    }
}
#endif

/* int4_block for `rows` rows (1..PASS): the count made a constant for the compiler. */
static inline __attribute__((always_inline)) void
block_rows(const uint8_t *w, const uint8_t *hb, const uint16_t *p, const int8_t *xr,
           const float *dx, const float *sx, int64_t in_f, int64_t rows, const int five,
           float out[][8]) {
    switch (rows) {
    case 1: int4_block(w, hb, p, xr, dx, sx, in_f, 1, five, out); break;
    case 2: int4_block(w, hb, p, xr, dx, sx, in_f, 2, five, out); break;
    case 3: int4_block(w, hb, p, xr, dx, sx, in_f, 3, five, out); break;
#if PASS == 8
    case 4: int4_block(w, hb, p, xr, dx, sx, in_f, 4, five, out); break;
    case 5: int4_block(w, hb, p, xr, dx, sx, in_f, 5, five, out); break;
    case 6: int4_block(w, hb, p, xr, dx, sx, in_f, 6, five, out); break;
    case 7: int4_block(w, hb, p, xr, dx, sx, in_f, 7, five, out); break;
#endif
    default: int4_block(w, hb, p, xr, dx, sx, in_f, PASS, five, out);
    }
}

/* Rows times an int4 matrix, or an int5 one where `high` (its 5th bits) is given. */
static void dot8_rows_mm(const void *x, int x_bf16, const uint8_t *packed, const uint8_t *high,
                         const uint16_t *params, void *y, int y_bf16, int64_t n, int64_t out_f,
                         int64_t in_f) {
    const int64_t groups = in_f / GROUP;
    const Rounded rows = round_rows(x, x_bf16, n, in_f);
    const int8_t *xq = rows.q;
    const float *dx = rows.scale, *sx = rows.sum;
#ifdef ROWDOT_VNNI
    if (n > PASS && out_f % 16 == 0) {
        int4_pairs_mm(packed, high, params, xq, dx, sx, y, y_bf16, n, out_f, in_f);
        free_rounded(rows);
        return;
    }
#endif
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < out_f / 8; b++) {
        const uint8_t *w = packed + b * in_f * 4, *hb = high ? high + b * in_f : NULL;
        const uint16_t *p = params + b * groups * 16;
        for (int64_t r0 = 0; r0 < n; r0 += PASS) { /* PASS rows at a time: the block stays in L1 */
            float out[PASS][8];
            const int64_t at = r0 * groups, count = n - r0 < PASS ? n - r0 : PASS;
            const int8_t *xr = xq + r0 * in_f;
            if (hb)
                block_rows(w, hb, p, xr, dx + at, sx + at, in_f, count, 1, out);
            else
                block_rows(w, NULL, p, xr, dx + at, sx + at, in_f, count, 0, out);
            for (int64_t r = r0; r < n && r < r0 + PASS; r++)
                for (int c = 0; c < 8; c++)
                    store_value(y, r * out_f + b * 8 + c, out[r - r0][c], y_bf16);
        }
    }
    free_rounded(rows);
}

void int4_rows_mm(const void *x, int x_bf16, const uint8_t *packed, const uint16_t *params,
                  void *y, int y_bf16, int64_t n, int64_t out_f, int64_t in_f) {
    dot8_rows_mm(x, x_bf16, packed, NULL, params, y, y_bf16, n, out_f, in_f);
}

void int5_rows_mm(const void *x, int x_bf16, const uint8_t *packed, const uint8_t *high,
                  const uint16_t *params, void *y, int y_bf16, int64_t n, int64_t out_f,
                  int64_t in_f) {
    dot8_rows_mm(x, x_bf16, packed, high, params, y, y_bf16, n, out_f, in_f);
}

void int8_rows_mm(const void *x, int x_bf16, const int8_t *weight, const uint16_t *scales,
                  void *y, int y_bf16, int64_t n, int64_t out_f, int64_t in_f) {
    const Rounded rows = round_rows(x, x_bf16, n, in_f);
    const int8_t *xq = rows.q;
    const float *dx = rows.scale;
#ifdef ROWDOT_VNNI
    int8_vnni_mm(weight, scales, xq, dx, y, y_bf16, n, out_f, in_f);
#else
    const int64_t groups = in_f / GROUP;
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < out_f; c += 4)
        for (int64_t r = 0; r < n; r++) {
            float out[4];
            int8_four(weight + c * in_f, xq + r * in_f, dx + r * groups, in_f, out);
            for (int i = 0; i < 4; i++)
                store_value(y, r * out_f + c + i, out[i] * bf16_to_float(scales[c + i]), y_bf16);
        }
#endif
    free_rounded(rows);
}
