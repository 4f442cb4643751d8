// The bf16 kernels that layer.c calls in the other translation units. Each defining unit
// includes this header too, so the compiler checks these declarations against the
// definitions (ops_impl.h, kv_fp8_impl.h, attention_impl.h).
#pragma once

#include <stdint.h>

#include "common.h"

void strata_rms_norm_bf16(const bf16_t* x, bf16_t* residual, const bf16_t* weight, bf16_t* out,
                          int64_t rows, int64_t hidden, float eps, int add_residual);
void strata_rope_bf16(bf16_t* q, bf16_t* k, const int64_t* positions, const float* cos_table,
                      const float* sin_table, int64_t tokens, int64_t q_heads, int64_t k_heads,
                      int64_t head_dim, int64_t q_stride, int64_t k_stride);
void strata_silu_mul_bf16(const bf16_t* gate_up, bf16_t* out, int64_t rows, int64_t inter);
void strata_kv_write_bf16(const bf16_t* k, const bf16_t* v, int64_t k_stride, int64_t v_stride,
                          bf16_t* k_pages, bf16_t* v_pages, const int64_t* slots, int64_t tokens,
                          int64_t row);
int strata_kv_write_fp8_bf16(const bf16_t* k, const bf16_t* v, int64_t k_stride,
                             int64_t v_stride, uint8_t* k_pages, uint8_t* v_pages,
                             float* k_scales, float* v_scales, const int64_t* slots,
                             int64_t tokens, int64_t kv_heads, int64_t head_dim, int rotate_k);
int strata_paged_decode_bf16(const bf16_t* q, int64_t q_stride, const bf16_t* k_pages,
                             const bf16_t* v_pages, const float* k_scales,
                             const float* v_scales, bf16_t* out, const int64_t* block_tables,
                             const int32_t* seq_lens, int64_t num_seqs, int64_t num_heads,
                             int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                             int64_t max_blocks, float scale, int rotated);
int strata_paged_decode_bf16_fp8(const bf16_t* q, int64_t q_stride, const uint8_t* k_pages,
                                 const uint8_t* v_pages, const float* k_scales,
                                 const float* v_scales, bf16_t* out,
                                 const int64_t* block_tables, const int32_t* seq_lens,
                                 int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                                 int64_t head_dim, int64_t block_size, int64_t max_blocks,
                                 float scale, int rotated);
