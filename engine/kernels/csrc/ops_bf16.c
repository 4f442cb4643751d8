// bf16 instantiations of the element-wise ops and the KV-page writes (bf16 and FP8 pages).

#include <omp.h>
#include <stdlib.h>

#include "common.h"
#include "fp8.h"
#include "elem_bf16.h"
#include "kernels.h"

#define SUFFIX bf16
#include "ops_impl.h"
#include "kv_fp8_impl.h"
