/* Packed weights -> dense matrices, for products of many rows (see unpack.py; kernels.py builds
   this file with -O3 -march=native: the loops below are written for the compiler to vectorize, but
   for one written by hand). The output is bf16 (stored as uint16_t, rounded to nearest even) or
   float32. */

#include <stdint.h>

#include "bf16.h"
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
/* One input of a block of 64 channels, by hand: the compiler's own vectors for the loop below
   are slower (benchmarks/results/comments.md). 32 bytes -> 64 bf16 weights. */
static inline void block64_bf16(const uint8_t *bytes, const float *scale, const float *shift,
                                uint16_t *out) {
    const __m256i packed = _mm256_loadu_si256((const __m256i *)bytes);
    const __m256i nibble = _mm256_set1_epi8(15);
    const __m256i halves[2] = {_mm256_and_si256(packed, nibble),
                               _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble)};
    for (int h = 0; h < 2; h++) { /* channels 0..31 (low nibbles), then 32..63 (high) */
        const float *s = scale + 32 * h, *z = shift + 32 * h;
        __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(halves[h])));
        __m512 high = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(halves[h], 1)));
        low = _mm512_fmadd_ps(low, _mm512_loadu_ps(s), _mm512_loadu_ps(z));
        high = _mm512_fmadd_ps(high, _mm512_loadu_ps(s + 16), _mm512_loadu_ps(z + 16));
        _mm512_storeu_si512(out + 32 * h, (__m512i)_mm512_cvtne2ps_pbh(high, low));
    }
}
#endif

/* torch's CPU int4 packing (aten._convert_weight_to_int4pack_for_cpu): the output channels in
   blocks of `block`; byte k * block/2 + c of a block holds input k of its channel c (low nibble)
   and of channel c + block/2 (high). scales_zeros (in/group, out, 2) bf16: w = (q - 8) * scale
   + zero. Writes W.T, (in, out): each block's channels are contiguous there. */
void int4_to_dense_t(const uint8_t *restrict packed, const uint16_t *restrict scales_zeros,
                     void *restrict out, int64_t out_f, int64_t in_f, int64_t block,
                     int64_t group, int bf16) {
    const int64_t half = block / 2;
    float scale[block], shift[block]; /* w = q * scale + shift, for the current group */
    for (int64_t b = 0; b < out_f / block; b++) {
        for (int64_t k = 0; k < in_f; k++) {
            if (k % group == 0) {
                const uint16_t *sz = scales_zeros + ((k / group) * out_f + b * block) * 2;
                for (int64_t c = 0; c < block; c++) {
                    scale[c] = bf16_to_float(sz[2 * c]);
                    shift[c] = bf16_to_float(sz[2 * c + 1]) - 8 * scale[c];
                }
            }
            const uint8_t *bytes = packed + (b * in_f + k) * half;
            const int64_t row = k * out_f + b * block;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
            if (bf16 && block == 64) {
                block64_bf16(bytes, scale, shift, (uint16_t *)out + row);
                continue;
            }
#endif
            for (int64_t c = 0; c < half; c++) {
                store_value(out, row + c, (float)(bytes[c] & 15) * scale[c] + shift[c], bf16);
                store_value(out, row + half + c, (float)(bytes[c] >> 4) * scale[half + c] + shift[half + c], bf16);
            }
        }
    }
}

/* int8 weights (out, in) with a bf16 scale per output channel: writes W. */
void int8_to_dense(const int8_t *restrict weight, const uint16_t *restrict scales,
                   void *restrict out, int64_t out_f, int64_t in_f, int bf16) {
    for (int64_t o = 0; o < out_f; o++) {
        const float scale = bf16_to_float(scales[o]);
        for (int64_t k = 0; k < in_f; k++)
            store_value(out, o * in_f + k, (float)weight[o * in_f + k] * scale, bf16);
    }
}

/* rowdot.c's int4 layout (dot8, drawn there): output channels in blocks of 8; per block, group
   and step of 8 inputs, 32 bytes whose byte 4c + j holds input j (low nibble) and j + 4 (high)
   of channel c; the group's 8 bf16 scales, then 8 mins, in params. int5 where `high` is given:
   the weights' 5th bits, 32 bytes per block and group, bit 2s + h of byte 4c + j for input
   8s + 4h + j of channel c. Writes W (out, in). */
void int4_dot_to_dense(const uint8_t *restrict packed, const uint8_t *restrict high,
                       const uint16_t *restrict params, void *restrict out, int64_t out_f,
                       int64_t in_f, int bf16) {
    const int64_t groups = in_f / 32;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < out_f / 8; b++)
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *bytes = packed + (b * groups + g) * 128;
            const uint8_t *fifth = high ? high + (b * groups + g) * 32 : NULL;
            const uint16_t *p = params + (b * groups + g) * 16;
            for (int c = 0; c < 8; c++) {
                const float d = bf16_to_float(p[c]), m = bf16_to_float(p[8 + c]);
                const int64_t at = (b * 8 + c) * in_f + g * 32;
                for (int s = 0; s < 4; s++)
                    for (int j = 0; j < 4; j++) {
                        const uint8_t q = bytes[32 * s + 4 * c + j];
                        const int h = fifth ? fifth[4 * c + j] >> (2 * s) : 0;
                        const int lo = (q & 15) | (h & 1) << 4, hi = (q >> 4) | (h & 2) << 3;
                        store_value(out, at + 8 * s + j, (float)lo * d + m, bf16);
                        store_value(out, at + 8 * s + 4 + j, (float)hi * d + m, bf16);
                    }
            }
        }
}
