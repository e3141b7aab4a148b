"""The remote store's keys and values: one key per block, derived under the tenant's key, and a value
that is used only after its MAC or AEAD tag checked out (`Keyring`). The bytes of a key and of a value
are described in docs/formats.md ("Remote store value"); this file is their one code definition.

Anyone who can reach the store may be hostile, so nothing read from it is trusted until checked under a
secret store clients do not have (``secret_file``; a key per tenant is derived from it): a value
planted, altered, or moved from another key (a mixed-up reply, a copied key) is caught like a corrupt
one. Without a secret the same scheme runs with an empty key: integrity only.
"""

from __future__ import annotations

import hmac
import os
import stat
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Final, TypeAlias

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvstore_service import native

Buffer: TypeAlias = bytes | bytearray | memoryview

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

    def wrap(self, tenant: str, key: bytes, payload: Buffer) -> tuple[Buffer, ...]:
        """The value stored under remote key ``key``, as pieces sent one after the other: the header,
        then the payload (a view of it: not copied) and its MAC, or the payload encrypted and its tag."""
        view = bytes_view(payload)
        _, mac_key, aead_key = self._keys(tenant)
        salt = os.urandom(16) if self.encrypt else bytes(16)
        header = _HEADER.pack(VALUE_MAGIC, VALUE_VERSION, self.mode, HEADER_BYTES, view.nbytes, salt)
        bound = header + struct.pack("<H", len(key)) + key  # what the tag covers besides the payload
        if self.encrypt:  # a fresh key per value (from its random salt): the nonce can be fixed
            wrapped = bytearray(view.nbytes + _GCM_TAG)
            AESGCM(hmac.digest(aead_key, salt, "sha256")).encrypt_into(_NONCE, view, bound, wrapped)
            return header, wrapped
        mac = hmac.new(mac_key, bound, "sha256")
        mac.update(view)
        return header, view, mac.digest()

    def unwrap(self, tenant: str, key: bytes, value: Buffer, payload_bytes: int | None = None,
             into: memoryview | None = None) -> tuple[memoryview, int] | None:
        """The payload of the value read under ``key`` and its CRC32C, or None unless the value is one
        this keyring wrapped under this key (its MAC or AEAD tag checked before anything is used), of this
        mode, ``payload_bytes`` long when that is given. With ``into``, the payload lands there (whatever
        it holds is garbage when None is returned)."""
        view = bytes_view(value)
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


def bytes_view(data: Buffer) -> memoryview:
    view = memoryview(data)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def encode_value(key: bytes, payload: Buffer, tenant: str = "", keyring: Keyring = PUBLIC) -> bytes:
    """The whole value, joined, as a reader sees it."""
    return b"".join(bytes(p) for p in keyring.wrap(tenant, key, payload))


def decode_value(key: bytes, value: Buffer, payload_bytes: int | None = None, tenant: str = "",
                 keyring: Keyring = PUBLIC) -> memoryview | None:
    """The payload of a valid value read under ``key`` (see `Keyring.unwrap`), else None."""
    opened = keyring.unwrap(tenant, key, value, payload_bytes)
    return None if opened is None else opened[0]

