"""CPU KV memory in shared memory (a sealed memfd) that the daemon maps to copy blocks in and out."""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from kvstore_client.client import MemorySpec
from kvstore_client.protocol import memfd


class SharedKVMemory:
    """A sealed memfd viewed as a torch uint8 tensor. The memory lives while the tensor or the
    daemon's mapping does; close() only drops this object's descriptor."""

    def __init__(self, nbytes: int, name: str = "kvstore-kv") -> None:
        self.nbytes = nbytes
        self.fd = memfd.create(name, nbytes)
        storage = torch.UntypedStorage.from_file(f"/proc/self/fd/{self.fd}", shared=True, nbytes=nbytes)
        assert isinstance(storage, torch.UntypedStorage)  # torch's annotation also allows a TypedStorage
        self.tensor = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (nbytes,), (1,))

    def memory_spec(self, num_blocks: int, regions: Sequence[tuple[int, ...]]) -> MemorySpec:
        return MemorySpec.cpu(self.fd, self.nbytes, num_blocks, regions)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def block_cache(num_blocks: int, block_bytes: int) -> tuple[SharedKVMemory, MemorySpec]:
    """A simple KV cache of `num_blocks` contiguous blocks (one region), e.g. for tests and benchmarks."""
    memory = SharedKVMemory(num_blocks * block_bytes)
    return memory, memory.memory_spec(num_blocks, [(0, block_bytes, block_bytes)])


def move_to_shared_memory(tensors: Sequence[torch.Tensor]) -> dict[int, SharedKVMemory]:
    """Move CPU tensors into shared memory, in place: one sealed memfd per distinct storage (vLLM's
    KV cache: one allocation with a view per layer; vllm-ascend's: a K and a V tensor per layer).
    Every tensor keeps its shape, strides and offset, and everyone holding it now reads and writes
    the shared copy. Returns the shared memories by the address of the storage each replaced."""
    by_storage: dict[int, list[torch.Tensor]] = {}
    for t in tensors:
        by_storage.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    memories = {}
    for address, group in by_storage.items():
        old = group[0].untyped_storage()
        memory = SharedKVMemory(old.nbytes())
        new = memory.tensor.untyped_storage()
        new.copy_(old)
        for t in group:
            t.set_(new, t.storage_offset(), t.size(), t.stride())
        memories[address] = memory
    return memories


def shared_memory_spec(memories: Sequence[SharedKVMemory], num_blocks: int,
                       regions: Sequence[tuple[int, ...]]) -> MemorySpec:
    """The MemorySpec of CPU KV memories; regions name them by index (see MemorySpec)."""
    return MemorySpec("cpu", tuple(b"" for _ in memories), tuple(m.nbytes for m in memories), num_blocks,
                      tuple(regions), fds=tuple(m.fd for m in memories))
