"""CPU KV memory in shared memory: the daemon maps the same file and copies blocks in and out."""

from __future__ import annotations

import os
import secrets
from collections.abc import Sequence

import torch
from kvstore_client.client import MemorySpec


class SharedKVMemory:
    """A file in /dev/shm viewed as a torch uint8 tensor; the owner unlinks it on close()."""

    def __init__(self, nbytes: int, shm_dir: str = "/dev/shm", name: str | None = None) -> None:
        self.path = os.path.join(shm_dir, name or f"kvstore-kv-{os.getpid()}-{secrets.token_hex(6)}")
        self.nbytes = nbytes
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)
        finally:
            os.close(fd)
        storage = torch.UntypedStorage.from_file(self.path, shared=True, nbytes=nbytes)
        self.tensor = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (nbytes,), (1,))

    def memory_spec(self, num_blocks: int, regions: Sequence[tuple[int, int, int]]) -> MemorySpec:
        return MemorySpec("cpu", self.path.encode(), self.nbytes, num_blocks, tuple(regions))

    def close(self) -> None:
        try:
            os.unlink(self.path)
        except OSError:
            pass


def block_cache(num_blocks: int, block_bytes: int, shm_dir: str = "/dev/shm") -> tuple[SharedKVMemory, MemorySpec]:
    """A simple KV cache of `num_blocks` contiguous blocks (one region), e.g. for tests and benchmarks."""
    memory = SharedKVMemory(num_blocks * block_bytes, shm_dir)
    return memory, memory.memory_spec(num_blocks, [(0, block_bytes, block_bytes)])


def move_to_shared_memory(tensors: Sequence[torch.Tensor], shm_dir: str = "/dev/shm") -> SharedKVMemory:
    """Move CPU tensors that share one storage (vLLM's KV cache: one allocation, one view per layer)
    into a shared-memory file, in place: every tensor keeps its shape, strides and offset, and
    everyone holding it now reads and writes the shared copy."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in tensors}
    if len(storages) != 1:
        raise ValueError(f"expected tensors of one storage, got {len(storages)} storages")
    (old,) = storages.values()
    memory = SharedKVMemory(old.nbytes(), shm_dir)
    new = memory.tensor.untyped_storage()
    new.copy_(old)
    for t in tensors:
        t.set_(new, t.storage_offset(), t.size(), t.stride())
    return memory
