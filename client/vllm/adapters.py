"""LoRA adapters in the pool's keys. vLLM names an adapter in its block hashes by its name alone, so an
adapter whose files were replaced under the same name would be served its predecessor's KV, across
engine restarts. A LoRA request's keys are vLLM's hashes mixed with the adapter's fingerprint (its
files, by the model identity's rule: any byte changed changes it): a changed adapter never meets its
old blocks, and the same files at another path share them (under the same name: vLLM's hashes carry
it). An adapter whose files are not on this machine is not cached (vLLM recomputes its requests).

The fingerprint is taken once per adapter (id and path) in an engine's life: vLLM keeps a loaded
adapter's weights while it runs, so files replaced under a running engine change nothing it computes.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

from kvstore_client.identity import ModelNotFound, weights_identity

log = logging.getLogger(__name__)


def mix(fingerprint: bytes, key: bytes) -> bytes:
    """A LoRA request's key: vLLM's block hash, keyed by the adapter's files."""
    return hashlib.sha256(fingerprint + key).digest()[: len(key)]


class KeyedRequest:
    """A LoRA request as the planner sees it: vLLM's request, with its block hashes mixed with the
    adapter's fingerprint (extended as vLLM hashes more blocks)."""

    def __init__(self, request: Any, fingerprint: bytes) -> None:
        self.request = request
        self.fingerprint = fingerprint
        self._keys: list[bytes] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.request, name)

    @property
    def block_hashes(self) -> list[bytes]:
        hashes, keys = self.request.block_hashes, self._keys
        if len(keys) != len(hashes):
            del keys[len(hashes):]
            keys.extend(mix(self.fingerprint, bytes(h)) for h in hashes[len(keys):])
        return keys


class Adapters:
    """The fingerprints of the adapters this engine has served."""

    def __init__(self) -> None:
        self._fingerprints: dict[tuple[int, str], bytes | None] = {}

    def keyed(self, request: Any) -> KeyedRequest | None:
        """The request with its keys mixed with its adapter's fingerprint; None where the adapter's
        files cannot be read (its requests are not cached)."""
        lora = request.lora_request
        fingerprint = self.fingerprint(lora.lora_int_id, lora.lora_path)
        return None if fingerprint is None else KeyedRequest(request, fingerprint)

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
