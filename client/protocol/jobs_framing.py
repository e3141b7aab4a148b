"""The framing of `<socket>.jobs`, the daemon's plain unix socket for store and load requests
(kvstore_service/jobs_socket.py says why it exists and what it answers).

A frame is a 4-byte little-endian length, then the body: a request's body is STORE or LOAD and a
TransferRequest, a reply's is 0 and a TransferResponse, or a gRPC status code and the refusal's
message (UTF-8).
"""

from __future__ import annotations

STORE = 1
LOAD = 2
# A reply's head when the daemon closes the connection for breaking one of the socket's rules (then a
# status code and the message): the client sends by gRPC instead.
TURNED_AWAY = 255
MAX_REQUEST_BYTES = 4 << 20  # the daemon's default --max-job-request-bytes: larger requests go by gRPC
SUFFIX = ".jobs"  # the socket's path: the daemon's unix socket's, plus this


def frame(head: int, payload: bytes) -> bytes:
    return (len(payload) + 1).to_bytes(4, "little") + bytes([head]) + payload
