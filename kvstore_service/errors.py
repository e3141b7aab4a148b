"""The one error the daemon's core raises: a refusal with a gRPC status name and a clear message."""

from __future__ import annotations


class KVError(Exception):
    """A request the daemon refuses; `code` is a grpc.StatusCode name."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def invalid(message: str) -> KVError:
    return KVError("INVALID_ARGUMENT", message)
