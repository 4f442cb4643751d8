// fp32 linear on packed weights: y[M, N] = x[M, K] @ w[N, K]^T (+ bias).
//
// The fp32 counterpart of linear.h, for models served in fp32. `strata_pack_f32` rewrites w
// once, at load time, into panels of 64 output columns: wp[N/64][K][64]. The microkernel keeps
// a 6 x 64 block of y in 24 registers, broadcasts one x value per row and issues FMAs against
// four contiguous weight vectors, so each panel streams through memory once per 6 rows. In a
// decode step (M = 1) that is a sequential read of every weight at memory bandwidth, where a
// general GEMM library's row-major GEMV reaches a third of it on this class of machine.
// On AVX2 (16 registers of 8 floats) a block is 6 rows x 16 columns in 12 registers (1 x 64 or
// 2 x 32 for fewer rows), and a panel is read in 64 / width passes over its own cache lines.
// Returns -1 where it does not apply (neither AVX-512 nor AVX2, N % 64) and the caller uses
// torch instead.

#include "linear_f32_block.h"

int strata_linear_packable_f32(int64_t n, int64_t k) {
#ifdef STRATA_VEC
    return n % LINF_PANEL == 0 && k > 0;
#else
    (void)n, (void)k;
    return 0;
#endif
}

void strata_pack_f32(const float* w, float* wp, int64_t N, int64_t K) {
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < N / LINF_PANEL; p++)
        for (int64_t k = 0; k < K; k++)
            for (int64_t j = 0; j < LINF_PANEL; j++)
                wp[(p * K + k) * LINF_PANEL + j] = w[(p * LINF_PANEL + j) * K + k];
}

int strata_linear_packed_f32(const float* x, const float* wp, const float* bias, float* y,
                             int64_t M, int64_t N, int64_t K) {
#ifndef STRATA_VEC
    (void)x, (void)wp, (void)bias, (void)y, (void)M, (void)N, (void)K;
    return -1;
#else
    if (!strata_linear_packable_f32(N, K) || M < 1) return -1;
    const int64_t panels = N / LINF_PANEL;
    const int64_t blocks = (M + LINF_MR - 1) / LINF_MR;
    // panel-major items: a thread's consecutive items reuse one panel from cache
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        for (int64_t blk = 0; blk < blocks; blk++) {
            const int64_t m0 = blk * LINF_MR;
            const int64_t mr = M - m0 < LINF_MR ? M - m0 : LINF_MR;
            const float* xs = x + m0 * K;
            const float* panel = wp + p * K * LINF_PANEL;
            const float* bs = bias ? bias + p * LINF_PANEL : 0;
            float* ys = y + m0 * N + p * LINF_PANEL;
            linf_rows(xs, panel, bs, ys, K, N, mr);
        }
    }
    return 0;
#endif
}
