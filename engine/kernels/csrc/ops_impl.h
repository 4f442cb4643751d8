// Elementwise and memory-bound kernels, instantiated once per storage type by ops.c with:
//   SUFFIX, ELEM, S_LOAD(e)->float, S_STORE(float)->ELEM, S_ROUND(float)->float (to ELEM
//   precision), V_LOAD(p)->vf, V_STORE(p, v), V_ROUND(v)->vf (common.h's vector layer: one
//   source for the AVX-512 and the AVX2 builds).
// Rounding mirrors what the equivalent torch ops do in ELEM precision, so the native and torch
// paths agree to the last bit in most elements.

#define CAT_(a, b) a##_##b
#define CAT(a, b) CAT_(a, b)
#define FN(name) CAT(name, SUFFIX)

// Residual-fused RMSNorm over `rows` rows of `hidden`:
//   add_residual: residual = round(x + residual); out = round(round(residual * inv) * weight)
//   otherwise:    out = round(round(x * inv) * weight)
void FN(strata_rms_norm)(const ELEM* x, ELEM* residual, const ELEM* weight, ELEM* out,
                         int64_t rows, int64_t hidden, float eps, int add_residual) {
#pragma omp parallel for schedule(static) if (rows * hidden >= 8192)
    for (int64_t m = 0; m < rows; m++) {
        const ELEM* xr = x + m * hidden;
        ELEM* rr = add_residual ? residual + m * hidden : 0;
        float ss = 0.0f;
        int64_t h = 0;
#ifdef STRATA_VEC
        vf acc = vf_zero();
        for (; h + VF_W <= hidden; h += VF_W) {
            vf v = V_LOAD(xr + h);
            if (rr) {
                v = V_ROUND(vf_add(v, V_LOAD(rr + h)));
                V_STORE(rr + h, v);
            }
            acc = vf_fmadd(v, v, acc);
        }
        ss = vf_reduce_add(acc);
#endif
        for (; h < hidden; h++) {
            float v = S_LOAD(xr[h]);
            if (rr) {
                v = S_ROUND(v + S_LOAD(rr[h]));
                rr[h] = S_STORE(v);
            }
            ss += v * v;
        }
        const float inv = 1.0f / sqrtf(ss / (float)hidden + eps);
        const ELEM* src = rr ? rr : xr;
        ELEM* o = out + m * hidden;
        h = 0;
#ifdef STRATA_VEC
        const vf vinv = vf_set1(inv);
        for (; h + VF_W <= hidden; h += VF_W) {
            vf n = V_ROUND(vf_mul(V_LOAD(src + h), vinv));
            V_STORE(o + h, vf_mul(n, V_LOAD(weight + h)));
        }
#endif
        for (; h < hidden; h++) o[h] = S_STORE(S_ROUND(S_LOAD(src[h]) * inv) * S_LOAD(weight[h]));
    }
}

static inline void FN(rotate)(ELEM* x, const float* c, const float* s, int64_t half) {
    int64_t i = 0;
#ifdef STRATA_VEC
    for (; i + VF_W <= half; i += VF_W) {
        vf x1 = V_LOAD(x + i), x2 = V_LOAD(x + half + i);
        vf vc = vf_load_f32(c + i), vs = vf_load_f32(s + i);
        V_STORE(x + i, vf_fmsub(x1, vc, vf_mul(x2, vs)));
        V_STORE(x + half + i, vf_fmadd(x2, vc, vf_mul(x1, vs)));
    }
#endif
    for (; i < half; i++) {
        float x1 = S_LOAD(x[i]), x2 = S_LOAD(x[half + i]);
        x[i] = S_STORE(x1 * c[i] - x2 * s[i]);
        x[half + i] = S_STORE(x2 * c[i] + x1 * s[i]);
    }
}

// Neox-style rotary embedding applied in place to q [tokens, q_heads, D] and k [tokens,
// k_heads, D] (token strides q_stride / k_stride); cos/sin are fp32 [max_pos, D/2] tables.
void FN(strata_rope)(ELEM* q, ELEM* k, const int64_t* positions, const float* cos_table,
                     const float* sin_table, int64_t tokens, int64_t q_heads, int64_t k_heads,
                     int64_t head_dim, int64_t q_stride, int64_t k_stride) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for schedule(static) if (tokens >= 32)
    for (int64_t t = 0; t < tokens; t++) {
        const float* c = cos_table + positions[t] * half;
        const float* s = sin_table + positions[t] * half;
        for (int64_t h = 0; h < q_heads; h++) FN(rotate)(q + t * q_stride + h * head_dim, c, s, half);
        for (int64_t h = 0; h < k_heads; h++) FN(rotate)(k + t * k_stride + h * head_dim, c, s, half);
    }
}

// out[m, :] = round(round(silu(gate)) * up) where gate_up[m] = [gate (inter) | up (inter)].
void FN(strata_silu_mul)(const ELEM* gate_up, ELEM* out, int64_t rows, int64_t inter) {
#pragma omp parallel for schedule(static) if (rows * inter >= 16384)
    for (int64_t m = 0; m < rows; m++) {
        const ELEM* g = gate_up + m * 2 * inter;
        const ELEM* u = g + inter;
        ELEM* o = out + m * inter;
        int64_t i = 0;
#ifdef STRATA_VEC
        const vf one = vf_set1(1.0f);
        for (; i + VF_W <= inter; i += VF_W) {
            vf gv = V_LOAD(g + i);
            vf act = vf_div(gv, vf_add(one, vf_exp(vf_sub(vf_zero(), gv))));
            V_STORE(o + i, vf_mul(V_ROUND(act), V_LOAD(u + i)));
        }
#endif
        for (; i < inter; i++) {
            float gv = S_LOAD(g[i]);
            o[i] = S_STORE(S_ROUND(gv / (1.0f + expf(-gv))) * S_LOAD(u[i]));
        }
    }
}

// Copy each token's K and V rows (row = kv_heads * D elements, token strides k_stride /
// v_stride) into page slot `slots[t]` of the page pools.
void FN(strata_kv_write)(const ELEM* k, const ELEM* v, int64_t k_stride, int64_t v_stride,
                         ELEM* k_pages, ELEM* v_pages, const int64_t* slots, int64_t tokens,
                         int64_t row) {
#pragma omp parallel for schedule(static) if (tokens >= 256)
    for (int64_t t = 0; t < tokens; t++) {
        memcpy(k_pages + slots[t] * row, k + t * k_stride, (size_t)row * sizeof(ELEM));
        memcpy(v_pages + slots[t] * row, v + t * v_stride, (size_t)row * sizeof(ELEM));
    }
}

#undef FN
#undef CAT
#undef CAT_
