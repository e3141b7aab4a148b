"""A test PKI: a CA, server and client certificates (and a rogue CA's), and TLS clients of a daemon."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from kvstore_client import KVStoreClient


def make_cert(subject: str, issuer_key, issuer_name, key, ca: bool = False) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
               .issuer_name(issuer_name or x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def pem(obj) -> bytes:
    if isinstance(obj, x509.Certificate):
        return obj.public_bytes(serialization.Encoding.PEM)
    return obj.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def tls_client(port: int, pki: dict, cert: str | None) -> KVStoreClient:
    creds = grpc.ssl_channel_credentials(root_certificates=pki["ca"], private_key=pki[cert + "_key"] if cert else None,
                                         certificate_chain=pki[cert] if cert else None)
    return KVStoreClient(f"dns:localhost:{port}", timeout=5, credentials=creds)


def make_pki(tmp_path: Path, clients: tuple[str, ...] = ("client",)) -> dict[str, bytes | str]:
    """PEMs by name: the CA, the server's and `clients`' certificates (their CN the name) and keys,
    and a certificate "rogue" of another CA; `<name>_path` for the files the daemon reads."""
    files: dict[str, bytes | str] = {}
    cas = {}
    for name in ("ca", "rogue_ca"):
        key = ec.generate_private_key(ec.SECP256R1())
        cas[name] = (key, make_cert(name, key, None, key, ca=True))
    for name, ca in (("server", "ca"), *((c, "ca") for c in clients), ("rogue", "rogue_ca")):
        key = ec.generate_private_key(ec.SECP256R1())
        ca_key, ca_cert = cas[ca]
        files[name] = pem(make_cert(name, ca_key, ca_cert.subject, key))
        files[name + "_key"] = pem(key)
    files["ca"] = pem(cas["ca"][1])
    for name in ("server", "server_key", "ca"):
        (tmp_path / f"{name}.pem").write_bytes(files[name])  # type: ignore[arg-type]
        files[name + "_path"] = str(tmp_path / f"{name}.pem")
    return files
