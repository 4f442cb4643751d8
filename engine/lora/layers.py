"""Multi-LoRA in one batch: adapter slots (slot 0 is the base model), `LoRALinear` adding each
token's own adapter update to the fused projections, and `LoRAManager`, which loads adapters
into slots on demand. The design is in docs/design/kernels.md.
"""

from __future__ import annotations

from collections import OrderedDict
from concurrent import futures
from types import ModuleType

import msgspec
import torch
from torch import nn

from engine.config import LoRAConfig
from engine.kernels.cpu import LayerLoRA, pair_rows
from engine.lora.adapter import (
    AdapterError,
    LoRAAdapter,
    load_adapter,
    read_adapter_settings,
    resolve_under,
)
from engine.lora.batch import LoRABatch
from engine.model.llama import DecoderLayer, LlamaForCausalLM
from engine.model.native_cpu import NativeDecoderLayer
from engine.model_config import ModelConfig
from engine.protocol import InvalidRequestError, LoRARequest
from kvstore.hostmem import HostArena

# fused projection -> the PEFT modules it is made of, in output order
GROUPS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
_GATHER_MAX_TOKENS = 64  # up to this many tokens, gather per token (BGMV); above, per adapter


class LoRAManager:
    """`config.max_loras` adapter slots (plus the base slot 0) for every fused projection."""

    def __init__(
        self,
        config: LoRAConfig,
        model: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        *,
        b_transposed: bool = False,
    ) -> None:
        """`b_transposed`: keep B transposed in pairs of rows, [slots, rows / 2, out, 2]
        (what the native decoder layer reads: `pair_rows`, each module's rows rounded up to an
        even number), instead of [slots, out, rows] (the torch and Triton paths)."""
        assert config.max_loras > 0
        self.config = config
        self.b_transposed = b_transposed
        self.model_config = model
        self.dtype = dtype
        slots, r = config.max_loras + 1, config.max_lora_rank
        if b_transposed:
            r += r % 2
        self.rows_per_module = r
        self._sizes = _group_sizes(model)
        shapes: dict[tuple[int, str], tuple[tuple[int, ...], tuple[int, ...]]] = {}
        for layer in range(model.num_layers):
            for group, parts in GROUPS.items():
                fan_in, outs = self._sizes[group]
                rows = len(parts) * r
                b_shape: tuple[int, ...] = (
                    (slots, rows // 2, sum(outs), 2) if b_transposed else (slots, sum(outs), rows)
                )
                shapes[layer, group] = (slots, rows, fan_in), b_shape
        self.a: dict[tuple[int, str], torch.Tensor] = {}
        self.b: dict[tuple[int, str], torch.Tensor] = {}
        # on the host, every slot in one huge-page arena: a step may read them all
        flat = [(shape, dtype) for pair in shapes.values() for shape in pair]
        arena = HostArena(HostArena.size_of(flat)) if device.type == "cpu" else None
        for key, (a_shape, b_shape) in shapes.items():
            if arena is None:
                self.a[key] = torch.zeros(a_shape, dtype=dtype, device=device)
                self.b[key] = torch.zeros(b_shape, dtype=dtype, device=device)
            else:
                self.a[key], self.b[key] = arena.take(a_shape, dtype), arena.take(b_shape, dtype)
        self._slot_of: OrderedDict[str, int] = OrderedDict()  # adapter key -> slot, LRU first
        self._free = list(range(config.max_loras, 0, -1))
        self.num_loads = 0
        # the loader thread: weights are read off the engine thread, so a load never stalls
        # the running batch
        self.loader = futures.ThreadPoolExecutor(1, thread_name_prefix="strata-lora")
        self._loading: dict[str, futures.Future[LoRAAdapter]] = {}

    def check(self, lora: LoRARequest) -> LoRARequest:
        """The quick checks of an adapter, from its config (no weights read): raises
        InvalidRequestError for one this engine could never load (AdapterPathError for one
        outside the adapter directory). Returns `lora` with its path resolved: the one to
        load from."""
        if self.config.adapter_dir is not None:
            path = resolve_under(lora.path, self.config.adapter_dir, lora.name)
            lora = msgspec.structs.replace(lora, path=path)
        try:
            rank, _, _ = read_adapter_settings(lora.path, lora.name)
        except AdapterError as exc:
            raise InvalidRequestError(str(exc)) from None
        if rank > self.config.max_lora_rank:
            raise InvalidRequestError(
                f"{lora.name}: rank {rank} exceeds this engine's max_lora_rank "
                f"{self.config.max_lora_rank}"
            )
        return lora

    def ready_slot(self, lora: LoRARequest) -> int | None:
        """The slot already holding `lora` (now the most recently used), or None."""
        slot = self._slot_of.get(lora.key)
        if slot is not None:
            self._slot_of.move_to_end(lora.key)
        return slot

    def start_load(self, lora: LoRARequest) -> None:
        """Read and validate the adapter's weights on the loader thread (once per key)."""
        if lora.key not in self._loading:
            self._loading[lora.key] = self.loader.submit(
                load_adapter, lora.path, self.model_config, name=lora.name, dtype=self.dtype
            )

    @property
    def loading(self) -> bool:
        return bool(self._loading)

    def wait(self, timeout: float) -> None:
        """Block until a load finishes or `timeout` seconds pass."""
        futures.wait(list(self._loading.values()), timeout, futures.FIRST_COMPLETED)

    def finish_loads(self, in_use: set[int]) -> tuple[dict[str, int], dict[str, str]]:
        """Put every adapter whose weights are read into a slot: the free ones, then the
        least recently used that no request in `in_use` holds. Returns (key -> slot) for
        the adapters now ready and (key -> error) for those that failed to load; one that
        finds every slot busy stays pending."""
        ready: dict[str, int] = {}
        failed: dict[str, str] = {}
        for key, future in list(self._loading.items()):
            if not future.done():
                continue
            try:
                adapter = future.result()
            except AdapterError as exc:
                del self._loading[key]
                failed[key] = str(exc)
                continue
            slot = self._take_slot(in_use)
            if slot is None:
                continue
            del self._loading[key]
            self._write(slot, adapter)
            self._slot_of[key] = slot
            self.num_loads += 1
            ready[key] = slot
            in_use = in_use | {slot}
        return ready, failed

    def _take_slot(self, in_use: set[int]) -> int | None:
        if not self._free:
            victim = next((k for k, s in self._slot_of.items() if s not in in_use), None)
            if victim is None:
                return None
            self._free.append(self._slot_of.pop(victim))
        return self._free.pop()

    def _write(self, slot: int, adapter: LoRAAdapter) -> None:
        r = self.rows_per_module
        for (layer, group), a in self.a.items():
            b = self.b[layer, group]
            a[slot].zero_()
            # bt: [rows, out], B transposed before its rows are paired
            bt = b.new_zeros(a.shape[1], b.shape[2]) if self.b_transposed else None
            b[slot].zero_()
            row = 0
            for i, part in enumerate(GROUPS[group]):
                out = self._sizes[group][1][i]
                w = adapter.weights.get((layer, part))
                if w is not None:
                    a[slot, i * r : i * r + adapter.rank] = w.a
                    if bt is not None:
                        bt[i * r : i * r + adapter.rank, row : row + out] = w.b.T
                    else:
                        b[slot, row : row + out, i * r : i * r + adapter.rank] = w.b
                row += out
            if bt is not None:
                b[slot] = pair_rows(bt)

    def part_ends(self) -> list[list[int]]:
        """Per fused projection (in GROUPS order), where each module's output columns end."""
        ends = []
        for group in GROUPS:
            outs = self._sizes[group][1]
            ends.append([sum(outs[: i + 1]) for i in range(len(outs))])
        return ends

    @property
    def loaded(self) -> list[str]:
        return list(self._slot_of)


def _group_sizes(config: ModelConfig) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Fused projection -> (in_features, out_features of each part)."""
    h, i, q, kv = config.hidden_size, config.intermediate_size, config.q_size, config.kv_size
    return {
        "qkv_proj": (h, (q, kv, kv)),
        "o_proj": (q, (h,)),
        "gate_up_proj": (h, (i, i)),
        "down_proj": (i, (h,)),
    }


class LoRALinear(nn.Module):
    """A fused projection plus the LoRA update of each token's adapter slot."""

    def __init__(self, base: nn.Module, a: torch.Tensor, b: torch.Tensor, batch: LoRABatch) -> None:
        super().__init__()
        self.base = base
        self.a, self.b, self.batch = a, b, batch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        batch = self.batch
        if batch.in_static_step:  # a captured decode step: always the kernels
            assert batch.ops is not None
            order, tiles = batch.static_segments(x.shape[0])
            static_out: torch.Tensor = batch.ops.lora_apply(y, x, self.a, self.b, order, tiles)
            return static_out
        slots = batch.slots
        if slots is None:
            return y
        if batch.ops is not None:  # SGMV-style Triton kernels for every step size
            assert batch.order is not None and batch.tiles is not None
            out: torch.Tensor = batch.ops.lora_apply(y, x, self.a, self.b, batch.order, batch.tiles)
            return out
        if x.shape[0] <= _GATHER_MAX_TOKENS:  # BGMV: every token its own adapter
            h = torch.bmm(self.a[slots], x.unsqueeze(-1))  # [T, R, 1]
            return y + torch.bmm(self.b[slots], h).squeeze(-1).to(y.dtype)
        delta = torch.zeros_like(y)
        for slot in self.batch.present:  # SGMV: one segment per adapter in the step
            rows = (slots == slot).nonzero().squeeze(1)
            delta.index_add_(0, rows, (x[rows] @ self.a[slot].T) @ self.b[slot].T)
        return y + delta


def apply_lora(
    model: LlamaForCausalLM, manager: LoRAManager, ops: ModuleType | None = None
) -> LoRABatch:
    """Wrap every fused projection of `model` in place (a whole native decoder layer gets
    its slots' weights instead, and applies them in its kernel); returns the batch object
    the runner fills each step. `ops`: the Triton LoRA kernels, else torch ops."""
    batch = LoRABatch(ops)
    for layer in model.layers:
        if isinstance(layer, NativeDecoderLayer):  # the layer kernel adds the updates itself
            assert manager.b_transposed, "native decoder layers read B transposed"
            i = layer.layer_idx
            a = [manager.a[i, group] for group in GROUPS]
            b = [manager.b[i, group] for group in GROUPS]
            layer.use_lora(LayerLoRA(a, b, manager.part_ends()), batch)
            continue
        assert isinstance(layer, DecoderLayer) and not manager.b_transposed
        assert not getattr(layer.gate_up_proj, "silu_mul", False), "gate_up applies the act"
        for group in GROUPS:
            key = (layer.layer_idx, group)
            wrapped = LoRALinear(getattr(layer, group), manager.a[key], manager.b[key], batch)
            setattr(layer, group, wrapped)
    return batch
