// Body of the paged decode kernel; included by paged_decode.c with KERNEL_NAME, ELEM, LOAD and
// STORE defined. Two passes per (sequence, KV head): scores for every cached token, then the
// softmax-weighted sum of V rows.

int KERNEL_NAME(const ELEM* q, const ELEM* k_pages, const ELEM* v_pages, ELEM* out,
                const int64_t* block_tables, const int32_t* seq_lens, int64_t num_seqs,
                int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                int64_t max_blocks, float scale) {
    const int64_t group = num_heads / num_kv_heads;
    if (head_dim > MAX_HEAD_DIM || group > MAX_GROUP || group * num_kv_heads != num_heads)
        return -1;
    int64_t max_len = 1;
    for (int64_t s = 0; s < num_seqs; s++) {
        if (seq_lens[s] < 1 || seq_lens[s] > max_blocks * block_size) return -2;
        if (seq_lens[s] > max_len) max_len = seq_lens[s];
    }
    const int64_t row = num_kv_heads * head_dim;  // elements between tokens in a page
    const int64_t page = block_size * row;        // elements between pages
    int failed = 0;
#pragma omp parallel
    {
        float* scores = (float*)malloc(sizeof(float) * (size_t)(group * max_len));
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t s = 0; s < num_seqs; s++) {
            for (int64_t h = 0; h < num_kv_heads; h++) {
                if (!scores) continue;
                const int64_t len = seq_lens[s];
                const int64_t* table = block_tables + s * max_blocks;
                float qf[MAX_GROUP][MAX_HEAD_DIM];
                float acc[MAX_GROUP][MAX_HEAD_DIM];
                float xf[MAX_HEAD_DIM];
                float inv_sum[MAX_GROUP];
                for (int64_t g = 0; g < group; g++) {
                    const ELEM* qh = q + (s * num_heads + h * group + g) * head_dim;
                    for (int64_t d = 0; d < head_dim; d++) {
                        qf[g][d] = LOAD(qh[d]) * scale;
                        acc[g][d] = 0.0f;
                    }
                }
                for (int64_t j0 = 0, b = 0; j0 < len; j0 += block_size, b++) {
                    const ELEM* kb = k_pages + table[b] * page + h * head_dim;
                    const int64_t n = len - j0 < block_size ? len - j0 : block_size;
                    for (int64_t t = 0; t < n; t++) {
                        const ELEM* kr = kb + t * row;
                        for (int64_t d = 0; d < head_dim; d++) xf[d] = LOAD(kr[d]);
                        for (int64_t g = 0; g < group; g++) {
                            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                            for (int64_t d = 0; d < head_dim; d++) dot += qf[g][d] * xf[d];
                            scores[g * max_len + j0 + t] = dot;
                        }
                    }
                }
                for (int64_t g = 0; g < group; g++) {
                    float* sg = scores + g * max_len;
                    float m = -INFINITY;
                    for (int64_t j = 0; j < len; j++) m = sg[j] > m ? sg[j] : m;
                    float sum = 0.0f;
                    for (int64_t j = 0; j < len; j++) {
                        sg[j] = expf(sg[j] - m);
                        sum += sg[j];
                    }
                    inv_sum[g] = 1.0f / sum;
                }
                for (int64_t j0 = 0, b = 0; j0 < len; j0 += block_size, b++) {
                    const ELEM* vb = v_pages + table[b] * page + h * head_dim;
                    const int64_t n = len - j0 < block_size ? len - j0 : block_size;
                    for (int64_t t = 0; t < n; t++) {
                        const ELEM* vr = vb + t * row;
                        for (int64_t d = 0; d < head_dim; d++) xf[d] = LOAD(vr[d]);
                        for (int64_t g = 0; g < group; g++) {
                            const float p = scores[g * max_len + j0 + t];
#pragma omp simd
                            for (int64_t d = 0; d < head_dim; d++) acc[g][d] += p * xf[d];
                        }
                    }
                }
                for (int64_t g = 0; g < group; g++) {
                    ELEM* oh = out + (s * num_heads + h * group + g) * head_dim;
                    for (int64_t d = 0; d < head_dim; d++) oh[d] = STORE(acc[g][d] * inv_sum[g]);
                }
            }
        }
        free(scores);
    }
    return failed ? -3 : 0;
}
