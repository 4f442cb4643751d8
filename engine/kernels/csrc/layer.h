// One whole bf16 decoder layer in a single call, so that no Python runs between its kernels:
//   h = norm(x [+ residual]); qkv = h W_qkv (+b); rope(q, k); write k, v into the pages;
//   a = paged attention; o = a W_o; h = norm(o + residual); out = down(silu(gate) * up).
// Every step is one of the kernels above, called in the same order and with the same
// arithmetic as the per-module path, so both give bit-identical results.
//
// x, out: [T, H]; residual: [T, H], updated in place (for the first layer pass first = 1 and
// it is initialised from x). Pages are bf16, or FP8 bytes when k_scales/v_scales are given.
// Weights are packed by strata_pack_bf16, or stay quantized: w_formats gives each of the four
// projections' format (0: packed bf16; 8 or 4: quant.h's q8 or q4 rows, multiplied by
// strata_quant_linear exactly as a lone quantized linear is). ws is scratch of T * (H + qkv + heads * D + 3 * I)
// elements. With lora_slots (one adapter slot per token), each projection also adds its
// tokens' LoRA updates (lora.h): lora_a/lora_b hold the A [slots, R, in] and B transposed
// [slots, R, out] of qkv, o, gate_up and down, lora_rows their R, lora_part_ends (3 per
// projection) and lora_parts split each projection's columns by module, and lora_h is
// scratch of T * max(R) floats. Returns 0, or the failing kernel's code.

// One projection: packed bf16 weights (format 0) or quantized rows, then `lora`'s update of
// its output (NULL: none). After quantized products the update runs inside the product where
// strata_quant_linear_lora takes it (a decode step on the 8-bit q4 path), else after it.
static int lin_any(int64_t format, const bf16_t* x, const void* w, const bf16_t* bias, bf16_t* y,
                   int64_t M, int64_t N, int64_t K, const LoRAUpdate* lora) {
    if (format == 0) return lin_packed(x, (const bf16_t*)w, bias, y, M, N, K, 0, lora);
    if (lora) {
        const int rc = strata_quant_linear_lora(format, x, (const uint8_t*)w, bias, y, M, N, K, lora);
        if (rc != -1) return rc;
    }
    const int rc = strata_quant_linear(format, x, 1, (const uint8_t*)w, bias, y, 0, M, N, K);
    if (rc || !lora) return rc;
    return strata_lora_bf16(lora->x, lora->ldx, lora->a, lora->bt, lora->slots, lora->y,
                            lora->ldy, lora->T, lora->K, lora->N, lora->R, lora->part_ends,
                            lora->parts, lora->h);
}

// One projection of the decoder layer on its own (tests): lin_any over weights of `format`
// (packed bf16 or quantized rows) and the multi-LoRA update of strata_lora_bf16's arguments,
// y [M, N] contiguous.
int strata_linear_lora_bf16(int64_t format, const bf16_t* x, const void* w, const bf16_t* bias,
                            bf16_t* y, int64_t M, int64_t N, int64_t K, const bf16_t* a,
                            const bf16_t* bt, const int32_t* slots, int64_t R,
                            const int64_t* part_ends, int64_t parts, float* h) {
    const LoRAUpdate u = {x, K, a, bt, slots, y, N, M, K, N, R, part_ends, parts, h};
    return lin_any(format, x, w, bias, y, M, N, K, &u);
}

int strata_decoder_layer_bf16(
    const bf16_t* x, bf16_t* residual, int first, const bf16_t* in_norm, const bf16_t* post_norm,
    float eps, const void* w_qkv, const bf16_t* b_qkv, const void* w_o, const void* w_gate_up,
    const void* w_down, const int64_t* w_formats, const int64_t* positions, const float* cos_table, const float* sin_table,
    void* k_pages, void* v_pages, float* k_scales, float* v_scales, int rotated,
    const int64_t* slots, const int64_t* block_tables,
    const int32_t* seq_lens, int64_t max_blocks, int64_t T, int64_t H, int64_t heads,
    int64_t kv_heads, int64_t D, int64_t I, int64_t block_size, float scale, bf16_t* ws,
    bf16_t* out, const bf16_t* const* lora_a, const bf16_t* const* lora_b,
    const int64_t* lora_rows, const int64_t* lora_part_ends, const int64_t* lora_parts,
    const int32_t* lora_slots, float* lora_h) {
    const int64_t qn = heads * D, kvn = kv_heads * D, qkvn = qn + 2 * kvn;
    bf16_t* h = ws;                // [T, H]
    bf16_t* qkv = h + T * H;       // [T, qkvn]
    bf16_t* att = qkv + T * qkvn;  // [T, qn]
    bf16_t* gate_up = att + T * qn;  // [T, 2I]
    bf16_t* act = gate_up + T * 2 * I;  // [T, I]
    int rc;
    // each projection's adapter update, run (and warmed) by the linear it follows (lora.h)
    LoRAUpdate lu[4];
    const bf16_t* ins[4] = {h, att, h, act};
    bf16_t* outs[4] = {qkv, out, gate_up, out};
    const int64_t ks[4] = {H, qn, H, I}, ns[4] = {qkvn, H, 2 * I, H};
    for (int i = 0; lora_slots && i < 4; i++)
        lu[i] = (LoRAUpdate){ins[i], ks[i], lora_a[i], lora_b[i], lora_slots, outs[i], ns[i], T,
                             ks[i], ns[i], lora_rows[i], lora_part_ends + 3 * i, lora_parts[i],
                             lora_h};
    if (first) {
        memcpy(residual, x, (size_t)(T * H) * sizeof(bf16_t));
        strata_rms_norm_bf16(residual, 0, in_norm, h, T, H, eps, 0);
    } else {
        strata_rms_norm_bf16(x, residual, in_norm, h, T, H, eps, 1);
    }
    if ((rc = lin_any(w_formats[0], h, w_qkv, b_qkv, qkv, T, qkvn, H, lora_slots ? &lu[0] : 0)))
        return rc;
    strata_rope_bf16(qkv, qkv + qn, positions, cos_table, sin_table, T, heads, kv_heads, D, qkvn,
                     qkvn);
    if (k_scales) {
        if ((rc = strata_kv_write_fp8_bf16(qkv + qn, qkv + qn + kvn, qkvn, qkvn, k_pages, v_pages,
                                           k_scales, v_scales, slots, T, kv_heads, D, rotated)))
            return rc;
        rc = strata_paged_decode_bf16_fp8(qkv, qkvn, k_pages, v_pages, k_scales, v_scales, att,
                                          block_tables, seq_lens, T, heads, kv_heads, D,
                                          block_size, max_blocks, scale, rotated);
    } else {
        strata_kv_write_bf16(qkv + qn, qkv + qn + kvn, qkvn, qkvn, k_pages, v_pages, slots, T, kvn);
        rc = strata_paged_decode_bf16(qkv, qkvn, k_pages, v_pages, 0, 0, att, block_tables,
                                      seq_lens, T, heads, kv_heads, D, block_size, max_blocks,
                                      scale, 0);
    }
    if (rc) return rc;
    if ((rc = lin_any(w_formats[1], att, w_o, 0, out, T, H, qn, lora_slots ? &lu[1] : 0))) return rc;
    strata_rms_norm_bf16(out, residual, post_norm, h, T, H, eps, 1);
    if ((rc = lin_any(w_formats[2], h, w_gate_up, 0, gate_up, T, 2 * I, H, lora_slots ? &lu[2] : 0)))
        return rc;
    strata_silu_mul_bf16(gate_up, act, T, I);
    if ((rc = lin_any(w_formats[3], act, w_down, 0, out, T, H, I, lora_slots ? &lu[3] : 0))) return rc;
    return 0;
}

// Every decoder layer in one call: layer l reads x (l = 0) or layer l-1's output and writes
// out0 (even l) or out1 (odd l); the last layer's output is in out0 when the layer count is
// odd, else in out1. w_formats holds layer l's four formats at 4 l .. 4 l + 3. The per-layer
// arrays hold each layer's weights and pages (b_qkv,
// k_scales and v_scales may be NULL: no bias, bf16 pages). The same kernels run in the same
// order as one strata_decoder_layer_bf16 call per layer, so results are bit-identical;
// what goes is the caller's work between layers. With lora_slots, layer l's adapters are
// lora_a/lora_b/lora_rows/lora_parts[4 l .. 4 l + 3] and lora_part_ends[12 l .. 12 l + 11]
// (the per-layer arrays of strata_decoder_layer_bf16, concatenated).
int strata_decoder_stack_bf16(
    int64_t layers, const bf16_t* x, bf16_t* residual, const bf16_t* const* in_norm,
    const bf16_t* const* post_norm, float eps, const void* const* w_qkv,
    const bf16_t* const* b_qkv, const void* const* w_o, const void* const* w_gate_up,
    const void* const* w_down, const int64_t* w_formats, const int64_t* positions, const float* cos_table,
    const float* sin_table, void* const* k_pages, void* const* v_pages, float* const* k_scales,
    float* const* v_scales, int rotated, const int64_t* slots, const int64_t* block_tables,
    const int32_t* seq_lens, int64_t max_blocks, int64_t T, int64_t H, int64_t heads,
    int64_t kv_heads, int64_t D, int64_t I, int64_t block_size, float scale, bf16_t* ws,
    bf16_t* out0, bf16_t* out1, const bf16_t* const* lora_a, const bf16_t* const* lora_b,
    const int64_t* lora_rows, const int64_t* lora_part_ends, const int64_t* lora_parts,
    const int32_t* lora_slots, float* lora_h) {
    for (int64_t l = 0; l < layers; l++) {
        const bf16_t* in = l == 0 ? x : (l % 2 ? out0 : out1);
        bf16_t* out = l % 2 ? out1 : out0;
        const int rc = strata_decoder_layer_bf16(
            in, residual, l == 0, in_norm[l], post_norm[l], eps, w_qkv[l], b_qkv ? b_qkv[l] : 0,
            w_o[l], w_gate_up[l], w_down[l], w_formats + 4 * l, positions, cos_table, sin_table, k_pages[l],
            v_pages[l], k_scales ? k_scales[l] : 0, v_scales ? v_scales[l] : 0, rotated, slots,
            block_tables, seq_lens, max_blocks, T, H, heads, kv_heads, D, I, block_size, scale,
            ws, out, lora_slots ? lora_a + 4 * l : 0, lora_slots ? lora_b + 4 * l : 0,
            lora_slots ? lora_rows + 4 * l : 0, lora_slots ? lora_part_ends + 12 * l : 0,
            lora_slots ? lora_parts + 4 * l : 0, lora_slots, lora_h);
        if (rc) return rc;
    }
    return 0;
}
