"""A Triton matrix-vector product for one-token steps: y = x W^T (+ b) with x [1, K], one fp32
sum per weight row. `EngineConfig.gemv` says where it replaces cuBLAS. Interpreted on CPU
for tests. The design is in docs/design/kernels.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    N,
    K,
    stride_wn,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    cols = tl.arange(0, BLOCK_K)
    base = w_ptr + rows.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_N], tl.float32)
    for k in range(0, K, BLOCK_K):
        k_ok = (k + cols) < K
        x = tl.load(x_ptr + k + cols, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(base + (k + cols)[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows, acc.to(out_ptr.dtype.element_ty), mask=row_ok)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    block_n: int = 4,
    block_k: int = 1024,
    launch: dict[str, int] | None = None,
) -> torch.Tensor:
    """x [1, K] @ weight[N, K]^T (+ bias [N]) -> [1, N] in x's dtype. `launch`: Triton's
    launch options (num_warps, num_stages), for sweeps."""
    assert x.dim() == 2 and x.shape[0] == 1 and weight.dim() == 2
    n, k = weight.shape
    assert x.shape[1] == k and weight.stride(1) == 1
    x = x.contiguous()
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x,
        weight,
        bias if bias is not None else weight,
        out,
        n,
        k,
        weight.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_N=block_n,
        BLOCK_K=min(block_k, triton.next_power_of_2(k)),
        **(launch or {}),
    )
    return out
