"""Who a caller is, and which tenant's blocks it may reach.

The operator declares tenants (`--tenants`: name -> unix uids and mTLS client names) and admins
(`--admin-uids`, `--admin-tls-names`). A caller is known by the kernel on the unix socket (the
`<socket>.cred` handshake's SO_PEERCRED uid) and by its client certificate over TCP (mTLS). The
daemon puts the caller's tenant into every namespace it names, so the part a client chooses can
never reach another tenant's blocks; stats, lookups and Clear show a tenant only its own.

With no rules at all (no tenants, no --allowed-uids, no admins) the node is trusted: every caller
is an admin of the one tenant "", and namespaces are the clients' own names.

gRPC does not tell a unix caller's uid per call: there the handshake identifies the caller of
Register, Clear, Stats and session-less lookups, and a session stays bound to the transport it
registered over (a TCP session, to its client certificate's name on every call).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from kvstore_service.config import Config
from kvstore_service.errors import KVError, invalid
from kvstore_service.peercred import PeerCred

# Between a tenant and the client's namespace in the name the index keeps: clients cannot send it
# (control characters are refused in namespaces), so no client-chosen name looks like another tenant's.
SEPARATOR = "\x1f"
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
UNIX = "unix"  # the principal of an unidentified caller on the unix socket (a trusted node only)


@dataclass(frozen=True, slots=True)
class Caller:
    principal: str  # "uid:<n>", "tls:<name>", "unix" or "tcp": what a session is bound to
    tenant: str | None  # None: in no tenant (may still be an admin, or be refused)
    admin: bool = False

    def member(self, action: str) -> str:
        """The caller's tenant, or PERMISSION_DENIED naming what it may not do."""
        if self.tenant is None:
            raise KVError("PERMISSION_DENIED", f"{self.principal or 'an unidentified caller'} belongs to no tenant "
                          f"(--tenants), so it may not {action}")
        return self.tenant


def tls_names(context: Any) -> list[str]:
    """A TCP caller's verified client certificate names: its subject CN first, then its SANs."""
    auth = context.auth_context()
    names = [n.decode() for n in auth.get("x509_common_name", ())]
    return names + [n.decode() for n in context.peer_identities() or () if n.decode() not in names]


def scoped(tenant: str, namespace: str) -> str:
    """The index's name of a tenant's namespace."""
    return f"{tenant}{SEPARATOR}{namespace}" if tenant else namespace


def split(name: str) -> tuple[str, str]:
    """(tenant, the client's namespace) of an index name."""
    tenant, sep, namespace = name.partition(SEPARATOR)
    return (tenant, namespace) if sep else ("", name)


def check_namespace(namespace: str, max_bytes: int) -> None:
    if not namespace:
        raise invalid("namespace is empty")
    size = len(namespace.encode())
    if size > max_bytes:
        raise invalid(f"namespace is {size} bytes, more than --max-namespace-bytes {max_bytes}")
    if _CONTROL.search(namespace):
        raise invalid("namespace contains a control character")


class Tenancy:
    def __init__(self, config: Config) -> None:
        self.allowed_uids = set(config.allowed_uids)
        self.admin_uids = set(config.admin_uids)
        self.admin_tls_names = set(config.admin_tls_names)
        self.by_uid = {uid: name for name, t in config.tenants.items() for uid in t.uids}
        self.by_tls_name = {tls: name for name, t in config.tenants.items() for tls in t.tls_names}
        self.has_tenants = bool(config.tenants)
        self.restricted = bool(config.tenants or self.allowed_uids or self.admin_uids or self.admin_tls_names)

    def handshake_uids(self) -> set[int]:
        """The uids the `<socket>.cred` handshake accepts; empty: any."""
        if not self.has_tenants and not self.allowed_uids:  # (admins alone restrict no one)
            return set()
        return self.allowed_uids | self.admin_uids | set(self.by_uid)

    def identify(self, cred: PeerCred | None, context: Any) -> Caller:
        """The caller of this RPC: its handshake's credentials on the unix socket, its client
        certificate over TCP."""
        if context.peer().startswith("unix:"):
            if cred is None:
                return Caller(UNIX, None if self.restricted else "", admin=not self.restricted)
            return self._of_uid(cred.uid)
        names = tls_names(context)
        if not names:
            return Caller("tcp", None if self.restricted else "", admin=not self.restricted)
        return self._of_tls(names)

    def _of_uid(self, uid: int) -> Caller:
        admin = uid in self.admin_uids or not self.restricted
        if self.has_tenants:
            tenant = self.by_uid.get(uid)
        else:
            tenant = "" if not self.allowed_uids or uid in self.allowed_uids else None
        return Caller(f"uid:{uid}", tenant, admin)

    def _of_tls(self, names: list[str]) -> Caller:
        admin = not self.restricted or any(n in self.admin_tls_names for n in names)
        # Without tenants, a certificate the client CA verified is of the one tenant.
        tenant = next((self.by_tls_name[n] for n in names if n in self.by_tls_name), None) if self.has_tenants else ""
        return Caller(f"tls:{names[0]}", tenant, admin)

    def check_session(self, owner: str, context: Any) -> None:
        """A session is used over the transport it registered on, over TCP by the same client
        certificate; refuse anyone else."""
        over_tcp = not owner.startswith(("uid:", UNIX))
        if context.peer().startswith("unix:") == over_tcp or (
                owner.startswith("tls:") and owner.removeprefix("tls:") not in tls_names(context)):
            raise KVError("PERMISSION_DENIED", "this session belongs to another caller")

