"""Daemon configuration: flags > environment (KVSTORE_*) > YAML file (--config) > defaults.

One pydantic model is the single source of truth: `kvstore serve --help` is generated from the
field descriptions below, and every field is also read from `KVSTORE_<FIELD>`.
"""

from __future__ import annotations

import os
import re
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ByteSize, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
)

from kvstore_client.protocol import DEFAULT_SOCKET, MAX_MEMORIES

TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
# The --config file's settings while Config.load builds a Config (read by settings_customise_sources).
_file_values: ContextVar[dict[str, Any] | None] = ContextVar("kvstore_config_file_values", default=None)


class ConfigError(ValueError):
    """A bad setting, one line per problem, each naming where the operator gave it: the flag
    (`--pool-size`), the environment variable (`KVSTORE_POOL_SIZE`) or the --config file's key."""


class Tenant(BaseModel):
    """Who belongs to a tenant: unix uids (the handshake's SO_PEERCRED) and mTLS client names."""

    model_config = ConfigDict(extra="forbid")
    uids: list[int] = Field(default_factory=list)
    tls_names: list[str] = Field(default_factory=list)


class Config(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KVSTORE_", extra="forbid", validate_default=True)

    socket: str = Field(DEFAULT_SOCKET, description="Unix socket path the daemon listens on.")
    socket_mode: str = Field("0660", description="Permission bits of the socket file (octal).")
    socket_group: str = Field("", description="Group that owns the socket file (name or gid); empty: keep.")
    allowed_uids: list[int] = Field(
        default_factory=list, description="Peer uids allowed on the unix socket (SO_PEERCRED); empty: any."
    )
    tenants: dict[str, Tenant] = Field(
        default_factory=dict, description="Tenants, as JSON or YAML: {name: {uids: [...], tls_names: [...]}}. Each "
        "sees and shares only its own blocks; a caller in no tenant is refused. None: one tenant for all.")
    admin_uids: list[int] = Field(
        default_factory=list, description="Uids that see every tenant's stats and may clear any tenant's blocks.")
    admin_tls_names: list[str] = Field(
        default_factory=list, description="mTLS client names (certificate CN/SAN) with the rights of --admin-uids.")
    tcp: str = Field("", description="Also listen on this TCP host:port (needs TLS or --insecure).")
    insecure: bool = Field(False, description="Allow plaintext TCP (logs a warning).")
    tls_cert: str = Field("", description="PEM server certificate for TCP.")
    tls_key: str = Field("", description="PEM private key of --tls-cert.")
    tls_client_ca: str = Field("", description="PEM CA bundle; when set, TCP clients must present a cert (mTLS).")
    pool_size: ByteSize = Field(ByteSize(1 << 30), description="Pool capacity, e.g. 4GiB, 512MiB.")
    pool_path: str = Field(
        "/dev/shm/kvstore-pool", description="Shared-memory file holding the pool; re-attached on restart."
    )
    fresh: bool = Field(False, description="Discard the blocks of an existing pool file and start empty.")
    segment_size: ByteSize = Field(
        ByteSize(64 << 20), description="Pool unit handed to one block size at a time (largest block allowed)."
    )
    copy_threads: int = Field(2, ge=1, le=64, description="Threads that copy blocks.")
    populate_threads: int = Field(
        0, ge=0, le=1024,
        description="Threads that fault a new pool's pages in at start, before the daemon serves (page faults "
        "run at one core's speed per thread); 0: one per core the daemon may run on.",
    )
    populate_first: ByteSize = Field(
        ByteSize(1 << 30), description="Bytes of a new pool faulted in before the daemon serves; the rest is "
        "faulted in while it serves (--populate-threads, in steps of about 256 MiB), its usable capacity growing "
        "(stats: ready_bytes). Stores meanwhile take the capacity ready, evicting within it.")
    pool_numa: str = Field(
        "interleave", description="How a new pool's pages are placed on NUMA nodes: 'interleave' spreads them over "
        "every node the daemon may allocate on (when there are several: engines of every device share the "
        "blocks), 'first-touch' leaves them where the populating threads run, or a list of nodes to spread "
        "them over (e.g. '0,1' or '0-3').")
    devices: list[str] = Field(
        default_factory=list,
        description="Device backends (cuda, npu) to set up at start: the runtime loaded and the pool pinned "
        "before the daemon serves, so an engine's first Register does not wait for it; others on first use.",
    )
    lease_ttl_s: float = Field(60.0, gt=0, description="Default lifetime of a lookup lease, seconds.")
    max_lease_ttl_s: float = Field(600.0, gt=0, description="Longest lease a lookup may ask for, seconds.")
    max_leases_per_session: int = Field(4096, ge=1, description="Most leases one session holds at once.")
    attach_timeout_s: float = Field(
        10.0, gt=0, description="A session that never opens its Attach stream within this is dropped."
    )
    max_sessions: int = Field(256, ge=1, description="Most registered sessions at once.")
    max_sessions_per_uid: int = Field(64, ge=1, description="Most sessions one peer uid holds at once.")
    max_namespace_bytes: int = Field(1024, ge=1, description="Longest namespace name, in bytes (UTF-8).")
    max_session_memory: ByteSize = Field(
        ByteSize(256 << 30), description="Most host memory one CPU session's layout may address (the daemon maps "
        "and prefaults it).")
    max_device_memory: ByteSize = Field(
        ByteSize(1 << 40), description="Most device memory the sessions on one device (GPU, NPU) may address "
        "together: device KV caches map no host memory, so the host limits do not count them (an 8-GPU node of "
        "288 GB parts fits, each part several times over).")
    max_layout_regions: int = Field(
        4096, ge=1, description="Most regions in a registered KV layout (layers x K/V x groups of the largest "
        "models fit).")
    max_session_memories: int = Field(
        MAX_MEMORIES, ge=1, le=MAX_MEMORIES, description="Most KV allocations one session registers "
        f"(vllm-ascend: a K and a V tensor per layer); at most {MAX_MEMORIES}, what one SCM_RIGHTS message "
        "carries for cpu memfds.")
    max_shards: int = Field(
        256, ge=1, le=4096, description="Most TP shards of a namespace's blocks (a block holds one part per shard).")
    max_inflight_jobs: int = Field(1024, ge=1, description="Most unfinished jobs per session.")
    max_request_bytes: ByteSize = Field(ByteSize(64 << 20), description="Largest gRPC message accepted.")
    max_watches_per_session: int = Field(
        4, ge=1, description="Most WatchBlocks streams one session holds open (the connector opens one).")
    max_watches_per_uid: int = Field(
        64, ge=1, description="Most WatchBlocks streams the sessions of one peer uid (or client certificate) hold.")
    max_lookup_keys: int = Field(
        65536, ge=1, description="Most keys one Lookup names (a 1M-token prompt in 16-token blocks; with several "
        "KV cache groups, blocks x groups): the grouped hit rule runs on the event loop, 2 ms per 4,000 blocks "
        "measured (about 8 ms at this bound with 4 groups).")
    max_job_request_bytes: ByteSize = Field(
        ByteSize(4 << 20), description="Largest store or load request on <socket>.jobs (a 64k-block job is "
        "2.6 MiB); clients send larger ones by gRPC.")
    max_jobs_buffer_bytes: ByteSize = Field(
        ByteSize(64 << 20), description="Bytes of requests being received on <socket>.jobs, in all; a frame "
        "over it turns its connection away (the client then uses gRPC).")
    max_jobs_buffer_bytes_per_uid: ByteSize = Field(
        ByteSize(16 << 20), description="The same, of one peer uid.")
    max_event_bytes: ByteSize = Field(
        ByteSize(64 << 20), description="Most bytes of block descriptions (token ids, parent hash: what routers' "
        "KV events need) held for every namespace together: descriptions of blocks not stored yet make room first "
        "(oldest first), then more are dropped, counted.")
    max_event_description_bytes: ByteSize = Field(
        ByteSize(8 << 10), description="Largest description of one block an engine may send; larger ones are "
        "dropped, counted.")
    event_journal: str = Field(
        "", description="File keeping the block descriptions across daemon restarts, so that recovered blocks are "
        "announced at once (a restarted daemon reads it back); '': beside the pool file (<pool-path>.events); "
        "'off': not kept. Needs a file system that takes plain writes (not hugetlbfs).")
    max_event_queue: int = Field(
        65536, ge=1, description="Most block events queued for one engine's stream; one that falls further "
        "behind is reset (sent the namespace's blocks again).")
    verify_loads: float = Field(
        0.05, ge=0, le=1,
        description="Fraction of loaded blocks whose checksum is verified (0..1); 1 checks every block: "
        "a bulk load then runs at ~90% of its unverified speed (checksums taken as it copies), a small "
        "one copied whole (verified before it copies) at ~60%.",
    )
    disk_path: str = Field(
        "", description="Directory of the disk tier (NVMe): blocks written behind once sealed, read back on a "
        "pool miss, kept across restarts; owned by the daemon's uid, not group/other writable. Empty: off.")
    disk_size: ByteSize = Field(ByteSize(64 << 30), description="Most bytes the disk tier's segment files take.")
    disk_segment_size: ByteSize = Field(
        ByteSize(256 << 20), description="Disk tier segment file size: space is reclaimed a segment at a time.")
    disk_queue_bytes: ByteSize = Field(
        ByteSize(256 << 20), description="Blocks waiting to be written to disk; more are dropped, counted.")
    remote: str = Field(
        "", description="Shared cold tier on Redis/Valkey: redis://host:port, rediss:// (TLS) or "
        "redis+cluster://host:port,host:port; user:password@ allowed (never logged). Empty: off.")
    remote_password_file: str = Field(
        "", description="File holding the remote store's password (else the URL's, else $KVSTORE_REMOTE_PASSWORD).")
    remote_tls_ca: str = Field("", description="PEM CA bundle to verify a rediss:// store (default: the system's).")
    remote_queue_bytes: ByteSize = Field(
        ByteSize(256 << 20), description="Blocks waiting for their upload (write-behind); more are dropped, counted.")
    remote_timeout_s: float = Field(1.0, gt=0, description="Longest wait for one call to the remote store.")
    remote_breaker_s: float = Field(
        10.0, gt=0, description="After 3 failed calls in a row, the remote store is not asked for this long.")
    remote_fetch_bytes: ByteSize = Field(
        ByteSize(256 << 20), description="Most bytes one lookup brings in from the disk or the remote store.")
    remote_secret_file: str = Field(
        "", description="File holding the remote store's secret (32+ random bytes; not readable by others): keys "
        "are derived and values authenticated with it (a key per tenant), so store clients can neither read "
        "nor plant blocks. Needed with --tenants.")
    remote_encrypt: bool = Field(
        False, description="Also encrypt values (AES-256-GCM, a key per tenant) with --remote-secret-file: for a "
        "store others can read.")
    metrics_port: int = Field(0, ge=0, le=65535, description="Prometheus /metrics port; 0: off.")
    metrics_max_connections: int = Field(
        16, ge=1, description="Connections the /metrics and /healthz server serves at once (a thread each); "
        "more are closed at once.")
    metrics_request_timeout_s: float = Field(
        5.0, gt=0, description="A /metrics or /healthz connection silent this long is closed.")
    metrics_host: str = Field(
        "127.0.0.1", description="Address /metrics and /healthz listen on (no authentication: loopback by default; "
        "the Helm chart gives the pod IP so that Prometheus can scrape).")
    metrics_namespaces: bool = Field(
        True, description="Per-namespace series on /metrics (labelled with the tenant, the model and a namespace "
        "id); off: daemon-wide figures only, no tenant named.")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="Log level.")
    drain_timeout_s: float = Field(
        20.0, gt=0, description="A stopping daemon (SIGTERM) lets the copies in flight finish for at most this "
        "long before any engine learns that its jobs ended; past it the daemon exits at once, without telling "
        "them (a copy may still be writing). Keep it below the pod's terminationGracePeriodSeconds."
    )
    handshake_timeout_s: float = Field(
        2.0, gt=0, description="A connection to <socket>.cred that has not sent its token within this is closed."
    )
    max_handshakes_per_uid: int = Field(
        16, ge=1, description="Most handshakes in progress on <socket>.cred per peer uid; more are refused at once."
    )
    max_handshakes: int = Field(
        256, ge=1, description="Most handshakes in progress on <socket>.cred in all; more are refused at once."
    )
    max_engine_id_bytes: int = Field(
        256, ge=1, description="Longest engine_id a Register may give, in bytes (UTF-8); it is logged.")
    max_memory_per_uid: ByteSize = Field(
        ByteSize(1 << 40), description="Most host memory one caller's CPU sessions (a peer uid's, or a TLS client "
        "name's) address together, registrations in progress included.")
    max_lease_blocks_per_uid: int = Field(
        1 << 20, ge=1, description="Blocks the leases of one peer uid name in all (each costs the daemon a "
        "reference: ~8 MiB at the default).")
    max_leases_per_uid: int = Field(
        8192, ge=1, description="Most leases one caller's sessions (a peer uid's, or a TLS client name's) hold "
        "together.")
    max_lease_share: float = Field(
        0.5, gt=0, le=1, description="With --tenants: most of the pool's capacity one tenant's leases pin (blocks "
        "counted once), so that the rest stays evictable for the other tenants' stores.")

    @field_validator("tenants")
    @classmethod
    def _tenant_names(cls, value: dict[str, Tenant]) -> dict[str, Tenant]:
        owners: dict[str, str] = {}
        for name, tenant in value.items():
            if not TENANT_NAME.fullmatch(name):
                raise ValueError(f"tenant name {name!r}: use 1-63 letters, digits, '_', '.', '-' (a letter or digit "
                                 "first)")
            for who in [f"uid {u}" for u in tenant.uids] + [f"TLS name {n!r}" for n in tenant.tls_names]:
                if who in owners:
                    raise ValueError(f"{who} is in two tenants ({owners[who]!r} and {name!r})")
                owners[who] = name
        return value

    @model_validator(mode="after")
    def _tcp_callers_identified(self) -> Config:
        rules = self.tenants or self.allowed_uids or self.admin_uids or self.admin_tls_names
        if self.tcp and rules and not self.tls_client_ca:
            raise ValueError("--tcp with --tenants, --allowed-uids or admins needs --tls-client-ca (mTLS): a TCP "
                             "caller has no uid, only a client certificate can say who it is")
        return self

    @model_validator(mode="after")
    def _remote_secret(self) -> Config:
        if self.remote and self.tenants and not self.remote_secret_file:
            raise ValueError("--remote with --tenants needs --remote-secret-file: without a secret, whoever can write "
                             "the store can plant any tenant's blocks and whoever can read it reads them")
        if self.remote_encrypt and not self.remote_secret_file:
            raise ValueError("--remote-encrypt needs --remote-secret-file: the encryption keys are derived from it")
        return self

    @field_validator("socket_mode")
    @classmethod
    def _octal(cls, value: str) -> str:
        int(value, 8)
        return value

    @field_validator("devices")
    @classmethod
    def _known_devices(cls, value: list[str]) -> list[str]:
        unknown = sorted(set(value) - {"cpu", "cuda", "npu"})
        if unknown:
            raise ValueError(f"unknown device backend(s) {unknown}: expected cuda or npu")
        return value

    @field_validator("pool_numa")
    @classmethod
    def _numa_policy(cls, value: str) -> str:
        if value not in ("interleave", "first-touch"):
            parse_nodes(value)
        return value

    def numa_nodes(self) -> list[int] | None:
        """The NUMA nodes to spread a new pool over (--pool-numa), or None."""
        if self.pool_numa == "first-touch":
            return None
        if self.pool_numa != "interleave":
            return parse_nodes(self.pool_numa)
        try:  # the nodes this process may allocate on (its cpuset's mems)
            with open("/proc/self/status") as f:
                allowed = next((line.split(":", 1)[1] for line in f if line.startswith("Mems_allowed_list:")), "0")
        except OSError:
            return None
        nodes = [n for n in parse_nodes(allowed.strip()) if n < 64]
        return nodes if len(nodes) > 1 else None

    @field_validator("pool_size", "segment_size")
    @classmethod
    def _positive(cls, value: ByteSize) -> ByteSize:
        if value <= 0:
            raise ValueError("must be positive")
        return value

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Keyword arguments (the flags) > KVSTORE_* > the --config file; no dotenv, no secrets dir."""
        return init_settings, env_settings, InitSettingsSource(settings_cls, _file_values.get() or {})

    @classmethod
    def load(cls, yaml_path: str | None = None, **overrides: Any) -> Config:
        """Build the config: `overrides` (flags) beat env vars, which beat the YAML file. A bad value
        raises ConfigError naming its flag, variable or file key."""
        file_keys: dict[str, str] = {}  # setting -> the key as the file spells it
        file_values: dict[str, Any] = {}
        if yaml_path:
            try:
                raw = yaml.safe_load(Path(yaml_path).read_text()) or {}
            except yaml.YAMLError as e:
                mark = getattr(e, "problem_mark", None)
                at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
                raise ConfigError(f"--config {yaml_path}: not valid YAML{at}: {getattr(e, 'problem', e)}") from None
            if not isinstance(raw, dict):
                raise ConfigError(f"--config {yaml_path}: expected a mapping of settings")
            file_keys = {str(k).replace("-", "_"): str(k) for k in raw}
            file_values = {str(k).replace("-", "_"): v for k, v in raw.items()}
        token = _file_values.set(file_values)
        try:
            return cls(**overrides)
        except ValidationError as e:
            where = _Sources(overrides, file_keys, yaml_path)
            raise ConfigError("\n".join(where.describe(error) for error in e.errors())) from None
        except SettingsError as e:  # a KVSTORE_* list or mapping that is not JSON
            field = re.search(r'field "(\w+)"', str(e))
            name = f"KVSTORE_{field.group(1).upper()}" if field else "a KVSTORE_* variable"
            raise ConfigError(f"{name}: not valid JSON (lists and mappings are given as JSON in the environment, "
                              "e.g. [1000, 1001])") from None
        finally:
            _file_values.reset(token)


class _Sources:
    """Where each setting of one Config.load came from, to name it in an error."""

    def __init__(self, flags: dict[str, Any], file_keys: dict[str, str], yaml_path: str | None) -> None:
        self.flags = flags
        self.file_keys = file_keys
        self.yaml_path = yaml_path
        self.env = {k.upper() for k in os.environ}

    def name(self, setting: str) -> str:
        if setting in self.flags:
            return "--" + setting.replace("_", "-")
        if f"KVSTORE_{setting.upper()}" in self.env:
            return f"KVSTORE_{setting.upper()}"
        if setting in self.file_keys:
            return f"--config {self.yaml_path}, key {self.file_keys[setting]}"
        return f"{setting} (default)"

    def describe(self, error: Any) -> str:
        """One line: the source, the place inside it (nested settings), what is wrong and the value given."""
        loc = [str(part) for part in error["loc"]]
        message = str(error["msg"]).removeprefix("Value error, ")
        if not loc:  # a rule across settings: its message names them
            return message
        where = self.name(loc[0]) + "".join(f"[{part}]" for part in loc[1:])
        if error["type"] == "extra_forbidden":
            return f"{where}: not a setting (see kvstore serve --help)"
        value = error.get("input")
        given = f" (given: {value!r})" if isinstance(value, str | int | float) and not isinstance(value, bool) else ""
        return f"{where}: {message}{given}"


def parse_nodes(text: str) -> list[int]:
    """NUMA nodes written as the kernel lists them: '0', '0,2', '0-3,8-11'."""
    nodes: list[int] = []
    try:
        for part in text.split(","):
            first, _, last = part.partition("-")
            nodes += range(int(first), int(last or first) + 1)
    except ValueError:
        raise ValueError(f"expected NUMA nodes like '0,1' or '0-3', 'interleave' or 'first-touch' (got {text!r})") \
            from None
    if not nodes or min(nodes) < 0 or max(nodes) > 63:
        raise ValueError(f"NUMA nodes must be 0..63 (got {text!r})")
    return nodes
