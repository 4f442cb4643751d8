// Strata's CPU kernels, one shared library: RMSNorm (+ residual), RoPE, SiLU*up, KV-page
// writes and paged attention for fp32 and bf16 storage (pages in that type or in FP8 with
// scales, fp8.h), the packed linears (linear.h, linear_f32.h) and the whole bf16 decoder layer built
// from them (layer.h). Built on first use by engine/kernels/cpu.py, which compiles the
// translation units below in parallel and links them, and called through ctypes:
//   ops.c                 ABI, CPU features (the vector paths built in), argmax
//   ops_f32.c             fp32 element-wise ops, KV writes, attention (fp32 and FP8 pages),
//                         the packed fp32 linear (linear_f32.h)
//   ops_bf16.c            bf16 element-wise ops and KV writes
//   attention_bf16.c      bf16 attention over bf16 pages
//   attention_bf16_fp8.c  bf16 attention over FP8 pages
//   layer.c               the packed linear, multi-LoRA and the fused decoder layer
// kernels.h declares what one unit calls in another.

#include <omp.h>
#include <stdlib.h>

#include "common.h"
#include "fp8.h"

int strata_kernels_abi(void) { return 11; }

int strata_has_avx512(void) {
#ifdef STRATA_AVX512
    return 1;
#else
    return 0;
#endif
}

// The vector paths compiled in: 2 AVX-512, 1 AVX2 + FMA, 0 none (the scalar C).
int strata_isa(void) {
#if defined(STRATA_AVX512)
    return 2;
#elif defined(STRATA_AVX2)
    return 1;
#else
    return 0;
#endif
}

int strata_has_avx512_bf16(void) {
#ifdef STRATA_AVX512BF16
    return 1;
#else
    return 0;
#endif
}

// Row-wise argmax of fp32 logits [rows, cols] (first index wins ties, like torch).
void strata_argmax_f32(const float* x, int64_t* out, int64_t rows, int64_t cols) {
#pragma omp parallel for schedule(static) if (rows >= 4)
    for (int64_t r = 0; r < rows; r++) {
        const float* xr = x + r * cols;
        float best = -INFINITY;
        int64_t at = 0, c = 0;
#ifdef STRATA_AVX512
        if (cols >= 16) {
            __m512 vbest = _mm512_set1_ps(-INFINITY);
            __m512i vidx = _mm512_setzero_si512(), cur = _mm512_setr_epi32(
                0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
            const __m512i step = _mm512_set1_epi32(16);
            for (; c + 16 <= cols; c += 16) {
                const __m512 v = _mm512_loadu_ps(xr + c);
                const __mmask16 gt = _mm512_cmp_ps_mask(v, vbest, _CMP_GT_OQ);
                vbest = _mm512_mask_mov_ps(vbest, gt, v);
                vidx = _mm512_mask_mov_epi32(vidx, gt, cur);
                cur = _mm512_add_epi32(cur, step);
            }
            float lanes[16];
            int32_t idx[16];
            _mm512_storeu_ps(lanes, vbest);
            _mm512_storeu_si512(idx, vidx);
            for (int i = 0; i < 16; i++)
                if (lanes[i] > best || (lanes[i] == best && idx[i] < at)) best = lanes[i], at = idx[i];
        }
#elif defined(STRATA_AVX2)
        if (cols >= 8) {
            __m256 vbest = _mm256_set1_ps(-INFINITY);
            __m256i vidx = _mm256_setzero_si256(), cur = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            const __m256i step = _mm256_set1_epi32(8);
            for (; c + 8 <= cols; c += 8) {
                const __m256 v = _mm256_loadu_ps(xr + c);
                const __m256 gt = _mm256_cmp_ps(v, vbest, _CMP_GT_OQ);
                vbest = _mm256_blendv_ps(vbest, v, gt);
                vidx = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(vidx),
                                                            _mm256_castsi256_ps(cur), gt));
                cur = _mm256_add_epi32(cur, step);
            }
            float lanes[8];
            int32_t idx[8];
            _mm256_storeu_ps(lanes, vbest);
            _mm256_storeu_si256((__m256i*)idx, vidx);
            for (int i = 0; i < 8; i++)
                if (lanes[i] > best || (lanes[i] == best && idx[i] < at)) best = lanes[i], at = idx[i];
        }
#endif
        for (; c < cols; c++)
            if (xr[c] > best) best = xr[c], at = c;
        out[r] = at;
    }
}
