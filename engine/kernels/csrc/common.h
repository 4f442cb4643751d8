// Shared helpers for Strata's CPU kernels: bf16 conversion, vector loads/stores, vector exp.
// Every kernel has a portable scalar path; the AVX-512 paths are compiled in when the build
// targets them (the `native` build on an AVX-512 CPU), the AVX2 + FMA ones when it targets
// AVX2 and not AVX-512 (the `avx2` build, or `native` on an AVX2 CPU). The `vf` layer at the
// end names one vector of floats for either, so that short kernels are written once.
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define STRATA_AVX512 1
#endif
#if defined(STRATA_AVX512) && defined(__AVX512BF16__)
#define STRATA_AVX512BF16 1
#endif
#if !defined(STRATA_AVX512) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define STRATA_AVX2 1
#endif
#if defined(STRATA_AVX512) || defined(STRATA_AVX2)
#define STRATA_VEC 1
#endif

typedef uint16_t bf16_t;

static inline float bf16_to_f32(bf16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline bf16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u >> 16) | 0x40);  // quiet NaN
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
    return (bf16_t)(u >> 16);
}

static inline float f32_id(float x) { return x; }

static inline float round_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }

// Warming the KV pages of the sequence a thread attends to next (attention_impl.h): L2
// prefetches, a few cache lines of K and V per call, issued while the thread computes on
// rows it already has in cache, so that DRAM streams the next sequence in the meantime.
typedef struct {
    const char* k;  // K and V pools (bytes)
    const char* v;
    const int64_t* table;  // the next sequence's block table
    int64_t page_bytes;    // one block of one pool
    int64_t blocks;        // blocks to warm
    int64_t block, offset;  // cursor
    int64_t per_call;       // cache lines per call
} KVWarm;

static inline void kv_warm(KVWarm* w) {
    if (!w) return;
    for (int64_t left = w->per_call * 64; left > 0 && w->block < w->blocks;) {
        const int64_t base = w->table[w->block] * w->page_bytes;
        const int64_t end = w->offset + left < w->page_bytes ? w->offset + left : w->page_bytes;
        const char* k = w->k + base;
        const char* v = w->v + base;
        for (int64_t at = w->offset; at < end; at += 64) {
            __builtin_prefetch(k + at, 0, 2);
            __builtin_prefetch(v + at, 0, 2);
        }
        left -= end - w->offset;
        w->offset = end;
        if (end >= w->page_bytes) {
            w->offset = 0;
            w->block++;
        }
    }
}

// A warm of one sequence's pages (`blocks` blocks of `page_bytes` through `table`), spread
// over `calls` calls of kv_warm.
static inline KVWarm kv_warm_seq(const void* k, const void* v, const int64_t* table,
                                 int64_t page_bytes, int64_t blocks, int64_t calls) {
    const int64_t lines = blocks * ((page_bytes + 63) / 64);
    calls = calls < 1 ? 1 : calls;
    return (KVWarm){(const char*)k, (const char*)v, table, page_bytes, blocks, 0, 0,
                    (lines + calls - 1) / calls};
}

// Whether attention row b reads every key of row a through the same blocks, and at least as
// many keys: the consecutive rows of one prompt in a prefill step.
static inline int rows_share(const int64_t* tables, const int32_t* lens, int64_t max_blocks,
                             int64_t block_size, int64_t a, int64_t b) {
    if (lens[b] < lens[a]) return 0;
    const int64_t blocks = (lens[a] + block_size - 1) / block_size;
    return !memcmp(tables + a * max_blocks, tables + b * max_blocks,
                   (size_t)blocks * sizeof(int64_t));
}

#ifdef STRATA_AVX512
static inline __m512 v_load_bf16(const bf16_t* p) {
    __m256i raw = _mm256_loadu_si256((const __m256i*)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

static inline __m256i v_pack_bf16(__m512 v) {
#ifdef STRATA_AVX512BF16
    return (__m256i)_mm512_cvtneps_pbh(v);
#else
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16));
#endif
}

static inline void v_store_bf16(bf16_t* p, __m512 v) {
    _mm256_storeu_si256((__m256i*)p, v_pack_bf16(v));
}

static inline __m512 v_round_bf16(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v_pack_bf16(v)), 16));
}

// exp(x) to ~2 ulp for x in [-87, 88]: 2^n * p(r), r = x - n ln2, degree-6 polynomial.
static inline __m512 v_exp(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

// In-place transpose of a 16 x 16 matrix held as 16 row vectors.
static inline void v_transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {  // r[4i + c], 128-bit block k: column 4k + c, rows 4i..4i+3
        const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
        const __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
        r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
        r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
    for (int c = 0; c < 4; c++) {
        t[c] = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x88);
        t[4 + c] = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xDD);
        t[8 + c] = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x88);
        t[12 + c] = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xDD);
    }
    for (int c = 0; c < 4; c++) {
        r[c] = _mm512_shuffle_f32x4(t[c], t[8 + c], 0x88);
        r[4 + c] = _mm512_shuffle_f32x4(t[4 + c], t[12 + c], 0x88);
        r[8 + c] = _mm512_shuffle_f32x4(t[c], t[8 + c], 0xDD);
        r[12 + c] = _mm512_shuffle_f32x4(t[4 + c], t[12 + c], 0xDD);
    }
}

// Horizontal sums of 16 vectors at once: lane t of the result is the sum of a[t]'s lanes.
static inline __m512 v_hsum16(const __m512 a[16]) {
    __m512 b[8], c[4];
    for (int i = 0; i < 8; i++)
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                             _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++)
        c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    // c[i] lane L holds the lane-L partial sums of a[4i..4i+3]; fold the four 128-bit lanes
    __m512 d = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88),
                             _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
    __m512 e = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88),
                             _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(d, e, 0x88), _mm512_shuffle_f32x4(d, e, 0xDD));
}
#endif

#ifdef STRATA_AVX2
// 8 bf16 -> 8 floats: each value shifted into the high half of its lane.
static inline __m256 v8_load_bf16(const bf16_t* p) {
    const __m128i raw = _mm_loadu_si128((const __m128i*)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// 8 floats -> 8 bf16, rounded to nearest even (f32_to_bf16 without its NaN case).
static inline __m128i v8_pack_bf16(__m256 v) {
    __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    return _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1));
}

static inline void v8_store_bf16(bf16_t* p, __m256 v) {
    _mm_storeu_si128((__m128i*)p, v8_pack_bf16(v));
}

static inline __m256 v8_round_bf16(__m256 v) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v8_pack_bf16(v)), 16));
}

// exp(x) as v_exp computes it, 2^n applied by building its exponent bits (n in [-126, 127]).
static inline __m256 v8_exp(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

static inline float v8_reduce_add(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float v8_reduce_max(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// Horizontal sums of 8 vectors at once: lane t of the result is the sum of a[t]'s lanes.
static inline __m256 v8_hsum8(const __m256 a[8]) {
    const __m256 b0 = _mm256_hadd_ps(a[0], a[1]), b1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 b2 = _mm256_hadd_ps(a[4], a[5]), b3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 c0 = _mm256_hadd_ps(b0, b1), c1 = _mm256_hadd_ps(b2, b3);
    // c0: lanes 0-3 the low halves' sums of a[0..3], lanes 4-7 their high halves'
    return _mm256_add_ps(_mm256_permute2f128_ps(c0, c1, 0x20), _mm256_permute2f128_ps(c0, c1, 0x31));
}
#endif

// One vector of floats: 16 lanes on AVX-512, 8 on AVX2. The AVX-512 names are the
// intrinsics and helpers above themselves, so a kernel written on this layer compiles to
// the same instructions as one written on them.
#if defined(STRATA_AVX512)
typedef __m512 vf;
#define VF_W 16
#define vf_zero _mm512_setzero_ps
#define vf_set1 _mm512_set1_ps
#define vf_add _mm512_add_ps
#define vf_sub _mm512_sub_ps
#define vf_mul _mm512_mul_ps
#define vf_div _mm512_div_ps
#define vf_max _mm512_max_ps
#define vf_fmadd _mm512_fmadd_ps
#define vf_fmsub _mm512_fmsub_ps
#define vf_load_f32 _mm512_loadu_ps
#define vf_store_f32 _mm512_storeu_ps
#define vf_load_bf16 v_load_bf16
#define vf_store_bf16 v_store_bf16
#define vf_round_bf16 v_round_bf16
#define vf_exp v_exp
#define vf_reduce_add _mm512_reduce_add_ps
#define vf_reduce_max _mm512_reduce_max_ps
#elif defined(STRATA_AVX2)
typedef __m256 vf;
#define VF_W 8
#define vf_zero _mm256_setzero_ps
#define vf_set1 _mm256_set1_ps
#define vf_add _mm256_add_ps
#define vf_sub _mm256_sub_ps
#define vf_mul _mm256_mul_ps
#define vf_div _mm256_div_ps
#define vf_max _mm256_max_ps
#define vf_fmadd _mm256_fmadd_ps
#define vf_fmsub _mm256_fmsub_ps
#define vf_load_f32 _mm256_loadu_ps
#define vf_store_f32 _mm256_storeu_ps
#define vf_load_bf16 v8_load_bf16
#define vf_store_bf16 v8_store_bf16
#define vf_round_bf16 v8_round_bf16
#define vf_exp v8_exp
#define vf_reduce_add v8_reduce_add
#define vf_reduce_max v8_reduce_max
#endif
#ifdef STRATA_VEC
static inline vf vf_id(vf v) { return v; }
#endif
