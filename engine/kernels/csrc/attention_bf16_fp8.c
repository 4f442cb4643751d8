// Paged attention for bf16 queries over FP8 pages with their scales.

#include <omp.h>
#include <stdlib.h>

#include "common.h"
#include "fp8.h"
#include "elem_bf16.h"
#include "kernels.h"

#define SUFFIX bf16_fp8
#define PAGE_FP8 1
#include "attention_impl.h"
