// The fp32 microkernel of linear_f32.h (and of linear.h's widened path on AVX2): an MR x 64
// block of y = x @ panel (+ bias), panel [K][64] fp32, y's rows N apart. See linear_f32.h.
#pragma once

#define LINF_PANEL 64
#define LINF_MR 6

#ifdef STRATA_AVX512
static inline __attribute__((always_inline)) void linf_block(const float* x, const float* panel,
                                                            const float* bias, float* y,
                                                            int64_t K, int64_t N, const int MR) {
    __m512 acc[LINF_MR][4];
    for (int r = 0; r < MR; r++)
        for (int i = 0; i < 4; i++) acc[r][i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        const float* wk = panel + k * LINF_PANEL;
        const __m512 w0 = _mm512_loadu_ps(wk);
        const __m512 w1 = _mm512_loadu_ps(wk + 16);
        const __m512 w2 = _mm512_loadu_ps(wk + 32);
        const __m512 w3 = _mm512_loadu_ps(wk + 48);
        for (int r = 0; r < MR; r++) {
            const __m512 xb = _mm512_set1_ps(x[r * K + k]);
            acc[r][0] = _mm512_fmadd_ps(xb, w0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(xb, w1, acc[r][1]);
            acc[r][2] = _mm512_fmadd_ps(xb, w2, acc[r][2]);
            acc[r][3] = _mm512_fmadd_ps(xb, w3, acc[r][3]);
        }
    }
    for (int i = 0; i < 4; i++) {
        const __m512 b = bias ? _mm512_loadu_ps(bias + 16 * i) : _mm512_setzero_ps();
        for (int r = 0; r < MR; r++)
            _mm512_storeu_ps(y + r * N + 16 * i, _mm512_add_ps(acc[r][i], b));
    }
}
#endif

#ifdef STRATA_AVX2
static inline __attribute__((always_inline)) void linf_block(const float* x, const float* panel,
                                                            const float* bias, float* y,
                                                            int64_t K, int64_t N, const int MR) {
    const int NG = MR == 1 ? 8 : MR == 2 ? 4 : 2;
    for (int ps = 0; ps < 8 / NG; ps++) {
        const int64_t col0 = ps * NG * 8;
        __m256 acc[LINF_MR][8];
        for (int r = 0; r < MR; r++)
            for (int g = 0; g < NG; g++) acc[r][g] = _mm256_setzero_ps();
        for (int64_t k = 0; k < K; k++) {
            const float* wk = panel + k * LINF_PANEL + col0;
            if (MR <= 2) {
                __m256 xb[LINF_MR];
                for (int r = 0; r < MR; r++) xb[r] = _mm256_broadcast_ss(x + r * K + k);
                for (int g = 0; g < NG; g++) {
                    const __m256 w = _mm256_loadu_ps(wk + 8 * g);
                    for (int r = 0; r < MR; r++) acc[r][g] = _mm256_fmadd_ps(xb[r], w, acc[r][g]);
                }
            } else {
                const __m256 w0 = _mm256_loadu_ps(wk), w1 = _mm256_loadu_ps(wk + 8);
                for (int r = 0; r < MR; r++) {
                    const __m256 xb = _mm256_broadcast_ss(x + r * K + k);
                    acc[r][0] = _mm256_fmadd_ps(xb, w0, acc[r][0]);
                    acc[r][1] = _mm256_fmadd_ps(xb, w1, acc[r][1]);
                }
            }
        }
        for (int g = 0; g < NG; g++) {
            const __m256 b = bias ? _mm256_loadu_ps(bias + col0 + 8 * g) : _mm256_setzero_ps();
            for (int r = 0; r < MR; r++)
                _mm256_storeu_ps(y + r * N + col0 + 8 * g, _mm256_add_ps(acc[r][g], b));
        }
    }
}
#endif

#ifdef STRATA_VEC
// linf_block for a block of mr (1 to LINF_MR) rows: each row count is its own unrolled copy.
static inline void linf_rows(const float* x, const float* panel, const float* bias, float* y,
                             int64_t K, int64_t ld, int64_t mr) {
    switch (mr) {
        case 1: linf_block(x, panel, bias, y, K, ld, 1); break;
        case 2: linf_block(x, panel, bias, y, K, ld, 2); break;
        case 3: linf_block(x, panel, bias, y, K, ld, 3); break;
        case 4: linf_block(x, panel, bias, y, K, ld, 4); break;
        case 5: linf_block(x, panel, bias, y, K, ld, 5); break;
        default: linf_block(x, panel, bias, y, K, ld, LINF_MR); break;
    }
}
#endif
