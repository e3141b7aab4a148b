"""LoRA adapters in the pool's keys (kvstore_client/vllm/adapters.py): an adapter replaced in place never
meets its old blocks, across engine restarts; the same files under another name or path share them."""

from __future__ import annotations

import hashlib
import json
import pickle
import shutil
import types
from pathlib import Path

import pytest

from kvstore_client.vllm.adapters import Adapters, KeyedRequest


@pytest.fixture(autouse=True)
def digest_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSTORE_DIGEST_CACHE", str(tmp_path / "digests.json"))


def adapter(path: Path, weights: bytes) -> Path:
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"r": 8, "target_modules": ["q_proj", "v_proj"]}))
    (path / "adapter_model.safetensors").write_bytes(weights)
    return path


class Hashing:
    """vLLM 0.32's block hashing in miniature: extra keys carry the adapter's name and path."""

    block_size = 4

    def extra_keys(self, request, start: int, end: int) -> tuple:
        lora = request.lora_request
        return (("lora", lora.lora_name, lora.lora_path),)

    def hash_tokens(self, parent, tokens, extra) -> bytes:
        return hashlib.sha256(pickle.dumps((parent, tuple(tokens), extra))).digest()


def request(path: Path, name: str = "sql", blocks: int = 3) -> types.SimpleNamespace:
    """What the connector reads of a vLLM LoRA request."""
    lora = types.SimpleNamespace(lora_int_id=1, lora_path=str(path), lora_name=name)
    r = types.SimpleNamespace(request_id="r", lora_request=lora, all_token_ids=list(range(4 * blocks + 2)),
                              block_hashes=[])
    hashing = Hashing()
    for i in range(blocks):  # vLLM's own hashes
        r.block_hashes.append(hashing.hash_tokens(r.block_hashes[-1] if i else None, r.all_token_ids[4 * i:4 * i + 4],
                                                  hashing.extra_keys(r, 0, 0)))
    return r


def keys(adapters: Adapters, path: Path, name: str = "sql") -> list[bytes]:
    keyed = adapters.keyed(request(path, name))
    assert isinstance(keyed, KeyedRequest)
    return keyed.block_hashes


def test_an_adapter_replaced_in_place_never_meets_its_old_blocks(tmp_path: Path) -> None:
    path = adapter(tmp_path / "sql", b"\x01" * 4096)
    before = keys(Adapters(Hashing()), path)
    assert before != request(path).block_hashes  # not vLLM's hashes: those name the adapter, not its files
    (path / "adapter_model.safetensors").write_bytes(b"\x01" * 4095 + b"\x02")  # one byte, same size
    assert keys(Adapters(Hashing()), path) != before  # the engine restarted: the new files, new keys


def test_the_same_adapter_under_another_name_and_path_shares_its_blocks(tmp_path: Path) -> None:
    path = adapter(tmp_path / "sql", b"\x01" * 4096)
    elsewhere = shutil.copytree(path, tmp_path / "mounted" / "sql-v1")
    assert request(path).block_hashes != request(elsewhere, "sql-v1").block_hashes  # vLLM's differ
    assert keys(Adapters(Hashing()), path) == keys(Adapters(Hashing()), elsewhere, "sql-v1")


def test_a_tail_is_chained_on_the_adapters_keys(tmp_path: Path) -> None:
    path = adapter(tmp_path / "sql", b"\x01" * 4096)
    keyed, other = (Adapters(Hashing()).keyed(request(p, n)) for p, n in ((path, "sql"), (path, "b")))
    assert keyed is not None and other is not None
    assert keyed.hash_tail(12, 14) == other.hash_tail(12, 14)
    assert keyed.hash_tail(12, 14) not in keyed.block_hashes


def test_keys_follow_vllms_hashes_as_blocks_fill(tmp_path: Path) -> None:
    path = adapter(tmp_path / "sql", b"\x01" * 4096)
    r = request(path)
    keyed = Adapters(Hashing()).keyed(r)
    assert keyed is not None and len(keyed.block_hashes) == 3
    grown = request(path, blocks=4)  # two more tokens: vLLM hashed one more block
    r.all_token_ids, r.block_hashes = grown.all_token_ids, grown.block_hashes
    assert keyed.block_hashes == Adapters(Hashing()).keyed(grown).block_hashes
    assert len(keyed.block_hashes) == 4 and keyed.request_id == "r"


def test_an_adapter_whose_files_are_not_here_is_not_cached(tmp_path: Path, caplog) -> None:
    adapters = Adapters(Hashing())
    assert adapters.keyed(request(tmp_path / "nowhere")) is None
    assert adapters.keyed(request(tmp_path / "nowhere")) is None
    assert caplog.text.count("cannot tell its identity") == 1  # said once
