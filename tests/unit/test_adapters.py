"""LoRA adapters in the pool's keys (kvstore_client/vllm/adapters.py): an adapter replaced in place never
meets its old blocks, across engine restarts; the same files at another path share them."""

from __future__ import annotations

import json
import shutil
import types
from pathlib import Path

import pytest
from support.blocks import key_of

from kvstore_client.vllm.adapters import Adapters, KeyedRequest


@pytest.fixture(autouse=True)
def digest_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSTORE_DIGEST_CACHE", str(tmp_path / "digests.json"))


def adapter(path: Path, weights: bytes) -> Path:
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"r": 8, "target_modules": ["q_proj", "v_proj"]}))
    (path / "adapter_model.safetensors").write_bytes(weights)
    return path


def request(path: Path, name: str = "sql", hashes: int = 3) -> types.SimpleNamespace:
    """What the connector reads of a vLLM LoRA request; vLLM's hashes carry the adapter's name only."""
    lora = types.SimpleNamespace(lora_int_id=1, lora_path=str(path), lora_name=name)
    return types.SimpleNamespace(request_id="r", lora_request=lora,
                                 block_hashes=[key_of(f"lora-{name}", i) for i in range(hashes)])


def keys(adapters: Adapters, path: Path) -> list[bytes]:
    keyed = adapters.keyed(request(path))
    assert isinstance(keyed, KeyedRequest)
    return keyed.block_hashes


def test_an_adapter_replaced_in_place_never_meets_its_old_blocks(tmp_path: Path) -> None:
    path = adapter(tmp_path / "sql", b"\x01" * 4096)
    before = keys(Adapters(), path)
    assert before != request(path).block_hashes  # not vLLM's hashes: those name the adapter only
    (path / "adapter_model.safetensors").write_bytes(b"\x01" * 4095 + b"\x02")  # one byte, same size
    assert keys(Adapters(), path) != before  # the engine restarted: the new files, new keys


def test_the_same_adapter_at_another_path_shares_its_blocks(tmp_path: Path) -> None:
    path = adapter(tmp_path / "sql", b"\x01" * 4096)
    elsewhere = shutil.copytree(path, tmp_path / "mounted" / "sql")
    assert keys(Adapters(), path) == keys(Adapters(), elsewhere)


def test_keys_follow_vllms_hashes_as_blocks_fill(tmp_path: Path) -> None:
    path = adapter(tmp_path / "sql", b"\x01" * 4096)
    r = request(path)
    keyed = Adapters().keyed(r)
    assert keyed is not None and len(keyed.block_hashes) == 3
    r.block_hashes.append(key_of("lora-sql", 3))
    assert len(keyed.block_hashes) == 4 and keyed.request_id == "r"


def test_an_adapter_whose_files_are_not_here_is_not_cached(tmp_path: Path, caplog) -> None:
    adapters = Adapters()
    assert adapters.keyed(request(tmp_path / "nowhere")) is None
    assert adapters.keyed(request(tmp_path / "nowhere")) is None
    assert caplog.text.count("cannot tell its identity") == 1  # said once
