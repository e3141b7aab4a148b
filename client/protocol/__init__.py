"""The wire contract beyond the .proto, shared by the client and the daemon.

The daemon imports this subpackage and nothing else of `kvstore_client`: the generated gRPC code
(`kvstore_pb2`, `kvstore_pb2_grpc`), the completion channel's layout (`completion`), sealed memfds
(`memfd`), the device-handle codec (`handle`), how an NPU's identity is read (`npu_identity`), and the
constants and the block ids' encoding below, each defined once here.
"""

from __future__ import annotations

import os
import sys
from array import array
from collections.abc import Sequence

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


def pack_block_ids(block_ids: Sequence[int]) -> bytes:
    """Block ids as TransferRequest.block_id_bytes carries them: little-endian uint64s."""
    ids = array("Q", block_ids)
    if sys.byteorder == "big":
        ids.byteswap()
    return ids.tobytes()


def unpack_block_ids(data: bytes) -> array[int]:
    """The block ids of `pack_block_ids` (len(data) a multiple of 8)."""
    ids = array("Q", data)
    if sys.byteorder == "big":
        ids.byteswap()
    return ids
