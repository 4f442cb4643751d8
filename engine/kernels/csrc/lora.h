// Multi-LoRA update on bf16 activations, for the fused decoder layer (layer.h):
//   y[t] += B[s] (A[s] x[t])   for every token t whose adapter slot s = slots[t] is not 0.
// a: [slots, R, K]; bt: B transposed (the adapter's scaling already in it) in pairs of rows,
// [slots, R / 2, N, 2], element (q, n, 0) being row 2q + 1 and (q, n, 1) row 2q, so that one
// 64-byte load feeds a bf16 dot product with 16 output columns of two rows; x rows of K at
// stride ldx, y rows of N at stride ldy, h: scratch of T * R floats. A fused projection of
// `parts` modules (qkv: 3) has its output columns split at part_ends and its R rows split
// evenly (an even number each), part p's columns depending only on part p's rows (B is
// block-diagonal). The rounding points are those of the torch path (engine/lora/layers.py): h
// and the update are rounded to bf16, then added to y. Tokens of the base model (slot 0) cost
// nothing.
#pragma once

// One projection's update, as strata_lora_bf16 takes it; the fused layer hands it to the
// linear before it (linear.h), which runs it in the same parallel region.
typedef struct LoRAUpdate {
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

// Tokens that share an adapter share its weights' loads: the update runs on groups of up to
// LORA_TOKENS tokens of one slot (built once per update, before its parallel region), and each
// token's sums are the ones it would get alone, so results do not depend on its batch mates.
#define LORA_TOKENS 4

typedef struct {
    int32_t* tok;  // group g: tok[g LORA_TOKENS .. + size[g])
    int8_t* size;
    int64_t n;     // groups; -1: out of memory
} LoRAGroups;

static LoRAGroups lora_groups(const int32_t* slots, int64_t T) {
    LoRAGroups g = {0, 0, 0};
    char* mem = malloc((size_t)T * (LORA_TOKENS * sizeof(int32_t) + 1 + sizeof(int64_t)) + 1);
    if (!mem) {
        g.n = -1;
        return g;
    }
    g.tok = (int32_t*)mem;
    int64_t* open = (int64_t*)(mem + (size_t)T * LORA_TOKENS * sizeof(int32_t));
    g.size = (int8_t*)(open + T);
    int64_t n_open = 0;
    for (int64_t t = 0; t < T; t++) {
        const int32_t s = slots[t];
        if (s == 0) continue;
        int64_t j = n_open - 1;  // an open group of the same slot, the latest first
        while (j >= 0 && slots[g.tok[open[j] * LORA_TOKENS]] != s) j--;
        if (j < 0) {
            g.tok[g.n * LORA_TOKENS] = (int32_t)t;
            g.size[g.n] = 1;
            open[n_open++] = g.n++;
            continue;
        }
        const int64_t k = open[j];
        g.tok[k * LORA_TOKENS + g.size[k]++] = (int32_t)t;
        if (g.size[k] == LORA_TOKENS) open[j] = open[--n_open];
    }
    return g;
}

// Warming the adapter weights of an update from inside the linear that precedes it
// (lin_packed, linear.h). In a decode step every token may bring its own adapter, and reading
// their A and B from DRAM after the linear cost as much as the linear itself; the linear is
// bound by its dot products, so the same bytes can stream in while it computes. Each thread
// warms the adapters of its own groups of tokens, a phase at a time (lin_packed): every
// distinct slot's A rows and the B^T row segments the update reads (a fused projection's B is
// block-diagonal), spread evenly over the phase's items of the product. (Warming further
// ahead, through the next projections' adapters at a fixed rate, measured no faster than not
// warming at all.)
#define LORA_WARM_MAX_TOKENS 128  // more tokens (prefill) share adapters and are compute-bound

typedef struct {
    const LoRAUpdate* s;
    const LoRAGroups* g;
    int64_t g_first;  // the thread's first group: slots seen since then are warm already
    int64_t gi, g1;   // the cursor and the end of the groups to warm
    int64_t row;      // -1: the group's A; else the pair of rows of B^T
    const char* at;   // the current span, as cache lines from `at` up to `end`
    const char* end;
} LoRAWarm;

static inline int32_t lora_group_slot(const LoRAUpdate* s, const LoRAGroups* g, int64_t gi) {
    return s->slots[g->tok[gi * LORA_TOKENS]];
}

static inline void lora_warm_set(LoRAWarm* w, const char* p, int64_t bytes) {
    w->at = (const char*)((uintptr_t)p & ~(uintptr_t)63);
    w->end = p + bytes;
}

// Moves to the next span; returns 0 when the groups are done.
static inline int lora_warm_next(LoRAWarm* w) {
    const LoRAUpdate* s = w->s;
    if (w->gi < w->g1 && w->row + 1 < s->R / 2) {
        const int64_t q = ++w->row, per = s->R / s->parts / 2, p = q / per;
        const int64_t c0 = p ? s->part_ends[p - 1] : 0;
        const int64_t slot = lora_group_slot(s, w->g, w->gi);
        lora_warm_set(w, (const char*)(s->bt + (slot * s->R / 2 + q) * 2 * s->N + 2 * c0),
                      (s->part_ends[p] - c0) * 4);
        return 1;
    }
    for (w->gi++; w->gi < w->g1; w->gi++) {  // the next group with an adapter not yet warmed
        const int32_t slot = lora_group_slot(s, w->g, w->gi);
        int64_t u = w->g_first;
        while (u < w->gi && lora_group_slot(s, w->g, u) != slot) u++;
        if (u < w->gi) continue;
        w->row = -1;
        lora_warm_set(w, (const char*)(s->a + slot * s->R * s->K), s->R * s->K * 2);
        return 1;
    }
    return 0;
}

// Groups [g0, g1) of the thread whose groups start at g_first.
static inline void lora_warm_start(LoRAWarm* w, const LoRAUpdate* s, const LoRAGroups* g,
                                   int64_t g_first, int64_t g0, int64_t g1) {
    w->s = s;
    w->g = g;
    w->g_first = g_first;
    w->gi = g0 - 1;
    w->g1 = g1;
    w->row = s->R / 2;  // so that the first lora_warm_next moves to a group
    w->at = w->end = 0;
    lora_warm_next(w);
}

// Cache lines there are to warm in all.
static inline int64_t lora_warm_lines(const LoRAWarm* w) {
    LoRAWarm c = *w;
    int64_t lines = 0;
    if (!c.at) return 0;
    do lines += (c.end - c.at + 63) / 64;
    while (lora_warm_next(&c));
    return lines;
}

// One more line (none once the groups are done).
static inline void lora_warm_one(LoRAWarm* w) {
    if (w->at >= w->end && (!w->at || !lora_warm_next(w))) {
        w->at = w->end = 0;
        return;
    }
    __builtin_prefetch(w->at, 0, 2);
    w->at += 64;
}

// NR rows of A (`ldw` apart) dotted with the x of NT tokens, each row and each x loaded once:
// each (row, token) sum runs in the same order whatever NR and NT (vector steps of 32
// elements with AVX-512, 16 on AVX2, into one accumulator, its sum, then the tail), so
// results do not depend on how rows and tokens are grouped; the NR x NT accumulator chains are
// independent, which hides the latency of the dot products (one chain alone waits on it).
#define LORA_SHRINK_ROWS 4
static inline __attribute__((always_inline)) void lora_dots(const bf16_t* const* x,
                                                            const bf16_t* w, int64_t ldw,
                                                            int64_t k_len,
                                                            float out[][LORA_TOKENS],
                                                            const int NR, const int NT) {
    int64_t k = 0;
    float acc[LORA_SHRINK_ROWS][LORA_TOKENS] = {{0}};
#ifdef STRATA_AVX512BF16
    __m512 v[LORA_SHRINK_ROWS][LORA_TOKENS];
    for (int r = 0; r < NR; r++)
        for (int i = 0; i < NT; i++) v[r][i] = _mm512_setzero_ps();
    for (; k + 32 <= k_len; k += 32) {
        __m512bh xv[LORA_TOKENS];
        for (int i = 0; i < NT; i++) xv[i] = (__m512bh)_mm512_loadu_si512(x[i] + k);
        for (int r = 0; r < NR; r++) {
            const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + r * ldw + k);
            for (int i = 0; i < NT; i++) v[r][i] = _mm512_dpbf16_ps(v[r][i], xv[i], wv);
        }
    }
    for (int r = 0; r < NR; r++)
        for (int i = 0; i < NT; i++) acc[r][i] = _mm512_reduce_add_ps(v[r][i]);
#elif defined(STRATA_AVX512)
    // without bf16 dot products: 32 elements per step, each operand's even elements widened
    // by a shift and its odd ones by a mask, two FMAs into one accumulator, the even first
    __m512 v[LORA_SHRINK_ROWS][LORA_TOKENS];
    for (int r = 0; r < NR; r++)
        for (int i = 0; i < NT; i++) v[r][i] = _mm512_setzero_ps();
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
    for (; k + 32 <= k_len; k += 32) {
        __m512 xe[LORA_TOKENS], xo[LORA_TOKENS];
        for (int i = 0; i < NT; i++) {
            const __m512i raw = _mm512_loadu_si512(x[i] + k);
            xe[i] = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
            xo[i] = _mm512_castsi512_ps(_mm512_and_si512(raw, hi));
        }
        for (int r = 0; r < NR; r++) {
            const __m512i raw = _mm512_loadu_si512(w + r * ldw + k);
            const __m512 we = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
            const __m512 wo = _mm512_castsi512_ps(_mm512_and_si512(raw, hi));
            for (int i = 0; i < NT; i++) {
                v[r][i] = _mm512_fmadd_ps(xe[i], we, v[r][i]);
                v[r][i] = _mm512_fmadd_ps(xo[i], wo, v[r][i]);
            }
        }
    }
    for (int r = 0; r < NR; r++)
        for (int i = 0; i < NT; i++) acc[r][i] = _mm512_reduce_add_ps(v[r][i]);
#elif defined(STRATA_AVX2)
    // 16 elements per step: one 256-bit load of each operand, its even elements widened by a
    // shift and its odd ones by a mask (no lane-crossing conversion), then two FMAs into one
    // accumulator, the even elements' product first
    __m256 v[LORA_SHRINK_ROWS][LORA_TOKENS];
    for (int r = 0; r < NR; r++)
        for (int i = 0; i < NT; i++) v[r][i] = _mm256_setzero_ps();
    const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
    for (; k + 16 <= k_len; k += 16) {
        __m256 xe[LORA_TOKENS], xo[LORA_TOKENS];
        for (int i = 0; i < NT; i++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i*)(x[i] + k));
            xe[i] = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
            xo[i] = _mm256_castsi256_ps(_mm256_and_si256(raw, hi));
        }
        for (int r = 0; r < NR; r++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i*)(w + r * ldw + k));
            const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
            const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(raw, hi));
            for (int i = 0; i < NT; i++) {
                v[r][i] = _mm256_fmadd_ps(xe[i], we, v[r][i]);
                v[r][i] = _mm256_fmadd_ps(xo[i], wo, v[r][i]);
            }
        }
    }
    for (int r = 0; r < NR; r++)
        for (int i = 0; i < NT; i++) acc[r][i] = v8_reduce_add(v[r][i]);
#endif
    for (int r = 0; r < NR; r++)
        for (int i = 0; i < NT; i++) {
            for (int64_t j = k; j < k_len; j++)
                acc[r][i] += bf16_to_f32(x[i][j]) * bf16_to_f32(w[r * ldw + j]);
            out[r][i] = acc[r][i];
        }
}

#define LORA_COLS 128  // output columns per work item of the expand
#define LORA_VECS 8    // vectors the expand keeps in registers per token at most
#ifdef STRATA_AVX512
#define LORA_VW 16     // columns per vector
#define LORA_WIDE 2    // tokens at most that take LORA_VECS vectors each
#else
#define LORA_VW 8
#define LORA_WIDE 1
#endif

#ifdef STRATA_AVX512
// y[0, 16 V) += round_bf16(sum over r in [2 q0, 2 q1) of h[r] B^T[r, 0, 16 V)), B^T in row
// pairs (bp: pair q0's first column; pairs 2 ld elements apart; see LoRAUpdate); without
// `add`, y = the rounded sum (the same bits as adding it to zeros).
// With AVX512-BF16, one dot-product instruction per pair: it adds the odd element's product
// (row 2q), then the even one's (row 2q + 1), each rounded, and bf16 products are exact in
// fp32: the fp32 sums of the one-row-at-a-time path bit for bit (outside denormals, which it
// flushes). Without it, two FMAs per pair in the same order.
static inline __attribute__((always_inline)) void lora_expand_pairs(
    const float* const* h, const bf16_t* bp, int64_t ld, int64_t q0, int64_t q1,
    bf16_t* const* y, int add, const int V, const int NT) {
    __m512 acc[LORA_TOKENS][LORA_VECS];
    for (int k = 0; k < NT; k++)
        for (int i = 0; i < V; i++) acc[k][i] = _mm512_setzero_ps();
    for (int64_t q = q0; q < q1; q++) {
        const bf16_t* b = bp + q * 2 * ld;
#ifdef STRATA_AVX512BF16
        __m512bh hp[LORA_TOKENS];
        for (int k = 0; k < NT; k++) {
            uint32_t h0, h1;
            memcpy(&h0, h[k] + 2 * q, 4);
            memcpy(&h1, h[k] + 2 * q + 1, 4);
            hp[k] = (__m512bh)_mm512_set1_epi32((int)((h0 & 0xffff0000u) | (h1 >> 16)));
        }
        for (int i = 0; i < V; i++) {
            const __m512bh w = (__m512bh)_mm512_loadu_si512(b + 32 * i);
            for (int k = 0; k < NT; k++) acc[k][i] = _mm512_dpbf16_ps(acc[k][i], hp[k], w);
        }
#else
        for (int i = 0; i < V; i++) {
            const __m512i w = _mm512_loadu_si512(b + 32 * i);
            const __m512 first = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(-65536)));
            const __m512 second = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
            for (int k = 0; k < NT; k++) {
                acc[k][i] = _mm512_fmadd_ps(_mm512_set1_ps(h[k][2 * q]), first, acc[k][i]);
                acc[k][i] = _mm512_fmadd_ps(_mm512_set1_ps(h[k][2 * q + 1]), second, acc[k][i]);
            }
        }
#endif
    }
    for (int k = 0; k < NT; k++)
        for (int i = 0; i < V; i++) {
            const __m512 u = v_round_bf16(acc[k][i]);
            v_store_bf16(y[k] + 16 * i, add ? _mm512_add_ps(v_load_bf16(y[k] + 16 * i), u) : u);
        }
}
#elif defined(STRATA_AVX2)
// The AVX2 expand: 8 columns per vector, two FMAs per pair in the AVX-512 path's order.
static inline __attribute__((always_inline)) void lora_expand_pairs(
    const float* const* h, const bf16_t* bp, int64_t ld, int64_t q0, int64_t q1,
    bf16_t* const* y, int add, const int V, const int NT) {
    __m256 acc[LORA_TOKENS][LORA_VECS];
    for (int k = 0; k < NT; k++)
        for (int i = 0; i < V; i++) acc[k][i] = _mm256_setzero_ps();
    const __m256i hi = _mm256_set1_epi32(-65536);
    for (int64_t q = q0; q < q1; q++) {
        const bf16_t* b = bp + q * 2 * ld;
        for (int i = 0; i < V; i++) {
            const __m256i w = _mm256_loadu_si256((const __m256i*)(b + 16 * i));
            const __m256 first = _mm256_castsi256_ps(_mm256_and_si256(w, hi));
            const __m256 second = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
            for (int k = 0; k < NT; k++) {
                acc[k][i] = _mm256_fmadd_ps(_mm256_set1_ps(h[k][2 * q]), first, acc[k][i]);
                acc[k][i] = _mm256_fmadd_ps(_mm256_set1_ps(h[k][2 * q + 1]), second, acc[k][i]);
            }
        }
    }
    for (int k = 0; k < NT; k++)
        for (int i = 0; i < V; i++) {
            const __m256 u = v8_round_bf16(acc[k][i]);
            v8_store_bf16(y[k] + 8 * i, add ? _mm256_add_ps(v8_load_bf16(y[k] + 8 * i), u) : u);
        }
}
#endif

// h = A x for the tokens of group gi, LORA_SHRINK_ROWS rows of A from row block rb.
static void lora_shrink_item(const LoRAUpdate* u, const LoRAGroups* g, int64_t gi, int64_t rb) {
    const bf16_t *x = u->x, *a = u->a;
    const int64_t ldx = u->ldx, K = u->K, R = u->R;
    float* h = u->h;
    const int32_t* tk = g->tok + gi * LORA_TOKENS;
    const int nt = g->size[gi];
    const int64_t r0 = rb * LORA_SHRINK_ROWS;
    const int nr = R - r0 < LORA_SHRINK_ROWS ? (int)(R - r0) : LORA_SHRINK_ROWS;
    const bf16_t* xs[LORA_TOKENS];
    float dots[LORA_SHRINK_ROWS][LORA_TOKENS];
    for (int k = 0; k < nt; k++) xs[k] = x + tk[k] * ldx;
    const bf16_t* w = a + (u->slots[tk[0]] * R + r0) * K;
#define LORA_DOTS(OUT, NR)                                  \
    switch (nt) {                                           \
        case 1: lora_dots(xs, w, K, K, OUT, NR, 1); break;  \
        case 2: lora_dots(xs, w, K, K, OUT, NR, 2); break;  \
        case 3: lora_dots(xs, w, K, K, OUT, NR, 3); break;  \
        default: lora_dots(xs, w, K, K, OUT, NR, 4); break; \
    }
    if (nr == LORA_SHRINK_ROWS) {
        LORA_DOTS(dots, LORA_SHRINK_ROWS)
    } else {
        for (int r = 0; r < nr; r++, w += K) {  // the last few rows, one at a time
            LORA_DOTS(&dots[r], 1)
        }
    }
#undef LORA_DOTS
    for (int r = 0; r < nr; r++)
        for (int k = 0; k < nt; k++) h[tk[k] * R + r0 + r] = round_bf16(dots[r][k]);
}

#define LORA_ROW_BLOCKS(R) (((R) + LORA_SHRINK_ROWS - 1) / LORA_SHRINK_ROWS)

// h = A x for every token with an adapter: the calling thread's share of the items of the
// enclosing parallel region, without waiting for the others.
static void lora_shrink(const LoRAUpdate* u, const LoRAGroups* g) {
    const int64_t row_blocks = LORA_ROW_BLOCKS(u->R);
#pragma omp for collapse(2) schedule(static) nowait
    for (int64_t gi = 0; gi < g->n; gi++)
        for (int64_t rb = 0; rb < row_blocks; rb++) lora_shrink_item(u, g, gi, rb);
}

// y += B h for the tokens of group gi (rows of y `ldy` apart), LORA_COLS columns from chunk c;
// without `add`, y = B h.
static void lora_expand_item(const LoRAUpdate* u, const LoRAGroups* g, int64_t gi, int64_t c,
                             bf16_t* y, int64_t ldy, int add) {
    const bf16_t* bt = u->bt;
    const int64_t N = u->N, R = u->R, parts = u->parts;
    const int64_t* part_ends = u->part_ends;
    const int32_t* tk = g->tok + gi * LORA_TOKENS;
    const int nt = g->size[gi];
    const float* hs[LORA_TOKENS];
    bf16_t* ys[LORA_TOKENS];
    for (int k = 0; k < nt; k++) hs[k] = u->h + tk[k] * R, ys[k] = y + tk[k] * ldy;
    const int64_t end = (c + 1) * LORA_COLS < N ? (c + 1) * LORA_COLS : N;
    const bf16_t* bs = bt + u->slots[tk[0]] * R * N;  // B^T of the slot: [R / 2, N, 2]
    // the columns of part p only read rows [p R / parts, (p + 1) R / parts) of B^T
    // and h: the rest of a fused projection's B is zero
    int64_t p = 0;
    for (int64_t n = c * LORA_COLS; n < end;) {
        while (part_ends[p] <= n) p++;
        const int64_t n1 = part_ends[p] < end ? part_ends[p] : end;
        const int64_t r0 = p * (R / parts), r1 = r0 + R / parts;
#ifdef STRATA_VEC
        bf16_t* yn[LORA_TOKENS];
#define LORA_EXPAND(V_)                                                                           \
    for (; n + LORA_VW * (V_) <= n1; n += LORA_VW * (V_)) {                                       \
        for (int k = 0; k < nt; k++) yn[k] = ys[k] + n;                                           \
        switch (nt) {                                                                             \
            case 1: lora_expand_pairs(hs, bs + 2 * n, N, r0 / 2, r1 / 2, yn, add, V_, 1); break;  \
            case 2: lora_expand_pairs(hs, bs + 2 * n, N, r0 / 2, r1 / 2, yn, add, V_, 2); break;  \
            case 3: lora_expand_pairs(hs, bs + 2 * n, N, r0 / 2, r1 / 2, yn, add, V_, 3); break;  \
            default: lora_expand_pairs(hs, bs + 2 * n, N, r0 / 2, r1 / 2, yn, add, V_, 4); break; \
        }                                                                                         \
    }
        if (nt <= LORA_WIDE) {  // LORA_VECS vectors in registers per token
            LORA_EXPAND(8)
        }
        LORA_EXPAND(4)
        LORA_EXPAND(1)
#undef LORA_EXPAND
#endif
        for (; n < n1; n++)
            for (int k = 0; k < nt; k++) {
                float acc = 0.0f;
                for (int64_t r = r0; r < r1; r++)
                    acc += hs[k][r] * bf16_to_f32(bs[(r / 2 * N + n) * 2 + 1 - r % 2]);
                ys[k][n] = f32_to_bf16((add ? bf16_to_f32(ys[k][n]) : 0.0f) + round_bf16(acc));
            }
    }
}

#define LORA_CHUNKS(N) (((N) + LORA_COLS - 1) / LORA_COLS)

// y += B h, once every thread's h (and y, when y is a linear's output) is complete: a
// worksharing loop of the enclosing parallel region, ending at its barrier.
static void lora_expand(const LoRAUpdate* u, const LoRAGroups* g) {
    const int64_t chunks = LORA_CHUNKS(u->N);
#pragma omp for collapse(2) schedule(static)
    for (int64_t gi = 0; gi < g->n; gi++)
        for (int64_t c = 0; c < chunks; c++) lora_expand_item(u, g, gi, c, u->y, u->ldy, 1);
}

// The update of groups [g0, g1) alone, in the calling thread, into delta ([T, N], rows of
// those groups' tokens; added to y by lora_add_delta once the linear's output is complete):
// the decode path of lin_packed, which runs it a few groups at a time between its items of the
// product, on adapter weights it has just warmed.
static void lora_update_groups(const LoRAUpdate* u, const LoRAGroups* g, int64_t g0, int64_t g1,
                               bf16_t* delta) {
    const int64_t row_blocks = LORA_ROW_BLOCKS(u->R), chunks = LORA_CHUNKS(u->N);
    for (int64_t gi = g0; gi < g1; gi++) {  // every column of a token's delta is written once
        for (int64_t rb = 0; rb < row_blocks; rb++) lora_shrink_item(u, g, gi, rb);
        for (int64_t c = 0; c < chunks; c++) lora_expand_item(u, g, gi, c, delta, u->N, 0);
    }
}

// A decode step's update in the linear's parallel region (lin_packed, lin_widened): each
// thread owns a share [g0, g1) of the groups and splits it into LORA_PHASES phases (fewer when
// it has fewer groups), as it splits its items of the product.
#define LORA_PHASES 4

static inline int64_t lora_phases(int64_t g0, int64_t g1) {
    return g1 - g0 < LORA_PHASES ? (g1 > g0 ? g1 - g0 : 1) : LORA_PHASES;
}

// Phase ph of the thread whose groups are [g0, g1): its groups [*pg0, *pg1), and in `warm`
// their adapters' lines (none without lw); returns how many to warm per item of the product,
// `items` items being left for the phase.
static inline int64_t lora_phase(const LoRAUpdate* lw, const LoRAGroups* g, int64_t g0,
                                 int64_t g1, int64_t ph, int64_t phases, int64_t items,
                                 LoRAWarm* warm, int64_t* pg0, int64_t* pg1) {
    *pg0 = g0 + ph * (g1 - g0) / phases;
    *pg1 = g0 + (ph + 1) * (g1 - g0) / phases;
    *warm = (LoRAWarm){0};
    if (!lw || items <= 0) return 0;
    lora_warm_start(warm, lw, g, g0, *pg0, *pg1);
    return (lora_warm_lines(warm) + items - 1) / items;
}

// y[t] += delta[t] for the tokens of groups [g0, g1): the same sums, rounded alike, as
// lora_expand adding straight into y (delta holds the rounded updates exactly).
static void lora_add_delta(const LoRAUpdate* u, const LoRAGroups* g, int64_t g0, int64_t g1,
                           const bf16_t* delta) {
    for (int64_t gi = g0; gi < g1; gi++)
        for (int k = 0; k < g->size[gi]; k++) {
            const int64_t t = g->tok[gi * LORA_TOKENS + k];
            bf16_t* y = u->y + t * u->ldy;
            const bf16_t* d = delta + t * u->N;
            int64_t n = 0;
#ifdef STRATA_VEC
            for (; n + VF_W <= u->N; n += VF_W)
                vf_store_bf16(y + n, vf_add(vf_load_bf16(y + n), vf_load_bf16(d + n)));
#endif
            for (; n < u->N; n++) y[n] = f32_to_bf16(bf16_to_f32(y[n]) + bf16_to_f32(d[n]));
        }
}

// The end of a linear's parallel region with `lora`'s update (lin_packed, lin_widened): in a
// decode step (lw), the thread's deltas added once every thread's product is done; otherwise
// the whole update, its shrink (which reads x only) not waiting for the product.
static void lora_finish(const LoRAUpdate* lora, const LoRAUpdate* lw, const LoRAGroups* g,
                        int64_t g0, int64_t g1, const bf16_t* delta) {
    if (lw) {
#pragma omp barrier
        lora_add_delta(lw, g, g0, g1, delta);
    } else if (lora) {
        lora_shrink(lora, g);
#pragma omp barrier
        lora_expand(lora, g);
    }
}
