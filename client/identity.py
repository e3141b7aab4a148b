"""What a model IS, for the namespace: a fingerprint of its files, not where they lie.

Blocks computed by one set of weights must never be served to another: a model updated in place (a
volume at a fixed path, a hub id at a new revision) gets a new identity, and engines of the same
weights at different paths share one. The fingerprint covers, by path relative to the model
directory:
- every small file that shapes the model or its tokens (config, tokenizer, custom modelling code)
  in full;
- every weight file's size and a sample of its bytes: for safetensors, the header (names, dtypes,
  shapes, offsets) and the first and middle bytes of every tensor, so a fine-tune that touched only
  some layers still changes it; for other formats, evenly spaced pieces of the whole file.
It reads the headers and 512 bytes a tensor, whatever the model's size. Files that do not change
what the model computes (README, generation settings) are left out: editing them keeps the cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

# Read whole and hashed: what shapes the model or how text becomes tokens.
CONFIG_SUFFIXES = {".json", ".model", ".txt", ".tiktoken", ".py", ".vocab", ".bpe", ".spm"}
# Sampled: weights.
WEIGHT_SUFFIXES = {".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack", ".npz"}
# Files that do not change what the model computes for given tokens.
IGNORED_NAMES = {"generation_config.json", "README.md", "LICENSE", "LICENSE.txt", "USE_POLICY.md"}
MAX_CONFIG_FILE = 64 << 20  # larger "config" files are sampled like weights
MAX_DEPTH = 2  # model/, model/original/, model/original/x/
MAX_FILES = 10_000
TENSOR_SAMPLE = 256  # bytes read at a tensor's start and middle
FILE_SAMPLES = 64  # pieces of a non-safetensors weight file
FILE_SAMPLE = 4096
MAX_HEADER = 100 << 20  # safetensors' own limit on its JSON header


class ModelNotFound(Exception):
    """The model's files are not on this machine (a loader that streams them, say)."""


def fingerprint(path: str | os.PathLike[str]) -> str:
    """The identity of a model directory (or a single weight file, e.g. GGUF): 32 hex digits."""
    root = Path(path)
    digest = hashlib.sha256(b"kvstore-model-identity-v1\0")
    files = [root] if root.is_file() else _model_files(root)
    if not files:
        raise ModelNotFound(f"{root}: no model files")
    for file in files:
        name = file.name if file == root else file.relative_to(root).as_posix()
        digest.update(name.encode() + b"\0")
        with open(file, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            digest.update(struct.pack("<Q", size))
            if file.suffix in WEIGHT_SUFFIXES or size > MAX_CONFIG_FILE:
                _sample_weights(f.fileno(), size, file.suffix == ".safetensors", digest)
            else:
                digest.update(f.read())
    return digest.hexdigest()[:32]


def _model_files(root: Path) -> list[Path]:
    """The files that make up a model, sorted by relative path; symlinks followed (hub caches)."""
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        depth = len(Path(dirpath).relative_to(root).parts)
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".")) if depth < MAX_DEPTH else []
        for name in filenames:
            suffix = Path(name).suffix
            if name.startswith(".") or name in IGNORED_NAMES or suffix not in CONFIG_SUFFIXES | WEIGHT_SUFFIXES:
                continue
            found.append(Path(dirpath) / name)
            if len(found) > MAX_FILES:
                raise ModelNotFound(f"{root}: more than {MAX_FILES} files; not a model directory")
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def _sample_weights(fd: int, size: int, safetensors: bool, digest: hashlib._Hash) -> None:
    def read(offset: int, length: int) -> bytes:
        return os.pread(fd, length, offset)

    if safetensors and size >= 8:
        (header_len,) = struct.unpack("<Q", read(0, 8))
        if 0 < header_len <= min(MAX_HEADER, size - 8):
            header = read(8, header_len)
            digest.update(header)
            base = 8 + header_len
            for name, info in sorted(json.loads(header).items()):
                if name == "__metadata__":
                    continue
                start, end = info["data_offsets"]
                digest.update(read(base + start, min(TENSOR_SAMPLE, end - start)))
                middle = start + (end - start) // 2
                digest.update(read(base + middle, min(TENSOR_SAMPLE, end - middle)))
            return
    step = max(size // FILE_SAMPLES, 1)
    for offset in range(0, size, step):
        digest.update(read(offset, FILE_SAMPLE))


def hub_snapshot(repo_id: str, revision: str | None) -> Path | None:
    """The local snapshot directory of a hub model vLLM has downloaded (its name is the resolved
    commit), or None if it is not in the local hub cache."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    found = try_to_load_from_cache(repo_id, "config.json", revision=revision)
    return Path(found).parent if isinstance(found, str) else None


def weights_identity(model: str, revision: str | None, tokenizer: str | None = None,
                     tokenizer_revision: str | None = None) -> str:
    """`weights=<fingerprint>` (plus the tokenizer's, where it is another directory) of the model
    vLLM loads: a local directory or file, or a hub id's downloaded snapshot. Raises ModelNotFound
    where the files are not on this machine."""
    parts = [f"weights={_fingerprint_of(model, revision)}"]
    if tokenizer and tokenizer != model:
        parts.append(f"tokenizer={_fingerprint_of(tokenizer, tokenizer_revision)}")
    return ";".join(parts)


def _fingerprint_of(model: str, revision: str | None) -> str:
    local = Path(model).expanduser()
    if local.exists():
        return fingerprint(local)
    snapshot = hub_snapshot(model, revision)
    if snapshot is None:
        raise ModelNotFound(f"{model} (revision {revision or 'default'}) is neither a local path nor in the "
                            "local hub cache")
    return fingerprint(snapshot)
