"""What differs between the vLLM releases the connector serves (releases.py), found by feature checks.

vLLM 0.32 and 0.33 offer everything the connector uses. vLLM 0.23 (what vllm-ascend 0.23 runs on) is of
an older generation, told by its missing KV cache layout module (`LAYOUTS` False). There the connector:
- describes the KV memory from the tensors vLLM hands it, each layer's blocks in dim 0 (there is no
  KVCacheLayout), and answers the layout hook with None (0.23 takes its answer as the attention layout);
- keeps each request's block ids from the scheduler output (`BlockTables`: 0.23 has no block state);
- serves one full-attention (or MLA) KV cache group only: 0.23 reports load failures per block id of one
  group and offers no Mamba states;
- stays off unless PYTHONHASHSEED is an integer: 0.23 seeds its block hashes at random in every process
  otherwise, so no two processes would ever share a block; the seed is part of the namespace;
- neither loads nor stores a LoRA request's blocks: 0.23 keys an adapter by its name alone, so an adapter
  replaced under the same name would be served its predecessor's KV.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

LAYOUTS = importlib.util.find_spec("vllm.v1.kv_cache_layout") is not None

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except ImportError:  # vLLM 0.23: the worker's mixin asks get_finished, which the connector answers from these

    @dataclass
    class KVConnectorTransferResults:  # type: ignore[no-redef]
        finished_sending: set[str] = field(default_factory=set)
        finished_recving: set[str] = field(default_factory=set)
        failed_recving: set[str] = field(default_factory=set)


_NONE: frozenset[str] = frozenset()


def failed_recving(output: Any) -> Collection[str]:
    """Requests whose loads failed, of a KVConnectorOutput (0.23 has none: its failures are block ids)."""
    return getattr(output, "failed_recving", None) or _NONE


def unsupported(kv_cache_config: KVCacheConfig) -> str:
    """Why this vLLM release cannot serve this KV cache ("" if it can)."""
    if LAYOUTS:
        return ""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    seed = os.environ.get("PYTHONHASHSEED", "")
    if not seed.isdigit():
        return ("vLLM 0.23 seeds its block hashes at random in every process unless PYTHONHASHSEED is an integer "
                "(the same on every engine of the node): no block could ever be shared; set it")
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1 or not isinstance(groups[0].kv_cache_spec, FullAttentionSpec):
        kinds = sorted(type(g.kv_cache_spec).__name__ for g in groups)
        return (f"on vLLM 0.23 one full-attention (or MLA) KV cache group is served, not {kinds} (for a "
                "sliding-window model, --disable-hybrid-kv-cache-manager gives one group)")
    return ""


def namespace_parts() -> list[str]:
    """What the namespace adds on this release: 0.23's hash seed (engines of other seeds never share keys)."""
    return [] if LAYOUTS else [f"hash_seed={os.environ.get('PYTHONHASHSEED')}"]


def uncacheable(request: Any) -> bool:
    """Requests the connector neither loads nor stores on this release (see the module's docstring)."""
    return not LAYOUTS and request.lora_request is not None


def kv_cache_layout(vllm_config: VllmConfig) -> str | None:
    """The resolved KV cache layout's name; None where the release has none (0.23)."""
    return getattr(vllm_config.cache_config, "kv_cache_layout", None)


def as_layer_tuples(kv_caches: Mapping[str, Any], num_blocks: int) -> dict[str, tuple[torch.Tensor, ...]]:
    """0.23's per-layer KV tensors as tuples of tensors with the blocks in dim 0 (the describer's form for
    tensors vLLM laid out itself): vllm-ascend's (K, V) as they are; a CUDA tensor (2, blocks, ...) split
    into K and V; a CPU tensor (blocks, heads, tokens, 2 x head size) whole."""
    out = {}
    for name, value in kv_caches.items():
        if isinstance(value, (tuple, list)):
            out[name] = tuple(value)
        elif value.dim() > 1 and value.shape[0] % num_blocks and value.shape[0] == 2:
            out[name] = (value[0], value[1])
        else:
            out[name] = (value,)
    return out


def event_fields(event_type: type, owner: str) -> dict[str, str]:
    """The `ownership` field of vLLM's KV events, where the release has it (0.23 does not)."""
    return {"ownership": owner} if "ownership" in getattr(event_type, "__struct_fields__", ()) else {}


class BlockTables:
    """0.23's scheduler output has no kv_connector_block_state: each request's block ids, kept from what it
    schedules (a new request's table, a cached one's new blocks appended, or its table anew when resumed)."""

    boundary_state_offloads = None  # (0.23 offers no Mamba states)

    def __init__(self) -> None:
        self.tables: dict[str, tuple[list[int], ...]] = {}

    def update(self, out: Any) -> BlockTables:
        tables = self.tables
        for req_id in (*out.finished_req_ids, *(out.preempted_req_ids or ())):
            tables.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            tables[new.req_id] = tuple(list(ids) for ids in new.block_ids)
        cached = out.scheduled_cached_reqs
        for req_id, ids in zip(cached.req_ids, cached.new_block_ids, strict=True):
            table = tables.get(req_id)
            if ids is None:
                continue
            if table is None or req_id in cached.resumed_req_ids:
                tables[req_id] = tuple(list(group) for group in ids)
            else:
                for group, more in zip(table, ids, strict=True):
                    group.extend(more)
        return self

    def get_block_ids(self, req_id: str) -> tuple[list[int], ...] | None:
        return self.tables.get(req_id)
