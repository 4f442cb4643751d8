// Multi-LoRA update on bf16 activations, for the fused decoder layer (layer.h):
//   y[t] += B[s] (A[s] x[t])   for every token t whose adapter slot s = slots[t] is not 0.
// a: [slots, R, K]; bt: B transposed, [slots, R, N] (the adapter's scaling already in it), so
// the expand reads 16 contiguous output columns per row of B^T; x rows of K at stride ldx,
// y rows of N at stride ldy, h: scratch of T * R floats. A fused projection of `parts`
// modules (qkv: 3) has its output columns split at part_ends and its R rows split evenly, part
// p's columns depending only on part p's rows (B is block-diagonal). The rounding points are
// those of the torch path (engine/lora/layers.py): h and the update are rounded to bf16, then
// added to y. Tokens of the base model (slot 0) cost nothing.

// One projection's update, as strata_lora_bf16 takes it; the fused layer hands it to the
// linear before it (linear.h), which runs it in the same parallel region.
typedef struct {
    const bf16_t* x;
    int64_t ldx;
    const bf16_t* a;
    const bf16_t* bt;
    const int32_t* slots;
    bf16_t* y;
    int64_t ldy, T, K, N, R;
    const int64_t* part_ends;
    int64_t parts;
    float* h;
} LoRAUpdate;

// Warming the adapter weights of an update from inside the linear that precedes it
// (lin_packed, linear.h). In a decode step every token may bring its own adapter, and reading
// their A and B from DRAM after the linear cost as much as the linear itself; the linear is
// bound by its dot products, so the same bytes can stream in while it computes. Each thread
// warms the adapters of the tokens its share of the update handles: every distinct slot's A
// rows and the B^T row segments the update reads (a fused projection's B is block-diagonal),
// spread evenly over its items of the product. (Warming further ahead, through the next
// projections' adapters at a fixed rate, measured no faster than not warming at all.)
#define LORA_WARM_MAX_TOKENS 128  // more tokens (prefill) share adapters and are compute-bound

typedef struct {
    const LoRAUpdate* s;
    int64_t t0, t, t1;  // the thread's tokens and the cursor in them
    int64_t row;        // -1: the token's A; else the row of B^T
    const char* at;     // the current span, as cache lines from `at` up to `end`
    const char* end;
} LoRAWarm;

static inline void lora_warm_set(LoRAWarm* w, const char* p, int64_t bytes) {
    w->at = (const char*)((uintptr_t)p & ~(uintptr_t)63);
    w->end = p + bytes;
}

// Moves to the next span; returns 0 when the thread's tokens are done.
static inline int lora_warm_next(LoRAWarm* w) {
    const LoRAUpdate* s = w->s;
    if (w->t < w->t1 && w->row + 1 < s->R) {
        const int64_t row = ++w->row, per = s->R / s->parts, p = row / per;
        const int64_t c0 = p ? s->part_ends[p - 1] : 0;
        const int64_t slot = s->slots[w->t];
        lora_warm_set(w, (const char*)(s->bt + (slot * s->R + row) * s->N + c0),
                      (s->part_ends[p] - c0) * 2);
        return 1;
    }
    for (w->t++; w->t < w->t1; w->t++) {  // the next token with an adapter not yet warmed
        const int32_t slot = s->slots[w->t];
        int64_t u = w->t0;
        if (slot == 0 || (w->t > w->t0 && s->slots[w->t - 1] == slot)) continue;
        while (u < w->t && s->slots[u] != slot) u++;
        if (u < w->t) continue;
        w->row = -1;
        lora_warm_set(w, (const char*)(s->a + slot * s->R * s->K), s->R * s->K * 2);
        return 1;
    }
    return 0;
}

static inline void lora_warm_start(LoRAWarm* w, const LoRAUpdate* s, int64_t t0, int64_t t1) {
    w->s = s;
    w->t0 = t0;
    w->t = t0 - 1;
    w->t1 = t1;
    w->row = s->R;  // so that the first lora_warm_next moves to a token
    w->at = w->end = 0;
    lora_warm_next(w);
}

// Cache lines the thread has to warm in all.
static inline int64_t lora_warm_lines(const LoRAWarm* w) {
    LoRAWarm c = *w;
    int64_t lines = 0;
    if (!c.at) return 0;
    do lines += (c.end - c.at + 63) / 64;
    while (lora_warm_next(&c));
    return lines;
}

// One more line (none once the thread's tokens are done).
static inline void lora_warm_one(LoRAWarm* w) {
    if (w->at >= w->end && (!w->at || !lora_warm_next(w))) {
        w->at = w->end = 0;
        return;
    }
    __builtin_prefetch(w->at, 0, 2);
    w->at += 64;
}

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

#define LORA_COLS 128  // output columns per work item of the expand
#define LORA_GROUPS 4  // 32-column groups the expand keeps in registers at most

#ifdef STRATA_AVX512
// y[0, 32 G) += round_bf16(sum over r in [r0, r1) of h[r] B^T[r, 0, 32 G)), the rows of
// B^T `ld` apart.
// With AVX512-BF16, two rows per dot-product instruction: it adds the odd element's product,
// then the even one's, each rounded, and bf16 products are exact in fp32, so placing row r at
// the odd element gives the fp32 sums of the one-row-at-a-time path bit for bit (outside
// denormals, which it flushes). Rows are interleaved in registers: B^T stays as stored.
static inline __attribute__((always_inline)) void lora_expand_cols(const float* h,
                                                                  const bf16_t* b, int64_t ld,
                                                                  int64_t r0, int64_t r1,
                                                                  bf16_t* y, const int G) {
    __m512 acc[2 * LORA_GROUPS];  // G groups of 32 columns
    for (int i = 0; i < 2 * G; i++) acc[i] = _mm512_setzero_ps();
    int64_t r = r0;
#ifdef STRATA_AVX512BF16
    // The unpacks interleave rows r + 1 (even elements) and r within 128-bit lanes, so the
    // accumulators hold columns in the order 0-3 8-11 16-19 24-27 (lo) and 4-7 12-15 20-23
    // 28-31 (hi) of each 32; they are put back in order once, after the row loop.
    __m512 lo[LORA_GROUPS], hi[LORA_GROUPS];
    for (int i = 0; i < G; i++) lo[i] = hi[i] = _mm512_setzero_ps();
    for (; r + 2 <= r1; r += 2) {
        uint32_t h0, h1;
        memcpy(&h0, h + r, 4);
        memcpy(&h1, h + r + 1, 4);
        const __m512bh hp = (__m512bh)_mm512_set1_epi32((int)((h0 & 0xffff0000u) | (h1 >> 16)));
        for (int i = 0; i < G; i++) {
            const __m512i a = _mm512_loadu_si512(b + r * ld + 32 * i);
            const __m512i c = _mm512_loadu_si512(b + (r + 1) * ld + 32 * i);
            lo[i] = _mm512_dpbf16_ps(lo[i], hp, (__m512bh)_mm512_unpacklo_epi16(c, a));
            hi[i] = _mm512_dpbf16_ps(hi[i], hp, (__m512bh)_mm512_unpackhi_epi16(c, a));
        }
    }
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second =
        _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int i = 0; i < G; i++) {
        acc[2 * i] = _mm512_permutex2var_ps(lo[i], first, hi[i]);
        acc[2 * i + 1] = _mm512_permutex2var_ps(lo[i], second, hi[i]);
    }
#endif
    for (; r < r1; r++) {
        const __m512 hr = _mm512_set1_ps(h[r]);
        for (int i = 0; i < 2 * G; i++)
            acc[i] = _mm512_fmadd_ps(hr, v_load_bf16(b + r * ld + 16 * i), acc[i]);
    }
    for (int i = 0; i < 2 * G; i++)
        v_store_bf16(y + 16 * i, _mm512_add_ps(v_load_bf16(y + 16 * i), v_round_bf16(acc[i])));
}
#endif

// h = A x for every token with an adapter: the calling thread's share of the items of the
// enclosing parallel region, without waiting for the others.
static void lora_shrink(const LoRAUpdate* u) {
    const bf16_t *x = u->x, *a = u->a;
    const int32_t* slots = u->slots;
    const int64_t ldx = u->ldx, T = u->T, K = u->K, R = u->R;
    float* h = u->h;
#pragma omp for collapse(2) schedule(static) nowait
    for (int64_t t = 0; t < T; t++)
        for (int64_t r = 0; r < R; r++) {
            const int64_t s = slots[t];
            if (s == 0) continue;
            h[t * R + r] = round_bf16(lora_dot_bf16(x + t * ldx, a + (s * R + r) * K, K));
        }
}

// y += B h, once every thread's h (and y, when y is a linear's output) is complete: a
// worksharing loop of the enclosing parallel region, ending at its barrier.
static void lora_expand(const LoRAUpdate* u) {
    const bf16_t* bt = u->bt;
    const int32_t* slots = u->slots;
    bf16_t* y = u->y;
    const int64_t ldy = u->ldy, T = u->T, N = u->N, R = u->R, parts = u->parts;
    const int64_t* part_ends = u->part_ends;
    const float* h = u->h;
    const int64_t chunks = (N + LORA_COLS - 1) / LORA_COLS;
#pragma omp for collapse(2) schedule(static)
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
                for (; n + 128 <= n1; n += 128) lora_expand_cols(ht, bs + n, N, r0, r1, yr + n, 4);
                for (; n + 32 <= n1; n += 32) lora_expand_cols(ht, bs + n, N, r0, r1, yr + n, 1);
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

void strata_lora_bf16(const bf16_t* x, int64_t ldx, const bf16_t* a, const bf16_t* bt,
                      const int32_t* slots, bf16_t* y, int64_t ldy, int64_t T, int64_t K,
                      int64_t N, int64_t R, const int64_t* part_ends, int64_t parts, float* h) {
    const LoRAUpdate u = {x, ldx, a, bt, slots, y, ldy, T, K, N, R, part_ends, parts, h};
#pragma omp parallel
    {
        lora_shrink(&u);
#pragma omp barrier
        lora_expand(&u);
    }
}
