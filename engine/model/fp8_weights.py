"""FP8 weights (`WeightFormat.FP8`): the decoder's projections quantized to float8_e4m3fn with
a float32 scale per output row, their products run by engine/kernels/triton_fp8_linear.py.
Applied from outside the model, as engine/model/triton_layers.py is; on CUDA `choose_plans`
times the kernels' candidate tiles per weight shape at start. Which weights and why:
docs/design/kernels.md, "FP8 weights".
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from types import ModuleType

import torch
from torch import nn

from engine.cuda_graphs import graph_ms_per_call
from engine.model.llama import LlamaForCausalLM, SiluAndMul
from engine.model.triton_layers import PROJECTIONS
from kvstore.fp8 import FP8_DTYPE, quantize_fp8

_CHUNK_BYTES = 256 << 20  # fp32 temporaries of one quantization pass at most

log = logging.getLogger(__name__)


@torch.no_grad()
def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (values [N, K] float8_e4m3fn, scales [N] float32), on its device,
    a band of rows at a time (at most `_CHUNK_BYTES` of fp32 temporaries)."""
    n, k = weight.shape
    values = torch.empty(n, k, dtype=FP8_DTYPE, device=weight.device)
    scales = torch.empty(n, dtype=torch.float32, device=weight.device)
    rows = max(1, _CHUNK_BYTES // (4 * k))
    for start in range(0, n, rows):
        band = slice(start, start + rows)
        values[band], scales[band] = quantize_fp8(weight[band])
    return values, scales


def dequantize_weight(
    values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The weight the FP8 products multiply by: values * scales per row, in `dtype` (exact
    in float32; a reference for tests)."""
    return (values.float() * scales[:, None]).to(dtype)


class Fp8Linear(nn.Module):
    """An nn.Linear whose weight is held in FP8 with a scale per output row; every input
    goes to the FP8 kernels (`ops`: engine/kernels/triton_fp8_linear.py)."""

    weight_scale: torch.Tensor  # [out] float32

    def __init__(self, linear: nn.Linear, ops: ModuleType, *, pdl: bool = False) -> None:
        """Quantizes `linear.weight`; shares its bias. `linear` is left unchanged (the caller
        drops it, which releases the 16-bit weight). `pdl`: the GEMV launches to start early,
        its first weights loaded while the kernel before finishes (triton_pdl.py)."""
        super().__init__()
        values, scales = quantize_weight(linear.weight)
        self.weight = nn.Parameter(values, requires_grad=False)  # [out, in] e4m3
        self.register_buffer("weight_scale", scales)
        self.bias = linear.bias
        self.ops = ops
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.plan = ops.DEFAULT_PLAN  # see choose_plans
        # a gate | up projection that also applies the activation (see fuse_silu_mul)
        self.silu_mul = False
        self.pdl = pdl

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in] -> [T, out] in x's dtype; with `silu_mul`, silu(gate) * up, [T, out / 2]."""
        out: torch.Tensor = self.ops.fp8_linear(
            x,
            self.weight,
            self.weight_scale,
            self.bias,
            plan=self.plan,
            silu_mul=self.silu_mul,
            pdl=self.pdl,
        )
        return out

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_weight(self.weight, self.weight_scale, dtype)


def apply_fp8_weights(model: LlamaForCausalLM, ops: ModuleType, *, pdl: bool = False) -> list[str]:
    """Replace every projection of every layer, and the LM head unless it is tied to the
    embeddings, with an `Fp8Linear` (in place, one at a time: the 16-bit weights are
    released as they go; `pdl` as there). Returns the names of the groups now in FP8 (of
    PROJECTIONS and "lm_head")."""
    for layer in model.layers:
        for name in PROJECTIONS:
            linear = getattr(layer, name)
            assert isinstance(linear, nn.Linear), f"{name} is already swapped: {linear}"
            setattr(layer, name, Fp8Linear(linear, ops, pdl=pdl))
            del linear
    swapped = list(PROJECTIONS)
    if not model.config.tie_word_embeddings:
        assert isinstance(model.lm_head, nn.Linear)
        model.lm_head = Fp8Linear(model.lm_head, ops, pdl=pdl)
        swapped.append("lm_head")
    device = model.embed_tokens.weight.device
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the 16-bit weights' blocks, back to the device
    return swapped


def fuse_silu_mul(model: LlamaForCausalLM) -> None:
    """Every layer's FP8 gate_up projection applies the activation too, which the layer then
    skips (`act` becomes an identity): one launch fewer per layer and decode step, with the
    same bits. Not with LoRA, whose gate_up update comes before the activation."""
    for layer in model.layers:
        assert isinstance(layer.gate_up_proj, Fp8Linear) and isinstance(layer.act, SiluAndMul)
        layer.gate_up_proj.silu_mul = True
        layer.act = nn.Identity()


@torch.inference_mode()
def choose_plans(model: LlamaForCausalLM, ops: ModuleType, *, pdl: bool = False) -> dict[str, str]:
    """Per FP8 projection (and LM head), the kernel and tiles that ran its products fastest,
    timed on these weights (up to 16 of them, the first layers') back to back in a CUDA
    graph, as a decode step runs them: at one row, every GEMV candidate and the smallest
    bucket's matmul candidates; at each row bucket's size (512 for the last), that bucket's
    matmul candidates. Sets each module's `plan` (CUDA only); a candidate that fails to
    compile on this device is skipped. Returns the plans' names by group. Timings vary a
    little between starts, so two starts may pick differently where candidates are close;
    the products then round their fp32 sums in another order. With `pdl`, the GEMVs are
    timed as the engine launches them, each starting while the one before finishes."""
    groups = {name: [getattr(layer, name) for layer in model.layers] for name in PROJECTIONS}
    groups["lm_head"] = [model.lm_head]
    dtype = model.embed_tokens.weight.dtype
    chosen = {}
    for name, modules in groups.items():
        if not all(isinstance(m, Fp8Linear) for m in modules):
            continue
        first = [(m.weight, m.weight_scale, m.bias) for m in modules[:16]]
        weights = [first[i % len(first)] for i in range(max(8, len(first)))]
        time = partial(
            _fastest, ops, name, weights, modules[0].in_features, dtype, modules[0].silu_mul, pdl
        )
        gemv, gemv_ms = time(1, "fp8_gemv", ops.GEMV_CANDIDATES)
        _, narrow_ms = time(1, "fp8_gemm", ops.GEMM_CANDIDATES[ops.ROW_BUCKETS[0]])
        gemm = tuple(
            (bucket, time(bucket or 512, "fp8_gemm", ops.GEMM_CANDIDATES[bucket])[0])
            for bucket in ops.ROW_BUCKETS
        )
        plan = ops.Fp8Plan(gemv=gemv, gemv_max_rows=1 if gemv_ms <= narrow_ms else 0, gemm=gemm)
        for m in modules:
            m.plan = plan
        chosen[name] = plan.name
    return chosen


def _fastest(
    ops: ModuleType,
    name: str,
    weights: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
    in_features: int,
    dtype: torch.dtype,
    silu_mul: bool,
    pdl: bool,
    rows: int,
    kernel: str,
    candidates: tuple[object, ...],
) -> tuple[object, float]:
    """The candidate tiles under which `kernel` ran products of `rows` rows by `weights`
    fastest (with the activation where `silu_mul`: in the GEMV, after the matmul), and its
    ms per product."""
    x = torch.randn(rows, in_features, dtype=dtype, device=weights[0][0].device)
    fn = getattr(ops, kernel)
    if kernel == "fp8_gemv":
        fn = partial(fn, silu_mul=silu_mul, pdl=pdl)
    elif silu_mul:
        fn = _then_silu_mul(fn, ops)
    times = {}
    for tiles in candidates:
        try:
            times[tiles] = graph_ms_per_call(
                [partial(fn, x, w, s, b, tiles=tiles) for w, s, b in weights]
            )
        except Exception as exc:  # too much shared memory on this device, say
            log.info("FP8 %s: %s does not run here (%s)", name, tiles, exc)
    report = ", ".join(f"{getattr(t, 'name', t)} {ms * 1e3:.1f} us" for t, ms in times.items())
    log.info("FP8 %s at %d rows: %s", name, rows, report)
    best = min(times, key=lambda t: times[t])
    return best, times[best]


def _then_silu_mul(fn: Callable[..., torch.Tensor], ops: ModuleType) -> Callable[..., torch.Tensor]:
    """`fn`'s product followed by the activation, as `fp8_linear` runs it past the GEMV."""

    def product(*args: object, **kwargs: object) -> torch.Tensor:
        out: torch.Tensor = ops.triton_fused.silu_mul(fn(*args, **kwargs))
        return out

    return product
