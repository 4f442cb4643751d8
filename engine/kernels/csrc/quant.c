// Linears over quantized weights (quant.h): each output row is a sum over blocks of 32 of
// d_w * d_x * dot(q_w, q_x), an integer dot product of the weight block and the activation
// block quantized to int16, minus (q4) sum_b m_b * d_x * sum(q_x). The products run 32 at a
// time as int16 pairs (`vpmaddwd`: AVX-512BW on 512 bits, AVX2 on 256), a scalar loop
// elsewhere; weights are widened from their 4 or 8 bits in registers. Activations get 16
// bits, not llama.cpp's 8: some channels of small models carry outliers hundreds of times
// the rest of their block, and 8 bits then flip greedy answers (docs/design/kernels.md).
// Threads split the output rows; the activation rows are quantized once per call and every
// weight row is used for up to 4 of them at a time.

#include <omp.h>
#include <stdlib.h>

#include "common.h"
#include "quant.h"

#if defined(STRATA_AVX512)
#define Q_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define Q_AVX2 1
#endif

#define Q_ROWS 4     // activation rows sharing one pass over a weight row
#define Q_NCHUNK 16  // weight rows a thread keeps in cache while it walks the activation rows
#define Q_XMAX 32767.0f
#define Q_SERIAL_ROWS 8  // activation rows quantized by the calling thread alone

int strata_quant_isa(void) {
#if defined(Q_AVX512)
    return 3;
#elif defined(Q_AVX2)
    return 2;
#else
    return 0;
#endif
}

int64_t strata_quant_row_bytes(int64_t format, int64_t K) {
    const int64_t nb = K / QBLOCK;
    return format == 8 ? K + 4 * nb : K / 2 + 8 * nb;
}

// bias[n] in x's type as fp32 (0 without a bias), and one output element stored
static inline float q_bias(const void* bias, int x_bf16, int64_t n) {
    return !bias ? 0.0f : x_bf16 ? bf16_to_f32(((const bf16_t*)bias)[n]) : ((const float*)bias)[n];
}

static inline void q_store(void* y, int out_f32, int64_t at, float v) {
    if (out_f32)
        ((float*)y)[at] = v;
    else
        ((bf16_t*)y)[at] = f32_to_bf16(v);
}

static void quant_row(const void* x, int x_bf16, int64_t K, int16_t* q, float* d, float* s) {
    for (int64_t b = 0; b < K / QBLOCK; b++) {
        float v[QBLOCK];
        for (int j = 0; j < QBLOCK; j++)
            v[j] = x_bf16 ? bf16_to_f32(((const bf16_t*)x)[b * QBLOCK + j])
                          : ((const float*)x)[b * QBLOCK + j];
        float amax = 0.0f;
        for (int j = 0; j < QBLOCK; j++) amax = fmaxf(amax, fabsf(v[j]));
        const float db = amax / Q_XMAX;
        const float id = db != 0.0f ? 1.0f / db : 0.0f;
        int32_t sum = 0;
        for (int j = 0; j < QBLOCK; j++) {
            float r = nearbyintf(v[j] * id);
            r = r > Q_XMAX ? Q_XMAX : (r < -Q_XMAX ? -Q_XMAX : r);
            q[b * QBLOCK + j] = (int16_t)r;
            sum += (int32_t)r;
        }
        d[b] = db;
        s[b] = db * (float)sum;
    }
}

void strata_quant_activations(const void* x, int x_bf16, int64_t M, int64_t K, int16_t* xq,
                              float* xd, float* xs) {
    const int64_t nb = K / QBLOCK, elem = x_bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) if (M >= 4)
    for (int64_t m = 0; m < M; m++)
        quant_row((const char*)x + m * K * elem, x_bf16, K, xq + m * K, xd + m * nb, xs + m * nb);
}

#if defined(Q_AVX512) || defined(Q_AVX2)
// a q4 block's 16 bytes -> its 32 values (0..15) in order, as bytes
static inline __m256i q4_unpack(const uint8_t* qs) {
    const __m128i b = _mm_loadu_si128((const __m128i*)qs);
    const __m128i mask = _mm_set1_epi8(0x0f);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), mask), _mm_and_si128(b, mask));
}
#endif

#ifdef Q_AVX512
typedef __m512 qacc_t;
typedef __m512i qw_t;  // a block's 32 weights as int16
static inline qw_t q_load(int format, const uint8_t* w, int64_t b) {
    if (format == 8) return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(w + b * QBLOCK)));
    // the 16 bytes widened to int16 first: the low nibbles are values 0..15, the high 16..31
    const __m256i b16 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(w + b * 16)));
    const __m256i lo = _mm256_and_si256(b16, _mm256_set1_epi16(0x0f));
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), _mm256_srli_epi16(b16, 4), 1);
}
// acc += (sum of the block's 32 products, in 16 lanes) * scale
static inline qacc_t q_fma(qacc_t acc, qw_t wv, const int16_t* xq, float scale) {
    const __m512i p = _mm512_madd_epi16(wv, _mm512_loadu_si512(xq));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_set1_ps(scale), acc);
}
static inline qacc_t q_zero(void) { return _mm512_setzero_ps(); }
static inline float q_hsum(qacc_t a, qacc_t b) { return _mm512_reduce_add_ps(_mm512_add_ps(a, b)); }
#define Q_SIMD 1
#elif defined(Q_AVX2)
typedef __m256 qacc_t;
typedef struct {
    __m256i lo, hi;  // values 0..15 and 16..31 as int16
} qw_t;
static inline qw_t q_load(int format, const uint8_t* w, int64_t b) {
    qw_t v;
    if (format == 8) {
        const __m256i raw = _mm256_loadu_si256((const __m256i*)(w + b * QBLOCK));
        v.lo = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(raw));
        v.hi = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(raw, 1));
    } else {
        const __m256i raw = q4_unpack(w + b * (QBLOCK / 2));
        v.lo = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(raw));
        v.hi = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(raw, 1));
    }
    return v;
}
static inline qacc_t q_fma(qacc_t acc, qw_t wv, const int16_t* xq, float scale) {
    const __m256i p0 = _mm256_madd_epi16(wv.lo, _mm256_loadu_si256((const __m256i*)xq));
    const __m256i p1 = _mm256_madd_epi16(wv.hi, _mm256_loadu_si256((const __m256i*)(xq + 16)));
    const __m256 p = _mm256_cvtepi32_ps(_mm256_add_epi32(p0, p1));
    return _mm256_fmadd_ps(p, _mm256_set1_ps(scale), acc);
}
static inline qacc_t q_zero(void) { return _mm256_setzero_ps(); }
static inline float q_hsum(qacc_t a, qacc_t b) {
    const __m256 v = _mm256_add_ps(a, b);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#define Q_SIMD 1
#endif

// sums[r] = sum_b d_b xd[r, b] dot(q_b, xq[r, b]) over one packed weight row w, for R
// activation rows of K at xq (scales xd, K / 32 per row)
static inline __attribute__((always_inline)) void q_rows(const int format, const uint8_t* w,
                                                         const int16_t* xq, const float* xd,
                                                         int64_t K, float* sums, const int R) {
    const int64_t nb = K / QBLOCK;
    const float* d = (const float*)(w + (format == 8 ? K : K / 2));
#ifdef Q_SIMD
    // two accumulators per row (even and odd blocks): the FMA chains overlap
    qacc_t acc0[Q_ROWS], acc1[Q_ROWS];
    for (int r = 0; r < R; r++) acc0[r] = acc1[r] = q_zero();
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
        const qw_t w0 = q_load(format, w, b), w1 = q_load(format, w, b + 1);
        for (int r = 0; r < R; r++) {
            const int16_t* xr = xq + r * K + b * QBLOCK;
            const float* dr = xd + r * nb + b;
            acc0[r] = q_fma(acc0[r], w0, xr, d[b] * dr[0]);
            acc1[r] = q_fma(acc1[r], w1, xr + QBLOCK, d[b + 1] * dr[1]);
        }
    }
    if (b < nb) {
        const qw_t w0 = q_load(format, w, b);
        for (int r = 0; r < R; r++)
            acc0[r] = q_fma(acc0[r], w0, xq + r * K + b * QBLOCK, d[b] * xd[r * nb + b]);
    }
    for (int r = 0; r < R; r++) sums[r] = q_hsum(acc0[r], acc1[r]);
#else
    for (int r = 0; r < R; r++) sums[r] = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        int32_t wv[QBLOCK];
        for (int j = 0; j < QBLOCK; j++) {
            if (format == 8) {
                wv[j] = ((const int8_t*)w)[b * QBLOCK + j];
            } else {
                const uint8_t byte = w[b * (QBLOCK / 2) + (j & 15)];
                wv[j] = j < 16 ? byte & 15 : byte >> 4;
            }
        }
        for (int r = 0; r < R; r++) {
            const int16_t* xr = xq + r * K + b * QBLOCK;
            int32_t p = 0;
            for (int j = 0; j < QBLOCK; j++) p += wv[j] * xr[j];
            sums[r] += (float)p * (d[b] * xd[r * nb + b]);
        }
    }
#endif
}

static inline float dot_f32(const float* a, const float* b, int64_t n) {
#ifdef Q_AVX512
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 live = n - i >= 16 ? 0xffff : (__mmask16)((1u << (n - i)) - 1);
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(live, a + i), _mm512_maskz_loadu_ps(live, b + i),
                              acc);
    }
    return _mm512_reduce_add_ps(acc);
#else
    float s = 0.0f;
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
#endif
}

// The panel paths stream their weights from memory (a model's do not fit the caches), and
// a thread unpacking a panel would wait on every line of it. So while a panel's register
// blocks run, the next panel's rows (contiguous in w) are prefetched into L2, a share of
// the lines before each block: at 32 rows this cut the products' time by a quarter (q4)
// and a half (q8, the LM head) with the weights in memory.
typedef struct {
    const char* at;        // the next line to prefetch
    int64_t left, share;   // lines still to prefetch, lines per register block
} QPrefetch;

static inline QPrefetch q_prefetch(const uint8_t* w, int64_t panel_bytes, int64_t next,
                                   int64_t end, int64_t blocks) {
    const int64_t lines = next < end ? panel_bytes / 64 : 0;
    return (QPrefetch){(const char*)w + next * panel_bytes, lines, (lines + blocks) / blocks};
}

static inline void q_prefetch_some(QPrefetch* pf) {
    for (int64_t l = 0; l < pf->share && pf->left > 0; l++, pf->left--, pf->at += 64)
        __builtin_prefetch(pf->at, 0, 2);
}

#ifdef STRATA_AVX512BF16
// Many rows (prefill, large batches): the integer path's per-block scaling costs three
// instructions per 32 products, where the bf16 dot product needs one. So each thread turns
// one panel of 64 weight rows at a time back into bf16, interleaved by pairs of inputs as
// linear.h packs them ([K / 2][64][2], 64 * K * 2 bytes, kept in its L2), and runs a 6 x 64
// bf16 register block over every activation row against it. The weights still cross the
// memory bus once, quantized.
#define QG_PANEL 64
#define QG_MR 6
#define QG_MIN_ROWS 16

// one block of 16 weight rows: 32 values each, dequantized to bf16 and stored as 16 pairs
// of inputs per row, transposed so that each pair index kk is one 64-byte run of 16 rows
static void qg_dequant16(int format, const uint8_t* w, int64_t row_bytes, int64_t K, int64_t b,
                         bf16_t* panel, int64_t j0) {
    __m512 rows[16];
    for (int j = 0; j < 16; j++) {
        const uint8_t* wr = w + (j0 + j) * row_bytes;
        const float* d = (const float*)(wr + (format == 8 ? K : K / 2));
        __m512i lo, hi;  // values 0..15 and 16..31 as int32
        if (format == 8) {
            const __m256i raw = _mm256_loadu_si256((const __m256i*)(wr + b * QBLOCK));
            lo = _mm512_cvtepi8_epi32(_mm256_castsi256_si128(raw));
            hi = _mm512_cvtepi8_epi32(_mm256_extracti128_si256(raw, 1));
        } else {
            const __m256i raw = q4_unpack(wr + b * (QBLOCK / 2));
            lo = _mm512_cvtepu8_epi32(_mm256_castsi256_si128(raw));
            hi = _mm512_cvtepu8_epi32(_mm256_extracti128_si256(raw, 1));
        }
        const __m512 dv = _mm512_set1_ps(d[b]);
        __m512 flo = _mm512_mul_ps(_mm512_cvtepi32_ps(lo), dv);
        __m512 fhi = _mm512_mul_ps(_mm512_cvtepi32_ps(hi), dv);
        if (format == 4) {
            const __m512 mv = _mm512_set1_ps(d[K / QBLOCK + b]);
            flo = _mm512_sub_ps(flo, mv);
            fhi = _mm512_sub_ps(fhi, mv);
        }
        // 32 bf16 in input order = 16 words, word i the pair (2i, 2i + 1)
        rows[j] = _mm512_castsi512_ps(
            _mm512_inserti64x4(_mm512_castsi256_si512(v_pack_bf16(flo)), v_pack_bf16(fhi), 1));
    }
    v_transpose16(rows);  // rows[i]: pair i of the 16 rows
    for (int i = 0; i < 16; i++)
        _mm512_storeu_ps((float*)(panel + ((b * 16 + i) * QG_PANEL + j0 % QG_PANEL) * 2),
                         rows[i]);
}

static inline __attribute__((always_inline)) void qg_block(const bf16_t* x, const bf16_t* panel,
                                                          const bf16_t* bias, void* y, int64_t K,
                                                          int64_t N, int out_f32, const int MR) {
    __m512 acc[QG_MR][4];
    for (int r = 0; r < MR; r++)
        for (int i = 0; i < 4; i++) acc[r][i] = _mm512_setzero_ps();
    const int32_t* xp = (const int32_t*)x;
    const int64_t pairs = K / 2;
    for (int64_t kk = 0; kk < pairs; kk++) {
        const bf16_t* wk = panel + kk * 2 * QG_PANEL;
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wk);
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wk + 32);
        const __m512bh w2 = (__m512bh)_mm512_loadu_si512(wk + 64);
        const __m512bh w3 = (__m512bh)_mm512_loadu_si512(wk + 96);
        for (int r = 0; r < MR; r++) {
            const __m512bh xb = (__m512bh)_mm512_set1_epi32(xp[r * pairs + kk]);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xb, w0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xb, w1);
            acc[r][2] = _mm512_dpbf16_ps(acc[r][2], xb, w2);
            acc[r][3] = _mm512_dpbf16_ps(acc[r][3], xb, w3);
        }
    }
    for (int i = 0; i < 4; i++) {
        const __m512 bv = bias ? v_load_bf16(bias + 16 * i) : _mm512_setzero_ps();
        for (int r = 0; r < MR; r++) {
            const __m512 v = _mm512_add_ps(acc[r][i], bv);
            if (out_f32)
                _mm512_storeu_ps((float*)y + r * N + 16 * i, v);
            else
                v_store_bf16((bf16_t*)y + r * N + 16 * i, v);
        }
    }
}

static int qg_linear(int64_t format, const bf16_t* x, const uint8_t* w, const bf16_t* bias,
                     void* y, int out_f32, int64_t M, int64_t N, int64_t K) {
    const int64_t row_bytes = strata_quant_row_bytes(format, K), panels = N / QG_PANEL;
    const size_t elem = out_f32 ? sizeof(float) : sizeof(bf16_t);
    int failed = 0;
#pragma omp parallel
    {
        bf16_t* panel = aligned_alloc(64, (size_t)(QG_PANEL * K) * sizeof(bf16_t));
        if (!panel) {
#pragma omp atomic write
            failed = 1;
        }
        const int64_t nth = omp_get_num_threads(), tid = omp_get_thread_num();
        const int64_t p0 = tid * panels / nth, p1 = (tid + 1) * panels / nth;
        for (int64_t p = p0; panel && p < p1; p++) {
            for (int64_t b = 0; b < K / QBLOCK; b++)
                for (int64_t j0 = p * QG_PANEL; j0 < (p + 1) * QG_PANEL; j0 += 16)
                    qg_dequant16((int)format, w, row_bytes, K, b, panel, j0);
            const bf16_t* bs = bias ? bias + p * QG_PANEL : 0;
            QPrefetch pf = q_prefetch(w, QG_PANEL * row_bytes, p + 1, p1, (M + QG_MR - 1) / QG_MR);
            for (int64_t m0 = 0; m0 < M; m0 += QG_MR) {
                q_prefetch_some(&pf);
                const bf16_t* xs = x + m0 * K;
                void* ys = (char*)y + (size_t)(m0 * N + p * QG_PANEL) * elem;
                switch (M - m0 < QG_MR ? M - m0 : QG_MR) {
                    case 1: qg_block(xs, panel, bs, ys, K, N, out_f32, 1); break;
                    case 2: qg_block(xs, panel, bs, ys, K, N, out_f32, 2); break;
                    case 3: qg_block(xs, panel, bs, ys, K, N, out_f32, 3); break;
                    case 4: qg_block(xs, panel, bs, ys, K, N, out_f32, 4); break;
                    case 5: qg_block(xs, panel, bs, ys, K, N, out_f32, 5); break;
                    default: qg_block(xs, panel, bs, ys, K, N, out_f32, 6); break;
                }
            }
        }
        free(panel);
    }
    return failed ? -3 : 0;
}
#endif

// Two-level 8-bit activations (the 8-bit q4 paths below, and tests). Each block of 32 is
// quantized to int8 with d1 = amax / 127; a block whose values then sum to under
// QI_TWO_LEVEL in magnitude (a few large values and the rest rounded to near nothing: the
// outlier channels of small models) also gets its rounding error r = x - d1 q1 quantized
// the same way (d2, q2), so that x ~ d1 q1 + d2 q2 to about 15 bits; other blocks get
// q2 = 0, d2 = 0. s = d1 sum(q1) + d2 sum(q2); two = 1 where the block has a second level.
#define QI_TWO_LEVEL 508  // 4 * 127: a block's values average under 16 of 127 steps
#if defined(__AVX2__) && defined(__FMA__)
#define QI_AVX2 1  // the 8-bit q4 paths below
#endif
#if defined(STRATA_AVX512) && defined(__AVX512VNNI__)
#define QI_VNNI 1  // their many-rows products by `vpdpbusd` on 512 bits
#endif
#ifdef QI_AVX2
#include "lora.h"  // a decode step's adapter updates inside the many-rows product
#endif

#ifdef QI_AVX2
// 32 values in 4 vectors -> int8 at q with d = amax / 127 (round to nearest even of v / d),
// their int32 values in qi, and the values' sum and magnitude; returns d
static inline float qi_round8(const __m256 f[4], int8_t* q, __m256i qi[4], int32_t* sum,
                              int32_t* mag) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, f[0]), _mm256_andnot_ps(sign, f[1])),
                             _mm256_max_ps(_mm256_andnot_ps(sign, f[2]), _mm256_andnot_ps(sign, f[3])));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float d = _mm_cvtss_f32(h) / 127.0f;
    const __m256 id = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
    const __m256 hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
    __m256i sums = _mm256_setzero_si256(), mags = _mm256_setzero_si256();
    for (int i = 0; i < 4; i++) {
        __m256 r = _mm256_round_ps(_mm256_mul_ps(f[i], id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        r = _mm256_min_ps(_mm256_max_ps(r, lo), hi);
        qi[i] = _mm256_cvtps_epi32(r);
        sums = _mm256_add_epi32(sums, qi[i]);
        mags = _mm256_add_epi32(mags, _mm256_abs_epi32(qi[i]));
    }
    // int32 -> int8 in order: packs interleave the 128-bit lanes, a permute restores them
    const __m256i w16a = _mm256_packs_epi32(qi[0], qi[1]), w16b = _mm256_packs_epi32(qi[2], qi[3]);
    const __m256i w8 = _mm256_packs_epi16(w16a, w16b);
    _mm256_storeu_si256((__m256i*)q,
                        _mm256_permutevar8x32_epi32(w8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(sums), _mm256_extracti128_si256(sums, 1));
    t = _mm_hadd_epi32(t, t);
    *sum = _mm_cvtsi128_si32(_mm_hadd_epi32(t, t));
    t = _mm_add_epi32(_mm256_castsi256_si128(mags), _mm256_extracti128_si256(mags, 1));
    t = _mm_hadd_epi32(t, t);
    *mag = _mm_cvtsi128_si32(_mm_hadd_epi32(t, t));
    return d;
}
#else
// 32 values -> int8 at q with d = amax / 127 (round to nearest even of v / d), and the
// values' sum and magnitude; returns d
static float q_round8(const float* v, int8_t* q, int32_t* sum, int32_t* mag) {
    float amax = 0.0f;
    for (int j = 0; j < QBLOCK; j++) amax = fmaxf(amax, fabsf(v[j]));
    const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    *sum = *mag = 0;
    for (int j = 0; j < QBLOCK; j++) {
        float r = nearbyintf(v[j] * id);
        r = r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r);
        q[j] = (int8_t)r;
        *sum += (int32_t)r;
        *mag += r < 0.0f ? -(int32_t)r : (int32_t)r;
    }
    return d;
}
#endif

static void quant_row8(const void* x, int x_bf16, int64_t K, int8_t* q1, int8_t* q2, float* d1,
                       float* d2, float* s, uint8_t* two) {
    for (int64_t b = 0; b < K / QBLOCK; b++) {
        int8_t *qb = q1 + b * QBLOCK, *qb2 = q2 + b * QBLOCK;
        int32_t sum, mag, sum2 = 0, mag2;
        float db, db2 = 0.0f;
#ifdef QI_AVX2
        __m256 f[4];
        __m256i qi[4];
        for (int i = 0; i < 4; i++)
            f[i] = x_bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(
                                _mm256_cvtepu16_epi32(_mm_loadu_si128(
                                    (const __m128i*)((const bf16_t*)x + b * QBLOCK + 8 * i))),
                                16))
                          : _mm256_loadu_ps((const float*)x + b * QBLOCK + 8 * i);
        db = qi_round8(f, qb, qi, &sum, &mag);
        two[b] = db != 0.0f && mag < QI_TWO_LEVEL;
        if (two[b]) {  // the rounding error x - d1 q1 (one rounding), quantized the same way
            for (int i = 0; i < 4; i++)
                f[i] = _mm256_fnmadd_ps(_mm256_set1_ps(db), _mm256_cvtepi32_ps(qi[i]), f[i]);
            db2 = qi_round8(f, qb2, qi, &sum2, &mag2);
        }
#else
        float v[QBLOCK];
        for (int j = 0; j < QBLOCK; j++)
            v[j] = x_bf16 ? bf16_to_f32(((const bf16_t*)x)[b * QBLOCK + j])
                          : ((const float*)x)[b * QBLOCK + j];
        db = q_round8(v, qb, &sum, &mag);
        two[b] = db != 0.0f && mag < QI_TWO_LEVEL;
        if (two[b]) {  // the rounding error x - d1 q1 (one rounding), quantized the same way
            for (int j = 0; j < QBLOCK; j++) v[j] = fmaf(-db, (float)qb[j], v[j]);
            db2 = q_round8(v, qb2, &sum2, &mag2);
        }
#endif
        if (!two[b]) __builtin_memset(qb2, 0, QBLOCK);
        d1[b] = db;
        d2[b] = db2;
        s[b] = fmaf(db2, (float)sum2, db * (float)sum);
    }
}

void strata_quant_activations8(const void* x, int x_bf16, int64_t M, int64_t K, int8_t* q1,
                               int8_t* q2, float* d1, float* d2, float* s, uint8_t* two) {
    const int64_t nb = K / QBLOCK, elem = x_bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) if (M >= 4)
    for (int64_t m = 0; m < M; m++)
        quant_row8((const char*)x + m * K * elem, x_bf16, K, q1 + m * K, q2 + m * K, d1 + m * nb,
                   d2 + m * nb, s + m * nb, two + m * nb);
}

#ifdef QI_AVX2
// Many rows over q4 weights (AVX2; AVX512-VNNI below): 4-bit weights (unsigned, 0..15) times
// 8-bit activations (signed) with `vpmaddubsw`, 32 products an instruction where an fp32 FMA
// does 8. A pair of products is at most 2 * 15 * 127 = 3810, so a block's 8 steps of 4
// inputs sum in int16 without saturating; the block's sum is then widened (`vpmaddwd` by 1),
// scaled by d_w d_x in fp32 (the min terms are summed apart: QiActs). Each thread unpacks
// one panel of 16 weight rows at a time into [K / 4][16][4] bytes (4 consecutive inputs of
// each row together, as `vpmaddubsw` pairs them), with its scales and mins as [K / 32][16]
// floats, and runs a QI_MR x 16 register block over every activation row against it.
#define QI_PANEL 16
#ifdef QI_VNNI
#define QI_MR 8
#else
#define QI_MR 3
#endif
#define QI_MIN_ROWS 4

// 8 rows of 8 int32 each -> 8 columns (r[i] = column i)
static inline void qi_transpose8(__m256i r[8]) {
    __m256i t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x20);
        r[i + 4] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x31);
    }
}

// the panel of weight rows j0 .. j0 + 15: values as [K / 4][16][4], scales and mins [nb][16]
static void qi_unpack(const uint8_t* w, int64_t row_bytes, int64_t K, int64_t j0, uint8_t* panel,
                      float* pd, float* pm) {
    const int64_t nb = K / QBLOCK;
    const __m128i mask = _mm_set1_epi8(0x0f);
    for (int64_t b = 0; b < nb; b++) {
        for (int half = 0; half < 2; half++) {
            __m256i rows[8];  // row j's 32 values of block b, in order: 8 groups of 4
            for (int j = 0; j < 8; j++) {
                const uint8_t* wr = w + (j0 + half * 8 + j) * row_bytes;
                const __m128i raw = _mm_loadu_si128((const __m128i*)(wr + b * (QBLOCK / 2)));
                rows[j] = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), mask),
                                           _mm_and_si128(raw, mask));
            }
            qi_transpose8(rows);  // rows[g]: group g of the 8 rows, 4 bytes each
            for (int g = 0; g < 8; g++)
                _mm256_storeu_si256(
                    (__m256i*)(panel + ((b * 8 + g) * QI_PANEL + half * 8) * 4), rows[g]);
        }
        for (int j = 0; j < QI_PANEL; j++) {
            const float* d = (const float*)(w + (j0 + j) * row_bytes + K / 2);
            pd[b * QI_PANEL + j] = d[b];
            pm[b * QI_PANEL + j] = d[nb + b];
        }
    }
}

// The 8-bit q4 paths' sum for one output of one row is (a - m) + c, each from 0 in block
// order: a of d_w d_1 p_1 over the blocks, m of the min terms m_w s, and c of d_w d_2 p_2
// over the row's two-level blocks only. The panels sum c last, from each row's list of its
// two-level blocks, so that their loop over the blocks has no branch on the data.
typedef struct {
    int8_t *q1, *q2;    // [M, K]
    float *d1, *d2, *s;  // [M, nb]
    uint8_t* two;        // [M, nb]
    int32_t* tb;         // [M, nb]: each row's two-level blocks, in order, then unused
    int32_t* tn;         // [M]: how many
} QiActs;

#ifdef QI_VNNI
// With AVX512-VNNI one `vpdpbusd` does a group's 4 inputs for all 16 rows of the panel (one
// 512-bit vector) and adds them into int32: no int16 stage, no widening, and 8 rows' sums
// plus their fp32 sums fit the 32 registers. The per-lane arithmetic after the integer sums
// is qi_block's below, in the same order, so both builds give the same bits.
static inline __attribute__((always_inline)) void qi_level(const uint8_t* wp, const int8_t* xq,
                                                          const float* dx, int64_t K,
                                                          int64_t nb, __m512 dw, __m512* acc,
                                                          const int R) {
    __m512i s[QI_MR];
    for (int r = 0; r < R; r++) s[r] = _mm512_setzero_si512();
    for (int g = 0; g < 8; g++) {
        const __m512i w = _mm512_load_si512((const void*)(wp + g * 64));
        for (int r = 0; r < R; r++) {
            int32_t quad;
            __builtin_memcpy(&quad, xq + r * K + g * 4, 4);
            s[r] = _mm512_dpbusd_epi32(s[r], w, _mm512_set1_epi32(quad));
        }
    }
    for (int r = 0; r < R; r++)
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r]),
                                 _mm512_mul_ps(dw, _mm512_set1_ps(dx[r * nb])), acc[r]);
}

static inline __attribute__((always_inline)) void qi_block(const uint8_t* panel, const float* pd,
                                                          const float* pm, QiActs a, int64_t m0,
                                                          int64_t K, float* out, const int R) {
    const int64_t nb = K / QBLOCK;
    __m512 acc[QI_MR], am[QI_MR];
    for (int r = 0; r < R; r++) acc[r] = am[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t* wp = panel + b * QBLOCK * QI_PANEL;
        const int64_t at = m0 * K + b * QBLOCK, ds = m0 * nb + b;
        const __m512 dw = _mm512_loadu_ps(pd + b * QI_PANEL);
        qi_level(wp, a.q1 + at, a.d1 + ds, K, nb, dw, acc, R);
        const __m512 mw = _mm512_loadu_ps(pm + b * QI_PANEL);
        for (int r = 0; r < R; r++)
            am[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a.s[ds + r * nb]), am[r]);
    }
    for (int r = 0; r < R; r++) {  // then each row's second levels
        __m512 c = _mm512_setzero_ps();
        for (int32_t i = 0; i < a.tn[m0 + r]; i++) {
            const int64_t b = a.tb[(m0 + r) * nb + i], at = (m0 + r) * K + b * QBLOCK;
            qi_level(panel + b * QBLOCK * QI_PANEL, a.q2 + at, a.d2 + (m0 + r) * nb + b, K, nb,
                     _mm512_loadu_ps(pd + b * QI_PANEL), &c, 1);
        }
        _mm512_storeu_ps(out + r * QI_PANEL, _mm512_add_ps(_mm512_sub_ps(acc[r], am[r]), c));
    }
}
#else
// *s += p in int16, in place: one `vpaddw` into the register that holds the sum. Written
// as an intrinsic, GCC reorders the adds, keeping every product live at once, and spills;
// with an empty asm barrier on the sum instead, it copies the sum to another register after
// every add, and the loop issues 8 more instructions per group of 4 columns.
static inline __attribute__((always_inline)) void qi_add16(__m256i* s, __m256i p) {
    __asm__("vpaddw %1, %0, %0" : "+x"(*s) : "x"(p));
}

// acc[r][0..1] += one level of block b's products for the R rows at xq (stride K), scaled
// by d_w (dw0, dw1: the panel's 16 scales) times the rows' d_x (dx, stride nb). 3 rows'
// int16 and fp32 sums, 2 weight vectors and the broadcast take 15 of the 16 registers: with
// 4 rows the fp32 sums lived in memory, and their loads and stores cost more than a fourth
// row's share of the weight loads saves.
static inline __attribute__((always_inline)) void qi_level(const uint8_t* wp, const int8_t* xq,
                                                          const float* dx, int64_t K,
                                                          int64_t nb, const float* dw,
                                                          __m256 acc[][2], const int R) {
    __m256i s[QI_MR][2];
    for (int r = 0; r < R; r++) s[r][0] = s[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 1
    for (int g = 0; g < 8; g++) {
        const __m256i w0 = _mm256_load_si256((const __m256i*)(wp + g * 64));
        const __m256i w1 = _mm256_load_si256((const __m256i*)(wp + g * 64 + 32));
        for (int r = 0; r < R; r++) {
            int32_t quad;
            __builtin_memcpy(&quad, xq + r * K + g * 4, 4);
            const __m256i xb = _mm256_set1_epi32(quad);
            qi_add16(&s[r][0], _mm256_maddubs_epi16(w0, xb));
            qi_add16(&s[r][1], _mm256_maddubs_epi16(w1, xb));
        }
    }
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256 dw0 = _mm256_loadu_ps(dw), dw1 = _mm256_loadu_ps(dw + 8);
    for (int r = 0; r < R; r++) {
        const __m256 d = _mm256_set1_ps(dx[r * nb]);
        const __m256 p0 = _mm256_cvtepi32_ps(_mm256_madd_epi16(s[r][0], ones));
        const __m256 p1 = _mm256_cvtepi32_ps(_mm256_madd_epi16(s[r][1], ones));
        acc[r][0] = _mm256_fmadd_ps(p0, _mm256_mul_ps(dw0, d), acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(p1, _mm256_mul_ps(dw1, d), acc[r][1]);
    }
}

// out[r][0..15] = the R rows of a (from row m0) against one unpacked panel
static inline __attribute__((always_inline)) void qi_block(const uint8_t* panel, const float* pd,
                                                          const float* pm, QiActs a, int64_t m0,
                                                          int64_t K, float* out, const int R) {
    const int64_t nb = K / QBLOCK;
    __m256 acc[QI_MR][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t* wp = panel + b * QBLOCK * QI_PANEL;
        const int64_t at = m0 * K + b * QBLOCK, ds = m0 * nb + b;
        qi_level(wp, a.q1 + at, a.d1 + ds, K, nb, pd + b * QI_PANEL, acc, R);
    }
    __m256 am[QI_MR][2];  // the min terms
    for (int r = 0; r < R; r++) am[r][0] = am[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const __m256 mw0 = _mm256_loadu_ps(pm + b * QI_PANEL);
        const __m256 mw1 = _mm256_loadu_ps(pm + b * QI_PANEL + 8);
        for (int r = 0; r < R; r++) {
            const __m256 xs = _mm256_set1_ps(a.s[(m0 + r) * nb + b]);
            am[r][0] = _mm256_fmadd_ps(mw0, xs, am[r][0]);
            am[r][1] = _mm256_fmadd_ps(mw1, xs, am[r][1]);
        }
    }
    for (int r = 0; r < R; r++) {  // then each row's second levels
        __m256 c[1][2] = {{_mm256_setzero_ps(), _mm256_setzero_ps()}};
        for (int32_t i = 0; i < a.tn[m0 + r]; i++) {
            const int64_t b = a.tb[(m0 + r) * nb + i], at = (m0 + r) * K + b * QBLOCK;
            qi_level(panel + b * QBLOCK * QI_PANEL, a.q2 + at, a.d2 + (m0 + r) * nb + b, K, nb,
                     pd + b * QI_PANEL, c, 1);
        }
        for (int h = 0; h < 2; h++)
            _mm256_storeu_ps(out + r * QI_PANEL + 8 * h,
                             _mm256_add_ps(_mm256_sub_ps(acc[r][h], am[r][h]), c[0][h]));
    }
}

#endif

// the activations' buffer (returned, to free): q1 and q2 [M, K], then d1, d2, s and tb
// [M, nb], tn [M], two [M, nb]; a points into it
static int8_t* qi_acts_alloc(int64_t M, int64_t K, QiActs* a) {
    const int64_t nb = K / QBLOCK;
    int8_t* q1 = malloc((size_t)(2 * M * K) + (size_t)(4 * M * nb + M) * sizeof(float) +
                        (size_t)(M * nb));
    if (!q1) return 0;
    a->q1 = q1;
    a->q2 = q1 + M * K;
    a->d1 = (float*)(q1 + 2 * M * K);
    a->d2 = a->d1 + M * nb;
    a->s = a->d2 + M * nb;
    a->tb = (int32_t*)(a->s + M * nb);
    a->tn = a->tb + M * nb;
    a->two = (uint8_t*)(a->tn + M);
    return q1;
}

// activation row m of x [M, K] (bf16 or fp32) into a, with its list of two-level blocks
static void qi_quant_row(const void* x, int x_bf16, int64_t K, QiActs a, int64_t m) {
    const int64_t nb = K / QBLOCK;
    const uint8_t* two = a.two + m * nb;
    quant_row8((const char*)x + m * K * (x_bf16 ? 2 : 4), x_bf16, K, a.q1 + m * K, a.q2 + m * K,
               a.d1 + m * nb, a.d2 + m * nb, a.s + m * nb, a.two + m * nb);
    int32_t n = 0, *tb = a.tb + m * nb;
    for (int64_t b = 0; b < nb; b++) {  // without a branch: each block written, kept if two
        tb[n] = (int32_t)b;
        n += two[b];
    }
    a.tn[m] = n;
}

// Few rows (decode) over q4 weights: the same 8-bit products, straight from the packed rows
// (no panel to amortize), 8 weight rows at a time, a block at a time. A block's 32 products
// give 8 int32 lanes per weight row, summed across into one vector of the 8 rows' block
// sums, which are then scaled and summed in the panels' order and arithmetic (QiActs). So a
// row gets the same bits here as in a panel, and a request's results do not depend on how
// many rows share its step (tested).
#define QV_MAX_ROWS (QI_MIN_ROWS - 1)
#define QV_AHEAD 2  // groups of 8 weight rows prefetched ahead

// the 32 values 0..15 of a q4 block, in order, as bytes
static inline __m256i qv_unpack(const uint8_t* qs) {
    const __m128i raw = _mm_loadu_si128((const __m128i*)qs), mask = _mm_set1_epi8(0x0f);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), mask), _mm_and_si128(raw, mask));
}

// the int32 lanes of one block's products of w (bytes) and the row's 32 int8 values at xq
static inline __m256i qv_dot(__m256i w, const int8_t* xq) {
    const __m256i p = _mm256_maddubs_epi16(w, _mm256_loadu_si256((const __m256i*)xq));
    return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}

// the 8 rows' sums of h (pairs of rows summed across by `vphaddd`: h[i] holds rows 2i and
// 2i + 1), row j's in lane j
static inline __m256 q_across8(const __m256i h[4]) {
    const __m256i u = _mm256_hadd_epi32(h[0], h[1]), t = _mm256_hadd_epi32(h[2], h[3]);
    return _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_permute2x128_si256(u, t, 0x20),
                                               _mm256_permute2x128_si256(u, t, 0x31)));
}

// The 8-rows paths' group: the rows n0 .. n0 + 7 of w (a short last group repeats its first
// row in the rest); returns how many are real
static inline int q_group8(const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t N,
                           const uint8_t* wr[8]) {
    const int live = N - n0 < 8 ? (int)(N - n0) : 8;
    for (int j = 0; j < 8; j++) wr[j] = w + (n0 + (j < live ? j : 0)) * row_bytes;
    return live;
}

// the R rows' sums acc[r] (lane j: output n0 + j) plus bias, stored for the live outputs
static inline void q_store8(void* y, int out_f32, const void* bias, int x_bf16, int64_t N,
                            int64_t n0, int live, const __m256 acc[], int64_t R) {
    for (int64_t r = 0; r < R; r++) {
        float sums[8];
        _mm256_storeu_ps(sums, acc[r]);
        for (int j = 0; j < live; j++)
            q_store(y, out_f32, r * N + n0 + j, sums[j] + q_bias(bias, x_bf16, n0 + j));
    }
}

// the 8 rows' floats (scales or mins) of blocks b0 .. b0 + live - 1, each row's at wr[j] +
// at, transposed: t[i] holds block b0 + i's of the 8 rows
static inline void q_scales8(const uint8_t* const wr[8], int64_t at, int64_t b0, int live,
                             __m256i t[8]) {
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(live),
                                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    for (int j = 0; j < 8; j++) t[j] = _mm256_maskload_epi32((const int*)(wr[j] + at) + b0, mask);
    qi_transpose8(t);
}

// the block sums of 8 weight rows (wr[j] + off: block b's values) against R activation
// rows at xq (stride K), lane j being row j's: pairs of rows are summed across as they come
// (`vphaddd`), so that few vectors are live at once
static inline __attribute__((always_inline)) void qv_sums8(const uint8_t* const wr[8], int64_t off,
                                                          const int8_t* xq, int64_t K,
                                                          __m256 out[], const int R) {
    __m256i h[QV_MAX_ROWS][4];
    for (int j = 0; j < 8; j += 2) {
        const __m256i w0 = qv_unpack(wr[j] + off), w1 = qv_unpack(wr[j + 1] + off);
        for (int r = 0; r < R; r++)
            h[r][j / 2] = _mm256_hadd_epi32(qv_dot(w0, xq + r * K), qv_dot(w1, xq + r * K));
    }
    for (int r = 0; r < R; r++) out[r] = q_across8(h[r]);
}

// acc[r] (lane j: weight row j) = the R activation rows against 8 weight rows. Their
// scales and mins come 8 blocks at a time, transposed so that one vector holds a block's 8.
static inline __attribute__((always_inline)) void qv_rows8(const uint8_t* const wr[8], QiActs a,
                                                          int64_t K, QPrefetch* pf, __m256 acc[],
                                                          const int R) {
    const int64_t nb = K / QBLOCK;
    __m256 am[QV_MAX_ROWS], c[QV_MAX_ROWS];  // the min terms, the second levels
    for (int r = 0; r < R; r++) acc[r] = am[r] = c[r] = _mm256_setzero_ps();
    for (int64_t b0 = 0; b0 < nb; b0 += 8) {
        const int live = nb - b0 < 8 ? (int)(nb - b0) : 8;
        __m256i dt[8], mt[8];
        q_scales8(wr, K / 2, b0, live, dt);
        q_scales8(wr, K / 2 + nb * (int64_t)sizeof(float), b0, live, mt);
        for (int i = 0; i < live; i++) {
            const int64_t b = b0 + i;
            q_prefetch_some(pf);
            const __m256 dw = _mm256_castsi256_ps(dt[i]), mw = _mm256_castsi256_ps(mt[i]);
            __m256 p[QV_MAX_ROWS];
            qv_sums8(wr, b * (QBLOCK / 2), a.q1 + b * QBLOCK, K, p, R);
            for (int r = 0; r < R; r++) {
                const int64_t ds = r * nb + b;
                acc[r] = _mm256_fmadd_ps(p[r], _mm256_mul_ps(dw, _mm256_set1_ps(a.d1[ds])), acc[r]);
                am[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(a.s[ds]), am[r]);
                if (a.two[ds]) {
                    __m256 p2;
                    qv_sums8(wr, b * (QBLOCK / 2), a.q2 + r * K + b * QBLOCK, K, &p2, 1);
                    c[r] = _mm256_fmadd_ps(p2, _mm256_mul_ps(dw, _mm256_set1_ps(a.d2[ds])), c[r]);
                }
            }
        }
    }
    for (int r = 0; r < R; r++) acc[r] = _mm256_add_ps(_mm256_sub_ps(acc[r], am[r]), c[r]);
}

static int qv_linear(const void* x, int x_bf16, const uint8_t* w, const void* bias, void* y,
                     int out_f32, int64_t M, int64_t N, int64_t K) {
    const int64_t row_bytes = strata_quant_row_bytes(4, K);
    QiActs a;
    int8_t* buf = qi_acts_alloc(M, K, &a);
    if (!buf) return -3;
    // few rows: quantized before the parallel region, a barrier inside it costs more
    for (int64_t m = 0; m < M; m++) qi_quant_row(x, x_bf16, K, a, m);
#pragma omp parallel for schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += 8) {
        const uint8_t* wr[8];
        const int live = q_group8(w, row_bytes, n0, N, wr);
        // a later group into L2, a share of its lines each block: the hardware prefetcher
        // does not follow 8 rows read side by side as it follows one
        QPrefetch pf = q_prefetch(w, 8 * row_bytes, n0 / 8 + QV_AHEAD, N / 8, K / QBLOCK);
        __m256 acc[QV_MAX_ROWS];
        switch (M) {
            case 1: qv_rows8(wr, a, K, &pf, acc, 1); break;
            case 2: qv_rows8(wr, a, K, &pf, acc, 2); break;
            default: qv_rows8(wr, a, K, &pf, acc, QV_MAX_ROWS); break;
        }
        q_store8(y, out_f32, bias, x_bf16, N, n0, live, acc, M);
    }
    free(buf);
    return 0;
}

// With lw (a decode step's LoRA update; lora.h), each thread also updates its share of lw's
// groups of tokens in phases between its panels, warming their adapters during the panels'
// products, into delta [T, N] (added to y at the end): lin_packed's scheme (linear.h).
static int qi_linear(const void* x, int x_bf16, const uint8_t* w, const void* bias, void* y,
                     int out_f32, int64_t M, int64_t N, int64_t K, const LoRAUpdate* lw,
                     const LoRAGroups* groups, bf16_t* delta) {
    const int64_t nb = K / QBLOCK, row_bytes = strata_quant_row_bytes(4, K);
    const int64_t panels = N / QI_PANEL, blocks = (M + QI_MR - 1) / QI_MR;
    QiActs a;
    int8_t* q1 = qi_acts_alloc(M, K, &a);
    if (!q1) return -3;
    int failed = 0;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) qi_quant_row(x, x_bf16, K, a, m);
        // the panel's values, its scales and mins, and the register block's fp32 sums
        uint8_t* panel = aligned_alloc(
            64, (size_t)(QI_PANEL * K) + (size_t)(2 * QI_PANEL * nb + QI_MR * QI_PANEL) * sizeof(float));
        if (!panel) {
#pragma omp atomic write
            failed = 1;
        }
        float* pd = (float*)(panel + QI_PANEL * K);
        float* pm = pd + QI_PANEL * nb;
        float* out = pm + QI_PANEL * nb;
        const int64_t nth = omp_get_num_threads(), tid = omp_get_thread_num();
        const int64_t p0 = tid * panels / nth, p1 = (tid + 1) * panels / nth;
        const int64_t g0 = lw ? tid * groups->n / nth : 0;
        const int64_t g1 = lw ? (tid + 1) * groups->n / nth : 0;
        const int64_t phases = lora_phases(g0, g1);
        int64_t p = p0;
        for (int64_t ph = 0; panel && ph < phases; ph++) {
            const int64_t end = p0 + (ph + 1) * (p1 - p0) / phases;
            LoRAWarm warm;
            int64_t pg0, pg1;
            const int64_t lw_lines = lora_phase(lw, groups, g0, g1, ph, phases,
                                                (end - p) * blocks, &warm, &pg0, &pg1);
            for (; p < end; p++) {
                qi_unpack(w, row_bytes, K, p * QI_PANEL, panel, pd, pm);
                QPrefetch pf = q_prefetch(w, QI_PANEL * row_bytes, p + 1, p1, blocks);
                for (int64_t m0 = 0; m0 < M; m0 += QI_MR) {
                    const int R = M - m0 < QI_MR ? (int)(M - m0) : QI_MR;
                    q_prefetch_some(&pf);
                    for (int64_t l = 0; l < lw_lines; l++) lora_warm_one(&warm);
                    switch (R) {
                        case 1: qi_block(panel, pd, pm, a, m0, K, out, 1); break;
                        case 2: qi_block(panel, pd, pm, a, m0, K, out, 2); break;
#if QI_MR > 4
                        case 3: qi_block(panel, pd, pm, a, m0, K, out, 3); break;
                        case 4: qi_block(panel, pd, pm, a, m0, K, out, 4); break;
                        case 5: qi_block(panel, pd, pm, a, m0, K, out, 5); break;
                        case 6: qi_block(panel, pd, pm, a, m0, K, out, 6); break;
                        case 7: qi_block(panel, pd, pm, a, m0, K, out, 7); break;
#endif
                        default: qi_block(panel, pd, pm, a, m0, K, out, QI_MR); break;
                    }
                    for (int r = 0; r < R; r++)
                        for (int j = 0; j < QI_PANEL; j++) {
                            const int64_t n = p * QI_PANEL + j;
                            q_store(y, out_f32, (m0 + r) * N + n,
                                    out[r * QI_PANEL + j] + q_bias(bias, x_bf16, n));
                        }
                }
            }
            if (lw) lora_update_groups(lw, groups, pg0, pg1, delta);
        }
        free(panel);
        lora_finish(lw, lw, groups, g0, g1, delta);
    }
    free(q1);
    return failed ? -3 : 0;
}
#endif


#if defined(QI_AVX2) && !defined(STRATA_AVX512BF16)
// Many rows over q8 weights on AVX2 (the LM head of every quantized model), in panels: the
// activations in int16 as on the row-by-row path, and `vpmaddwd` pairs of inputs of 8
// weight rows at once, 16 products an instruction where an fp32 FMA does 8. Each thread
// widens a panel of 16 weight rows to int16, stored two inputs at a time ([K / 2][16][2]:
// one pair of inputs of the 16 rows in two vectors), with their scales [K / 32][16], and
// runs a QW_MR x 16 register block over it: int32 sums over a block's 16 pairs (at most
// 32 * 127 * 32767, no overflow), then scaled by d_w d_x into fp32. The 6 int32 sums, 6
// fp32 sums, 2 weight vectors and the broadcast pair take 15 of the 16 registers.
#define QW_PANEL 16
#define QW_MR 3
#define QW_MIN_ROWS 4

// the panel of q8 weight rows j0 .. j0 + 15: values as [K / 2][16][2] int16, scales [nb][16]
static void qw_unpack(const uint8_t* w, int64_t row_bytes, int64_t K, int64_t j0, int16_t* panel,
                      float* pd) {
    const int64_t nb = K / QBLOCK;
    for (int64_t b = 0; b < nb; b++) {
        for (int half = 0; half < 2; half++) {
            __m256i lo[8], hi[8];  // row j's pairs 0..7 and 8..15 of block b, 32 bits each
            for (int j = 0; j < 8; j++) {
                const __m256i raw = _mm256_loadu_si256(
                    (const __m256i*)(w + (j0 + half * 8 + j) * row_bytes + b * QBLOCK));
                lo[j] = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(raw));
                hi[j] = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(raw, 1));
            }
            qi_transpose8(lo);  // lo[g]: pair g of the 8 rows
            qi_transpose8(hi);
            for (int g = 0; g < 8; g++) {
                int16_t* at = panel + ((b * 16 + g) * QW_PANEL + half * 8) * 2;
                _mm256_store_si256((__m256i*)at, lo[g]);
                _mm256_store_si256((__m256i*)(at + 8 * QW_PANEL * 2), hi[g]);
            }
        }
        for (int j = 0; j < QW_PANEL; j++)
            pd[b * QW_PANEL + j] = ((const float*)(w + (j0 + j) * row_bytes + K))[b];
    }
}

// *s += p in int32, in place (see qi_add16)
static inline __attribute__((always_inline)) void qw_add32(__m256i* s, __m256i p) {
    __asm__("vpaddd %1, %0, %0" : "+x"(*s) : "x"(p));
}

// out[r][0..15] = the R activation rows from m0 (int16, scales xd) against the panel
static inline __attribute__((always_inline)) void qw_block(const int16_t* panel, const float* pd,
                                                          const int16_t* xq, const float* xd,
                                                          int64_t K, float* out, const int R) {
    const int64_t nb = K / QBLOCK;
    __m256 acc[QW_MR][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256i s[QW_MR][2];
        for (int r = 0; r < R; r++) s[r][0] = s[r][1] = _mm256_setzero_si256();
        const int16_t* wp = panel + b * QBLOCK * QW_PANEL;
        for (int g = 0; g < 16; g++) {
            const __m256i w0 = _mm256_load_si256((const __m256i*)(wp + g * 32));
            const __m256i w1 = _mm256_load_si256((const __m256i*)(wp + g * 32 + 16));
            for (int r = 0; r < R; r++) {
                int32_t pair;
                __builtin_memcpy(&pair, xq + r * K + b * QBLOCK + 2 * g, 4);
                const __m256i xb = _mm256_set1_epi32(pair);
                qw_add32(&s[r][0], _mm256_madd_epi16(w0, xb));
                qw_add32(&s[r][1], _mm256_madd_epi16(w1, xb));
            }
        }
        const __m256 dw0 = _mm256_loadu_ps(pd + b * QW_PANEL), dw1 = _mm256_loadu_ps(pd + b * QW_PANEL + 8);
        for (int r = 0; r < R; r++) {
            const __m256 d = _mm256_set1_ps(xd[r * nb + b]);
            acc[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r][0]), _mm256_mul_ps(dw0, d), acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r][1]), _mm256_mul_ps(dw1, d), acc[r][1]);
        }
    }
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(out + r * QW_PANEL, acc[r][0]);
        _mm256_storeu_ps(out + r * QW_PANEL + 8, acc[r][1]);
    }
}

static int qw_linear(const void* x, int x_bf16, const uint8_t* w, const void* bias, void* y,
                     int out_f32, int64_t M, int64_t N, int64_t K) {
    const int64_t nb = K / QBLOCK, row_bytes = strata_quant_row_bytes(8, K);
    const int64_t panels = N / QW_PANEL, elem = x_bf16 ? 2 : 4;
    int16_t* xq = malloc((size_t)(M * K * 2 + 2 * M * nb * (int64_t)sizeof(float)));
    if (!xq) return -3;
    float* xd = (float*)(xq + M * K);
    float* xs = xd + M * nb;
    int failed = 0;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++)
            quant_row((const char*)x + m * K * elem, x_bf16, K, xq + m * K, xd + m * nb, xs + m * nb);
        int16_t* panel = aligned_alloc(
            64, (size_t)(QW_PANEL * K) * 2 + (size_t)(QW_PANEL * nb + QW_MR * QW_PANEL) * sizeof(float));
        if (!panel) {
#pragma omp atomic write
            failed = 1;
        }
        float* pd = (float*)(panel + QW_PANEL * K);
        float* out = pd + QW_PANEL * nb;
        const int64_t nth = omp_get_num_threads(), tid = omp_get_thread_num();
        const int64_t p1 = (tid + 1) * panels / nth, blocks = (M + QW_MR - 1) / QW_MR;
        for (int64_t p = tid * panels / nth; panel && p < p1; p++) {
            qw_unpack(w, row_bytes, K, p * QW_PANEL, panel, pd);
            QPrefetch pf = q_prefetch(w, QW_PANEL * row_bytes, p + 1, p1, blocks);
            for (int64_t m0 = 0; m0 < M; m0 += QW_MR) {
                const int R = M - m0 < QW_MR ? (int)(M - m0) : QW_MR;
                q_prefetch_some(&pf);
                const int16_t* xm = xq + m0 * K;
                const float* dm = xd + m0 * nb;
                switch (R) {
                    case 1: qw_block(panel, pd, xm, dm, K, out, 1); break;
                    case 2: qw_block(panel, pd, xm, dm, K, out, 2); break;
                    default: qw_block(panel, pd, xm, dm, K, out, QW_MR); break;
                }
                for (int r = 0; r < R; r++)
                    for (int j = 0; j < QW_PANEL; j++) {
                        const int64_t n = p * QW_PANEL + j;
                        q_store(y, out_f32, (m0 + r) * N + n,
                                out[r * QW_PANEL + j] + q_bias(bias, x_bf16, n));
                    }
            }
        }
        free(panel);
    }
    free(xq);
    return failed ? -3 : 0;
}

// Few rows over q8 weights (the LM head at decode), as qv_linear does for q4: 8 weight rows
// at a time, a block at a time, each row's int32 block sum (`vpmaddwd` of its widened
// values and the int16 activations, summed across) one lane of a vector, then scaled in
// qw_block's order and arithmetic, so that a row gets the panels' bits.
#define QW_MAX_ROWS (QW_MIN_ROWS - 1)

// the block sums of 8 q8 weight rows (wr[j] + off: block b's values) against R int16
// activation rows at xq (stride K), lane j being row j's
static inline __attribute__((always_inline)) void qr_sums8(const uint8_t* const wr[8], int64_t off,
                                                          const int16_t* xq, int64_t K,
                                                          __m256 out[], const int R) {
    __m256i h[QW_MAX_ROWS][4];
    for (int j = 0; j < 8; j += 2) {
        __m256i lo[2], hi[2];
        for (int i = 0; i < 2; i++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i*)(wr[j + i] + off));
            lo[i] = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(raw));
            hi[i] = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(raw, 1));
        }
        for (int r = 0; r < R; r++) {
            const __m256i x0 = _mm256_loadu_si256((const __m256i*)(xq + r * K));
            const __m256i x1 = _mm256_loadu_si256((const __m256i*)(xq + r * K + 16));
            const __m256i p0 = _mm256_add_epi32(_mm256_madd_epi16(lo[0], x0), _mm256_madd_epi16(hi[0], x1));
            const __m256i p1 = _mm256_add_epi32(_mm256_madd_epi16(lo[1], x0), _mm256_madd_epi16(hi[1], x1));
            h[r][j / 2] = _mm256_hadd_epi32(p0, p1);
        }
    }
    for (int r = 0; r < R; r++) out[r] = q_across8(h[r]);
}

static inline __attribute__((always_inline)) void qr_rows8(const uint8_t* const wr[8],
                                                          const int16_t* xq, const float* xd,
                                                          int64_t K, QPrefetch* pf, __m256 acc[],
                                                          const int R) {
    const int64_t nb = K / QBLOCK;
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b0 = 0; b0 < nb; b0 += 8) {
        const int live = nb - b0 < 8 ? (int)(nb - b0) : 8;
        __m256i dt[8];
        q_scales8(wr, K, b0, live, dt);
        for (int i = 0; i < live; i++) {
            const int64_t b = b0 + i;
            q_prefetch_some(pf);
            const __m256 dw = _mm256_castsi256_ps(dt[i]);
            __m256 p[QW_MAX_ROWS];
            qr_sums8(wr, b * QBLOCK, xq + b * QBLOCK, K, p, R);
            for (int r = 0; r < R; r++)
                acc[r] = _mm256_fmadd_ps(p[r], _mm256_mul_ps(dw, _mm256_set1_ps(xd[r * nb + b])), acc[r]);
        }
    }
}

static int qr_linear(const void* x, int x_bf16, const uint8_t* w, const void* bias, void* y,
                     int out_f32, int64_t M, int64_t N, int64_t K) {
    const int64_t nb = K / QBLOCK, row_bytes = strata_quant_row_bytes(8, K);
    int16_t* xq = malloc((size_t)(M * K * 2 + 2 * M * nb * (int64_t)sizeof(float)));
    if (!xq) return -3;
    float* xd = (float*)(xq + M * K);
    float* xs = xd + M * nb;
    for (int64_t m = 0; m < M; m++)  // few rows: before the parallel region
        quant_row((const char*)x + m * K * (x_bf16 ? 2 : 4), x_bf16, K, xq + m * K, xd + m * nb,
                  xs + m * nb);
#pragma omp parallel for schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += 8) {
        const uint8_t* wr[8];
        const int live = q_group8(w, row_bytes, n0, N, wr);
        QPrefetch pf = q_prefetch(w, 8 * row_bytes, n0 / 8 + QV_AHEAD, N / 8, nb);  // as in qv
        __m256 acc[QW_MAX_ROWS];
        switch (M) {
            case 1: qr_rows8(wr, xq, xd, K, &pf, acc, 1); break;
            case 2: qr_rows8(wr, xq, xd, K, &pf, acc, 2); break;
            default: qr_rows8(wr, xq, xd, K, &pf, acc, QW_MAX_ROWS); break;
        }
        q_store8(y, out_f32, bias, x_bf16, N, n0, live, acc, M);
    }
    free(xq);
    return 0;
}
#endif

int strata_quant_path(int64_t format, int x_bf16, int64_t M, int64_t N) {
#ifdef STRATA_AVX512BF16
    // bf16 activations keep every value to 8 significant bits where int8 ones keep a block's
    // largest: with bf16 dot products at hand, prompts keep them (8-bit prompt products
    // flipped a greedy answer of the default model)
    if (x_bf16 && M >= QG_MIN_ROWS && N % QG_PANEL == 0) return QPATH_BF16_PANELS;
#endif
#ifdef QI_AVX2
#if defined(QI_VNNI) || !defined(STRATA_AVX512BF16)
    if (format == 4 && M >= QI_MIN_ROWS && N % QI_PANEL == 0) return QPATH_INT8;
#endif
    if (format == 4 && M <= QV_MAX_ROWS) return QPATH_INT8_ROWS;
#endif
#if defined(QI_AVX2) && !defined(STRATA_AVX512BF16)
    if (format == 8 && M >= QW_MIN_ROWS && N % QW_PANEL == 0) return QPATH_INT16_PANELS;
    if (format == 8 && M <= QW_MAX_ROWS) return QPATH_INT16_ROWS;
#endif
    (void)format, (void)x_bf16, (void)M, (void)N;
    return QPATH_INT16;
}

int strata_quant_linear(int64_t format, const void* x, int x_bf16, const uint8_t* w,
                        const void* bias, void* y, int out_f32, int64_t M, int64_t N, int64_t K) {
    if (K % QBLOCK || M < 1 || N < 1 || (format != 8 && format != 4)) return -1;
    switch (strata_quant_path(format, x_bf16, M, N)) {
#ifdef STRATA_AVX512BF16
        case QPATH_BF16_PANELS: return qg_linear(format, x, w, bias, y, out_f32, M, N, K);
#endif
#ifdef QI_AVX2
        case QPATH_INT8: return qi_linear(x, x_bf16, w, bias, y, out_f32, M, N, K, 0, 0, 0);
        case QPATH_INT8_ROWS: return qv_linear(x, x_bf16, w, bias, y, out_f32, M, N, K);
#endif
#if defined(QI_AVX2) && !defined(STRATA_AVX512BF16)
        case QPATH_INT16_PANELS: return qw_linear(x, x_bf16, w, bias, y, out_f32, M, N, K);
        case QPATH_INT16_ROWS: return qr_linear(x, x_bf16, w, bias, y, out_f32, M, N, K);
#endif
        default: break;
    }
    const int64_t nb = K / QBLOCK, row_bytes = strata_quant_row_bytes(format, K);
    // activation rows, quantized: xq [M, K] int16, then xd and xs [M, nb]
    int16_t* xq = malloc((size_t)(M * K * 2 + 2 * M * nb * (int64_t)sizeof(float)));
    if (!xq) return -3;
    float* xd = (float*)(xq + M * K);
    float* xs = xd + M * nb;
    const int64_t elem = x_bf16 ? 2 : 4;
    // a few rows (decode) are quantized before the parallel region: a barrier inside it
    // costs more than they do, and far more when the threads share their cores
    const int serial = M <= Q_SERIAL_ROWS;
    for (int64_t m = 0; serial && m < M; m++)
        quant_row((const char*)x + m * K * elem, x_bf16, K, xq + m * K, xd + m * nb, xs + m * nb);
#pragma omp parallel
    {
        if (!serial) {
#pragma omp for schedule(static)
            for (int64_t m = 0; m < M; m++)
                quant_row((const char*)x + m * K * elem, x_bf16, K, xq + m * K, xd + m * nb,
                          xs + m * nb);
        }
        const int64_t nth = omp_get_num_threads(), tid = omp_get_thread_num();
        const int64_t n0 = tid * N / nth, n1 = (tid + 1) * N / nth;
        for (int64_t nc = n0; nc < n1; nc += Q_NCHUNK) {
            const int64_t nc1 = nc + Q_NCHUNK < n1 ? nc + Q_NCHUNK : n1;
            for (int64_t m0 = 0; m0 < M; m0 += Q_ROWS) {
                const int64_t mr = M - m0 < Q_ROWS ? M - m0 : Q_ROWS;
                const int16_t* xqm = xq + m0 * K;
                const float* xdm = xd + m0 * nb;
                for (int64_t n = nc; n < nc1; n++) {
                    const uint8_t* wr = w + n * row_bytes;
                    // the row 8 ahead, from memory into L2 while these are multiplied: the
                    // hardware prefetcher alone left the LM head at batch 1 at half the
                    // memory's bandwidth
                    for (int64_t c = 0; m0 == 0 && n + 8 < n1 && c < row_bytes; c += 64)
                        __builtin_prefetch(wr + 8 * row_bytes + c, 0, 2);
                    float sums[Q_ROWS];
#define Q_CASE(F, R) q_rows(F, wr, xqm, xdm, K, sums, R)
                    if (format == 8) {
                        switch (mr) {
                            case 1: Q_CASE(8, 1); break;
                            case 2: Q_CASE(8, 2); break;
                            case 3: Q_CASE(8, 3); break;
                            default: Q_CASE(8, 4); break;
                        }
                    } else {
                        switch (mr) {
                            case 1: Q_CASE(4, 1); break;
                            case 2: Q_CASE(4, 2); break;
                            case 3: Q_CASE(4, 3); break;
                            default: Q_CASE(4, 4); break;
                        }
                    }
#undef Q_CASE
                    const float* mins = format == 4 ? (const float*)(wr + K / 2) + nb : 0;
                    const float b = q_bias(bias, x_bf16, n);
                    for (int64_t r = 0; r < mr; r++) {
                        float v = sums[r];
                        if (mins) v -= dot_f32(mins, xs + (m0 + r) * nb, nb);
                        q_store(y, out_f32, (m0 + r) * N + n, v + b);
                    }
                }
            }
        }
    }
    free(xq);
    return 0;
}

int strata_quant_linear_lora(int64_t format, const void* x, const uint8_t* w, const void* bias,
                             void* y, int64_t M, int64_t N, int64_t K,
                             const struct LoRAUpdate* lora) {
#ifdef QI_AVX2
    if (K % QBLOCK == 0 && M >= 1 && lora->T <= LORA_WARM_MAX_TOKENS &&
        strata_quant_path(format, 1, M, N) == QPATH_INT8) {
        const LoRAGroups groups = lora_groups(lora->slots, lora->T);
        if (groups.n < 0) return -3;
        bf16_t* delta = malloc((size_t)(lora->T * lora->N) * sizeof(bf16_t));
        const int rc =
            delta ? qi_linear(x, 1, w, bias, y, 0, M, N, K, lora, &groups, delta) : -3;
        free(delta);
        free(groups.tok);
        return rc;
    }
#endif
    (void)format, (void)x, (void)w, (void)bias, (void)y, (void)M, (void)N, (void)K, (void)lora;
    return -1;
}
