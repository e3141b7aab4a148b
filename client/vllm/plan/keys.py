"""A block's keys in the pool. One KV cache group: vLLM's block hash itself. Several (vLLM's hybrid
allocator): group g's key is vLLM's hash, this tag and g, so it never equals another group's key or a
single-group key; a lookup sends them block by block (kvstore_client.protocol.groups)."""

from __future__ import annotations

from collections.abc import Sequence

GROUP_TAG = b"g"


def group_key(block_hash: bytes, group: int) -> bytes:
    return bytes(block_hash) + GROUP_TAG + bytes([group])


def split_group_key(key: bytes) -> tuple[bytes, int]:
    """(vLLM's block hash, group) of a group key."""
    return key[: -len(GROUP_TAG) - 1], key[-1]


def group_keys(hashes: Sequence[bytes], groups: int) -> list[bytes]:
    """Every group's key of each block, block by block: [block 0 of group 0, of group 1, ..., block 1 of
    group 0, ...]. The pool's count of leading present keys then gives the blocks every group holds."""
    return [group_key(h, g) for h in hashes for g in range(groups)]
