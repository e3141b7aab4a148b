"""The wire contract beyond the .proto, shared by the client and the daemon.

The daemon imports this subpackage and nothing else of `kvstore_client`: the generated gRPC code
(`kvstore_pb2`, `kvstore_pb2_grpc`), the completion channel's layout (`completion`), sealed memfds
(`memfd`), the device-handle codec (`handle`), and the constants below, each defined once here.
"""

from __future__ import annotations

import os

from kvstore_client.protocol import kvstore_pb2 as _pb

PROTOCOL_VERSION = _pb.PROTOCOL_VERSION_CURRENT
OLDEST_PROTOCOL_VERSION = 2  # the oldest clients a daemon serves (they send TransferRequest.block_ids)
# Keys are block hashes: vLLM's sha256 (32 bytes) and shorter or longer hashes of other engines.
MIN_KEY, MAX_KEY = 16, 64
MAX_COMPLETION_SLOTS = 1 << 16
# KV memories (allocations) of one engine: on CPU each travels as a memfd with the completion
# channel's in one SCM_RIGHTS message, which carries at most 253 (the kernel's SCM_MAX_FD).
MAX_MEMORIES = 252
DEFAULT_SOCKET = "/tmp/kvstore/kvstore.sock"


def default_socket() -> str:
    return os.environ.get("KVSTORE_SOCKET", DEFAULT_SOCKET)
