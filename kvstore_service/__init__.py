"""kvstore daemon: a per-node sidecar that keeps LLM KV-cache blocks in a shared CPU memory pool."""

__version__ = "0.1.0"
