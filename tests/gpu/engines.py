"""Engine configs shared by the GPU tests."""

from __future__ import annotations

from engine.config import CacheConfig, EngineConfig, SchedulerConfig, WeightFormat


def fp8_config(**options) -> EngineConfig:
    """synthetic:llama3.2-1b with FP8 weights and decode graphs up to batch 8."""
    return EngineConfig(
        model="synthetic:llama3.2-1b",
        device="cuda",
        weights=WeightFormat.FP8,
        scheduler=SchedulerConfig(max_num_seqs=8, max_model_len=1024),
        cuda_graph_max_batch=8,
        cache=CacheConfig(kv_cache_memory_bytes=1 << 30),
        **options,
    )
