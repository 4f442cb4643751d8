// Quantized linears: weights stay in blocks of 32 along the input dimension and are
// multiplied with integer dot products (quant.c). Two weight formats, one packed row per
// output channel, each row its blocks' values first, then their fp32 scales:
//   q8: [K] int8 values (-127..127), then d[K / 32]:          w = d * q
//   q4: [K / 2] bytes, then d[K / 32], then m[K / 32]:        w = d * q - m, q in 0..15
// A q4 block is 16 bytes: byte j holds value j in its low nibble and value j + 16 in its
// high nibble (GGML's Q4_0/Q4_1 order). Activations are quantized on the fly, per row and
// block of 32, to int16 with one fp32 scale d = amax / 32767 (round to nearest even of
// x * (1 / d)).
#pragma once

#include <stdint.h>

#define QBLOCK 32

// Bytes of one packed row of K inputs.
int64_t strata_quant_row_bytes(int64_t format, int64_t K);

// y[M, N] = x[M, K] W^T (+ bias): x bf16 (x_bf16) or fp32, bias NULL or [N] in x's type, y
// fp32 (out_f32) or bf16. format 8: q8, 4: q4. Returns 0, -1 for K % 32, -3 out of memory.
int strata_quant_linear(int64_t format, const void* x, int x_bf16, const uint8_t* w,
                        const void* bias, void* y, int out_f32, int64_t M, int64_t N, int64_t K);

// strata_quant_linear of bf16 x to bf16 y, then the multi-LoRA update `lora` of y (lora.h) in
// the same parallel region, the way the packed linear runs a decode step's update (linear.h):
// each thread warms its tokens' adapters during its share of the product and updates them
// while they are in its cache. Taken where the product runs the many-rows 8-bit q4 path
// (QPATH_INT8) and lora is a decode step's; elsewhere it returns -1 and does nothing, and the
// caller runs the two one after the other (the same bits either way).
struct LoRAUpdate;
int strata_quant_linear_lora(int64_t format, const void* x, const uint8_t* w, const void* bias,
                             void* y, int64_t M, int64_t N, int64_t K,
                             const struct LoRAUpdate* lora);

// The activation quantizer on its own (tests): xq [M, K] int16, xd [M, K / 32] scales, xs
// [M, K / 32] each block's xd * sum(xq).
void strata_quant_activations(const void* x, int x_bf16, int64_t M, int64_t K, int16_t* xq,
                              float* xd, float* xs);

// The two-level 8-bit activations of the many-rows q4 path (quant.c; tests): q1, q2 [M, K]
// int8, d1, d2 and s [M, K / 32], two [M, K / 32] (1 where a block has its second level).
void strata_quant_activations8(const void* x, int x_bf16, int64_t M, int64_t K, int8_t* q1,
                               int8_t* q2, float* d1, float* d2, float* s, uint8_t* two);

// Which integer dot product this build uses: 3 AVX-512BW, 2 AVX2, 0 scalar.
int strata_quant_isa(void);
// Which arithmetic strata_quant_linear uses for a product of M rows and N outputs on this
// build: activations in int16 (any build), q4 weights against two-level 8-bit activations
// (AVX2: in panels for many rows, 8 weight rows at a time for few), q8 weights widened to
// int16 against int16 activations (AVX2 without AVX512-BF16: in panels for many rows, 8
// weight rows at a time for few), or the weights dequantized into bf16 panels (AVX512-BF16,
// many rows).
enum {
    QPATH_INT16 = 0,
    QPATH_INT8 = 1,
    QPATH_INT16_PANELS = 2,
    QPATH_BF16_PANELS = 3,
    QPATH_INT8_ROWS = 4,
    QPATH_INT16_ROWS = 5
};
int strata_quant_path(int64_t format, int x_bf16, int64_t M, int64_t N);
