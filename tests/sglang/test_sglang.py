"""SGLang's own HiCache controller, host pool and backend factory, on CPU, with kvstore_client.sglang
as its "dynamic" storage backend against a real daemon (tests/sglang/hicache_driver.py): SGLang's
backup thread writes pages, a new SGLang process's prefetch threads find and read them byte-exact."""

from __future__ import annotations

import json
import time

import pytest

ALL = 256  # tokens of a driver's 4 prompts (16 pages of 4 tokens each)


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_pages_come_back_byte_exact_zero_copy_or_staged(sglang, daemon, layout: str) -> None:
    # Stored zero-copy from SGLang's shared host pool, read through a staging area, and the other way:
    # the pool's bytes are the same either way.
    assert sglang.run("store", daemon.socket, "--layout", layout, "--shm")["stored_tokens"] == ALL
    got = sglang.run("fetch", daemon.socket, "--layout", layout)
    assert (got["hit_tokens"], got["wrong_pages"]) == (ALL, 0), got
    assert sglang.run("store", daemon.socket, "--layout", layout, "--seed", "1")["stored_tokens"] == ALL
    got = sglang.run("fetch", daemon.socket, "--layout", layout, "--seed", "1", "--shm")
    assert (got["hit_tokens"], got["wrong_pages"]) == (ALL, 0), got
    # SGLang's hybrid calls: the KV pool is served; with a Mamba pool's pages asked too (not served yet),
    # no prefix is usable, and nothing is read for it.
    assert got["v2_hit_pages"] == 16  # (of the first prompt: 64 tokens, pages of 4)
    assert got["hybrid_hit_pages"] == [0, {"mamba": 0}] and got["hybrid_got"] == {"mamba": [False]}, got
    # Another layout orders a page's bytes otherwise: its own namespace, no hit.
    other = "page_first" if layout == "layer_first" else "layer_first"
    assert sglang.run("fetch", daemon.socket, "--layout", other, "--shm")["hit_tokens"] == 0


def test_a_daemon_gone_is_a_miss_and_sglang_serves_on(sglang, daemon) -> None:
    assert sglang.run("store", daemon.socket, "--shm")["stored_tokens"] == ALL
    fetching = sglang.start("fetch", daemon.socket, "--shm", "--follow", "--timeout", "2")
    assert fetching.stdin is not None and fetching.stdout is not None

    def again() -> dict:
        fetching.stdin.write("\n")
        fetching.stdin.flush()
        return json.loads(fetching.stdout.readline())

    try:
        assert json.loads(fetching.stdout.readline())["hit_tokens"] == ALL
        daemon.kill()
        gone = again()
        assert gone["hit_tokens"] == 0 and gone["seconds"] < 10, gone  # (misses, quickly)
        daemon.start()  # the same pool: its blocks come back with it
        # The backend reconnects by itself (its session retries); the daemon serves the recovered pages
        # once it has verified them (a lookup meanwhile hits the verified part only).
        deadline = time.monotonic() + 20
        while (back := again())["hit_tokens"] < ALL and time.monotonic() < deadline:
            time.sleep(0.5)
        assert (back["hit_tokens"], back["wrong_pages"]) == (ALL, 0), back
        fetching.stdin.close()
        assert fetching.wait(60) == 0
    finally:
        fetching.kill()


def test_a_tenant_salt_keeps_pages_apart(sglang, daemon) -> None:
    """(SGLang's page keys carry no salt: the backend puts the extra config's tenant_salt into the
    namespace. Tenants by uid are the daemon's, the same for every engine: tests/process/test_tenants.py.)
    Stored by SGLang's copying calls (no interface_v1), read zero-copy: the same bytes."""
    assert sglang.run("store", daemon.socket, "--salt", "team-1", "--v0")["stored_tokens"] == ALL
    assert sglang.run("fetch", daemon.socket, "--salt", "team-2")["hit_tokens"] == 0
    got = sglang.run("fetch", daemon.socket, "--v0")
    assert got["hit_tokens"] == 0 and got["v2_hit_pages"] == 0, got
    got = sglang.run("fetch", daemon.socket, "--salt", "team-1", "--shm")
    assert (got["hit_tokens"], got["wrong_pages"]) == (ALL, 0), got
    assert daemon.client().stats().loaded_tokens == ALL  # (the namespace names its page's tokens: block=4)


def test_a_model_updated_in_place_never_meets_its_old_pages(sglang, daemon, tmp_path) -> None:
    """Without model_identity the namespace names the model's files (kvstore_client/identity.py, as for
    vLLM); a model whose identity cannot be told leaves SGLang serving without the pool, saying why."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    (model / "model.safetensors").write_bytes(b"weights, version 1")
    assert sglang.run("store", daemon.socket, "--model", str(model))["stored_tokens"] == ALL
    assert sglang.run("fetch", daemon.socket, "--model", str(model))["hit_tokens"] == ALL
    (model / "model.safetensors").write_bytes(b"weights, version 2")
    assert sglang.run("fetch", daemon.socket, "--model", str(model))["hit_tokens"] == 0
    gone = sglang.run("fetch", daemon.socket, "--model", str(tmp_path / "nowhere"), "--shm")
    assert gone["hit_tokens"] == 0 and gone["v2_hit_pages"] == 0, gone
    assert "cannot tell the model's identity" in sglang.last_stderr and "kvstore is off" in sglang.last_stderr
