// Paged attention for bf16 queries over bf16 pages.

#include <omp.h>
#include <stdlib.h>

#include "common.h"
#include "fp8.h"
#include "elem_bf16.h"
#include "kernels.h"

#define SUFFIX bf16
#include "attention_impl.h"
