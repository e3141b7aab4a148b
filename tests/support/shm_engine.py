"""A torch-free engine for tests and benchmarks: KV memory in a sealed memfd, any region layout."""

from __future__ import annotations

import mmap
import os
import secrets
from collections.abc import Sequence

from kvstore_client import KVStoreClient, MemorySpec
from kvstore_client.protocol import memfd
from kvstore_client.protocol.completion import Completion
from support.blocks import content_of

Regions = Sequence[tuple[int, int, int]]


class ShmEngine:
    """An engine without torch: KV memory in a sealed memfd (any region layout), one session. The
    memfd is named `kvstore-kv-<pid>-<random>`, so the daemon's /proc maps tell whose it holds."""

    def __init__(self, socket: str, namespace: str, num_blocks: int, regions: Regions,
                 completion_slots: int = 1024, timeout: float = 10.0, sealed: bool = True) -> None:
        self.num_blocks = num_blocks
        self.regions = list(regions)
        self.block_bytes = sum(r[2] for r in self.regions)
        self.size = max(o + (num_blocks - 1) * s + b for o, s, b in self.regions)
        self.name = f"kvstore-kv-{os.getpid()}-{secrets.token_hex(4)}"
        if sealed:
            self.fd = memfd.create(self.name, self.size)
        else:  # (as SGLang's shared host pool: the daemon reads it as a file)
            self.fd = os.memfd_create(self.name, os.MFD_CLOEXEC)
            os.ftruncate(self.fd, self.size)
        self.mm = mmap.mmap(self.fd, self.size)
        self.spec = MemorySpec.cpu(self.fd, self.size, num_blocks, self.regions)
        self.client = KVStoreClient(socket, timeout=timeout)
        self.session = self.client.session(namespace, self.spec, completion_slots=completion_slots)

    @classmethod
    def contiguous(cls, socket: str, namespace: str, num_blocks: int, block_bytes: int, **kw) -> ShmEngine:
        return cls(socket, namespace, num_blocks, [(0, block_bytes, block_bytes)], **kw)

    def read(self, block: int) -> bytes:
        return b"".join(self.mm[o + block * s: o + block * s + n] for o, s, n in self.regions)

    def write(self, block: int, data: bytes) -> None:
        at = 0
        for o, s, n in self.regions:
            self.mm[o + block * s: o + block * s + n] = data[at: at + n]
            at += n

    def fill(self, keys: Sequence[bytes], blocks: Sequence[int]) -> None:
        for key, b in zip(keys, blocks, strict=True):
            self.write(b, content_of(key, self.block_bytes))

    def zero(self, blocks: Sequence[int]) -> None:
        zeros = bytes(self.block_bytes)
        for b in blocks:
            self.write(b, zeros)

    def corrupt_blocks(self, keys: Sequence[bytes], blocks: Sequence[int]) -> int:
        """Blocks whose bytes differ from their key's content."""
        return sum(self.read(b) != content_of(k, self.block_bytes) for k, b in zip(keys, blocks, strict=True))

    def store(self, keys: Sequence[bytes], blocks: Sequence[int], timeout: float = 30.0) -> Completion:
        self.fill(keys, blocks)
        job = self.session.store(keys, blocks)
        return self.session.wait([job], timeout)[job]

    def load(self, keys: Sequence[bytes], blocks: Sequence[int], timeout: float = 30.0) -> Completion:
        self.zero(blocks)
        job = self.session.load(keys, blocks)
        return self.session.wait([job], timeout)[job]

    def close(self) -> None:
        self.session.close()
        self.client.close()
        self.mm.close()
        os.close(self.fd)

