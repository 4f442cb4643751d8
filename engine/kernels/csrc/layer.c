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
#include "layer.h"
