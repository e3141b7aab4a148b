"""The store behind the remote tier: the `RemoteStore` interface (``put_many``, ``get_many``,
``delete``, ``close``) and its Redis/Valkey adapter (redis-py's asyncio clients); another store
(Mooncake) is one more class."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, Protocol

from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import Connection, SSLConnection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ClusterDownError, SlotNotCoveredError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kvstore_service.tiers.remote.codec import Buffer, bytes_view
from kvstore_service.tiers.remote.url import RemoteURL

# -- the store interface and its Redis/Valkey adapter --------------------------------------------

class RemoteStore(Protocol):
    """A key/value store the tier writes behind to. Results are per key, in the keys' order: an
    exception instance is that key's failure (an adapter raises only when the whole call failed)."""

    async def put_many(self, items: Sequence[tuple[bytes, Sequence[Buffer]]]) -> list[BaseException | None]: ...

    async def get_many(self, keys: Sequence[bytes], max_bytes: int | None = None) -> list[bytes | BaseException | None]:
        """The values (None: absent); with `max_bytes`, at most max_bytes + 1 bytes of each."""
        ...

    async def delete(self, keys: Sequence[bytes]) -> None: ...

    async def close(self) -> None: ...


class Pieces(tuple[Buffer, ...]):
    """A command argument sent as these buffers one after the other, never joined: a value of header +
    payload leaves from the payload's own memory (redis-py sends a memoryview argument as it is, but
    one argument must be one buffer)."""


class _PackPieces:
    def pack_command(self, *args: Any) -> list[Any]:
        if not any(isinstance(a, Pieces) for a in args):
            return super().pack_command(*args)  # type: ignore[misc]
        out: list[Any] = [b"*%d\r\n" % len(args)]
        for arg in args:
            parts = arg if isinstance(arg, Pieces) else (self.encoder.encode(arg),)  # type: ignore[attr-defined]
            out.append(b"$%d\r\n" % sum(bytes_view(p).nbytes for p in parts))
            out += parts
            out.append(b"\r\n")
        return out


class PiecesConnection(_PackPieces, Connection):
    """redis-py's connection, sending `Pieces` arguments unjoined."""


class PiecesSSLConnection(_PackPieces, SSLConnection):
    """redis-py's TLS connection, sending `Pieces` arguments unjoined."""


class RedisStore:
    """Redis or Valkey, one server or a cluster, through redis-py's asyncio clients. A batch goes as one
    pipeline per cluster node (all nodes at once), so one dead node fails only the keys it owns; after a
    connection error the cluster map is refreshed before the next batch. The client never retries on
    its own: the tier's breaker decides when to ask again."""

    def __init__(self, url: RemoteURL, password: str | None = None, timeout_s: float = 1.0,
                 tls_ca_file: str | None = None) -> None:
        self.url = url
        options: dict[str, object] = dict(
            username=url.username, password=password, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0), health_check_interval=0)
        if url.tls:
            options.update(ssl=True, ssl_ca_certs=tls_ca_file)
        self._cluster: RedisCluster | None = None
        self._single: Redis | None = None
        pieces = PiecesSSLConnection if url.tls else PiecesConnection
        if url.cluster:
            self._cluster = RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in url.hosts],
                                         require_full_coverage=False, **options)  # type: ignore[arg-type]
            # redis-py has no connection_class option for clusters: every node, found now or later, is
            # built from these kwargs (the startup nodes were built already).
            self._cluster.nodes_manager.connection_kwargs["connection_class"] = pieces
            for node in self._cluster.nodes_manager.startup_nodes.values():
                node.connection_class = pieces
        else:
            host, port = url.hosts[0]
            self._single = Redis(host=host, port=port, db=url.db, **options)  # type: ignore[arg-type]
            self._single.connection_pool.connection_class = pieces
        self._stale = False  # a node failed: refresh the cluster map before the next batch

    async def _groups(self, keys: Sequence[bytes], results: list[object]) -> list[list[int]]:
        """Indexes of ``keys`` grouped by the node that owns them (one group off a cluster); a key no node
        serves gets its error in ``results`` and no group."""
        if self._cluster is None:
            return [list(range(len(keys)))]
        await self._cluster.initialize()  # no-op once the map is loaded
        if self._stale:
            await self._cluster.nodes_manager.initialize()
            self._stale = False
        groups: dict[str, list[int]] = {}
        for i, key in enumerate(keys):
            try:
                node = self._cluster.get_node_from_key(key)  # type: ignore[arg-type]  # bytes keys are fine
                assert node is not None  # a primary always (None is for replicas)
            except SlotNotCoveredError as e:
                results[i] = e
                continue
            groups.setdefault(node.name, []).append(i)
        return list(groups.values())

    async def _run(self, keys: Sequence[bytes], queue: Sequence[tuple[str, tuple[Any, ...]]]) -> list[object]:
        """Run ``queue`` (a command per key) as one pipeline per node; results in order, errors inline."""
        results: list[object] = [None] * len(keys)

        async def run_group(indexes: list[int]) -> None:
            client = self._cluster if self._cluster is not None else self._single
            assert client is not None
            pipe = client.pipeline(transaction=False)
            for i in indexes:
                command, args = queue[i]
                pipe.execute_command(command, *args)
            try:
                out: list[object] = await pipe.execute(raise_on_error=False)
            except Exception as e:  # the node failed as a whole
                if isinstance(e, (RedisConnectionError, RedisTimeoutError, ClusterDownError, SlotNotCoveredError)):
                    self._stale = True
                out = [e] * len(indexes)
            for i, r in zip(indexes, out, strict=True):
                results[i] = r

        await asyncio.gather(*(run_group(g) for g in await self._groups(keys, results)))
        return results

    async def put_many(self, items: Sequence[tuple[bytes, Sequence[Buffer]]]) -> list[BaseException | None]:
        out = await self._run([k for k, _ in items], [("SET", (k, Pieces(v))) for k, v in items])
        return [r if isinstance(r, BaseException) else None for r in out]

    async def get_many(self, keys: Sequence[bytes], max_bytes: int | None = None) -> list[bytes | BaseException | None]:
        """The values (None: absent); with `max_bytes`, at most max_bytes + 1 bytes of each (GETRANGE: a
        value of another size never crosses the wire whole, and one longer shows it)."""
        if max_bytes is None:
            out = await self._run(keys, [("GET", (k,)) for k in keys])
        else:
            out = [r or None for r in await self._run(keys, [("GETRANGE", (k, 0, max_bytes)) for k in keys])]
        return [r if r is None or isinstance(r, (bytes, BaseException)) else TypeError(type(r)) for r in out]

    async def delete(self, keys: Sequence[bytes]) -> None:
        for r in await self._run(keys, [("DEL", (k,)) for k in keys]):
            if isinstance(r, BaseException):
                raise r

    async def close(self) -> None:
        if self._cluster is not None:
            await self._cluster.aclose()
        if self._single is not None:
            await self._single.aclose()

