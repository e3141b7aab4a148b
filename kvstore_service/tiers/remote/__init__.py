"""A shared cold tier on Redis/Valkey: blocks written behind to a remote store, fetched back on a miss.

    tier = RemoteTier.from_url("redis+cluster://10.0.0.5:6379,10.0.0.6:6379", queue_bytes=256 << 20)
    tier.offer(tenant, namespace, keys, payloads)         # on the event loop; never waits for the store
    found = await tier.fetch(tenant, namespace, missing)  # the leading run of verified payloads

Keys and values (`Keyring`). Anyone who can reach the store may be hostile, so nothing read from it is
trusted until checked under a secret store clients do not have (``secret_file``; a key per tenant is
derived from it). One key per block, ``kvs2:<48 hex>``: an HMAC of (namespace, block key) under the
tenant's key, so a key says nothing about its tenant, namespace or prompt, and nobody without the
secret can compute the key of a guessed prompt (nor ask EXISTS about it); no ``{hashtag}`` pins the keys
to one cluster slot. A value is a 32-byte header (magic ``KVSR``, version, mode, header length, payload
length, salt; little-endian), then either the payload and an HMAC-SHA256 of (header, key, payload), or
(``encrypt``) the payload encrypted with AES-256-GCM under a key of its own (derived from the random
salt), header and key authenticated with it, then the tag. A value is used only after its MAC or tag
checked out under this key: one planted, altered, or moved from another key (a mixed-up reply, a copied
key) is caught like a corrupt one. Without a secret the same scheme runs with an empty key: integrity
only. Capacity and eviction belong to the server (``maxmemory`` + ``allkeys-lru``): the tier never
deletes a valid value, and a fetched block is the caller's to copy into its pool.

Failure model: the store is a cache, so every failure is a miss and none reaches the caller.
- Write-behind: ``offer`` queues a view of each payload, never a copy: an upload task seals them a
  batch at a time and sends them in pipelined batches, each value in pieces (header, payload, MAC),
  straight from the caller's memory (the daemon's pool slots, pinned until ``release`` says the tier is
  done with them); encrypted values leave from their ciphertext, a copy made as the batch is sealed.
  Queued and in-flight bytes stay within ``queue_bytes``. A full queue, an open breaker or a closed
  tier drops the block (counted); a failed upload is counted, not retried.
- Reads: ``fetch`` pipelines GETs (grouped by cluster node, so a dead node fails only its own keys) in
  batches of ``fetch_batch`` keys (fewer when that exceeds ``fetch_batch_bytes`` of known-size payloads) and
  stops at the first miss. A value that fails verification (magic,
  version, mode, lengths, the expected payload size, its MAC or AEAD tag) is deleted, counted as corrupt,
  and is a miss.
- Every store call (one batch) is bounded by ``timeout_s``; an error or timeout fails the keys of that
  call (misses, or dropped uploads), counted as errors/timeouts.
- Circuit breaker: ``breaker_failures`` failed calls in a row open it. While open (``breaker_s``) fetches
  return nothing without asking the store and uploads are dropped; then one call probes the store:
  success closes the breaker, failure opens it again.
- Nothing blocks the event loop on the store: all store I/O is asyncio. Sealing an upload batch (a MAC or
  an encryption of each payload) runs in a thread; so does opening a fetched batch of 1 MiB or more (its
  MAC or decryption, and a CRC32C: the pool's seal checksum of the block).

Credentials come from the ``password`` argument, else ``password_file``, else the URL's
``user:password@``, else the environment variable KVSTORE_REMOTE_PASSWORD; they are never logged (logs
and stats carry ``RemoteURL.masked()``).

The store behind the tier is a `RemoteStore` (``put_many``, ``get_many``, ``delete``, ``close``): this file
has the Redis/Valkey one (redis-py's asyncio clients); another (Mooncake) is one more class.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import logging
import os
import stat
import struct
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Final, NamedTuple, Protocol, TypeAlias, TypeVar
from urllib.parse import unquote

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import Connection, SSLConnection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ClusterDownError, SlotNotCoveredError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kvstore_service import native
from kvstore_service.stats import RemoteStats

log = logging.getLogger(__name__)

Buffer: TypeAlias = bytes | bytearray | memoryview
T = TypeVar("T")
# Where a fetch copies its payloads: called on the loop with (first, count), the keys[first:first + count]
# of a batch that arrived; returns a writable view per key, in order, as many as it takes (fewer: the
# batch ends there).
Place: TypeAlias = Callable[[int, int], Sequence[memoryview]]

KEY_PREFIX: Final = b"kvs2:"
VALUE_MAGIC: Final = b"KVSR"
VALUE_VERSION: Final = 2
MODE_MAC: Final = 1  # the payload, then HMAC-SHA256 of (header, key, payload)
MODE_AEAD: Final = 2  # the payload encrypted with AES-256-GCM, then its tag (header and key authenticated)
# magic, version, mode, header bytes, payload bytes, salt (AEAD: the value's key is derived from it)
_HEADER = struct.Struct("<4sBBHQ16s")
HEADER_BYTES: Final = _HEADER.size
_MAC_BYTES: Final = 32
_GCM_TAG: Final = 16
_NONCE: Final = bytes(12)
MIN_SECRET_BYTES: Final = 32
PASSWORD_ENV: Final = "KVSTORE_REMOTE_PASSWORD"
DEFAULT_PORT: Final = 6379
_SCHEMES: Final = {"redis": (False, False), "rediss": (False, True),  # scheme -> (cluster, tls)
                   "redis+cluster": (True, False), "rediss+cluster": (True, True)}
_VERIFY_IN_THREAD_BYTES: Final = 1 << 20  # a fetched batch at least this big is verified off the loop


# -- keys and values -----------------------------------------------------------------------------

class Keyring:
    """The store's secret and the keys derived from it, one set per tenant (HMAC-SHA256 of the secret and
    the tenant's name): one that names blocks (remote keys), one that authenticates values (HMAC-SHA256),
    one that encrypts them (AES-256-GCM, with ``encrypt``). Without a secret (``b""``) the same derivation
    runs on an empty key: values are checked for integrity only, and anyone can compute the keys.
    Thread-safe."""

    def __init__(self, secret: bytes = b"", encrypt: bool = False) -> None:
        if encrypt and not secret:
            raise ValueError("encrypting the remote store's values needs a secret")
        self.authenticated, self.encrypt = bool(secret), encrypt
        self.mode = MODE_AEAD if encrypt else MODE_MAC
        self.tag_bytes = _GCM_TAG if encrypt else _MAC_BYTES
        self._secret = secret
        self._tenants: dict[str, tuple[bytes, bytes, bytes]] = {}  # tenant -> (names, MACs, encryption) keys

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], encrypt: bool = False) -> Keyring:
        """The secret in ``path`` (its bytes, one trailing newline stripped): at least 32 bytes, in a file
        others cannot read. ValueError naming the file otherwise."""
        try:
            mode = os.stat(path).st_mode
            secret = Path(path).read_bytes().removesuffix(b"\n").removesuffix(b"\r")
        except OSError as e:
            raise ValueError(f"--remote-secret-file {path}: {e.strerror or e}") from None
        if mode & 0o007:
            raise ValueError(f"--remote-secret-file {path}: others may read it (mode {stat.S_IMODE(mode):04o}); "
                             "chmod o-rwx it")
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"--remote-secret-file {path}: {len(secret)} bytes, want at least {MIN_SECRET_BYTES} "
                             "random bytes (e.g. head -c 48 /dev/urandom | base64 > FILE)")
        return cls(secret, encrypt)

    def _keys(self, tenant: str) -> tuple[bytes, bytes, bytes]:
        keys = self._tenants.get(tenant)
        if keys is None:
            t = tenant.encode()
            root = hmac.digest(self._secret, b"kvstore remote v2 tenant\0" + t, "sha256")
            # (the mode is in the names: turning encryption on or off starts afresh, as a new secret does)
            keys = (hmac.digest(root, b"names%d" % self.mode, "sha256"), hmac.digest(root, b"values", "sha256"),
                    hmac.digest(root, b"encryption", "sha256"))
            self._tenants[tenant] = keys
        return keys

    def remote_keys(self, tenant: str, namespace: str, block_keys: Iterable[bytes]) -> list[bytes]:
        """The store key of each block: ``kvs2:`` and 48 hex digits of an HMAC (under the tenant's key) of
        the namespace and the block key. Nothing in it can be computed or told apart without the secret:
        not the tenant, the namespace, the block, nor which keys share a namespace; no hashtag, so keys
        spread over a cluster's slots."""
        n = namespace.encode()
        scope = hmac.new(self._keys(tenant)[0], struct.pack("<I", len(n)) + n, "sha256")
        out = []
        for key in block_keys:
            h = scope.copy()
            h.update(struct.pack("<H", len(key)) + key)
            out.append(KEY_PREFIX + h.digest()[:24].hex().encode())
        return out

    def value_bytes(self, payload_bytes: int) -> int:
        """The size of the value holding a payload of this size."""
        return HEADER_BYTES + payload_bytes + self.tag_bytes

    def seal(self, tenant: str, key: bytes, payload: Buffer) -> tuple[Buffer, ...]:
        """The value stored under remote key ``key``, as pieces sent one after the other: the header,
        then the payload (a view of it: not copied) and its MAC, or the payload encrypted and its tag."""
        view = _bytes_view(payload)
        _, mac_key, aead_key = self._keys(tenant)
        salt = os.urandom(16) if self.encrypt else bytes(16)
        header = _HEADER.pack(VALUE_MAGIC, VALUE_VERSION, self.mode, HEADER_BYTES, view.nbytes, salt)
        bound = header + struct.pack("<H", len(key)) + key  # what the tag covers besides the payload
        if self.encrypt:  # a fresh key per value (from its random salt): the nonce can be fixed
            sealed = bytearray(view.nbytes + _GCM_TAG)
            AESGCM(hmac.digest(aead_key, salt, "sha256")).encrypt_into(_NONCE, view, bound, sealed)
            return header, sealed
        mac = hmac.new(mac_key, bound, "sha256")
        mac.update(view)
        return header, view, mac.digest()

    def open(self, tenant: str, key: bytes, value: Buffer, payload_bytes: int | None = None,
             into: memoryview | None = None) -> tuple[memoryview, int] | None:
        """The payload of the value read under ``key`` and its CRC32C, or None unless the value is one
        this keyring sealed under this key (its MAC or AEAD tag checked before anything is used), of this
        mode, ``payload_bytes`` long when that is given. With ``into``, the payload lands there (whatever
        it holds is garbage when None is returned)."""
        view = _bytes_view(value)
        if view.nbytes < HEADER_BYTES + self.tag_bytes:
            return None
        magic, version, mode, header_bytes, length, salt = _HEADER.unpack_from(view)
        if (magic != VALUE_MAGIC or version != VALUE_VERSION or mode != self.mode or header_bytes != HEADER_BYTES
                or view.nbytes != self.value_bytes(length) or (payload_bytes is not None and length != payload_bytes)):
            return None
        _, mac_key, aead_key = self._keys(tenant)
        bound = bytes(view[:HEADER_BYTES]) + struct.pack("<H", len(key)) + key
        body = view[HEADER_BYTES:]
        if self.encrypt:
            out = into if into is not None else memoryview(bytearray(length))
            try:
                AESGCM(hmac.digest(aead_key, salt, "sha256")).decrypt_into(_NONCE, body, bound, out)
            except InvalidTag:
                return None
            return out, native.crc32c(out)
        payload = body[:length]
        mac = hmac.new(mac_key, bound, "sha256")
        mac.update(payload)
        if not hmac.compare_digest(mac.digest(), body[length:]):
            return None
        return payload, native.crc32c(payload) if into is None else native.crc32c_copy(payload, into)


PUBLIC: Final = Keyring()  # no secret: integrity only


def remote_key(tenant: str, namespace: str, block_key: bytes, keyring: Keyring = PUBLIC) -> bytes:
    """The store key of a block (see `Keyring.remote_keys`)."""
    return keyring.remote_keys(tenant, namespace, [block_key])[0]


def remote_keys(tenant: str, namespace: str, block_keys: Iterable[bytes], keyring: Keyring = PUBLIC) -> list[bytes]:
    return keyring.remote_keys(tenant, namespace, block_keys)


def _bytes_view(data: Buffer) -> memoryview:
    view = memoryview(data)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def encode_value(key: bytes, payload: Buffer, tenant: str = "", keyring: Keyring = PUBLIC) -> bytes:
    """The whole value, joined, as a reader sees it."""
    return b"".join(bytes(p) for p in keyring.seal(tenant, key, payload))


def decode_value(key: bytes, value: Buffer, payload_bytes: int | None = None, tenant: str = "",
                 keyring: Keyring = PUBLIC) -> memoryview | None:
    """The payload of a valid value read under ``key`` (see `Keyring.open`), else None."""
    opened = keyring.open(tenant, key, value, payload_bytes)
    return None if opened is None else opened[0]


# -- URLs and credentials ------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class RemoteURL:
    """A parsed store URL: ``redis://``, ``rediss://`` (TLS), ``redis+cluster://`` or ``rediss+cluster://``
    with comma-separated seeds, optional ``user:password@`` and (not for clusters) a ``/db``."""

    scheme: str
    hosts: tuple[tuple[str, int], ...]
    username: str | None = None
    password: str | None = dataclasses.field(default=None, repr=False)
    db: int = 0

    @property
    def cluster(self) -> bool:
        return _SCHEMES[self.scheme][0]

    @property
    def tls(self) -> bool:
        return _SCHEMES[self.scheme][1]

    def masked(self, password: bool | None = None) -> str:
        """The URL for logs: the password, if any (``password`` overrides whether there is one), is ***."""
        has_password = self.password is not None if password is None else password
        user = self.username or ""
        auth = f"{user}:***@" if has_password else (f"{user}@" if user else "")
        hosts = ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in self.hosts)
        return f"{self.scheme}://{auth}{hosts}" + (f"/{self.db}" if self.db else "")


def _parse_host(spec: str) -> tuple[str, int]:
    if spec.startswith("["):  # [ipv6]:port
        host, _, rest = spec[1:].partition("]")
        port = rest.removeprefix(":")
    else:
        host, _, port = spec.rpartition(":") if ":" in spec else (spec, "", "")
    if not host or not (port.isdigit() if port else True) or not 0 < int(port or DEFAULT_PORT) < 65536:
        raise ValueError(f"bad host {spec!r} (want host[:port])")
    return host, int(port or DEFAULT_PORT)


def parse_url(url: str) -> RemoteURL:
    """Parse a store URL (ValueError naming the problem, never echoing a password)."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in _SCHEMES:
        raise ValueError(f"remote store URL must start with one of {', '.join(s + '://' for s in _SCHEMES)}")
    netloc, _, path = rest.partition("/")
    if "?" in netloc or "?" in path or "#" in rest:
        raise ValueError("remote store URL: query strings and fragments are not supported")
    userinfo, at, hostlist = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, secret = userinfo.partition(":")
        username, password = unquote(user) or None, unquote(secret) if colon else None
    hosts = tuple(_parse_host(h.strip()) for h in hostlist.split(",") if h.strip())
    if not hosts:
        raise ValueError("remote store URL names no host")
    cluster = _SCHEMES[scheme][0]
    if not cluster and len(hosts) > 1:
        raise ValueError(f"{scheme}:// takes one host; use {scheme}+cluster:// for several seeds")
    if path and (cluster or not path.isdigit()):
        raise ValueError("remote store URL: the path may only be a database number, and not for a cluster")
    return RemoteURL(scheme, hosts, username, password, int(path or 0))


def resolve_password(url: RemoteURL, password: str | None = None, password_file: str | os.PathLike[str] | None = None,
                     environ: Mapping[str, str] = os.environ) -> str | None:
    """The password to use: the argument, else the file's content (one trailing newline stripped), else
    the URL's, else $KVSTORE_REMOTE_PASSWORD, else None."""
    if password is not None:
        return password
    if password_file is not None:
        return Path(password_file).read_text().removesuffix("\n").removesuffix("\r")
    if url.password is not None:
        return url.password
    return environ.get(PASSWORD_ENV) or None


# -- the store interface and its Redis/Valkey adapter --------------------------------------------

class RemoteStore(Protocol):
    """A key/value store the tier writes behind to. Results are per key, in the keys' order: an
    exception instance is that key's failure (an adapter raises only when the whole call failed)."""

    async def put_many(self, items: Sequence[tuple[bytes, Sequence[Buffer]]]) -> list[BaseException | None]: ...

    async def get_many(self, keys: Sequence[bytes]) -> list[bytes | BaseException | None]: ...

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
            out.append(b"$%d\r\n" % sum(_bytes_view(p).nbytes for p in parts))
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

    async def get_many(self, keys: Sequence[bytes]) -> list[bytes | BaseException | None]:
        out = await self._run(keys, [("GET", (k,)) for k in keys])
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


# -- the circuit breaker -------------------------------------------------------------------------

class Breaker:
    """closed -> (``failures`` failed calls in a row) -> open for ``open_s`` -> half-open: one probe call
    -> closed on success, open again on failure. A probe that never reports is replaced after ``open_s``."""

    def __init__(self, failures: int, open_s: float) -> None:
        self.failures, self.open_s = max(1, failures), open_s
        self.state = "closed"
        self.opens = 0
        self._failed = 0
        self._until = 0.0  # open: until then; half-open: the probe's deadline

    def blocked(self) -> bool:
        """Whether the store is not to be asked now (open, not yet due for a probe)."""
        return self.state == "open" and time.monotonic() < self._until

    def allow(self) -> bool:
        """Whether a call may go to the store now; in an open breaker past its time, the caller probes."""
        if self.state == "closed":
            return True
        now = time.monotonic()
        if now < self._until:
            return False
        self.state, self._until = "half-open", now + self.open_s
        return True

    def success(self) -> None:
        if self.state != "closed":
            log.info("remote store answers again: breaker closed")
        self.state, self._failed = "closed", 0

    def failure(self, error: BaseException | None) -> None:
        self._failed += 1
        if self.state == "half-open" or (self.state == "closed" and self._failed >= self.failures):
            if self.state == "closed":
                self.opens += 1
                log.warning("remote store failing (%s): breaker open for %.1f s", error, self.open_s)
            self.state, self._until = "open", time.monotonic() + self.open_s


# -- the tier ------------------------------------------------------------------------------------

_COUNTERS = tuple(f.name for f in dataclasses.fields(RemoteStats)
                  if f.name not in ("url", "breaker", "breaker_opens", "fetch_seconds_sum", "queued_blocks",
                                    "queued_bytes", "queue_limit_bytes"))


class _Upload(NamedTuple):
    """A queued block: its value is sealed from ``payload`` (a view of the caller's memory) when it is sent."""

    tenant: str
    payload: memoryview
    release: Callable[[], None]  # the caller's memory is no longer read
    size: int  # value bytes


def _keep(_: int) -> None:
    """`offer` without ``release``: the payloads are the caller's to keep alive (bytes are)."""


class RemoteTier:
    """Write-behind and prefix fetch over a `RemoteStore`; see the module docstring for the failure model.
    Use it from one event loop (the daemon's): nothing in it is thread-safe."""

    def __init__(self, store: RemoteStore, *, url: str = "", keyring: Keyring = PUBLIC, queue_bytes: int = 256 << 20,
                 timeout_s: float = 1.0, breaker_s: float = 10.0, breaker_failures: int = 3, fetch_batch: int = 16,
                 fetch_batch_bytes: int = 16 << 20, upload_batch_bytes: int = 32 << 20) -> None:
        self.store, self.url, self.keyring = store, url, keyring
        self.queue_bytes, self.timeout_s = queue_bytes, timeout_s
        self.fetch_batch, self.upload_batch_bytes = max(1, fetch_batch), upload_batch_bytes
        self.fetch_batch_bytes = fetch_batch_bytes
        self.breaker = Breaker(breaker_failures, breaker_s)
        self._queue: OrderedDict[bytes, _Upload] = OrderedDict()
        self._in_flight: dict[bytes, int] = {}  # key -> value bytes, being uploaded
        self._bytes = 0  # queued + in flight
        self._counts = dict.fromkeys(_COUNTERS, 0)
        self._fetch_seconds = 0.0
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._uploader: asyncio.Task[None] | None = None
        self._spare_reads: set[asyncio.Future[Any]] = set()  # batches fetched ahead, not needed
        self._closed = False

    @classmethod
    def from_url(cls, url: str, *, password: str | None = None, password_file: str | os.PathLike[str] | None = None,
                 tls_ca_file: str | None = None, timeout_s: float = 1.0,
                 secret_file: str | os.PathLike[str] | None = None, encrypt: bool = False,
                 **options: int | float) -> RemoteTier:
        """A tier on the Redis/Valkey store at ``url``, its keys and values sealed with the secret in
        ``secret_file`` (`Keyring`; encrypted too with ``encrypt``); ``options`` are the constructor's.
        Connects lazily (an unreachable store is a miss, not an error here); ValueError for a bad URL or
        secret file."""
        parsed = parse_url(url)
        keyring = Keyring.from_file(secret_file, encrypt) if secret_file is not None else Keyring(b"", encrypt)
        secret = resolve_password(parsed, password, password_file)
        store = RedisStore(parsed, secret, timeout_s, tls_ca_file)
        masked = parsed.masked(secret is not None)
        if keyring.authenticated:
            log.info("remote tier: %s; keys derived from the secret, values %s", masked,
                     "encrypted (AES-256-GCM)" if encrypt else "authenticated (HMAC-SHA256)")
        else:
            log.warning("remote tier: %s without a secret (--remote-secret-file): whoever can write the store can "
                        "plant blocks, whoever can read it reads them (see Security in README)", masked)
        return cls(store, url=masked, keyring=keyring, timeout_s=timeout_s, **options)  # type: ignore[arg-type]

    # -- write-behind --

    def offer(self, tenant: str, namespace: str, keys: Sequence[bytes], payloads: Sequence[Buffer],
              release: Callable[[int], None] | None = None) -> int:
        """Queue blocks for upload. The payloads are not copied: each must stay unchanged until
        ``release(i)`` is called for it (once per offered block, when it is uploaded, failed, dropped or
        skipped; maybe before this returns). Never waits. Returns how many were newly queued: keys
        already queued or uploading are skipped; when the queue is full, or the breaker open, the rest
        are dropped (counted). Call it on the loop."""
        if len(keys) != len(payloads):
            raise ValueError("offer: keys and payloads differ in length")
        done = release or _keep
        if self._closed or self.breaker.blocked():
            self._counts["dropped_closed" if self._closed else "dropped_unhealthy"] += len(keys)
            for i in range(len(keys)):
                done(i)
            return 0
        queued = 0
        for i, rkey in enumerate(self.keyring.remote_keys(tenant, namespace, keys)):
            payload = _bytes_view(payloads[i])
            size = self.keyring.value_bytes(payload.nbytes)
            if rkey in self._queue or rkey in self._in_flight:
                done(i)
                continue
            if self._bytes + size > self.queue_bytes:  # later blocks of a chain are useless without this one
                self._counts["dropped_full"] += len(keys) - i
                for j in range(i, len(keys)):
                    done(j)
                break
            self._queue[rkey] = _Upload(tenant, payload, partial(done, i), size)
            self._bytes += size
            queued += 1
        if queued:
            self._idle.clear()
            self._wake.set()
            if self._uploader is None or self._uploader.done():  # first use, or it died (logged)
                self._uploader = asyncio.get_running_loop().create_task(self._upload_loop(), name="remote-upload")
                self._uploader.add_done_callback(_log_death)
        return queued

    async def _upload_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                if not self.breaker.allow():
                    self._counts["dropped_unhealthy"] += len(self._queue)
                    self._drop_queue()
                    break
                await self._upload(self._take_batch())
            if not self._queue and not self._in_flight:
                self._idle.set()

    def _take_batch(self) -> list[tuple[bytes, _Upload]]:
        batch: list[tuple[bytes, _Upload]] = []
        size = 0
        # (payload bytes count: 32 values of 1 MiB are one batch, not 31 and a straggler)
        while self._queue and (not batch or size + next(iter(self._queue.values())).payload.nbytes
                               <= self.upload_batch_bytes):
            key, upload = self._queue.popitem(last=False)
            batch.append((key, upload))
            self._in_flight[key] = upload.size
            size += upload.payload.nbytes
        return batch

    async def _upload(self, batch: list[tuple[bytes, _Upload]]) -> None:
        try:  # (sealed off the loop: a MAC or an encryption is a pass over the payload)
            values = await asyncio.to_thread(self._seal, batch)
            results = await self._call(self.store.put_many(values), len(batch))
        finally:
            for key, upload in batch:
                self._bytes -= self._in_flight.pop(key)
                upload.release()  # answered (every byte sent) or failed: the payload is not read again
        for (_, upload), result in zip(batch, results, strict=True):
            if result is not None:
                self._counts["upload_failed"] += 1
                continue
            self._counts["uploaded"] += 1
            self._counts["bytes_up"] += upload.size

    def _seal(self, batch: list[tuple[bytes, _Upload]]) -> list[tuple[bytes, Sequence[Buffer]]]:
        return [(key, self.keyring.seal(u.tenant, key, u.payload)) for key, u in batch]

    def _drop_queue(self) -> None:
        for upload in self._queue.values():
            self._bytes -= upload.size
            upload.release()
        self._queue.clear()

    async def drain(self) -> None:
        """Wait until every queued block is uploaded or dropped."""
        await self._idle.wait()

    # -- fetch --

    async def fetch(self, tenant: str, namespace: str, keys: Sequence[bytes],
                    payload_bytes: int | None = None) -> list[memoryview]:
        """The payloads of the leading ``keys`` found in the store, verified (views of the received values,
        not copies): a prefix of ``keys``, stopping at the first absent, failed or corrupt block. With
        ``payload_bytes``, a payload of another size is corrupt. Never raises for store failures."""
        found: list[memoryview] = []
        async for batch in self.fetch_batches(tenant, namespace, keys, payload_bytes):
            found += (payload for payload, _ in batch)
        return found

    async def fetch_batches(self, tenant: str, namespace: str, keys: Sequence[bytes], payload_bytes: int | None = None,
                            place: Place | None = None) -> AsyncGenerator[list[tuple[memoryview, int]]]:
        """`fetch`, one batch at a time, each payload with its CRC32C (verified: the pool's seal checksum
        of the block): the next batch's GETs are under way while one is verified and handed over; a batch
        past the first miss is fetched for nothing, at most one. With `place`, each batch's payloads are
        copied where it says as they are verified (one pass over the bytes), and the batch
        ends where its places do."""
        if not keys:
            return
        self._counts["fetches"] += 1
        found, asked, start = 0, False, time.monotonic()
        ahead: asyncio.Future[Any] | None = None
        try:
            if not self.breaker.allow():
                self._counts["skipped"] += len(keys)
                return
            asked = True
            rkeys = self.keyring.remote_keys(tenant, namespace, keys)
            size = self.fetch_batch
            if payload_bytes:  # batches of at most fetch_batch_bytes: the caller copies one as the next comes
                size = max(1, min(size, self.fetch_batch_bytes // payload_bytes))
            chunks = [rkeys[i:i + size] for i in range(0, len(rkeys), size)]
            reading = asyncio.ensure_future(self._get(chunks[0]))
            for n, chunk in enumerate(chunks):
                values, ahead = await reading, None
                if n + 1 < len(chunks):
                    ahead = reading = asyncio.ensure_future(self._get(chunks[n + 1]))
                good = await self._verify(tenant, chunk, values, payload_bytes, place, n * size)
                found += len(good)
                self._counts["bytes_down"] += sum(payload.nbytes for payload, _ in good)
                if good:
                    yield good
                if len(good) < len(chunk):
                    break
        finally:
            if ahead is not None:  # past the first miss: let it finish (cancelling a pipeline drops its connection)
                self._spare_reads.add(ahead)
                ahead.add_done_callback(self._spare_reads.discard)
            if asked:  # (the caller's time between batches included: the latency its lookup sees)
                self._fetch_seconds += time.monotonic() - start
                self._counts["fetch_seconds_count"] += 1
            self._counts["hits"] += found
            self._counts["misses"] += len(keys) - found

    async def _get(self, keys: list[bytes]) -> list[bytes | BaseException | None]:
        return await self._call(self.store.get_many(keys), len(keys))

    async def _verify(self, tenant: str, keys: list[bytes], values: list[bytes | BaseException | None],
                      payload_bytes: int | None, place: Place | None, first: int) -> list[tuple[memoryview, int]]:
        """The payloads (and CRC32C) of the leading valid values (copied to their places, with `place`:
        keys[i] is the request's key first + i); a value that fails verification is deleted."""
        present: list[bytes] = []
        for value in values:
            if not isinstance(value, bytes):
                break
            present.append(value)
        places = place(first, len(present)) if place is not None and present else None
        if places is not None:
            present = present[:len(places)]
        if sum(map(len, present)) >= _VERIFY_IN_THREAD_BYTES:
            good = await asyncio.to_thread(self._open_leading, tenant, keys, present, payload_bytes, places)
        else:
            good = self._open_leading(tenant, keys, present, payload_bytes, places)
        if len(good) < len(present):  # present[len(good)] is corrupt
            self._counts["corrupt"] += 1
            log.warning("remote store: a value under %r failed verification (corrupt, or not sealed with this "
                        "daemon's secret) and was deleted", keys[len(good)][:24])
            await self._call(self._delete([keys[len(good)]]), 1)
        return good

    def _open_leading(self, tenant: str, keys: Sequence[bytes], values: Sequence[bytes], payload_bytes: int | None,
                      places: Sequence[memoryview] | None) -> list[tuple[memoryview, int]]:
        """The leading values that open (a prefix of `keys`), each copied to its place if given."""
        good = []
        for i, value in enumerate(values):
            opened = self.keyring.open(tenant, keys[i], value, payload_bytes, None if places is None else places[i])
            if opened is None:
                break
            good.append(opened)
        return good

    async def _delete(self, keys: list[bytes]) -> list[BaseException | None]:
        await self.store.delete(keys)
        return [None] * len(keys)

    async def _call(self, op: Awaitable[list[T]], n: int) -> list[T | BaseException]:
        """Await one store call under the timeout; count its failures and tell the breaker."""
        results: list[T | BaseException]
        try:
            async with asyncio.timeout(self.timeout_s):
                results = list(await op)
        except Exception as e:  # TimeoutError included: a failed call fails each of its keys
            results = [e] * n
        failed = [r for r in results if isinstance(r, BaseException)]
        self._counts["errors"] += len(failed)
        self._counts["timeouts"] += sum(isinstance(r, (TimeoutError, RedisTimeoutError)) for r in failed)
        if failed:
            log.debug("remote store: %d of %d keys failed: %r", len(failed), n, failed[0])
            self.breaker.failure(failed[0])
        else:
            self.breaker.success()
        return results

    # -- state --

    def stats(self) -> RemoteStats:
        c = self._counts
        return RemoteStats(url=self.url, breaker=self.breaker.state, breaker_opens=self.breaker.opens,
                           fetch_seconds_sum=self._fetch_seconds, queued_blocks=len(self._queue) + len(self._in_flight),
                           queued_bytes=self._bytes, queue_limit_bytes=self.queue_bytes,
                           **{k: c[k] for k in _COUNTERS})

    async def close(self, drain_s: float = 0.0) -> None:
        """Stop: upload what is queued for up to ``drain_s``, drop the rest (counted), close the store."""
        if drain_s > 0 and not self._idle.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(drain_s):
                    await self.drain()
        self._closed = True
        self._counts["dropped_closed"] += len(self._queue) + len(self._in_flight)
        if self._uploader is not None:
            self._uploader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._uploader
            self._uploader = None
        await asyncio.gather(*self._spare_reads, return_exceptions=True)
        self._drop_queue()
        self._idle.set()
        await self.store.close()


def _log_death(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("remote tier: the upload task died; restarted on the next offer", exc_info=task.exception())
