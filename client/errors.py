"""Typed exceptions for gRPC failures, so callers catch `NotFound` rather than inspect status codes."""

from __future__ import annotations

import grpc


class KVStoreError(Exception):
    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


class InvalidArgument(KVStoreError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(KVStoreError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(KVStoreError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(KVStoreError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(KVStoreError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class PermissionDenied(KVStoreError):
    code = grpc.StatusCode.PERMISSION_DENIED


class Unavailable(KVStoreError):
    """The daemon cannot be reached (not running, restarting, wrong socket)."""

    code = grpc.StatusCode.UNAVAILABLE


_BY_CODE = {cls.code: cls for cls in (InvalidArgument, NotFound, AlreadyExists, FailedPrecondition,
                                      ResourceExhausted, PermissionDenied, Unavailable)}
_BY_CODE[grpc.StatusCode.DEADLINE_EXCEEDED] = Unavailable


def from_rpc_error(error: grpc.RpcError) -> KVStoreError:
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = error.details() if hasattr(error, "details") else str(error)
    cls = _BY_CODE.get(code, KVStoreError)
    return cls(f"{code.name}: {details}", code)


def error_of(code: int, message: str) -> KVStoreError:
    """The typed error of a refusal given as a gRPC status code's number (<socket>.jobs' replies)."""
    status = next((s for s in grpc.StatusCode if s.value[0] == code), grpc.StatusCode.UNKNOWN)
    return _BY_CODE.get(status, KVStoreError)(f"{status.name}: {message}", status)
