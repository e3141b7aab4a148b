"""Block keys and block contents derived from their keys, so any process can verify bytes it did
not write. Torch-free: the soak workers and the fuzzer import it; `support.engine.content_tensor`
gives the same bytes as a tensor."""

from __future__ import annotations

import hashlib
import random


def key_of(scope: str, i: int) -> bytes:
    return hashlib.sha256(f"{scope}/{i}".encode()).digest()


def content_of(key: bytes, size: int) -> bytes:
    """The bytes a block stored under `key` holds."""
    return random.Random(key).randbytes(size)
