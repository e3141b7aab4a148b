"""vLLM KV connector (vLLM 0.23, 0.32 and 0.33: releases.py, compat.py): offload KV blocks to the kvstore
sidecar and load them back.

    --kv-transfer-config '{"kv_connector": "KVStoreConnector",
                           "kv_connector_module_path": "kvstore_client.vllm", "kv_role": "kv_both",
                           "kv_connector_extra_config": {"socket": "/run/kvstore/kvstore.sock"}}'

Scheduler side (no tensors; its decisions are plan/'s, with no I/O): looks a request's block hashes up
in the sidecar asynchronously (`get_num_new_matched_tokens` answers None, "ask again", until the reply
is in), pins the hits with a lease, pairs keys with the engine blocks vLLM allocates, and plans each
step's loads and stores.
Worker side: moves the KV cache into shared memory (CPU) and registers it, submits the planned jobs
without waiting, and polls their completions from shared memory in the steps that have jobs in
flight. No RPC is ever made on the engine's step loop (lookups and lease releases run on the
session's background thread); if the sidecar is down, lookups miss, loads fail (vLLM recomputes)
and stores are dropped, and the connector reconnects on its own.
"""

from __future__ import annotations

from typing import Any

# vLLM finds the connector with getattr(import_module("kvstore_client.vllm"), "KVStoreConnector"). The
# class is imported on that first access, not with the package, so that `python -m
# kvstore_client.vllm.cpu_cli` starts vLLM's CLI without importing torch and vLLM first.


def __getattr__(name: str) -> Any:
    if name == "KVStoreConnector":
        from vllm.version import __version__

        from kvstore_client.vllm.releases import check_vllm_version

        check_vllm_version(__version__)  # before connector.py imports names a release may lack
        from kvstore_client.vllm import connector

        return connector.KVStoreConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
