"""asyncio client: the same calls as `KVStoreClient`, for programs that run an event loop.

    async with AsyncKVStoreClient(socket) as client:
        print((await client.stats()).blocks)
        session = await client.session("ns", memory_spec)
        job = await session.store(keys, block_ids)
        done = await session.wait([job])
        await session.close()
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import AsyncIterable, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import grpc
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore_client.client import (
    MAX_MESSAGE,
    MemorySpec,
    identity_token,
    pack_keys,
    peer_handshake,
    registration,
    target_for,
)
from kvstore_client.errors import from_rpc_error
from kvstore_client.protocol import kvstore_pb2 as pb
from kvstore_client.protocol import kvstore_pb2_grpc as pb_grpc
from kvstore_client.protocol import pack_block_ids
from kvstore_client.protocol.completion import Completion, CompletionChannel

_Reply = TypeVar("_Reply")


class AsyncKVStoreClient:
    def __init__(self, socket: str | None = None, timeout: float = 10.0) -> None:
        self.target = target_for(socket)
        self.timeout = timeout
        options = [("grpc.max_receive_message_length", MAX_MESSAGE), ("grpc.max_send_message_length", MAX_MESSAGE)]
        self.channel = grpc.aio.insecure_channel(self.target, options=options)
        self.stub = pb_grpc.KVStoreStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)

    async def call(self, method: Callable[..., Awaitable[_Reply]], request: Message,
                   timeout: float | None = None) -> _Reply:
        try:
            return await method(request, timeout=timeout or self.timeout)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    async def health(self, service: str = "") -> str:
        reply = await self.call(self._health.Check, health_pb2.HealthCheckRequest(service=service))
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    async def stats(self) -> pb.StatsResponse:
        token = await asyncio.to_thread(identity_token, self.target)
        return await self.call(self.stub.Stats, pb.StatsRequest(peer_token=token))

    async def clear(self, namespace: str = "", tenant: str = "") -> int:
        token = await asyncio.to_thread(peer_handshake, self.target)
        request = pb.ClearRequest(namespace=namespace, tenant=tenant, peer_token=token)
        return (await self.call(self.stub.Clear, request)).cleared_blocks

    async def lookup(self, namespace: str, keys: Sequence[bytes]) -> int:
        packed, size = pack_keys(keys)
        token = await asyncio.to_thread(peer_handshake, self.target)
        request = pb.LookupRequest(namespace=namespace, keys=packed, key_size=size, peer_token=token)
        return (await self.call(self.stub.Lookup, request)).hits

    async def session(self, namespace: str, memory: MemorySpec | None = None, engine_id: str = "",
                      completion_slots: int = 1024) -> AsyncSession:
        session = AsyncSession(self, namespace, memory, engine_id or f"engine-{os.getpid()}", completion_slots)
        await session.open()
        return session

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncKVStoreClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class AsyncSession:
    """A registered engine on an event loop. Unlike `Session`, it does not re-register by itself:
    when `closed_by_daemon` is set, open a new one."""

    def __init__(self, client: AsyncKVStoreClient, namespace: str, memory: MemorySpec | None, engine_id: str,
                 slots: int) -> None:
        self.client, self.namespace, self.memory, self.engine_id = client, namespace, memory, engine_id
        self.slots = slots
        self.session_id = b""
        self.channel: CompletionChannel | None = None
        self.closed_by_daemon = asyncio.Event()
        self._job_ids = itertools.count(1)
        self._pending: set[int] = set()
        self._attach: asyncio.Task[None] | None = None

    async def open(self) -> None:
        if self.memory is not None:
            self.channel = CompletionChannel.create(self.slots)
        try:
            request = await asyncio.to_thread(registration, self.client.target, self.engine_id, self.namespace,
                                              self.memory, self.channel)
            reply = await self.client.call(self.client.stub.Register, request)
        except BaseException:
            self._drop_channel()
            raise
        self.session_id = reply.session_id
        stream = self.client.stub.Attach(pb.AttachRequest(session_id=self.session_id))
        await stream.read()  # the Attached event: the session is live
        self._attach = asyncio.get_running_loop().create_task(self._hold(stream))

    async def _hold(self, stream: AsyncIterable[Any]) -> None:
        try:
            async for _ in stream:
                pass
        except grpc.RpcError:
            pass
        self.closed_by_daemon.set()

    async def store(self, keys: Sequence[bytes], block_ids: Sequence[int]) -> int:
        return await self._submit(self.client.stub.Store, keys, block_ids)

    async def load(self, keys: Sequence[bytes], block_ids: Sequence[int]) -> int:
        return await self._submit(self.client.stub.Load, keys, block_ids)

    async def _submit(self, method: Callable[..., Awaitable[Any]], keys: Sequence[bytes],
                      block_ids: Sequence[int]) -> int:
        job_id = next(self._job_ids)
        packed, size = pack_keys(keys)
        await self.client.call(method, pb.TransferRequest(session_id=self.session_id, job_id=job_id, keys=packed,
                                                          key_size=size, block_id_bytes=pack_block_ids(block_ids)))
        self._pending.add(job_id)
        return job_id

    def poll(self) -> list[Completion]:
        """Finished jobs, from shared memory (no RPC, no await)."""
        if self.channel is None:
            return []
        done = [c for c in (self.channel.check(j) for j in self._pending) if c is not None]
        self._pending.difference_update(c.job_id for c in done)
        return done

    async def wait(self, job_ids: Sequence[int], timeout: float = 30.0) -> dict[int, Completion]:
        """Every job of `job_ids` finished. Completions of other jobs stay pending for poll()."""
        wanted = set(job_ids)
        found: dict[int, Completion] = {}
        async with asyncio.timeout(timeout):
            while wanted - found.keys():
                for job_id in wanted - found.keys():
                    c = self.channel.check(job_id) if self.channel is not None else None
                    if c is not None:
                        found[job_id] = c
                        self._pending.discard(job_id)
                await asyncio.sleep(0.0005)
        return found

    async def lookup(self, keys: Sequence[bytes], lease: bool = False) -> tuple[int, bytes]:
        packed, size = pack_keys(keys)
        reply = await self.client.call(self.client.stub.Lookup, pb.LookupRequest(
            session_id=self.session_id, keys=packed, key_size=size, lease=lease))
        return reply.hits, reply.lease_id

    async def release_lease(self, lease_id: bytes) -> None:
        await self.client.call(self.client.stub.ReleaseLease,
                               pb.ReleaseLeaseRequest(session_id=self.session_id, lease_id=lease_id))

    async def close(self) -> None:
        if self.session_id and not self.closed_by_daemon.is_set():
            await self.client.call(self.client.stub.Unregister, pb.UnregisterRequest(session_id=self.session_id))
        if self._attach is not None:
            self._attach.cancel()
        self._drop_channel()

    def _drop_channel(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None
