// Paged decode attention for CPUs: one query token per sequence, K/V read in place from the
// page pool through the block table (no gather copy); grouped-query heads share each K/V row
// load. One work item per (sequence, KV head), spread over OpenMP threads. The body lives in
// paged_decode_impl.h and is instantiated once per storage dtype.
//
// Layouts (row-major, contiguous):
//   q, out       [num_seqs, num_heads, head_dim]
//   k/v pages    [num_blocks, block_size, num_kv_heads, head_dim]
//   block_tables [num_seqs, max_blocks] int64
//   seq_lens     [num_seqs] int32, tokens to attend to (including the new one)
// Returns 0, or a negative code for shapes the kernel does not support.

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_HEAD_DIM 256
#define MAX_GROUP 32

static inline float bf16_load(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t bf16_store(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even (inputs are finite)
    return (uint16_t)(u >> 16);
}

static inline float f32_load(float x) { return x; }
static inline float f32_store(float x) { return x; }

#define KERNEL_NAME paged_decode_f32
#define ELEM float
#define LOAD f32_load
#define STORE f32_store
#include "paged_decode_impl.h"
#undef KERNEL_NAME
#undef ELEM
#undef LOAD
#undef STORE

#define KERNEL_NAME paged_decode_bf16
#define ELEM uint16_t
#define LOAD bf16_load
#define STORE bf16_store
#include "paged_decode_impl.h"
