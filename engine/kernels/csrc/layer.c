// The bf16 layer unit: multi-LoRA updates (lora.h), the packed linear (linear.h) and the
// fused decoder layer and stack (layer.h), which call the other units through kernels.h.

#include <omp.h>
#include <stdlib.h>

#include "common.h"
#include "kernels.h"
#include "quant.h"

#include "lora.h"
#include "linear_f32_block.h"
#include "linear.h"

// The multi-LoRA update on its own (lora.h): shrink, then expand, in one parallel region.
int strata_lora_bf16(const bf16_t* x, int64_t ldx, const bf16_t* a, const bf16_t* bt,
                      const int32_t* slots, bf16_t* y, int64_t ldy, int64_t T, int64_t K,
                      int64_t N, int64_t R, const int64_t* part_ends, int64_t parts, float* h) {
    const LoRAUpdate u = {x, ldx, a, bt, slots, y, ldy, T, K, N, R, part_ends, parts, h};
    LoRAGroups g = lora_groups(slots, T);
    if (g.n < 0) return -3;
#pragma omp parallel
    {
        lora_shrink(&u, &g);
#pragma omp barrier
        lora_expand(&u, &g);
    }
    free(g.tok);
    return 0;
}

#include "layer.h"
