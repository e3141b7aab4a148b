"""vLLM's own KV cache configs and allocations, as its worker makes them, for tests of the connector's
layout descriptions (tests/vllm/test_layouts.py) and of its worker side."""

from __future__ import annotations

import functools

import torch
from vllm.config import CacheConfig, VllmConfig
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache

try:  # vLLM 0.33 moved it (same signature)
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
except ImportError:  # 0.32
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups

BLOCK, HEADS, HEAD_SIZE = 16, 2, 8
SPEC = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.float32)
NUM_BLOCKS = 7


@functools.cache
def vllm_config() -> VllmConfig:
    return VllmConfig(cache_config=CacheConfig(num_gpu_blocks_override=NUM_BLOCKS))


def layer_names(count: int) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(count)]


def plan(layout: str, layers: int, spec=SPEC, groups: list[KVCacheGroupSpec] | None = None) -> KVCacheConfig:
    """vLLM's own KVCacheConfig for `layers` layers of `spec` in `layout` (NUM_BLOCKS blocks)."""
    config = vllm_config()
    config.cache_config.kv_cache_layout = layout  # what the engine core resolves
    groups = groups or [KVCacheGroupSpec(layer_names(layers), spec)]
    kv_cache_config = get_kv_cache_config_from_groups(config, groups, available_memory=1 << 30)
    kv_cache_config.kv_cache_layout = layout  # what the engine core hands the workers
    return kv_cache_config


def allocate(config: KVCacheConfig, ratio: int) -> dict[str, torch.Tensor]:
    """The worker's allocation: one int8 buffer, per-layer views with `ratio` kernel blocks per manager block."""
    kernel_block_sizes = [group.kv_cache_spec.block_size // ratio for group in config.kv_cache_groups]
    assert config.kv_cache_layout is not None
    return allocate_kv_cache(config, torch.device("cpu"), KVCacheLayout[config.kv_cache_layout], kernel_block_sizes)
