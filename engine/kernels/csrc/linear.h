// bf16 linear on packed weights: y[M, N] = x[M, K] @ w[N, K]^T (+ bias), fp32 accumulation.
//
// `strata_pack_bf16` rewrites w once, at load time, into panels of 64 output columns whose
// k-pairs are interleaved: wp[N/64][K/2][64][2]. The microkernel then keeps a 6 x 64 block of
// y in 24 registers, broadcasts one k-pair of x per row and issues AVX512-BF16 dot products
// against four contiguous weight vectors: no horizontal sums, and each panel streams through
// memory exactly once per 6 rows. The same kernel serves decode (M = 1: weight streaming at
// memory bandwidth) and prefill (M in the thousands: close to the dot-product peak).
//
// AVX2 has no bf16 dot product and 16 vector registers. Its microkernel reads the same
// panels: one 256-bit load holds a k-pair of 8 columns, and a shift (the even k) and a mask
// (the odd k) widen it to two fp32 vectors for two FMAs. The rows of x are widened to fp32
// once per LIN2_KC k-pairs into a buffer that the FMAs broadcast from. A block of y is 4 rows
// x 16 columns in 8 registers (2 x 32 or 1 x 64 for fewer rows: 8 accumulators either way),
// so a panel is read in 64 / width passes, each pass over its own cache lines. From
// LIN2_WIDE_ROWS rows on, panels are widened to fp32 once and run linear_f32.h's block
// (lin_widened, below).
// Returns -1 where it does not apply (neither AVX512-BF16 nor AVX2, N % 64 or K % 2) and the
// caller uses torch instead.

#define LIN_PANEL 64
#if defined(STRATA_AVX512BF16)
#define LIN_MR 6
#define STRATA_LIN_BF16 1
#elif defined(STRATA_AVX2)
#define LIN_MR 4
#define LIN2_KC 256
#define STRATA_LIN_BF16 1
#endif
#define LIN_WARM_BLOCKS 4

int strata_linear_packable_bf16(int64_t n, int64_t k) {
#ifdef STRATA_LIN_BF16
    return n % LIN_PANEL == 0 && k % 2 == 0;
#else
    (void)n, (void)k;
    return 0;
#endif
}

void strata_pack_bf16(const bf16_t* w, bf16_t* wp, int64_t N, int64_t K) {
    const int64_t pairs = K / 2;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < N / LIN_PANEL; p++)
        for (int64_t kk = 0; kk < pairs; kk++)
            for (int64_t j = 0; j < LIN_PANEL; j++) {
                const bf16_t* src = w + (p * LIN_PANEL + j) * K + 2 * kk;
                bf16_t* dst = wp + ((p * pairs + kk) * LIN_PANEL + j) * 2;
                dst[0] = src[0];
                dst[1] = src[1];
            }
}

#ifdef STRATA_AVX512BF16
static inline __attribute__((always_inline)) void lin_block(const bf16_t* x, const bf16_t* panel,
                                                           const bf16_t* bias, void* y,
                                                           int64_t K, int64_t N, int out_f32,
                                                           const char* warm, int64_t warm_lines,
                                                           LoRAWarm* lw, int64_t lw_lines,
                                                           const int MR) {
    __m512 acc[LIN_MR][4];
    for (int r = 0; r < MR; r++)
        for (int i = 0; i < 4; i++) acc[r][i] = _mm512_setzero_ps();
    const int32_t* xp = (const int32_t*)x;  // k-pairs of x as 32-bit words
    const int64_t pairs = K / 2;
    int64_t warm_err = 0, lw_err = 0;
    for (int64_t kk = 0; kk < pairs; kk++) {
        // spread `warm_lines` L2 prefetches (and the `lw_lines` adapter lines in lw) over the
        // k loop
        for (warm_err += warm_lines; warm_err >= pairs; warm_err -= pairs, warm += 64)
            __builtin_prefetch(warm, 0, 2);
        for (lw_err += lw_lines; lw_err >= pairs; lw_err -= pairs) lora_warm_one(lw);
        const bf16_t* wk = panel + kk * 2 * LIN_PANEL;
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
        const __m512 b = bias ? v_load_bf16(bias + 16 * i) : _mm512_setzero_ps();
        for (int r = 0; r < MR; r++) {
            const __m512 v = _mm512_add_ps(acc[r][i], b);
            if (out_f32)
                _mm512_storeu_ps((float*)y + r * N + 16 * i, v);
            else
                v_store_bf16((bf16_t*)y + r * N + 16 * i, v);
        }
    }
}
#endif

#ifdef STRATA_AVX2
// MR rows of x against one panel (y and bias at the panel's first column), in passes of
// 8 NG columns: NG = 8, 4, 2 for 1, 2, 3-4 rows.
static inline __attribute__((always_inline)) void lin_block(const bf16_t* x, const bf16_t* panel,
                                                           const bf16_t* bias, void* y,
                                                           int64_t K, int64_t N, int out_f32,
                                                           const char* warm, int64_t warm_lines,
                                                           LoRAWarm* lw, int64_t lw_lines,
                                                           const int MR) {
    const int NG = MR == 1 ? 8 : MR == 2 ? 4 : 2;
    const int passes = 8 / NG;
    const int64_t pairs = K / 2, steps = pairs * passes;
    float xw[LIN_MR][2 * LIN2_KC] __attribute__((aligned(32)));
    const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
    int64_t warm_err = 0, lw_err = 0;
    for (int ps = 0; ps < passes; ps++) {
        const int64_t col0 = ps * NG * 8;
        __m256 acc[LIN_MR][8];
        for (int r = 0; r < MR; r++)
            for (int g = 0; g < NG; g++) acc[r][g] = _mm256_setzero_ps();
        for (int64_t k0 = 0; k0 < pairs; k0 += LIN2_KC) {
            const int64_t kn = pairs - k0 < LIN2_KC ? pairs - k0 : LIN2_KC;
            for (int r = 0; r < MR; r++) {
                const bf16_t* xr = x + r * K + 2 * k0;
                int64_t i = 0;
                for (; i + 8 <= 2 * kn; i += 8) _mm256_store_ps(&xw[r][i], v8_load_bf16(xr + i));
                for (; i < 2 * kn; i++) xw[r][i] = bf16_to_f32(xr[i]);
            }
            for (int64_t kk = 0; kk < kn; kk++) {
                // the panel warm and the adapter lines, spread over every pass's k loop
                for (warm_err += warm_lines; warm_err >= steps; warm_err -= steps, warm += 64)
                    __builtin_prefetch(warm, 0, 2);
                for (lw_err += lw_lines; lw_err >= steps; lw_err -= steps) lora_warm_one(lw);
                const bf16_t* wk = panel + ((k0 + kk) * LIN_PANEL + col0) * 2;
                if (MR <= 2) {  // columns outer: 2 weight and 2 MR broadcast registers
                    __m256 xe[LIN_MR], xo[LIN_MR];
                    for (int r = 0; r < MR; r++) {
                        xe[r] = _mm256_broadcast_ss(&xw[r][2 * kk]);
                        xo[r] = _mm256_broadcast_ss(&xw[r][2 * kk + 1]);
                    }
                    for (int g = 0; g < NG; g++) {
                        const __m256i raw = _mm256_loadu_si256((const __m256i*)(wk + 16 * g));
                        const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
                        const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(raw, hi));
                        for (int r = 0; r < MR; r++) {
                            acc[r][g] = _mm256_fmadd_ps(xe[r], we, acc[r][g]);
                            acc[r][g] = _mm256_fmadd_ps(xo[r], wo, acc[r][g]);
                        }
                    }
                } else {  // rows outer: 2 NG weight and 2 broadcast registers
                    __m256 we[8], wo[8];
                    for (int g = 0; g < NG; g++) {
                        const __m256i raw = _mm256_loadu_si256((const __m256i*)(wk + 16 * g));
                        we[g] = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
                        wo[g] = _mm256_castsi256_ps(_mm256_and_si256(raw, hi));
                    }
                    for (int r = 0; r < MR; r++) {
                        const __m256 xe = _mm256_broadcast_ss(&xw[r][2 * kk]);
                        const __m256 xo = _mm256_broadcast_ss(&xw[r][2 * kk + 1]);
                        for (int g = 0; g < NG; g++) {
                            acc[r][g] = _mm256_fmadd_ps(xe, we[g], acc[r][g]);
                            acc[r][g] = _mm256_fmadd_ps(xo, wo[g], acc[r][g]);
                        }
                    }
                }
            }
        }
        for (int g = 0; g < NG; g++) {
            const int64_t c = col0 + 8 * g;
            const __m256 b = bias ? v8_load_bf16(bias + c) : _mm256_setzero_ps();
            for (int r = 0; r < MR; r++) {
                const __m256 v = _mm256_add_ps(acc[r][g], b);
                if (out_f32)
                    _mm256_storeu_ps((float*)y + r * N + c, v);
                else
                    v8_store_bf16((bf16_t*)y + r * N + c, v);
            }
        }
    }
}
#endif

#ifdef STRATA_AVX2
// Several rows on AVX2 (LIN2_WIDE_ROWS or more): each panel is widened to fp32 once, into a
// buffer of the thread's in linear_f32.h's panel layout ([K][64]), and every block of LINF_MR
// rows of x (widened once too) runs the fp32 microkernel on it: 12 independent accumulators and
// no widening in the loop, where lin_block's 8 accumulators each take two dependent FMAs per
// k-pair, and each pass of a block widens the panel again. The sums are lin_block's, in the
// same order, so the results are the same bits. Measured on weights streamed from memory, a
// 4-row product is faster this way and a 2-row one is not. A decode step's LoRA update runs
// in phases between its items, as in lin_packed; their adapter lines are warmed before each
// item rather than within it.
#define LIN2_WIDE_ROWS 4

static void lin_widen_panel(const bf16_t* src, float* dst, int64_t K) {
    const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
    for (int64_t kk = 0; kk < K / 2; kk++)
        for (int j = 0; j < LIN_PANEL; j += 8) {
            const __m256i raw = _mm256_loadu_si256((const __m256i*)(src + (kk * LIN_PANEL + j) * 2));
            _mm256_storeu_ps(dst + 2 * kk * LIN_PANEL + j,
                             _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16)));
            _mm256_storeu_ps(dst + (2 * kk + 1) * LIN_PANEL + j,
                             _mm256_castsi256_ps(_mm256_and_si256(raw, hi)));
        }
}

static int lin_widened(const bf16_t* x, const bf16_t* wp, const bf16_t* bias, void* y, int64_t M,
                       int64_t N, int64_t K, int out_f32, const LoRAUpdate* lora,
                       const LoRAUpdate* lw, LoRAGroups* groups, bf16_t* delta) {
    const int64_t panels = N / LIN_PANEL, blocks = (M + LINF_MR - 1) / LINF_MR;
    const int64_t items = panels * blocks;
    float* xf = malloc((size_t)(M * K) * sizeof(float));
    if (!xf) return -3;
    int failed = 0;
#pragma omp parallel
    {
        const int64_t nth = omp_get_num_threads(), tid = omp_get_thread_num();
        const int64_t i0 = tid * items / nth, i1 = (tid + 1) * items / nth;
        const int64_t g0 = lw ? tid * groups->n / nth : 0;
        const int64_t g1 = lw ? (tid + 1) * groups->n / nth : 0;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < M; r++) {
            const bf16_t* xr = x + r * K;
            float* fr = xf + r * K;
            int64_t i = 0;
            for (; i + 8 <= K; i += 8) _mm256_storeu_ps(fr + i, v8_load_bf16(xr + i));
            for (; i < K; i++) fr[i] = bf16_to_f32(xr[i]);
        }
        float* panel = aligned_alloc(64, (size_t)(K * LIN_PANEL) * sizeof(float));
        if (!panel) {
#pragma omp atomic write
            failed = 1;
        } else {
            float tile[LINF_MR * LIN_PANEL] __attribute__((aligned(32)));
            float bw[LIN_PANEL];
            int64_t have = -1, item = i0;
            const int64_t phases = lora_phases(g0, g1);
            for (int64_t ph = 0; ph < phases; ph++) {  // as lin_packed's phases
                const int64_t end = i0 + (ph + 1) * (i1 - i0) / phases;
                LoRAWarm warm;
                int64_t pg0, pg1;
                const int64_t lw_lines =
                    lora_phase(lw, groups, g0, g1, ph, phases, end - item, &warm, &pg0, &pg1);
                for (; item < end; item++) {
                    const int64_t p = item / blocks, blk = item % blocks;
                    if (p != have) {
                        lin_widen_panel(wp + p * K * LIN_PANEL, panel, K);
                        for (int j = 0; bias && j < LIN_PANEL; j++)
                            bw[j] = bf16_to_f32(bias[p * LIN_PANEL + j]);
                        have = p;
                    }
                    for (int64_t l = 0; l < lw_lines; l++) lora_warm_one(&warm);
                    const int64_t m0 = blk * LINF_MR;
                    const int64_t mr = M - m0 < LINF_MR ? M - m0 : LINF_MR;
                    const float* xs = xf + m0 * K;
                    const float* bs = bias ? bw : 0;
                    float* ys = out_f32 ? (float*)y + m0 * N + p * LIN_PANEL : tile;
                    const int64_t ld = out_f32 ? N : LIN_PANEL;
                    linf_rows(xs, panel, bs, ys, K, ld, mr);
                    if (!out_f32)
                        for (int64_t r = 0; r < mr; r++)
                            for (int j = 0; j < LIN_PANEL; j += 8)
                                v8_store_bf16((bf16_t*)y + (m0 + r) * N + p * LIN_PANEL + j,
                                              _mm256_load_ps(tile + r * LIN_PANEL + j));
                }
                if (lw) lora_update_groups(lw, groups, pg0, pg1, delta);
            }
            free(panel);
        }
        lora_finish(lora, lw, groups, g0, g1, delta);
    }
    free(xf);
    return failed ? -3 : 0;
}
#endif

// The product, then `lora`'s update of its output (lora.h; NULL: none) in the same parallel
// region. In a decode step (T <= LORA_WARM_MAX_TOKENS) each thread owns a share of the update's
// groups of tokens and splits them into phases, as it splits its items of the product
// (lora_phase): during a phase's items it warms the phase's adapters, then updates those groups
// into a scratch delta while the weights are still in its cache (warmed for the whole linear
// and applied after it, they spilled out of the core's cache and were read again from L3 or
// DRAM); the deltas are added to y once every thread's share of the product is done. The AVX2
// widened path (lin_widened) does the same between its items.

static int lin_packed(const bf16_t* x, const bf16_t* wp, const bf16_t* bias, void* y, int64_t M,
                      int64_t N, int64_t K, int out_f32, const LoRAUpdate* lora) {
#ifndef STRATA_LIN_BF16
    (void)x, (void)wp, (void)bias, (void)y, (void)M, (void)N, (void)K, (void)out_f32, (void)lora;
    return -1;
#else
    if (!strata_linear_packable_bf16(N, K) || M < 1) return -1;
    const int64_t panels = N / LIN_PANEL;
    const int64_t blocks = (M + LIN_MR - 1) / LIN_MR;
    const size_t elem = out_f32 ? sizeof(float) : sizeof(bf16_t);
    // Panel-major items: a thread's consecutive items reuse the same panel from cache, and
    // while it works through one panel's row blocks it prefetches the next panel (its next
    // items), a slice per block, so that weights stream from DRAM during the arithmetic.
    // Below LIN_WARM_BLOCKS blocks the product is bound by the weight stream itself, which
    // the hardware prefetcher already follows (measured: warming there costs ~10%).
    const int64_t panel_lines = K * LIN_PANEL * (int64_t)sizeof(bf16_t) / 64;
    const int64_t slice = (panel_lines + blocks - 1) / blocks;
    const int64_t items = panels * blocks;
    const LoRAUpdate* lw =
        lora && lora->T <= LORA_WARM_MAX_TOKENS && blocks >= LIN_WARM_BLOCKS ? lora : 0;
    LoRAGroups groups = {0, 0, 0};
    if (lora && (groups = lora_groups(lora->slots, lora->T)).n < 0) return -3;
    bf16_t* delta = lw ? malloc((size_t)(lw->T * lw->N) * sizeof(bf16_t)) : 0;  // [T, N]
    if (lw && !delta) {
        free(groups.tok);
        return -3;
    }
#ifdef STRATA_AVX2
    if (M >= LIN2_WIDE_ROWS) {
        const int rc = lin_widened(x, wp, bias, y, M, N, K, out_f32, lora, lw, &groups, delta);
        free(delta);
        free(groups.tok);
        return rc;
    }
#endif
#pragma omp parallel
    {
        const int64_t nth = omp_get_num_threads(), tid = omp_get_thread_num();
        const int64_t i0 = tid * items / nth, i1 = (tid + 1) * items / nth;  // the thread's items
        const int64_t g0 = lw ? tid * groups.n / nth : 0, g1 = lw ? (tid + 1) * groups.n / nth : 0;
        const int64_t phases = lora_phases(g0, g1);
        int64_t item = i0;
        for (int64_t ph = 0; ph < phases; ph++) {
            const int64_t end = i0 + (ph + 1) * (i1 - i0) / phases;
            LoRAWarm warm_lora;
            int64_t pg0, pg1;
            const int64_t lw_lines =
                lora_phase(lw, &groups, g0, g1, ph, phases, end - item, &warm_lora, &pg0, &pg1);
            for (; item < end; item++) {
                const int64_t p = item / blocks, blk = item % blocks;
                const int64_t m0 = blk * LIN_MR;
                const int64_t mr = M - m0 < LIN_MR ? M - m0 : LIN_MR;
                const bf16_t* xs = x + m0 * K;
                const bf16_t* panel = wp + p * K * LIN_PANEL;
                const bf16_t* bs = bias ? bias + p * LIN_PANEL : 0;
                void* ys = (char*)y + (size_t)(m0 * N + p * LIN_PANEL) * elem;
                const int64_t first = blk * slice;
                const int64_t lines =
                    blocks >= LIN_WARM_BLOCKS && p + 1 < panels && first < panel_lines
                        ? (panel_lines - first < slice ? panel_lines - first : slice)
                        : 0;
                const char* warm = lines ? (const char*)(panel + K * LIN_PANEL) + first * 64 : 0;
                LoRAWarm* wl = &warm_lora;
#define LIN_CASE(R) lin_block(xs, panel, bs, ys, K, N, out_f32, warm, lines, wl, lw_lines, R)
                switch (mr) {
                    case 1: LIN_CASE(1); break;
                    case 2: LIN_CASE(2); break;
                    case 3: LIN_CASE(3); break;
#if LIN_MR > 4
                    case 4: LIN_CASE(4); break;
                    case 5: LIN_CASE(5); break;
#endif
                    default: LIN_CASE(LIN_MR); break;
                }
#undef LIN_CASE
            }
            if (lw) lora_update_groups(lw, &groups, pg0, pg1, delta);
        }
        lora_finish(lora, lw, &groups, g0, g1, delta);
    }
    free(delta);
    free(groups.tok);
    return 0;
#endif
}

int strata_linear_packed_bf16(const bf16_t* x, const bf16_t* wp, const bf16_t* bias, void* y,
                              int64_t M, int64_t N, int64_t K, int out_f32) {
    return lin_packed(x, wp, bias, y, M, N, K, out_f32, 0);
}
