// Shared helpers for Strata's CPU kernels: bf16 conversion, AVX-512 loads/stores, vector exp.
// Every kernel has a portable scalar path; the AVX-512 paths are compiled in when the build
// machine supports them (the library is built with -march=native on the machine that runs it).
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

static inline __m512 v_load_f32(const float* p) { return _mm512_loadu_ps(p); }
static inline void v_store_f32(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
static inline __m512 v_id(__m512 v) { return v; }

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
