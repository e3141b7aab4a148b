"""The engine's KV memory, described and handed to the daemon: on CPU moved into sealed memfds in place
(the daemon maps them), on devices exported by IPC. What cannot be described exactly raises
UnsupportedKVCache: the connector stays off, never guessing."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from kvstore_client.device import export_kv_memory
from kvstore_client.layouts import KVCacheDescription, describe_kv_cache
from kvstore_client.shm import SharedKVMemory, move_to_shared_memory, shared_memory_spec
from kvstore_client.vllm import compat

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from kvstore_client.client import MemorySpec

KVCaches = Mapping[str, torch.Tensor | tuple[torch.Tensor, ...]]


def describe(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, kv_caches: KVCaches) -> tuple[
        KVCacheDescription, KVCaches]:
    """The description of vLLM's own placement (kvstore_client.layouts), and the tensors it describes. On
    CPU by layer: loads may then be read layer by layer as they land (Worker.start_loads)."""
    layout = compat.kv_cache_layout(vllm_config)
    if layout is None:  # vLLM 0.23: described from the tensors themselves
        kv_caches = compat.as_layer_tuples(kv_caches, kv_cache_config.num_blocks)
    description = describe_kv_cache(kv_cache_config, kv_caches, layout)
    if description.memories[0].device.type == "cpu":
        description = describe_kv_cache(kv_cache_config, kv_caches, layout, by_layer=True)
    return description, kv_caches


def share(vllm_config: VllmConfig, kv_caches: KVCaches, description: KVCacheDescription, shards: int,
          shard: int) -> tuple[MemorySpec, list[SharedKVMemory]]:
    """The memory spec the daemon maps, and the shared memories made of CPU allocations (to close)."""
    regions = [(r.offset, r.block_stride, r.block_bytes, r.memory) for r in description.regions]
    memories: list[SharedKVMemory] = []
    if description.memories[0].device.type == "cpu":
        # The daemon maps shared-memory files: move the KV allocations there, in place (every tensor
        # vLLM holds of them, also of layers that share another layer's cache).
        addresses = [m.untyped_storage().data_ptr() for m in description.memories]
        tensors = [t for v in kv_caches.values() for t in (v if isinstance(v, (tuple, list)) else (v,))]
        # ... and the views vLLM's layers were bound to (kernel-block views, a Mamba layer's conv and SSM
        # states): left behind, the model would go on writing the old memory.
        tensors += [t for t in _bound_views(vllm_config) if t.untyped_storage().data_ptr() in addresses]
        moved = move_to_shared_memory(tensors)
        memories = [moved[a] for a in addresses]
        spec = shared_memory_spec(memories, description.num_blocks, regions)
    else:  # cuda/npu: the daemon opens the allocations by IPC
        spec = export_kv_memory(description.memories, description.num_blocks, regions)
    return replace(spec, shards=shards, shard=shard), memories


def _bound_views(vllm_config: VllmConfig) -> list[torch.Tensor]:
    """The KV tensors vLLM's layers hold (`kv_cache`, set by their bind_kv_cache)."""
    views = []
    for layer in vllm_config.compilation_config.static_forward_context.values():
        cache = getattr(layer, "kv_cache", None)
        tensors = cache if isinstance(cache, (tuple, list)) else (cache,)
        views += [t for t in tensors if isinstance(t, torch.Tensor)]
    return views
