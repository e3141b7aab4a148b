"""kvstore client: talk to the kvstore sidecar daemon from engines, tools and tests.

The names below load on first use, so that the daemon, which imports only `kvstore_client.protocol`,
does not load the client library with it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvstore_client.client import KVStoreClient, MemorySpec, Session
    from kvstore_client.errors import (
        AlreadyExists,
        FailedPrecondition,
        InvalidArgument,
        KVStoreError,
        NotFound,
        PermissionDenied,
        ResourceExhausted,
        Unavailable,
    )
    from kvstore_client.protocol import DEFAULT_SOCKET, default_socket
    from kvstore_client.protocol.completion import Completion

_HOMES = {
    "KVStoreClient": "client", "MemorySpec": "client", "Session": "client",
    "AlreadyExists": "errors", "FailedPrecondition": "errors", "InvalidArgument": "errors", "KVStoreError": "errors",
    "NotFound": "errors", "PermissionDenied": "errors", "ResourceExhausted": "errors", "Unavailable": "errors",
    "DEFAULT_SOCKET": "protocol", "default_socket": "protocol", "Completion": "protocol.completion",
}
__all__ = [
    "DEFAULT_SOCKET", "AlreadyExists", "Completion", "FailedPrecondition", "InvalidArgument", "KVStoreClient",
    "KVStoreError", "MemorySpec", "NotFound", "PermissionDenied", "ResourceExhausted", "Session", "Unavailable",
    "default_socket",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'kvstore_client' has no attribute {name!r}")
    return getattr(importlib.import_module(f"kvstore_client.{home}"), name)
