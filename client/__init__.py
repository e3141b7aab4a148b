"""kvstore client: talk to the kvstore sidecar daemon from engines, tools and tests."""

from kvstore_client.client import DEFAULT_SOCKET, KVStoreClient, MemorySpec, Session, default_socket
from kvstore_client.completion import Completion
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

__all__ = [
    "DEFAULT_SOCKET", "AlreadyExists", "Completion", "FailedPrecondition", "InvalidArgument", "KVStoreClient",
    "KVStoreError", "MemorySpec", "NotFound", "PermissionDenied", "ResourceExhausted", "Session", "Unavailable",
    "default_socket",
]
