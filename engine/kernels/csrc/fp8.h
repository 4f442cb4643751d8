// FP8 (e4m3fn) KV pages: conversions and the key rotation, with the same arithmetic as
// kvstore/fp8.py (one float32 scale per (token, KV head) row, s = max|x| / 448, or 1 for an
// all-zero row; values round(x / s) to nearest even; keys optionally Hadamard-rotated first),
// so both paths store the same bytes.
#pragma once

#include "common.h"

#define E4M3_MAX 448.0f
#define FP8_MAX_ROW 256  // widest row (head_dim) the FP8 kernels take

// x <- x H, H the unnormalized Walsh-Hadamard matrix; n a power of two. The butterfly order
// matches kvstore.fp8.hadamard, so both give bit-identical results.
static inline void fwht_f32(float* x, int64_t n) {
    for (int64_t h = 1; h < n; h <<= 1)
        for (int64_t i = 0; i < n; i += h << 1)
            for (int64_t j = i; j < i + h; j++) {
                const float a = x[j], b = x[j + h];
                x[j] = a + b;
                x[j + h] = a - b;
            }
}

// Exact value of an e4m3fn byte (NaN encodings are never written). Both readings (normal
// and subnormal) are computed and one taken by a bit mask, with no branch, so that the
// compiler vectorizes loops over it: on CPUs without AVX-512 a branch here kept FP8
// attention about 16 times slower than attention over 32-bit pages.
static inline float e4m3_to_f32(uint8_t b) {
    const uint32_t normal = ((uint32_t)(b & 0x7fu) << 20) + (120u << 23);  // exponent + 120
    const float sub_f = (float)(b & 7u) * (1.0f / 512.0f);                 // m * 2^-9
    uint32_t sub;
    memcpy(&sub, &sub_f, sizeof sub);
    const uint32_t is_normal = 0u - (uint32_t)((b & 0x78u) != 0);
    const uint32_t u = (normal & is_normal) | (sub & ~is_normal) | ((uint32_t)(b & 0x80u) << 24);
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

// Nearest e4m3fn value, ties to even; |x| must already be within E4M3_MAX.
static inline uint8_t f32_to_e4m3(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
    u &= 0x7fffffffu;
    if (u < 0x3c800000u) {  // below 2^-6: subnormal steps of 2^-9 (8 steps is the first normal)
        float a;
        memcpy(&a, &u, sizeof a);
        return sign | (uint8_t)nearbyintf(a * 512.0f);
    }
    u += 0x7ffffu + ((u >> 20) & 1u);  // keep 3 mantissa bits, ties to even
    return sign | (uint8_t)((((u >> 23) - 120u) << 3) | ((u >> 20) & 7u));
}

#ifdef STRATA_AVX512
// 16 e4m3fn bytes -> 16 floats. Each byte is re-biased into an fp16 bit pattern (exponent
// bias 15 instead of 7, so the half is the value times 2^-8, subnormals included) and widened.
static inline __m512 v_load_e4m3(const uint8_t* p) {
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)p));
    const __m256i h = _mm256_or_si256(
        _mm256_and_si256(_mm256_slli_epi16(b, 7), _mm256_set1_epi16(0x3f80)),
        _mm256_and_si256(_mm256_slli_epi16(b, 8), _mm256_set1_epi16((short)0x8000)));
    return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.0f));
}
#endif

#ifdef STRATA_AVX2
// 8 e4m3fn bytes -> 8 floats, as v_load_e4m3 (F16C widens the re-biased halves).
static inline __m256 v8_load_e4m3(const uint8_t* p) {
    const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i*)p));
    const __m128i h = _mm_or_si128(_mm_and_si128(_mm_slli_epi16(b, 7), _mm_set1_epi16(0x3f80)),
                                   _mm_and_si128(_mm_slli_epi16(b, 8), _mm_set1_epi16((short)0x8000)));
    return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.0f));
}
#endif
