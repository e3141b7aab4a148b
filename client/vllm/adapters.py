"""LoRA adapters in the pool's keys. vLLM names an adapter in its block hashes by its name and path, so
an adapter whose files were rewritten in place would be served its predecessor's KV, across engine
restarts, and the same adapter under another name or path would share nothing. A LoRA request's keys
are chained as vLLM chains its block hashes (parent, token ids, extra keys), with the adapter's
fingerprint (its files, by the model identity's rule: any byte changed changes it) in place of its name
and path: a changed adapter never meets its old blocks, and the same files anywhere share them. An
adapter whose files are not on this machine is not cached (vLLM recomputes its requests).

The fingerprint is taken once per adapter (id and path) in an engine's life: vLLM keeps a loaded
adapter's weights while it runs, so files replaced under a running engine change nothing it computes.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Protocol

from kvstore_client.identity import ModelNotFound, weights_identity

log = logging.getLogger(__name__)


class Hashing(Protocol):
    """vLLM's block hashing, as the scheduler side reaches it."""

    block_size: int

    def extra_keys(self, request: Any, start: int, end: int) -> tuple[Any, ...] | None: ...

    def hash_tokens(self, parent: bytes | None, tokens: Sequence[int], extra: tuple[Any, ...] | None) -> bytes: ...


class KeyedRequest:
    """A LoRA request as the planner sees it: vLLM's request, with block keys of its own (extended as
    vLLM hashes more blocks)."""

    def __init__(self, request: Any, fingerprint: bytes, hashing: Hashing) -> None:
        self.request = request
        self.fingerprint = fingerprint
        self.hashing = hashing
        self._keys: list[bytes] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.request, name)

    @property
    def block_hashes(self) -> list[bytes]:
        keys, size = self._keys, self.hashing.block_size
        while len(keys) < len(self.request.block_hashes):
            start = len(keys) * size
            keys.append(self._hash(keys[-1] if keys else None, start, start + size))
        return keys

    def hash_tail(self, start: int, end: int) -> bytes:
        """The key of tokens [start, end) after the request's full blocks."""
        keys = self.block_hashes
        return self._hash(keys[-1] if keys else None, start, end)

    def _hash(self, parent: bytes | None, start: int, end: int) -> bytes:
        extra = [k for k in self.hashing.extra_keys(self.request, start, end) or ()
                 if not (isinstance(k, tuple) and k[:1] == ("lora",))]
        extra.append(("adapter", self.fingerprint))
        return self.hashing.hash_tokens(parent, self.request.all_token_ids[start:end], tuple(extra))


class Adapters:
    """The fingerprints of the adapters this engine has served."""

    def __init__(self, hashing: Hashing) -> None:
        self.hashing = hashing
        self._fingerprints: dict[tuple[int, str], bytes | None] = {}

    def keyed(self, request: Any) -> KeyedRequest | None:
        """The request with keys of its own; None where the adapter's files cannot be read (its requests
        are not cached)."""
        lora = request.lora_request
        fingerprint = self.fingerprint(lora.lora_int_id, lora.lora_path)
        return None if fingerprint is None else KeyedRequest(request, fingerprint, self.hashing)

    def fingerprint(self, adapter_id: int, path: str) -> bytes | None:
        key = (adapter_id, path)
        if key not in self._fingerprints:
            try:
                self._fingerprints[key] = weights_identity(path, None).encode()
            except (ModelNotFound, OSError, ValueError) as e:
                log.warning("kvstore: LoRA adapter %s: cannot tell its identity from its files (%s); its requests "
                            "are recomputed, not cached", path, e)
                self._fingerprints[key] = None
        return self._fingerprints[key]
