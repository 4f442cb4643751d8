// Paged decode attention, instantiated by ops.c per query/output storage type (same macros as
// ops_impl.h) and per page format: pages in the same type (ELEM), or, with PAGE_FP8 defined,
// e4m3fn bytes with one float32 scale per (token, KV head) row (fp8.h). One query token per
// sequence; K/V are read in place from the page pool through the block table (no gather copy),
// and the query heads that share a KV head share each K/V row load. One work item per
// (sequence, KV head), spread over OpenMP threads. Two passes per item: scores for every
// cached token, then the softmax-weighted sum of V rows. FP8 row scales multiply each score
// (K) and each softmax weight (V) rather than every element. With `rotated`, FP8 keys were
// stored Hadamard-rotated, and each query is rotated the same way (and divided by head_dim)
// before its scores.
//
// Layouts: q [num_seqs, q_stride] with heads at h * head_dim; out [num_seqs, num_heads *
// head_dim]; pages [num_blocks, block_size, num_kv_heads, head_dim]; scales [num_blocks,
// block_size, num_kv_heads] (FP8 only, else NULL); block_tables [num_seqs, max_blocks] int64;
// seq_lens [num_seqs] int32 (tokens attended, including the new one).
// Returns 0, or a negative code when the shape is unsupported.
//
// A sequence's KV heads share its token rows, so once its first head has pulled them from
// DRAM the others compute on cached rows and memory sits idle. With enough sequences per
// thread, each thread therefore takes a run of consecutive sequences and, while it computes
// one, prefetches the next one's pages into L2 a few lines per token (KVWarm): DRAM streams
// all the time, and every sequence but the first of a run starts on cached rows.
//
// A prefill step has a row per prompt token, and a prompt's rows read the same pages: runs of
// such rows (up to 16) go together (attend_rows), each K and V row loaded once for the whole
// run, every output bit for bit what the row would get alone.

#define CAT_(a, b) a##_##b
#define CAT(a, b) CAT_(a, b)
#define FN(name) CAT(name, SUFFIX)

#define MAX_HEAD_DIM 256
#define MAX_GROUP 32
#define TILE_MIN 8  // rows of a prefill tile at least (attend_rows)
// the (group, head_dim) pairs with kernels specialised at compile time
#define STRATA_SPECIALISED_SHAPES(X)                                                        \
    X(1, 64) X(2, 64) X(3, 64) X(4, 64) X(5, 64) X(6, 64) X(7, 64) X(8, 64)                \
    X(1, 128) X(2, 128) X(3, 128) X(4, 128) X(5, 128) X(6, 128) X(7, 128) X(8, 128)

// bf16 pages with bf16 queries: both passes run bf16 dot products on the stored pairs (pass 2
// with the softmax weights rounded to bf16), and prefill rows go in tiles (attend_rows)
#if defined(ELEM_IS_BF16) && defined(STRATA_AVX512BF16) && !defined(PAGE_FP8)
#define DOT_BF16 1
#endif

#ifdef PAGE_FP8
#define PELEM uint8_t
#define PS_LOAD(x) e4m3_to_f32(x)
#ifdef STRATA_AVX512
#define PV_LOAD v_load_e4m3
#else
#define PV_LOAD v8_load_e4m3
#endif
#define ROW_SCALE(scales, slot) ((scales)[(slot) * kv_heads])
#else
#define PELEM ELEM
#define PS_LOAD(x) S_LOAD(x)
#define PV_LOAD V_LOAD
#define ROW_SCALE(scales, slot) 1.0f
#endif

static void FN(attend_one)(const ELEM* q, const PELEM* k_pages, const PELEM* v_pages,
                           const float* k_scales, const float* v_scales, ELEM* out,
                           const int64_t* table, int64_t len, int64_t group, int64_t head_dim,
                           int64_t block_size, int64_t kv_heads, int64_t row, int64_t page,
                           float scale, int rotated, float* scores, int64_t score_stride) {
    (void)k_scales, (void)v_scales, (void)kv_heads;
    float qf[MAX_GROUP][MAX_HEAD_DIM];
    float acc[MAX_GROUP][MAX_HEAD_DIM];
    float inv_sum[MAX_GROUP];
    const float q_scale = rotated ? scale / (float)head_dim : scale;
    for (int64_t g = 0; g < group; g++) {
        for (int64_t d = 0; d < head_dim; d++) {
            qf[g][d] = S_LOAD(q[g * head_dim + d]);
            acc[g][d] = 0.0f;
        }
        if (rotated) fwht_f32(qf[g], head_dim);
        for (int64_t d = 0; d < head_dim; d++) qf[g][d] *= q_scale;
    }
#ifdef STRATA_VEC
    const int vec = head_dim % VF_W == 0;
#else
    const int vec = 0;
#endif
    // pass 1: scores[g][j] = q_g . k_j
    for (int64_t j0 = 0, b = 0; j0 < len; j0 += block_size, b++) {
        const PELEM* kb = k_pages + table[b] * page;
        const int64_t n = len - j0 < block_size ? len - j0 : block_size;
        for (int64_t t = 0; t < n; t++) {
            const PELEM* kr = kb + t * row;
            const float ks = ROW_SCALE(k_scales, table[b] * block_size + t);
            for (int64_t g = 0; g < group; g++) {
                float dot = 0.0f;
                if (vec) {
#ifdef STRATA_VEC
                    vf a = vf_zero();
                    for (int64_t d = 0; d < head_dim; d += VF_W)
                        a = vf_fmadd(vf_load_f32(&qf[g][d]), PV_LOAD(kr + d), a);
                    dot = vf_reduce_add(a);
#endif
                } else {
                    for (int64_t d = 0; d < head_dim; d++) dot += qf[g][d] * PS_LOAD(kr[d]);
                }
                scores[g * score_stride + j0 + t] = dot * ks;
            }
        }
    }
    // softmax over each query head's scores
    for (int64_t g = 0; g < group; g++) {
        float* sg = scores + g * score_stride;
        float m = -INFINITY, sum = 0.0f;
        for (int64_t j = 0; j < len; j++) m = sg[j] > m ? sg[j] : m;
        int64_t j = 0;
#ifdef STRATA_VEC
        vf vsum = vf_zero();
        const vf vm = vf_set1(m);
        for (; j + VF_W <= len; j += VF_W) {
            vf e = vf_exp(vf_sub(vf_load_f32(sg + j), vm));
            vf_store_f32(sg + j, e);
            vsum = vf_add(vsum, e);
        }
        sum = vf_reduce_add(vsum);
#endif
        for (; j < len; j++) {
            sg[j] = expf(sg[j] - m);
            sum += sg[j];
        }
        inv_sum[g] = 1.0f / sum;
    }
    // pass 2: acc[g] = sum_j p[g][j] * v_j
    for (int64_t j0 = 0, b = 0; j0 < len; j0 += block_size, b++) {
        const PELEM* vb = v_pages + table[b] * page;
        const int64_t n = len - j0 < block_size ? len - j0 : block_size;
        for (int64_t t = 0; t < n; t++) {
            const PELEM* vr = vb + t * row;
            const float vs = ROW_SCALE(v_scales, table[b] * block_size + t);
            if (vec) {
#ifdef STRATA_VEC
                for (int64_t d = 0; d < head_dim; d += VF_W) {
                    const vf vv = PV_LOAD(vr + d);
                    for (int64_t g = 0; g < group; g++) {
                        const vf p = vf_set1(scores[g * score_stride + j0 + t] * vs);
                        vf_store_f32(&acc[g][d], vf_fmadd(p, vv, vf_load_f32(&acc[g][d])));
                    }
                }
#endif
            } else {
                for (int64_t g = 0; g < group; g++) {
                    const float p = scores[g * score_stride + j0 + t] * vs;
                    for (int64_t d = 0; d < head_dim; d++) acc[g][d] += p * PS_LOAD(vr[d]);
                }
            }
        }
    }
    for (int64_t g = 0; g < group; g++)
        for (int64_t d = 0; d < head_dim; d++)
            out[g * head_dim + d] = S_STORE(acc[g][d] * inv_sum[g]);
}

#ifdef STRATA_AVX512
// One key's score for one query head in fp32 (qv: the query times the softmax scale): the
// keys past a sequence's last whole group of 16.
static inline __attribute__((always_inline)) float FN(score_one)(const __m512* qv,
                                                                 const PELEM* kr, const int NV) {
    __m512 a = _mm512_mul_ps(qv[0], PV_LOAD(kr));
    for (int i = 1; i < NV; i++) a = _mm512_fmadd_ps(qv[i], PV_LOAD(kr + 16 * i), a);
    return _mm512_reduce_add_ps(a);
}

// Softmax over one query's scores (m: each head's maximum): inv_sum gets each head's
// 1 / sum, and the scores become their exponentials. With DOT_BF16 these are rounded to
// bf16 for pass 2's dot products and written over the start of the head's scores row
// (weight j at byte 2 j: each store lands on scores already read).
static inline __attribute__((always_inline)) void FN(attend_softmax)(
    float* scores, int64_t score_stride, const float* m, int64_t len, float* inv_sum,
    const int G) {
    for (int g = 0; g < G; g++) {
        float* sg = scores + g * score_stride;
        const __m512 vm = _mm512_set1_ps(m[g]);
        __m512 vsum = _mm512_setzero_ps();
        int64_t t = 0;
        for (; t + 16 <= len; t += 16) {
            const __m512 e = v_exp(_mm512_sub_ps(_mm512_loadu_ps(sg + t), vm));
#ifdef DOT_BF16
            _mm256_storeu_si256((__m256i*)((char*)sg + 2 * t), v_pack_bf16(e));
#else
            _mm512_storeu_ps(sg + t, e);
#endif
            vsum = _mm512_add_ps(vsum, e);
        }
        float sum = _mm512_reduce_add_ps(vsum);
        for (; t < len; t++) {
            const float e = expf(sg[t] - m[g]);
#ifdef DOT_BF16
            const bf16_t w = f32_to_bf16(e);
            memcpy((char*)sg + 2 * t, &w, 2);
#else
            sg[t] = e;
#endif
            sum += e;
        }
        inv_sum[g] = 1.0f / sum;
    }
}

// The pool slot of a sequence's key j.
static inline int64_t FN(key_slot)(const int64_t* table, int64_t j, int64_t block_shift) {
    return (table[j >> block_shift] << block_shift) + (j & (((int64_t)1 << block_shift) - 1));
}

#ifdef DOT_BF16
// Pass 2 on bf16 pairs: rows v0, v1 of two consecutive keys (v1 NULL: a zero row), their
// weights w (per head, one dword: key 0's bf16 in the low half). The two rows' elements are
// interleaved in 128-bit lanes, so acc[g][2c] holds dims 32c + (0-3, 8-11, 16-19, 24-27) and
// acc[g][2c + 1] dims 32c + (4-7, 12-15, 20-23, 28-31); attend_store puts them back in order.
static inline __attribute__((always_inline)) void FN(attend_pair)(
    __m512 acc[8][8], const __m512bh* w, const bf16_t* v0, const bf16_t* v1, const int G,
    const int D) {
    for (int c = 0; c < D / 32; c++) {
        const __m512i a = _mm512_loadu_si512(v0 + 32 * c);
        const __m512i b = v1 ? _mm512_loadu_si512(v1 + 32 * c) : _mm512_setzero_si512();
        const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(a, b);
        const __m512bh hi = (__m512bh)_mm512_unpackhi_epi16(a, b);
        for (int g = 0; g < G; g++) {
            acc[g][2 * c] = _mm512_dpbf16_ps(acc[g][2 * c], w[g], lo);
            acc[g][2 * c + 1] = _mm512_dpbf16_ps(acc[g][2 * c + 1], w[g], hi);
        }
    }
}

// The weights of keys j, j + 1 for each head (second NULL when j + 1 is past the end).
static inline __attribute__((always_inline)) void FN(attend_weights)(
    __m512bh* w, const float* scores, int64_t score_stride, int64_t j, int last, const int G) {
    for (int g = 0; g < G; g++) {
        uint32_t d;
        memcpy(&d, (const char*)(scores + g * score_stride) + 2 * j, 4);
        w[g] = (__m512bh)_mm512_set1_epi32((int)(last ? d & 0xffffu : d));
    }
}

static inline __attribute__((always_inline)) void FN(attend_store)(
    bf16_t* out, __m512 acc[8][8], const float* inv_sum, const int G, const int D) {
    // dims 0-15 of a 32: lanes 0-3 of the low half, 0-3 of the high half (16-19), 4-7, 20-23
    const __m512i lo_idx =
        _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i hi_idx =
        _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int g = 0; g < G; g++) {
        const __m512 vi = _mm512_set1_ps(inv_sum[g]);
        for (int c = 0; c < D / 32; c++) {
            const __m512 a = acc[g][2 * c], b = acc[g][2 * c + 1];
            v_store_bf16(out + g * D + 32 * c,
                         _mm512_mul_ps(_mm512_permutex2var_ps(a, lo_idx, b), vi));
            v_store_bf16(out + g * D + 32 * c + 16,
                         _mm512_mul_ps(_mm512_permutex2var_ps(a, hi_idx, b), vi));
        }
    }
}
#endif

// Softmax and pass 2, the weighted V rows by 16-token groups, into out.
static inline __attribute__((always_inline)) void FN(attend_finish)(
    float* scores, int64_t score_stride, const float* m, int64_t len, const PELEM* v_pages,
    const float* v_scales, const int64_t* table, int64_t block_shift, int64_t kv_heads,
    int64_t row, int64_t page, KVWarm* warm, ELEM* out, const int G, const int D) {
    (void)v_scales, (void)kv_heads;
    const int head_bytes = (int)(D * (int64_t)sizeof(PELEM));
    const int NV = D / 16;
    const int64_t block_mask = ((int64_t)1 << block_shift) - 1;
    const int grouped = block_shift >= 4;
    float inv_sum[8];
    FN(attend_softmax)(scores, score_stride, m, len, inv_sum, G);
    // pass 2: weighted V, by the same 16-token groups
#ifdef DOT_BF16
    const PELEM* v_even = 0;
#endif
    __m512 acc[8][8];
    for (int g = 0; g < G; g++)
        for (int i = 0; i < NV; i++) acc[g][i] = _mm512_setzero_ps();
    for (int64_t t0 = 0; t0 < len; t0 += 16) {
        const int64_t n = len - t0 < 16 ? len - t0 : 16;
        const int whole = grouped && n == 16;
        const int64_t slot0 = (table[t0 >> block_shift] << block_shift) + (t0 & block_mask);
        const int64_t nx0 = t0 + 16 < len ? t0 + 16 : t0;
        const char* ahead = (const char*)(v_pages + ((table[nx0 >> block_shift] << block_shift) +
                                                     (nx0 & block_mask)) * row);
        for (int64_t u = 0; u < n; u++) {
            const int64_t tt = t0 + u;
            int64_t slot = slot0 + u;
            if (whole) {
                for (int c = 0; c < head_bytes; c += 64)
                    _mm_prefetch(ahead + u * row * (int64_t)sizeof(PELEM) + c, _MM_HINT_T0);
                kv_warm(warm);
            } else {
                slot = (table[tt >> block_shift] << block_shift) + (tt & block_mask);
                const int64_t nx = tt + 16 < len ? tt + 16 : len - 1;
                const char* ah = (const char*)(v_pages + table[nx >> block_shift] * page +
                                               (nx & block_mask) * row);
                for (int c = 0; c < head_bytes; c += 64) _mm_prefetch(ah + c, _MM_HINT_T0);
                kv_warm(warm);
            }
            const PELEM* vr = v_pages + slot * row;
#ifdef DOT_BF16
            // keys by pairs: an even key waits for the next one, unless it is the last
            if (!(u & 1) && u + 1 < n) {
                v_even = vr;
                continue;
            }
            const int odd = (int)(u & 1);
            __m512bh w[8];
            FN(attend_weights)(w, scores, score_stride, odd ? tt - 1 : tt, !odd, G);
            FN(attend_pair)(acc, w, odd ? v_even : vr, odd ? vr : 0, G, D);
#else
            const float vs = ROW_SCALE(v_scales, slot);
            __m512 p[8];
            for (int g = 0; g < G; g++) p[g] = _mm512_set1_ps(scores[g * score_stride + tt] * vs);
            for (int i = 0; i < NV; i++) {
                const __m512 vv = PV_LOAD(vr + 16 * i);
                for (int g = 0; g < G; g++) acc[g][i] = _mm512_fmadd_ps(p[g], vv, acc[g][i]);
            }
#endif
        }
    }
#ifdef DOT_BF16
    FN(attend_store)(out, acc, inv_sum, G, D);
#else
    for (int g = 0; g < G; g++) {
        const __m512 vi = _mm512_set1_ps(inv_sum[g]);
        for (int i = 0; i < NV; i++) V_STORE(out + g * D + 16 * i, _mm512_mul_ps(acc[g][i], vi));
    }
#endif
}

// Specialised for compile-time (group, head_dim) so that queries and accumulators live in
// registers. Scores for 16 tokens at a time come out of one 16-way horizontal sum.
static inline __attribute__((always_inline)) void FN(attend_fast)(
    const ELEM* q, const PELEM* k_pages, const PELEM* v_pages, const float* k_scales,
    const float* v_scales, ELEM* out, const int64_t* table, int64_t len, int64_t block_shift,
    int64_t kv_heads, int64_t row, int64_t page, float scale, int rotated, float* scores,
    int64_t score_stride, KVWarm* warm, const int G, const int D) {
    (void)k_scales, (void)v_scales, (void)kv_heads, (void)rotated;
    // rows 16 tokens ahead are prefetched into L1, this head's part of them only: KVWarm has
    // brought the whole pages to L2, and three times the prefetches cost more than they gain
    const int head_bytes = (int)(D * (int64_t)sizeof(PELEM));
    const int NV = D / 16;
    const int64_t block_mask = ((int64_t)1 << block_shift) - 1;
    __m512 qv[8][8];
    const __m512 vscale = _mm512_set1_ps(scale);
#ifdef PAGE_FP8
    if (rotated) {
        float qr[8][128];
        const __m512 qscale = _mm512_set1_ps(scale / (float)D);
        for (int g = 0; g < G; g++) {
            for (int d = 0; d < D; d++) qr[g][d] = S_LOAD(q[g * D + d]);
            fwht_f32(qr[g], D);
            for (int i = 0; i < NV; i++) qv[g][i] = _mm512_mul_ps(_mm512_loadu_ps(&qr[g][16 * i]), qscale);
        }
    } else
#endif
    for (int g = 0; g < G; g++)
        for (int i = 0; i < NV; i++) qv[g][i] = _mm512_mul_ps(V_LOAD(q + g * D + 16 * i), vscale);
    // With blocks of 16 tokens or more, a 16-token group (j a multiple of 16) lies in one
    // block: its rows are consecutive, and one table lookup serves the whole group. (Both
    // cases are written out: one loop choosing per token measured 8-10% slower.)
    const int grouped = block_shift >= 4;
    // pass 1: scores, 16 tokens per horizontal sum, and each head's running maximum
    __m512 vmax[8];
    float tail_max[8];
    for (int g = 0; g < G; g++) {
        vmax[g] = _mm512_set1_ps(-INFINITY);
        tail_max[g] = -INFINITY;
    }
    int64_t j = 0;
#ifdef DOT_BF16
    // bf16 pages: dot products straight on the stored pairs, no conversion of K rows
    __m512bh qb[8][4];
    for (int g = 0; g < G; g++)
        for (int i = 0; i < NV / 2; i++)
            qb[g][i] = (__m512bh)_mm512_loadu_si512((const void*)(q + g * D + 32 * i));
#endif
    for (; j + 16 <= len; j += 16) {
        const PELEM* rows[16];
#ifdef PAGE_FP8
        float row_scales[16];
#endif
        if (grouped) {
            const int64_t slot0 = (table[j >> block_shift] << block_shift) + (j & block_mask);
            // pages are scattered: fetch the next group's rows while these are being used
            const int64_t nx = j + 16 < len ? j + 16 : j;
            const char* ahead = (const char*)(k_pages + ((table[nx >> block_shift] << block_shift) +
                                                         (nx & block_mask)) * row);
            for (int t = 0; t < 16; t++) {
                rows[t] = k_pages + (slot0 + t) * row;
#ifdef PAGE_FP8
                row_scales[t] = ROW_SCALE(k_scales, slot0 + t);
#endif
                for (int c = 0; c < head_bytes; c += 64)
                    _mm_prefetch(ahead + t * row * (int64_t)sizeof(PELEM) + c, _MM_HINT_T0);
                kv_warm(warm);
            }
        } else {
            for (int t = 0; t < 16; t++) {
                const int64_t jj = j + t;
                const int64_t slot = (table[jj >> block_shift] << block_shift) + (jj & block_mask);
                rows[t] = k_pages + slot * row;
#ifdef PAGE_FP8
                row_scales[t] = ROW_SCALE(k_scales, slot);
#endif
                const int64_t nx = jj + 16 < len ? jj + 16 : len - 1;
                const char* ahead = (const char*)(k_pages + table[nx >> block_shift] * page +
                                                  (nx & block_mask) * row);
                for (int c = 0; c < head_bytes; c += 64) _mm_prefetch(ahead + c, _MM_HINT_T0);
                kv_warm(warm);
            }
        }
        for (int g = 0; g < G; g++) {
            __m512 acc[16];
#ifdef DOT_BF16
            for (int t = 0; t < 16; t++) {
                __m512 a = _mm512_setzero_ps();
                for (int i = 0; i < NV / 2; i++)
                    a = _mm512_dpbf16_ps(
                        a, qb[g][i], (__m512bh)_mm512_loadu_si512((const void*)(rows[t] + 32 * i)));
                acc[t] = a;
            }
            const __m512 s = _mm512_mul_ps(v_hsum16(acc), vscale);
#else
            for (int t = 0; t < 16; t++) {
                __m512 a = _mm512_mul_ps(qv[g][0], PV_LOAD(rows[t]));
                for (int i = 1; i < NV; i++) a = _mm512_fmadd_ps(qv[g][i], PV_LOAD(rows[t] + 16 * i), a);
                acc[t] = a;
            }
#ifdef PAGE_FP8
            const __m512 s = _mm512_mul_ps(v_hsum16(acc), _mm512_loadu_ps(row_scales));
#else
            const __m512 s = v_hsum16(acc);
#endif
#endif
            _mm512_storeu_ps(scores + g * score_stride + j, s);
            vmax[g] = _mm512_max_ps(vmax[g], s);
        }
    }
    for (; j < len; j++) {
        const int64_t slot = (table[j >> block_shift] << block_shift) + (j & block_mask);
        const PELEM* kr = k_pages + slot * row;
        const float ks = ROW_SCALE(k_scales, slot);
        for (int g = 0; g < G; g++) {
            const float sc = FN(score_one)(qv[g], kr, NV) * ks;
            scores[g * score_stride + j] = sc;
            tail_max[g] = sc > tail_max[g] ? sc : tail_max[g];
        }
    }
    // softmax and pass 2
    float m[8];
    for (int g = 0; g < G; g++) {
        const float vm_max = _mm512_reduce_max_ps(vmax[g]);
        m[g] = vm_max > tail_max[g] ? vm_max : tail_max[g];
    }
    FN(attend_finish)(scores, score_stride, m, len, v_pages, v_scales, table, block_shift,
                      kv_heads, row, page, warm, out, G, D);
}

#ifdef DOT_BF16
// Prefill: R <= 16 query rows of one sequence (lens nondecreasing, every row's keys behind
// `table`), one KV head. Pass 1 puts the rows in the vector lanes, so each K row is loaded
// once for all of them and each score needs no horizontal sum of its own. Every score is
// still attend_fast's bit for bit: there, lane l of a key's accumulator holds the dword pairs
// l, 16 + l, ... of the dot product, and its 16-way sum (v_hsum16) adds the lanes as
// ((0 + 2) + (1 + 3)) + ((4 + 6) + (5 + 7)), then those two quads' sum plus the other two's;
// here partial l is that same chain of pairs, summed in that same order. The keys past a
// row's last whole 16-token group and the softmax are attend_fast's, row by row; pass 2
// interleaves each block of V rows in pairs once for all the rows, and runs each row's sums
// over its key pairs in attend_finish's order. scores: R * G rows of score_stride; out rows
// out_stride apart.
static inline __attribute__((always_inline)) void FN(attend_rows)(
    const ELEM* q, int64_t q_stride, const PELEM* k_pages, const PELEM* v_pages, ELEM* out,
    int64_t out_stride, const int64_t* table, const int32_t* lens, int R, int64_t block_shift,
    int64_t row, float scale, float* scores, int64_t score_stride, const int G, const int D) {
    const int NP = D / 2;  // bf16 pairs per head
    const int NV = D / 16;
    const __m512 vscale = _mm512_set1_ps(scale);
    __m512i qt[8 * 64];  // [g][pair]: lane r holds row r's pair (zero past R)
    for (int g = 0; g < G; g++)
        for (int p = 0; p < NP; p++) {
            int32_t lanes[16] = {0};
            for (int r = 0; r < R; r++) memcpy(&lanes[r], q + r * q_stride + g * D + 2 * p, 4);
            qt[g * NP + p] = _mm512_loadu_si512(lanes);
        }
    __m512 vmax[16][8];  // [row][g], as attend_fast keeps them
    for (int r = 0; r < R; r++)
        for (int g = 0; g < G; g++) vmax[r][g] = _mm512_set1_ps(-INFINITY);
    const int64_t whole = lens[R - 1] & ~(int64_t)15;  // the longest row's whole groups
    for (int64_t j = 0; j < whole; j += 16) {
        __m512 st[8][16];  // [g][key]: the rows' scores in the lanes
        const PELEM* kr[16];
        for (int t = 0; t < 16; t++) {
            const int64_t jj = j + t;
            kr[t] = k_pages + FN(key_slot)(table, jj, block_shift) * row;
            // the next group's rows: pages are scattered
            const char* ahead = (const char*)(k_pages +
                                              FN(key_slot)(table, jj + 16 < whole ? jj + 16 : jj,
                                                           block_shift) * row);
            for (int c = 0; c < D * (int)sizeof(PELEM); c += 64)
                _mm_prefetch(ahead + c, _MM_HINT_T0);
        }
        for (int g = 0; g < G; g++) {
            // by quads of partials, their query pairs held in registers across the 16 keys
            __m512 xs[4][16];
            for (int k = 0; k < 4; k++) {
                __m512bh qk[4][4];  // [i][c]: partial 4k + i, pair 16c + 4k + i
                for (int i = 0; i < 4; i++)
                    for (int c = 0; c < NP / 16; c++)
                        qk[i][c] = (__m512bh)qt[g * NP + 16 * c + 4 * k + i];
                for (int t = 0; t < 16; t++) {
                    __m512 part[4];
                    for (int i = 0; i < 4; i++) {
                        __m512 a = _mm512_setzero_ps();
                        for (int c = 0; c < NP / 16; c++) {
                            int32_t v;
                            memcpy(&v, kr[t] + 2 * (16 * c + 4 * k + i), 4);
                            a = _mm512_dpbf16_ps(a, qk[i][c], (__m512bh)_mm512_set1_epi32(v));
                        }
                        part[i] = a;
                    }
                    xs[k][t] = _mm512_add_ps(_mm512_add_ps(part[0], part[2]),
                                             _mm512_add_ps(part[1], part[3]));
                }
            }
            for (int t = 0; t < 16; t++)
                st[g][t] = _mm512_mul_ps(_mm512_add_ps(_mm512_add_ps(xs[0][t], xs[1][t]),
                                                       _mm512_add_ps(xs[2][t], xs[3][t])),
                                         vscale);
        }
        for (int g = 0; g < G; g++) {
            v_transpose16(st[g]);  // st[g][r]: row r's 16 scores
            for (int r = 0; r < R; r++)
                if (j + 16 <= lens[r]) {
                    _mm512_storeu_ps(scores + (r * G + g) * score_stride + j, st[g][r]);
                    vmax[r][g] = _mm512_max_ps(vmax[r][g], st[g][r]);
                }
        }
    }
    float inv_sum[16][8];
    for (int r = 0; r < R; r++) {
        const int64_t len = lens[r];
        float* sr = scores + r * G * score_stride;
        float m[8];
        __m512 qv[8][8];
        for (int g = 0; g < G; g++) {
            for (int i = 0; i < NV; i++)
                qv[g][i] = _mm512_mul_ps(V_LOAD(q + r * q_stride + g * D + 16 * i), vscale);
            m[g] = -INFINITY;
        }
        for (int64_t jj = len & ~(int64_t)15; jj < len; jj++) {
            const PELEM* kr = k_pages + FN(key_slot)(table, jj, block_shift) * row;
            for (int g = 0; g < G; g++) {
                const float sc = FN(score_one)(qv[g], kr, NV);
                sr[g * score_stride + jj] = sc;
                m[g] = sc > m[g] ? sc : m[g];
            }
        }
        for (int g = 0; g < G; g++) {
            const float vm_max = _mm512_reduce_max_ps(vmax[r][g]);
            m[g] = vm_max > m[g] ? vm_max : m[g];
        }
        FN(attend_softmax)(sr, score_stride, m, len, inv_sum[r], G);
    }
    // pass 2, by blocks of keys
    __m512 acc[16][8][8];  // [row][g][attend_pair's halves]
    for (int r = 0; r < R; r++)
        for (int g = 0; g < G; g++)
            for (int i = 0; i < NV; i++) acc[r][g][i] = _mm512_setzero_ps();
    enum { VB = 64 };  // keys per block, even
    __m512bh vp2[VB / 2][8];
    for (int64_t j = 0; j < lens[R - 1]; j += VB) {
        const int64_t n = lens[R - 1] - j < VB ? lens[R - 1] - j : VB;
        for (int64_t u = 0; u < n; u += 2) {
            const PELEM* v0 = v_pages + FN(key_slot)(table, j + u, block_shift) * row;
            const PELEM* v1 =
                u + 1 < n ? v_pages + FN(key_slot)(table, j + u + 1, block_shift) * row : 0;
            for (int c = 0; c < D / 32; c++) {
                const __m512i x = _mm512_loadu_si512(v0 + 32 * c);
                const __m512i y = v1 ? _mm512_loadu_si512(v1 + 32 * c) : _mm512_setzero_si512();
                vp2[u / 2][2 * c] = (__m512bh)_mm512_unpacklo_epi16(x, y);
                vp2[u / 2][2 * c + 1] = (__m512bh)_mm512_unpackhi_epi16(x, y);
            }
        }
        for (int r = 0; r < R; r++) {
            const int64_t nr = lens[r] - j < n ? lens[r] - j : n;
            const float* sr = scores + r * G * score_stride;
            __m512 a[8][8];
            for (int g = 0; g < G; g++)
                for (int i = 0; i < NV; i++) a[g][i] = acc[r][g][i];
            __m512bh w[8];
            for (int64_t u = 0; u + 1 < nr; u += 2) {
                FN(attend_weights)(w, sr, score_stride, j + u, 0, G);
                for (int i = 0; i < NV; i++)
                    for (int g = 0; g < G; g++)
                        a[g][i] = _mm512_dpbf16_ps(a[g][i], w[g], vp2[u / 2][i]);
            }
            if (nr > 0 && nr & 1) {  // the row's last key, alone
                FN(attend_weights)(w, sr, score_stride, j + nr - 1, 1, G);
                const PELEM* v0 = v_pages + FN(key_slot)(table, j + nr - 1, block_shift) * row;
                FN(attend_pair)(a, w, v0, 0, G, D);
            }
            for (int g = 0; g < G; g++)
                for (int i = 0; i < NV; i++) acc[r][g][i] = a[g][i];
        }
    }
    for (int r = 0; r < R; r++)
        FN(attend_store)(out + r * out_stride, acc[r], inv_sum[r], G, D);
}

#define STRATA_ROWS_CASE(G_, D_)                                                            \
    if (group == G_ && head_dim == D_) {                                                    \
        FN(attend_rows)(q, q_stride, kp, vp, out, out_stride, table, lens, R, block_shift,  \
                        row, scale, scores, score_stride, G_, D_);                          \
        return 1;                                                                           \
    }

// Returns 1 when a specialisation handled the rows.
static int FN(rows_dispatch)(const ELEM* q, int64_t q_stride, const PELEM* kp, const PELEM* vp,
                             ELEM* out, int64_t out_stride, const int64_t* table,
                             const int32_t* lens, int R, int64_t group, int64_t head_dim,
                             int64_t block_shift, int64_t row, float scale, float* scores,
                             int64_t score_stride) {
    STRATA_SPECIALISED_SHAPES(STRATA_ROWS_CASE)
    return 0;
}
#undef STRATA_ROWS_CASE
#endif

#define STRATA_ATTEND_CASE(G_, D_)                                                          \
    if (group == G_ && head_dim == D_) {                                                    \
        FN(attend_fast)(qs, kp, vp, ks, vs, os, tb, len, block_shift, kv_heads, row, page,  \
                        scale, rotated, scores, max_len, warm, G_, D_);                     \
        return 1;                                                                           \
    }

// Returns 1 when a specialisation handled the item.
static int FN(attend_dispatch)(const ELEM* qs, const PELEM* kp, const PELEM* vp,
                               const float* ks, const float* vs, ELEM* os, const int64_t* tb,
                               int64_t len, int64_t group, int64_t head_dim, int64_t block_shift,
                               int64_t kv_heads, int64_t row, int64_t page, float scale,
                               int rotated, float* scores, int64_t max_len,
                               KVWarm* warm) {
    STRATA_SPECIALISED_SHAPES(STRATA_ATTEND_CASE)
    return 0;
}
#undef STRATA_ATTEND_CASE
#endif

#ifdef STRATA_AVX2
// The AVX2 decode path, specialised for compile-time (group, head_dim) like attend_fast: pass 1
// takes 8 tokens at a time, their scores out of one 8-way horizontal sum (v8_hsum8), each
// head's running maximum kept as it goes; the softmax runs 8 scores per exponential; pass 2
// walks the V rows once per slice of head_dim whose G accumulators fit the 16 registers, the
// softmax weights broadcast per token. bf16 and FP8 values are widened on load (AVX2 has no
// bf16 dot product). The next sequence's pages are warmed as in attend_fast.
static inline __attribute__((always_inline)) float FN(score_one8)(const __m256* qv,
                                                                  const PELEM* kr, const int NV) {
    __m256 a = _mm256_mul_ps(qv[0], PV_LOAD(kr));
    for (int i = 1; i < NV; i++) a = _mm256_fmadd_ps(qv[i], PV_LOAD(kr + 8 * i), a);
    return v8_reduce_add(a);
}

static inline __attribute__((always_inline)) void FN(attend_fast)(
    const ELEM* q, const PELEM* k_pages, const PELEM* v_pages, const float* k_scales,
    const float* v_scales, ELEM* out, const int64_t* table, int64_t len, int64_t block_shift,
    int64_t kv_heads, int64_t row, int64_t page, float scale, int rotated, float* scores,
    int64_t score_stride, KVWarm* warm, const int G, const int D) {
    (void)k_scales, (void)v_scales, (void)kv_heads, (void)rotated, (void)page;
    const int NV = D / 8;
    const int head_bytes = (int)(D * (int64_t)sizeof(PELEM));
    const int64_t block_mask = ((int64_t)1 << block_shift) - 1;
    __m256 qv[8][16];
    float qr[8][128];
    const float q_scale = rotated ? scale / (float)D : scale;
    for (int g = 0; g < G; g++) {
        for (int d = 0; d < D; d++) qr[g][d] = S_LOAD(q[g * D + d]);
#ifdef PAGE_FP8
        if (rotated) fwht_f32(qr[g], D);
#endif
        for (int i = 0; i < NV; i++)
            qv[g][i] = _mm256_mul_ps(_mm256_loadu_ps(&qr[g][8 * i]), _mm256_set1_ps(q_scale));
    }
    // pass 1: scores, 8 tokens per horizontal sum
    __m256 vmax[8];
    float m[8];
    for (int g = 0; g < G; g++) vmax[g] = _mm256_set1_ps(-INFINITY), m[g] = -INFINITY;
    int64_t j = 0;
    for (; j + 8 <= len; j += 8) {
        const PELEM* rows[8];
        float row_scales[8];
        for (int t = 0; t < 8; t++) {
            const int64_t jj = j + t;
            const int64_t slot = (table[jj >> block_shift] << block_shift) + (jj & block_mask);
            rows[t] = k_pages + slot * row;
            row_scales[t] = ROW_SCALE(k_scales, slot);
            // pages are scattered: fetch the row 8 tokens ahead while these are used
            const int64_t nx = jj + 8 < len ? jj + 8 : len - 1;
            const char* ahead = (const char*)(k_pages + ((table[nx >> block_shift] << block_shift) +
                                                         (nx & block_mask)) * row);
            for (int c = 0; c < head_bytes; c += 64) _mm_prefetch(ahead + c, _MM_HINT_T0);
            kv_warm(warm);
        }
        (void)row_scales;
        for (int g = 0; g < G; g++) {
            __m256 acc[8];
            for (int t = 0; t < 8; t++) {
                __m256 a = _mm256_mul_ps(qv[g][0], PV_LOAD(rows[t]));
                for (int i = 1; i < NV; i++) a = _mm256_fmadd_ps(qv[g][i], PV_LOAD(rows[t] + 8 * i), a);
                acc[t] = a;
            }
#ifdef PAGE_FP8
            const __m256 sc = _mm256_mul_ps(v8_hsum8(acc), _mm256_loadu_ps(row_scales));
#else
            const __m256 sc = v8_hsum8(acc);
#endif
            _mm256_storeu_ps(scores + g * score_stride + j, sc);
            vmax[g] = _mm256_max_ps(vmax[g], sc);
        }
    }
    for (; j < len; j++) {
        const int64_t slot = (table[j >> block_shift] << block_shift) + (j & block_mask);
        const PELEM* kr = k_pages + slot * row;
        const float ks = ROW_SCALE(k_scales, slot);
        for (int g = 0; g < G; g++) {
            const float sc = FN(score_one8)(qv[g], kr, NV) * ks;
            scores[g * score_stride + j] = sc;
            m[g] = sc > m[g] ? sc : m[g];
        }
    }
    // softmax: the exponentials over the scores, and each head's 1 / sum
    float inv_sum[8];
    for (int g = 0; g < G; g++) {
        const float vm_max = v8_reduce_max(vmax[g]);
        m[g] = vm_max > m[g] ? vm_max : m[g];
        float* sg = scores + g * score_stride;
        const __m256 vm = _mm256_set1_ps(m[g]);
        __m256 vsum = _mm256_setzero_ps();
        int64_t t = 0;
        for (; t + 8 <= len; t += 8) {
            const __m256 e = v8_exp(_mm256_sub_ps(_mm256_loadu_ps(sg + t), vm));
            _mm256_storeu_ps(sg + t, e);
            vsum = _mm256_add_ps(vsum, e);
        }
        float sum = v8_reduce_add(vsum);
        for (; t < len; t++) {
            sg[t] = expf(sg[t] - m[g]);
            sum += sg[t];
        }
        inv_sum[g] = 1.0f / sum;
    }
    // pass 2: slices of CW vectors of head_dim, G * CW accumulators in registers
    const int CW = G <= 1 ? 8 : G <= 2 ? 4 : G <= 4 ? 2 : 1;
    for (int i0 = 0; i0 < NV; i0 += CW) {
        __m256 acc[8][8];
        for (int g = 0; g < G; g++)
            for (int i = 0; i < CW; i++) acc[g][i] = _mm256_setzero_ps();
        for (int64_t tt = 0; tt < len; tt++) {
            const int64_t slot = (table[tt >> block_shift] << block_shift) + (tt & block_mask);
            const PELEM* vr = v_pages + slot * row + 8 * i0;
            if (i0 == 0) {
                const int64_t nx = tt + 8 < len ? tt + 8 : len - 1;
                const char* ah = (const char*)(v_pages + ((table[nx >> block_shift] << block_shift) +
                                                          (nx & block_mask)) * row);
                for (int c = 0; c < head_bytes; c += 64) _mm_prefetch(ah + c, _MM_HINT_T0);
                kv_warm(warm);
            }
            const float vs = ROW_SCALE(v_scales, slot);
            __m256 vv[8];
            for (int i = 0; i < CW; i++) vv[i] = PV_LOAD(vr + 8 * i);
            for (int g = 0; g < G; g++) {
                const __m256 p = _mm256_set1_ps(scores[g * score_stride + tt] * vs);
                for (int i = 0; i < CW; i++) acc[g][i] = _mm256_fmadd_ps(p, vv[i], acc[g][i]);
            }
        }
        for (int g = 0; g < G; g++) {
            const __m256 vi = _mm256_set1_ps(inv_sum[g]);
            for (int i = 0; i < CW; i++)
                V_STORE(out + g * D + 8 * (i0 + i), _mm256_mul_ps(acc[g][i], vi));
        }
    }
}

#define STRATA_ATTEND_CASE(G_, D_)                                                          \
    if (group == G_ && head_dim == D_) {                                                    \
        FN(attend_fast)(qs, kp, vp, ks, vs, os, tb, len, block_shift, kv_heads, row, page,  \
                        scale, rotated, scores, max_len, warm, G_, D_);                     \
        return 1;                                                                           \
    }

// Returns 1 when a specialisation handled the item.
static int FN(attend_dispatch)(const ELEM* qs, const PELEM* kp, const PELEM* vp,
                               const float* ks, const float* vs, ELEM* os, const int64_t* tb,
                               int64_t len, int64_t group, int64_t head_dim, int64_t block_shift,
                               int64_t kv_heads, int64_t row, int64_t page, float scale,
                               int rotated, float* scores, int64_t max_len,
                               KVWarm* warm) {
    STRATA_SPECIALISED_SHAPES(STRATA_ATTEND_CASE)
    return 0;
}
#undef STRATA_ATTEND_CASE
#endif

int FN(strata_paged_decode)(const ELEM* q, int64_t q_stride, const PELEM* k_pages,
                            const PELEM* v_pages, const float* k_scales, const float* v_scales,
                            ELEM* out, const int64_t* block_tables,
                            const int32_t* seq_lens, int64_t num_seqs, int64_t num_heads,
                            int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                            int64_t max_blocks, float scale, int rotated) {
    const int64_t group = num_heads / num_kv_heads, kv_heads = num_kv_heads;
#ifdef PAGE_FP8
    if (!k_scales || !v_scales) return -5;
    if (rotated && (head_dim & (head_dim - 1))) return -6;  // rotation needs a power of two
#else
    if (rotated) return -6;  // only FP8 keys are stored rotated
#endif
    if (head_dim > MAX_HEAD_DIM || group > MAX_GROUP || group * num_kv_heads != num_heads)
        return -1;
    int64_t max_len = 1;
    for (int64_t s = 0; s < num_seqs; s++) {
        if (seq_lens[s] < 1 || seq_lens[s] > max_blocks * block_size) return -2;
        if (seq_lens[s] > max_len) max_len = seq_lens[s];
    }
    const int64_t row = num_kv_heads * head_dim;
    const int64_t page = block_size * row;
    int64_t block_shift = 0;
    while (((int64_t)1 << block_shift) < block_size) block_shift++;
    if (((int64_t)1 << block_shift) != block_size) return -4;  // power of two only
    int failed = 0;
    // Consecutive rows that share their blocks (a prompt's rows in a prefill step) go in tiles
    // (attend_rows). A tile's scores pass costs the same for 1 row as for 16, so runs shorter
    // than TILE_MIN rows take the one-row path, and tiles are used only when every thread can
    // have one of TILE_MIN rows or more.
    const int64_t threads = omp_get_max_threads();
    int tiles = 0;
#ifdef DOT_BF16
    if ((head_dim == 64 || head_dim == 128) && group <= 8 && num_seqs >= TILE_MIN * threads)
        for (int64_t s = 0; s + 1 < num_seqs && !tiles; s++)
            tiles = rows_share(block_tables, seq_lens, max_blocks, block_size, s, s + 1);
#endif
    // sequences per work item: up to 8, while every thread still gets two items or more; with
    // tiles, 16 rows, or one item per thread
    int64_t chunk = num_seqs / (2 * threads);
    chunk = chunk < 1 ? 1 : chunk > 8 ? 8 : chunk;
    if (tiles) chunk = num_seqs / threads < 16 ? num_seqs / threads : 16;
    const int64_t items = chunk > 1 ? (num_seqs + chunk - 1) / chunk : num_seqs * num_kv_heads;
#pragma omp parallel if (items > 1)
    {
        const int64_t rows = tiles ? 16 : 1;  // scores of up to 16 rows at once
        float* scores = (float*)malloc(sizeof(float) * (size_t)(rows * group * max_len));
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, chunk > 1 ? 1 : 8)
        for (int64_t item = 0; item < items; item++) {
            if (!scores) continue;
            // one (sequence, KV head), or `chunk` sequences with every KV head
            const int64_t s0 = chunk > 1 ? item * chunk : item / num_kv_heads;
            const int64_t s1 = chunk > 1 ? (s0 + chunk < num_seqs ? s0 + chunk : num_seqs) : s0 + 1;
            for (int64_t s = s0; s < s1; s++) {
#ifdef DOT_BF16
                if (tiles && chunk > 1) {
                    int64_t e = s + 1;
                    while (e < s1 && e - s < 16 &&
                           rows_share(block_tables, seq_lens, max_blocks, block_size, e - 1, e))
                        e++;
                    if (e - s >= TILE_MIN) {
                        for (int64_t h = 0; h < num_kv_heads; h++)
                            FN(rows_dispatch)(q + s * q_stride + h * group * head_dim, q_stride,
                                              k_pages + h * head_dim, v_pages + h * head_dim,
                                              out + (s * num_heads + h * group) * head_dim,
                                              num_heads * head_dim,
                                              block_tables + (e - 1) * max_blocks, seq_lens + s,
                                              (int)(e - s), group, head_dim, block_shift, row,
                                              scale, scores, max_len);
                        s = e - 1;
                        continue;
                    }
                }
#endif
                // The first sequence of a run has had no warm: its first head fetches all of
                // its pages during its scores pass (many misses in flight, not one row at a
                // time), and the other heads' passes warm the next sequence.
                const int64_t page_bytes = page * (int64_t)sizeof(PELEM);
                const int self_warm = chunk > 1 && s == s0 && num_kv_heads > 1;
                KVWarm warm = {0}, self = {0};
                if (self_warm)
                    self = kv_warm_seq(k_pages, v_pages, block_tables + s * max_blocks,
                                       page_bytes, (seq_lens[s] + block_size - 1) / block_size,
                                       seq_lens[s]);
                if (chunk > 1 && s + 1 < s1)  // one call per token, pass and (warming) head
                    warm = kv_warm_seq(k_pages, v_pages, block_tables + (s + 1) * max_blocks,
                                       page_bytes, (seq_lens[s + 1] + block_size - 1) / block_size,
                                       (num_kv_heads - self_warm) * 2 * seq_lens[s]);
                const int64_t h0 = chunk > 1 ? 0 : item % num_kv_heads;
                const int64_t h1 = chunk > 1 ? num_kv_heads : h0 + 1;
                for (int64_t h = h0; h < h1; h++) {
                    KVWarm* wp = self_warm && h == 0 ? &self : warm.k ? &warm : 0;
                    const ELEM* qs = q + s * q_stride + h * group * head_dim;
                    const PELEM* kp = k_pages + h * head_dim;
                    const PELEM* vp = v_pages + h * head_dim;
                    const float* ks = k_scales ? k_scales + h : 0;
                    const float* vs = v_scales ? v_scales + h : 0;
                    ELEM* os = out + (s * num_heads + h * group) * head_dim;
                    const int64_t* tb = block_tables + s * max_blocks;
#ifdef STRATA_VEC
                    if (FN(attend_dispatch)(qs, kp, vp, ks, vs, os, tb, seq_lens[s], group,
                                            head_dim, block_shift, kv_heads, row, page, scale,
                                            rotated, scores, max_len, wp))
                        continue;
#endif
                    FN(attend_one)(qs, kp, vp, ks, vs, os, tb, seq_lens[s], group, head_dim,
                                   block_size, kv_heads, row, page, scale, rotated, scores,
                                   max_len);
                }
            }
        }
        free(scores);
    }
    return failed ? -3 : 0;
}

#undef FN
#undef CAT
#undef CAT_
#undef MAX_HEAD_DIM
#undef MAX_GROUP
#undef STRATA_SPECIALISED_SHAPES
#undef TILE_MIN
#undef PELEM
#undef PS_LOAD
#undef PV_LOAD
#undef ROW_SCALE
#undef DOT_BF16
