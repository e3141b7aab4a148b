"""The namespace names what the model is, not where it lies (kvstore_client.identity): a model
updated in place never meets its old blocks; the same weights at another path share them."""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
from pathlib import Path

import pytest
from support.vllm.tiny_model import build_tiny_model, retrain

pytest.importorskip("vllm", reason="the connector package imports vllm (see .ci/run)")

from kvstore_client.identity import ModelNotFound, file_digest, fingerprint, weights_identity  # noqa: E402


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture
def model(built: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KVSTORE_DIGEST_CACHE", str(tmp_path / "digests.json"))
    return Path(shutil.copytree(built, tmp_path / "model"))


def header(path: Path) -> bytes:
    with open(path / "model.safetensors", "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return f.read(length)


def test_the_same_weights_at_another_path_have_the_same_identity(model: Path, tmp_path: Path) -> None:
    elsewhere = shutil.copytree(model, tmp_path / "mounted" / "elsewhere")
    assert fingerprint(model) == fingerprint(elsewhere)
    assert weights_identity(str(model), None) == weights_identity(str(elsewhere), "main")


def test_weights_updated_in_place_change_the_identity_though_sizes_and_headers_do_not(model: Path) -> None:
    before, size, head = fingerprint(model), (model / "model.safetensors").stat().st_size, header(model)
    retrain(model, seed=1)
    assert (model / "model.safetensors").stat().st_size == size and header(model) == head
    assert fingerprint(model) != before


def test_a_fine_tune_of_one_tensor_changes_the_identity(model: Path) -> None:
    before = fingerprint(model)
    retrain(model, seed=1, only="model.layers.1.self_attn.v_proj.weight")
    assert fingerprint(model) != before


def test_any_byte_changed_in_a_weight_file_changes_the_identity(model: Path) -> None:
    """The last rows of the embedding changed in place (a fine-tune of reserved special tokens): bytes no
    sample of a tensor's start and middle reads."""
    weights = model / "model.safetensors"
    head = header(model)
    start, end = json.loads(head)["model.embed_tokens.weight"]["data_offsets"]
    before = fingerprint(model)
    with open(weights, "r+b") as f:
        at = 8 + len(head) + end - 64
        f.seek(at)
        row = f.read(64)
        f.seek(at)
        f.write(bytes(b ^ 0x5A for b in row))
    assert fingerprint(model) != before


def test_weight_digests_are_read_once_and_a_rewrite_is_seen(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = fingerprint(model)

    def unread(*args: object) -> None:
        raise AssertionError("read again")

    digest = hashlib.file_digest
    monkeypatch.setattr(hashlib, "file_digest", unread)
    assert fingerprint(model) == before  # from the cache
    retrain(model, seed=1)  # the same size, written in place: a new ctime
    monkeypatch.setattr(hashlib, "file_digest", digest)
    assert fingerprint(model) != before


def test_a_hub_blob_is_digested_by_its_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = b"weights" * 1000
    name = hashlib.sha256(data).hexdigest()
    (tmp_path / "blobs").mkdir()
    (tmp_path / "blobs" / name).write_bytes(data)
    (tmp_path / "model.safetensors").symlink_to(tmp_path / "blobs" / name)
    monkeypatch.setattr(hashlib, "file_digest", None)  # never read
    assert file_digest(tmp_path / "model.safetensors", {}) == name


def test_a_changed_tokenizer_or_config_changes_the_identity(model: Path) -> None:
    before = fingerprint(model)
    tokenizer = model / "tokenizer.json"
    tokenizer.write_text(tokenizer.read_text().replace('"<pad>"', '"<PAD>"'))
    assert fingerprint(model) != before
    before = fingerprint(model)
    (model / "config.json").write_text((model / "config.json").read_text().replace("10000", "20000"))
    assert fingerprint(model) != before


def test_files_that_do_not_change_what_the_model_computes_keep_the_identity(model: Path) -> None:
    before = fingerprint(model)
    (model / "README.md").write_text("# a model card\n")
    (model / "generation_config.json").write_text('{"temperature": 0.3}')
    (model / ".kvstore_model_ok").write_text("{}")
    assert fingerprint(model) == before


def test_a_separate_tokenizer_directory_is_part_of_the_identity(model: Path, tmp_path: Path) -> None:
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    shutil.copy(model / "tokenizer.json", tokenizer / "tokenizer.json")
    with_tokenizer = weights_identity(str(model), None, str(tokenizer))
    assert with_tokenizer.startswith(weights_identity(str(model), None) + ";tokenizer=")


def test_a_hub_id_is_identified_by_its_downloaded_snapshot(model: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The hub cache's own layout (models--org--name/refs, snapshots/<commit>), read by huggingface_hub:
    the identity is the snapshot's files, so a new revision downloaded under the same id is new."""
    cache = tmp_path / "hub"
    repo = cache / "models--acme--tiny"
    shutil.copytree(model, repo / "snapshots" / ("a" * 40))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("a" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    assert weights_identity("acme/tiny", None) == weights_identity(str(model), None)

    retrained = repo / "snapshots" / ("b" * 40)
    shutil.copytree(model, retrained)
    retrain(retrained, seed=2)
    (repo / "refs" / "main").write_text("b" * 40)
    assert weights_identity("acme/tiny", None) != weights_identity(str(model), None)
    assert weights_identity("acme/tiny", "a" * 40) == weights_identity(str(model), None)


def test_a_model_whose_files_are_not_here_has_no_identity(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    with pytest.raises(ModelNotFound, match="acme/never-downloaded"):
        weights_identity("acme/never-downloaded", None)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFound, match="no model files"):
        fingerprint(tmp_path / "empty")
