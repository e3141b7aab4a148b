"""SGLang's hierarchical cache (HiCache) on the node's pool: a storage backend SGLang loads by module path.

    python -m sglang.launch_server ... --enable-hierarchical-cache --hicache-storage-backend dynamic \\
      --hicache-storage-backend-extra-config '{"backend_name": "kvstore", "module_path": "kvstore_client.sglang",
        "class_name": "KVStoreHiCacheStorage", "interface_v1": 1, "tenant_salt": "..."}'

SGLang keeps pages in its host pool (CPU memory) and asks this backend to keep them (`batch_set_v1`),
to say which it holds (`batch_exists`) and to fill host slots with them (`batch_get_v1`). No page
crosses a socket:
- zero-copy, with `"allocator": "shm"`: the host pool is a memfd, handed to the daemon once; the daemon
  maps it and its copy engine moves pages between it and the node's pool by offset (SGLang's memfd is
  not sealed against shrinking: the daemon guards that mapping, docs/sglang.md);
- otherwise through a staging area of sealed shared memory registered with the daemon: each page is
  copied once between SGLang's host pool and a staging slot here, and by the daemon from there.

Every call answers: a daemon that is down or refuses is a miss (or a page not kept), logged once, and
the backend reconnects by itself. SGLang's v1 calls never get None back (None ends SGLang's thread).
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    PoolTransfer,
    PoolTransferResult,
)

from kvstore_client.client import KVStoreClient, MemorySpec, Session
from kvstore_client.errors import KVStoreError
from kvstore_client.identity import ModelNotFound, weights_identity
from kvstore_client.shm import SharedKVMemory

log = logging.getLogger("kvstore_client.sglang")

# Keys of the extra config that are SGLang's own (the whole dict reaches the backend).
SGLANG_KEYS = {"backend_name", "module_path", "class_name", "interface_v1", "interface_v2", "allocator",
               "prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token",
               "hicache_storage_pass_prefix_keys", "tp_lcm_size"}


@dataclass(frozen=True)
class Settings:
    socket: str | None = None  # the daemon's unix socket; None: $KVSTORE_SOCKET or the default
    tenant_salt: str = ""  # engines of one tenant that must not share pages set different salts
    # The model's identity in the namespace; empty: a fingerprint of the model's files (as vLLM's connector).
    model_identity: str = ""
    timeout_s: float = 10.0  # an RPC's, and a copy job's, longest wait
    staging_bytes: int = 256 << 20  # each direction's staging area (at least one page)

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> Settings:
        extra = dict(extra or {})
        ours = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - ours - SGLANG_KEYS)
        if unknown:
            log.warning("kvstore: extra config keys %s are neither kvstore's (%s) nor SGLang's known ones",
                        unknown, sorted(ours))
        return cls(**{k: v for k, v in extra.items() if k in ours})


def page_key(key: str) -> bytes:
    """SGLang's page key (a 64-hex sha256 chain) as the pool's 32-byte key."""
    try:
        raw = bytes.fromhex(key)
    except ValueError:
        raw = b""
    return raw if len(raw) == 32 else hashlib.sha256(key.encode()).digest()


def model_identity(config: HiCacheStorageConfig, settings: Settings, format_tag: str | None) -> str:
    """What the weights are: the setting, or a fingerprint of the files at SGLang's model path."""
    if settings.model_identity:
        return f"identity={settings.model_identity}"
    path = config.model_name or ""
    if format_tag and path.endswith(f"-{format_tag}"):  # SGLang tags the path with the page format
        path = path[: -len(format_tag) - 1]
    try:
        return weights_identity(path, None)
    except (ModelNotFound, OSError, ValueError) as e:
        raise ValueError(f"kvstore: cannot tell the model's identity from {path!r} ({e}); set model_identity "
                         "in the extra config to name the weights") from None


def namespace_for(config: HiCacheStorageConfig, settings: Settings, host_pool: Any) -> str:
    """Pages are shared exactly when the engine, model, page format and rank's shard match, and the tenant
    salt: never with a vLLM engine (another first part), another layout or another rank's heads."""
    tag = getattr(host_pool, "storage_format_tag", None)
    page = first_page(host_pool)
    parts = ["engine=sglang", model_identity(config, settings, tag),
             f"pool={type(host_pool).__name__}", f"layout={host_pool.layout}",
             f"dtype={str(page.dtype).removeprefix('torch.')}", f"block={host_pool.page_size}",  # (tokens: stats)
             f"page_elements={page.numel()}"]
    parts += [f"{name}={getattr(host_pool, name)}" for name in
              ("layer_num", "start_layer", "head_num", "head_dim", "kv_lora_rank", "qk_rope_head_dim")
              if getattr(host_pool, name, None) is not None]
    if tag:
        parts.append(f"format={tag}")
    # Ranks holding different KV: TP ranks split heads (MLA ranks hold the same latents: one writes),
    # PP ranks layers, CP ranks tokens; attention DP ranks as SGLang numbers them.
    if not config.is_mla_model:
        parts.append(f"tp={config.tp_rank}/{config.tp_size}")
    parts += [f"pp={config.pp_rank}/{config.pp_size}", f"cp={config.attn_cp_rank}/{config.attn_cp_size}",
              f"dp={config.dp_rank}", f"dcp={getattr(config, 'dcp_rank', 0)}/{getattr(config, 'dcp_size', 1)}"]
    if settings.tenant_salt:
        parts.append(f"salt={settings.tenant_salt}")
    return ";".join(parts)


def first_page(host_pool: Any) -> torch.Tensor:
    """A flat page of the host pool, as a view: its size and dtype are every page's. (Not SGLang's
    get_dummy_flat_data_page, which allocates pinned memory: a GPU's on every call, none on CPU.)"""
    return host_pool.get_data_page(0, flat=True)


def page_regions(host_pool: Any, base: int) -> list[tuple[int, int, int]]:
    """The regions (offset from `base`, stride from page to page, bytes) of a host pool's pages, in the
    order of SGLang's flat page (`get_data_page(i, flat=True)`), read from the views' strides."""
    page = host_pool.page_size
    first, second = (_runs(host_pool.get_data_page(i * page, flat=False), base) for i in (0, 1))
    regions = [(a, b - a, n) for (a, n), (b, _) in zip(first, second, strict=True)]
    last = _runs(host_pool.get_data_page(host_pool.size - page, flat=False), base)
    pages = host_pool.size // page
    if any(o + (pages - 1) * s != at for (o, s, _), (at, _) in zip(regions, last, strict=True)):
        raise ValueError("the host pool's pages are not evenly strided")
    return regions


def _runs(view: torch.Tensor, base: int) -> list[tuple[int, int]]:
    """(offset from `base`, bytes) of each contiguous run of a view, in its iteration order."""
    sizes, strides = list(view.shape), list(view.stride())
    run, d = 1, len(sizes) - 1
    while d >= 0 and (sizes[d] == 1 or strides[d] == run):
        run *= sizes[d]
        d -= 1
    starts = [0]
    for size, stride in zip(sizes[: d + 1], strides[: d + 1], strict=True):
        starts = [s + i * stride for s in starts for i in range(size)]
    item = view.element_size()
    at = view.data_ptr() - base
    return [(at + s * item, run * item) for s in starts]


def shared_host_pool(host_pool: Any) -> MemorySpec | None:
    """The host pool as KV memory the daemon reads by itself, where SGLang made it one memfd
    (`"allocator": "shm"`); else None."""
    fds = getattr(getattr(host_pool, "allocator", None), "fds", None)
    buffer = getattr(host_pool, "kv_buffer", None)
    if not fds or len(fds) != 1 or not isinstance(buffer, torch.Tensor):
        return None
    size = os.fstat(fds[0]).st_size
    regions = page_regions(host_pool, buffer.untyped_storage().data_ptr())  # (SGLang maps the whole memfd)
    return MemorySpec.cpu(fds[0], size, host_pool.size // host_pool.page_size, regions)


class Staging:
    """Sealed shared memory registered as a session's KV memory: `slots` pages for stores, then `slots`
    for loads, each half used by one call at a time."""

    def __init__(self, client: KVStoreClient, namespace: str, engine_id: str, page_bytes: int, slots: int) -> None:
        self.slots = slots
        self.memory = SharedKVMemory(2 * slots * page_bytes, name="kvstore-sglang")
        self.pages = self.memory.tensor.view(2 * slots, page_bytes)
        spec = self.memory.memory_spec(2 * slots, [(0, page_bytes, page_bytes)])
        self.session = client.session(namespace, spec, engine_id=engine_id, wait=False)
        self.storing = threading.Lock()
        self.loading = threading.Lock()

    def close(self) -> None:
        self.session.close()
        self.memory.close()


class KVStoreHiCacheStorage(HiCacheStorage):
    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        self.config = storage_config
        self.settings = Settings.from_extra_config(storage_config.extra_config)
        self.client = KVStoreClient(self.settings.socket, timeout=self.settings.timeout_s)
        self.namespace = ""
        self.engine_id = f"sglang-{os.getpid()}-{_rank(storage_config)}"
        self.mem_pool_host: Any = None
        self.direct: Session | None = None  # zero-copy: the session whose KV memory is SGLang's host pool
        self._staging: Staging | None = None  # made on first use (v0 calls, or a host pool not in a memfd)
        self._making = threading.Lock()

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        self.mem_pool_host = mem_pool_host
        try:
            self.namespace = namespace_for(self.config, self.settings, mem_pool_host)
        except ValueError as e:  # (SGLang serves on without the node's pool: every page misses)
            log.error("%s: kvstore is off for this engine", e)
            return
        memory = shared_host_pool(mem_pool_host)
        if memory is not None:
            self.direct = self.client.session(self.namespace, memory, engine_id=self.engine_id, wait=False)
        else:
            self.staging()
        log.warning("kvstore: SGLang's HiCache keeps pages in the node's pool at %s (%s layout, %s, rank %s)",
                    self.client.target, mem_pool_host.layout,
                    "zero-copy from the shared host pool" if memory else "through a staging area", _rank(self.config))

    def staging(self) -> Staging:
        with self._making:
            if self._staging is None:
                page = first_page(self.mem_pool_host)
                page_bytes = page.numel() * page.element_size()
                slots = max(1, min(256, self.settings.staging_bytes // page_bytes))
                self._staging = Staging(self.client, self.namespace, self.engine_id + "-staging", page_bytes, slots)
            return self._staging

    @property
    def session(self) -> Session | None:
        """The session lookups go through."""
        return self.direct or (self._staging.session if self._staging is not None else None)

    # -- SGLang's zero-copy calls (interface_v1) -----------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """Pages the pool holds from the first on."""
        session = self.session
        if session is None or not keys:
            return 0
        try:
            return session.lookup([page_key(k) for k in keys])[0]
        except KVStoreError as e:
            log.debug("kvstore: lookup failed (%s): a miss", e)
            return 0

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        host = self.mem_pool_host
        starts = _page_starts(host_indices, host.page_size, len(keys))
        if not self.config.is_storage_writer:  # (MLA: one rank writes what every rank holds)
            return [True] * len(keys)
        if self.direct is not None:
            return [self._run(self.direct, True, [page_key(k) for k in keys], _pages(starts, host))] * len(keys)
        return self._store(keys, lambda i, slot: slot.copy_(_bytes_of(host.get_data_page(starts[i], flat=True))))

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        host = self.mem_pool_host
        starts = _page_starts(host_indices, host.page_size, len(keys))
        if self.direct is not None:
            return [self._run(self.direct, False, [page_key(k) for k in keys], _pages(starts, host))] * len(keys)
        dtype = first_page(host).dtype
        return self._load(keys, lambda i, slot: host.set_from_flat_data_page(starts[i], slot.view(dtype)))

    # -- SGLang's hybrid pools (v2): the KV pool is served, others (Mamba, SWA, ...) not yet ---------

    def batch_exists_v2(self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None,
                        extra_info: Any = None) -> PoolTransferResult:
        """The usable prefix: the KV pages held, unless another pool must hold pages too (none is
        served yet: a hybrid request misses)."""
        if pool_transfers:
            return PoolTransferResult(0, {t.name: 0 for t in pool_transfers})
        return PoolTransferResult(self.batch_exists(keys, extra_info), {})

    def batch_get_v2(self, transfers: list[PoolTransfer], extra_info: Any = None) -> dict[str, list[bool]]:
        return {t.name: [False] * len(t.keys or []) for t in transfers}

    def batch_set_v2(self, transfers: list[PoolTransfer], extra_info: Any = None) -> dict[str, list[bool]]:
        return {t.name: [False] * len(t.keys or []) for t in transfers}

    # -- SGLang's copying calls (without interface_v1) -----------------------------------------------

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        if not self.config.is_storage_writer:
            return True
        return all(self._store(keys, lambda i, slot: slot.copy_(_bytes_of(values[i]))))

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        """Each page into its target (a flat page tensor), or a new tensor of the host pool's dtype."""
        dtype = first_page(self.mem_pool_host).dtype
        out: list[torch.Tensor | None] = [None] * len(keys)

        def take(i: int, slot: torch.Tensor) -> None:
            page = slot.view(dtype)
            if target_locations is not None and target_locations[i] is not None:
                out[i] = target_locations[i].copy_(page.view(target_locations[i].shape))
            else:
                out[i] = page.clone()

        got = self._load(keys, take)
        return [t if ok else None for t, ok in zip(out, got, strict=True)]

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def clear(self) -> None:
        """Forget this engine's pages on the node (the daemon's Clear of the namespace; admins only)."""
        try:
            self.client.clear(namespace=self.namespace)
        except KVStoreError as e:
            log.warning("kvstore: clearing %s refused (%s)", self.namespace, e)

    def close(self) -> None:
        if self.direct is not None:
            self.direct.close()
        if self._staging is not None:
            self._staging.close()
        self.client.close()

    # -- moving pages ------------------------------------------------------------------------------

    def _store(self, keys: Sequence[str], fill: Callable[[int, torch.Tensor], object]) -> list[bool]:
        """Keep pages through the staging area: those the pool lacks are copied into store slots
        (`fill(i, slot)` writes page i), then stored by the daemon, a staging area at a time. Which
        pages are kept."""
        if not self.namespace or not keys:
            return [False] * len(keys)
        staging = self.staging()
        pool_keys = [page_key(k) for k in keys]
        held = self.batch_exists(list(keys))  # (pages the pool holds need no copy)
        kept = [True] * held + [False] * (len(keys) - held)
        with staging.storing:
            for start in range(held, len(keys), staging.slots):
                batch = range(start, min(len(keys), start + staging.slots))
                slots = list(range(len(batch)))
                for i, slot in zip(batch, slots, strict=True):
                    fill(i, staging.pages[slot])
                if not self._run(staging.session, True, [pool_keys[i] for i in batch], slots):
                    break
                kept[batch.start:batch.stop] = [True] * len(batch)
        return kept

    def _load(self, keys: Sequence[str], take: Callable[[int, torch.Tensor], object]) -> list[bool]:
        """Fill pages through the staging area's load slots, a staging area at a time (`take(i, slot)`
        reads page i out of its slot). Which pages landed: a leading run."""
        got = [False] * len(keys)
        if not self.namespace or not keys:
            return got
        staging = self.staging()
        with staging.loading:
            for start in range(0, len(keys), staging.slots):
                batch = range(start, min(len(keys), start + staging.slots))
                slots = [staging.slots + k for k in range(len(batch))]
                if not self._run(staging.session, False, [page_key(keys[i]) for i in batch], slots):
                    break
                for i, slot in zip(batch, slots, strict=True):
                    take(i, staging.pages[slot])
                got[batch.start:batch.stop] = [True] * len(batch)
        return got

    def _run(self, session: Session, is_store: bool, keys: list[bytes], blocks: list[int]) -> bool:
        """One copy job, waited for: whether every page moved. Given up on after the timeout, which the
        daemon knows: it touches none of the blocks after it, so they may be reused."""
        timeout = self.settings.timeout_s
        try:
            if is_store:
                job = session.store(keys, blocks, give_up_s=timeout)
            else:
                job = session.load(keys, blocks, give_up_s=timeout)
            return session.wait([job], timeout)[job].ok
        except (KVStoreError, TimeoutError) as e:
            log.debug("kvstore: %s of %d pages failed (%s)", "store" if is_store else "load", len(keys), e)
            return False


def _rank(config: HiCacheStorageConfig) -> str:
    return f"tp{config.tp_rank}pp{config.pp_rank}dp{config.dp_rank}"


def _page_starts(host_indices: torch.Tensor, page_size: int, pages: int) -> list[int]:
    """Page i of a call starts at host slot host_indices[i * page_size] (SGLang's contract)."""
    if host_indices.numel() < pages * page_size:
        raise ValueError(f"{host_indices.numel()} host indices for {pages} pages of {page_size} tokens")
    return host_indices[: pages * page_size: page_size].tolist()


def _pages(starts: list[int], host_pool: Any) -> list[int]:
    """The host pool's page numbers (the daemon's block ids) of pages starting at these host slots."""
    if any(s % host_pool.page_size for s in starts):
        raise ValueError(f"host slots {starts} do not all start a page of {host_pool.page_size} tokens")
    return [s // host_pool.page_size for s in starts]


def _bytes_of(page: torch.Tensor) -> torch.Tensor:
    return page.contiguous().view(torch.uint8).view(-1)
