"""Store URLs and credentials: ``redis://``, ``rediss://`` (TLS), ``redis+cluster://``,
``rediss+cluster://``. Credentials come from the ``password`` argument, else ``password_file``, else the
URL's ``user:password@``, else the environment variable KVSTORE_REMOTE_PASSWORD; they are never logged
(logs and stats carry ``RemoteURL.masked()``)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final
from urllib.parse import unquote

PASSWORD_ENV: Final = "KVSTORE_REMOTE_PASSWORD"
DEFAULT_PORT: Final = 6379
_SCHEMES: Final = {"redis": (False, False), "rediss": (False, True),  # scheme -> (cluster, tls)
                   "redis+cluster": (True, False), "rediss+cluster": (True, True)}
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

