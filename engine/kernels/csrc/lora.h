// Multi-LoRA update on bf16 activations, for the fused decoder layer (layer.h):
//   y[t] += B[s] (A[s] x[t])   for every token t whose adapter slot s = slots[t] is not 0.
// a: [slots, R, K]; bt: B transposed, [slots, R, N] (the adapter's scaling already in it), so
// the expand reads 16 contiguous output columns per row of B^T; x rows of K at stride ldx,
// y rows of N at stride ldy, h: scratch of T * R floats. A fused projection of `parts`
// modules (qkv: 3) has its output columns split at part_ends and its R rows split evenly, part
// p's columns depending only on part p's rows (B is block-diagonal). The rounding points are
// those of the torch path (engine/lora/layers.py): h and the update are rounded to bf16, then
// added to y. Tokens of the base model (slot 0) cost nothing.

static inline float lora_dot_bf16(const bf16_t* x, const bf16_t* w, int64_t k_len) {
    int64_t k = 0;
    float acc = 0.0f;
#ifdef STRATA_AVX512BF16
    __m512 v = _mm512_setzero_ps();
    for (; k + 32 <= k_len; k += 32)
        v = _mm512_dpbf16_ps(v, (__m512bh)_mm512_loadu_si512(x + k),
                             (__m512bh)_mm512_loadu_si512(w + k));
    acc = _mm512_reduce_add_ps(v);
#endif
    for (; k < k_len; k++) acc += bf16_to_f32(x[k]) * bf16_to_f32(w[k]);
    return acc;
}

#define LORA_COLS 64  // output columns per work item of the expand

void strata_lora_bf16(const bf16_t* x, int64_t ldx, const bf16_t* a, const bf16_t* bt,
                      const int32_t* slots, bf16_t* y, int64_t ldy, int64_t T, int64_t K,
                      int64_t N, int64_t R, const int64_t* part_ends, int64_t parts, float* h) {
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t t = 0; t < T; t++)
        for (int64_t r = 0; r < R; r++) {
            const int64_t s = slots[t];
            if (s == 0) continue;
            h[t * R + r] = round_bf16(lora_dot_bf16(x + t * ldx, a + (s * R + r) * K, K));
        }
    const int64_t chunks = (N + LORA_COLS - 1) / LORA_COLS;
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t t = 0; t < T; t++)
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t s = slots[t];
            if (s == 0) continue;
            const int64_t end = (c + 1) * LORA_COLS < N ? (c + 1) * LORA_COLS : N;
            const bf16_t* bs = bt + s * R * N;  // B^T of slot s: [R, N]
            bf16_t* yr = y + t * ldy;
            // the columns of part p only read rows [p R / parts, (p + 1) R / parts) of B^T
            // and h: the rest of a fused projection's B is zero
            int64_t p = 0;
            for (int64_t n = c * LORA_COLS; n < end;) {
                while (part_ends[p] <= n) p++;
                const int64_t n1 = part_ends[p] < end ? part_ends[p] : end;
                const int64_t r0 = p * (R / parts), r1 = r0 + R / parts;
                const float* ht = h + t * R;
#ifdef STRATA_AVX512
                for (; n + 16 <= n1; n += 16) {  // 16 columns at a time, h[r] broadcast
                    __m512 acc = _mm512_setzero_ps();
                    for (int64_t r = r0; r < r1; r++)
                        acc = _mm512_fmadd_ps(_mm512_set1_ps(ht[r]), v_load_bf16(bs + r * N + n),
                                              acc);
                    v_store_bf16(yr + n, _mm512_add_ps(v_load_bf16(yr + n), v_round_bf16(acc)));
                }
#endif
                for (; n < n1; n++) {
                    float acc = 0.0f;
                    for (int64_t r = r0; r < r1; r++) acc += ht[r] * bf16_to_f32(bs[r * N + n]);
                    yr[n] = f32_to_bf16(bf16_to_f32(yr[n]) + round_bf16(acc));
                }
            }
        }
}
