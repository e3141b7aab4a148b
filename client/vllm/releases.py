"""The vLLM releases the connector serves, and the gate that refuses the others.

The gate runs before any module that names release-specific vLLM symbols is imported (see
kvstore_client.vllm.__getattr__), so that an unserved release gets this one line, not an ImportError.
A series is listed once vLLM's own scheduler has driven the connector on it (tests/vllm).
"""

from __future__ import annotations

SERVED_SERIES = ("0.23", "0.32", "0.33")


def series_of(version: str) -> str:
    """"0.33" of "0.33.0", "0.33.1+cpu" or "0.33.0rc1"."""
    return ".".join(version.split("+")[0].split(".")[:2])


def check_vllm_version(version: str) -> None:
    """Raises RuntimeError, in one line, for a vLLM release the connector was not tested on."""
    if series_of(version) not in SERVED_SERIES:
        served = ", ".join(f"{s}.x" for s in SERVED_SERIES)
        raise RuntimeError(f"the kvstore connector serves vLLM {served} and this is vLLM {version}: install a "
                           "kvstore-sidecar-client release made for it, or remove the kv-transfer-config")
