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
            for (int64_t m0 = 0; m0 < M; m0 += QG_MR) {
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


int strata_quant_linear(int64_t format, const void* x, int x_bf16, const uint8_t* w,
                        const void* bias, void* y, int out_f32, int64_t M, int64_t N, int64_t K) {
    if (K % QBLOCK || M < 1 || N < 1 || (format != 8 && format != 4)) return -1;
#ifdef STRATA_AVX512BF16
    if (x_bf16 && M >= QG_MIN_ROWS && N % QG_PANEL == 0)
        return qg_linear(format, x, w, bias, y, out_f32, M, N, K);
#endif
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
                    const float b = !bias ? 0.0f
                                    : x_bf16 ? bf16_to_f32(((const bf16_t*)bias)[n])
                                             : ((const float*)bias)[n];
                    for (int64_t r = 0; r < mr; r++) {
                        float v = sums[r];
                        if (mins) v -= dot_f32(mins, xs + (m0 + r) * nb, nb);
                        v += b;
                        const int64_t at = (m0 + r) * N + n;
                        if (out_f32)
                            ((float*)y)[at] = v;
                        else
                            ((bf16_t*)y)[at] = f32_to_bf16(v);
                    }
                }
            }
        }
    }
    free(xq);
    return 0;
}
