// The quantizing KV-page write, instantiated per input storage type by ops.c (SUFFIX, ELEM,
// S_LOAD as in ops_impl.h). k, v: [tokens] rows of kv_heads * head_dim (row strides k_stride,
// v_stride); pages: [slots, kv_heads, head_dim] bytes; scales: [slots, kv_heads] float32.
// rotate_k: Hadamard-rotate key rows before quantizing them (head_dim a power of two).
// Returns 0, or -1 when head_dim is wider than FP8_MAX_ROW.

#define CAT_(a, b) a##_##b
#define CAT(a, b) CAT_(a, b)
#define FN(name) CAT(name, SUFFIX)

static void FN(quantize_row)(const ELEM* x, uint8_t* out, float* scale, int64_t n, int rotate) {
    float row[FP8_MAX_ROW];
    for (int64_t d = 0; d < n; d++) row[d] = S_LOAD(x[d]);
    if (rotate) fwht_f32(row, n);
    float amax = 0.0f;
    for (int64_t d = 0; d < n; d++) {
        const float a = fabsf(row[d]);
        amax = a > amax ? a : amax;
    }
    const float s = amax > 0.0f ? amax / E4M3_MAX : 1.0f;
    for (int64_t d = 0; d < n; d++) {
        float y = row[d] / s;
        y = y > E4M3_MAX ? E4M3_MAX : (y < -E4M3_MAX ? -E4M3_MAX : y);
        out[d] = f32_to_e4m3(y);
    }
    *scale = s;
}

int FN(strata_kv_write_fp8)(const ELEM* k, const ELEM* v, int64_t k_stride, int64_t v_stride,
                            uint8_t* k_pages, uint8_t* v_pages, float* k_scales, float* v_scales,
                            const int64_t* slots, int64_t tokens, int64_t kv_heads,
                            int64_t head_dim, int rotate_k) {
    if (head_dim > FP8_MAX_ROW) return -1;
#pragma omp parallel for schedule(static) if (tokens >= 64)
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t slot = slots[t];
        for (int64_t h = 0; h < kv_heads; h++) {
            const int64_t dst = (slot * kv_heads + h) * head_dim;
            FN(quantize_row)(k + t * k_stride + h * head_dim, k_pages + dst,
                             k_scales + slot * kv_heads + h, head_dim, rotate_k);
            FN(quantize_row)(v + t * v_stride + h * head_dim, v_pages + dst,
                             v_scales + slot * kv_heads + h, head_dim, 0);
        }
    }
    return 0;
}

#undef FN
#undef CAT
#undef CAT_
