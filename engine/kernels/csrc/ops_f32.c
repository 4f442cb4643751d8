// fp32 instantiations: element-wise ops, KV-page writes (fp32 and FP8 pages), paged
// attention over fp32 pages and over FP8 pages, and the packed fp32 linear.

#include <omp.h>
#include <stdlib.h>

#include "common.h"
#include "fp8.h"
#include "elem_f32.h"

#define SUFFIX f32
#include "ops_impl.h"
#include "attention_impl.h"
#include "kv_fp8_impl.h"
#undef SUFFIX
#define SUFFIX f32_fp8
#define PAGE_FP8 1
#include "attention_impl.h"
#undef PAGE_FP8
#undef SUFFIX

#include "linear_f32.h"
