/* bf16 <-> float for pellucid's C kernels (unpack.c, rowdot.c, lm_head.c): bf16 is the top
   half of a float's bits, stored here as uint16_t; with AVX2, 8 at a time. */

#ifndef PELLUCID_BF16_H
#define PELLUCID_BF16_H

#include <stdint.h>
#include <string.h>

static inline float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    bits += 0x7fff + ((bits >> 16) & 1); /* round to nearest, ties to even */
    return (uint16_t)(bits >> 16);
}

/* Element i of an array of bf16 (bf16 != 0) or float32. */
static inline float load_value(const void *x, int64_t i, int bf16) {
    return bf16 ? bf16_to_float(((const uint16_t *)x)[i]) : ((const float *)x)[i];
}

static inline void store_value(void *out, int64_t i, float value, int bf16) {
    if (bf16)
        ((uint16_t *)out)[i] = float_to_bf16(value);
    else
        ((float *)out)[i] = value;
}

#if defined(__AVX2__)
#include <immintrin.h>

static inline __m256 bf16x8(const uint16_t *p) { /* 8 bf16 -> 8 floats */
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

/* 8 values from element `at` of an array of bf16 (bf16 != 0) or float32 -> floats */
static inline __m256 load8(const void *x, int64_t at, int bf16) {
    return bf16 ? bf16x8((const uint16_t *)x + at) : _mm256_loadu_ps((const float *)x + at);
}
#endif

#endif
