"""vLLM KV events for the node's tiers: every engine of a namespace announces the pool's blocks as its own
CPU tier and the disk tier's as its STORAGE tier, so that cache-aware routers (llm-d's precise prefix-cache
scorer, Dynamo's KV router) route a prompt whose prefix another engine on the node stored to this one too.

The engine that stores a block describes it to the daemon (`describe`: parent hash, token ids, extra keys,
LoRA: what vLLM's own BlockStored carries), off the engine's step, on the session's background thread. The
daemon streams each namespace's committed and removed blocks to every engine's scheduler (WatchBlocks), a
reset and what the pool holds first; `Announcer.take` hands them to vLLM (KVConnectorBase_V1.take_events),
which publishes them with its own events (`--kv-events-config`).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from kvstore_client.vllm import compat
from kvstore_client.vllm.plan import split_group_key

if TYPE_CHECKING:
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.request import Request

    from kvstore_client.client import Session

log = logging.getLogger(__name__)

MEDIUM = "CPU"  # vLLM's medium for a CPU tier (Dynamo reads it as host memory, llm-d weighs it 0.8)
MEDIUM_DISK = "STORAGE"  # the disk tier's (llm-d weighs storage 0.4)
OWNERSHIP = "kvstore"
RETRY_S = 1.0  # a stream that ended (daemon away, session re-registering) is watched again after this


def describe(request: Request, blocks: Sequence[int], block_size: int) -> list[bytes]:
    """What an event needs of these full blocks of a request, one encoded description each, as vLLM's own
    BlockStored gives it (block_pool.py): parent hash, token ids, extra keys, LoRA."""
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

    # (vLLM 0.23 has no to_event_extra_keys: its own events carry the extra keys as they are)
    to_event_extra_keys = getattr(kv_cache_utils, "to_event_extra_keys", list)

    lora = request.lora_request
    lora_id, lora_name = (lora.adapter_id, lora.name) if lora else (None, None)
    hashes, tokens = request.block_hashes, request.all_token_ids
    out = []
    for i in blocks:
        start = i * block_size
        extra, _ = generate_block_hash_extra_keys(request, start, start + block_size, 0)
        extra_keys = to_event_extra_keys([extra])
        out.append(msgspec.msgpack.encode((bytes(hashes[i - 1]) if i else None, tokens[start:start + block_size],
                                           extra_keys[0] if extra_keys else None, lora_id, lora_name)))
    return out


class Announcer:
    """The scheduler side's events: a thread watches the daemon's stream of the namespace's blocks and
    turns it into vLLM's events; `take` (each engine step) drains them."""

    def __init__(self, session: Session, block_size: int, groups: Sequence[Any] | None) -> None:
        self.session = session
        self.block_size = block_size
        self.groups = groups  # several KV cache groups: their specs (a key ends with its group's tag)
        self.events: deque[KVCacheEvent] = deque()
        self.announced: set[tuple[bytes, bool]] = set()  # (key, on disk) announced as stored, not removed since
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="kvstore-events", daemon=True)
        self._thread.start()

    def take(self) -> list[KVCacheEvent]:
        events = self.events
        if not events:
            return []
        out = []
        while events:
            out.append(events.popleft())
        return out

    def close(self) -> None:
        self._closed.set()

    def _watch(self) -> None:
        while not self._closed.is_set():
            try:
                if self.session.connected:
                    for reset, events in self.session.watch_blocks(self._closed):
                        self._translate(reset, events)
            except Exception as e:  # noqa: BLE001 - the daemon away or restarting: watch again
                log.debug("kvstore: the block event stream ended (%s); watching again", e)
            self._closed.wait(RETRY_S)

    def _translate(self, reset: bool, events: Sequence[tuple[bool, bytes, bytes, bool]]) -> None:
        from vllm.distributed.kv_events import BlockStored
        from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash

        if reset:  # the daemon starts over (a new daemon, or this engine fell behind): forget what it said
            for held in list(self.announced):
                self._removed(*held)
            self.announced.clear()
        for removed, key, meta, on_disk in events:
            if removed:
                if (key, on_disk) in self.announced:
                    self.announced.discard((key, on_disk))
                    self._removed(key, on_disk)
                continue
            if (key, on_disk) in self.announced:
                continue
            try:
                parent, tokens, extra, lora_id, lora_name = msgspec.msgpack.decode(meta)
            except (msgspec.DecodeError, ValueError, TypeError):  # (another engine's bad description: not ours)
                log.debug("kvstore: a block description that does not decode was skipped")
                continue
            block_hash, group = self._split(key)
            spec = self.groups[group].kv_cache_spec if self.groups is not None and group is not None else None
            self.announced.add((key, on_disk))
            self.events.append(BlockStored(
                block_hashes=[maybe_convert_block_hash(BlockHash(block_hash))],
                parent_block_hash=maybe_convert_block_hash(BlockHash(parent)) if parent is not None else None,
                token_ids=tokens, block_size=self.block_size, lora_id=lora_id, lora_name=lora_name,
                medium=MEDIUM_DISK if on_disk else MEDIUM,
                extra_keys=[extra], group_idx=group,
                kv_cache_spec_kind=type(spec).__name__ if spec is not None else None,
                kv_cache_spec_sliding_window=getattr(spec, "sliding_window", None),
                **compat.event_fields(BlockStored, OWNERSHIP)))

    def _removed(self, key: bytes, on_disk: bool) -> None:
        from vllm.distributed.kv_events import BlockRemoved
        from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash

        block_hash, group = self._split(key)
        self.events.append(BlockRemoved(block_hashes=[maybe_convert_block_hash(BlockHash(block_hash))],
                                        medium=MEDIUM_DISK if on_disk else MEDIUM, group_idx=group,
                                        **compat.event_fields(BlockRemoved, OWNERSHIP)))

    def _split(self, key: bytes) -> tuple[bytes, int | None]:
        """(vLLM's block hash, group) of a key (common.group_key with several groups)."""
        return (key, None) if self.groups is None else split_group_key(key)

