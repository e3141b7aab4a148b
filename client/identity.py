"""What a model IS, for the namespace: a fingerprint of its files, not where they lie.

Blocks computed by one set of weights must never be served to another: a model updated in place (a
volume at a fixed path, a hub id at a new revision) gets a new identity, and engines of the same
weights at different paths share one. The fingerprint covers, by path relative to the model
directory:
- every small file that shapes the model or its tokens (config, tokenizer, custom modelling code)
  in full;
- every weight file's SHA-256: any byte changed changes it (a fine-tune that touched the last rows of
  an embedding, say). A hub snapshot's weight files are links to blobs named by their SHA-256: read
  from the name. Other files are read whole once; their digests are kept in a cache file
  (`KVSTORE_DIGEST_CACHE`, default ~/.cache/kvstore/file-digests.json) keyed by device, inode, size,
  mtime and ctime (every write changes the ctime), and the first process to need them computes
  them under a lock while the others of the node wait and read them. Files are digested on as many
  threads as there are cores (SHA-256 frees the GIL): 1.7 GB/s a core on this project's 2-vCPU VM,
  page-cached (benchmarks/bench_identity.py): a 100 GB model's first start takes ~28 s on its 2 cores
  (less with more cores and files; not measured here); later starts only stat the files.
Files that do not change what the model computes (README, generation settings) are left out:
editing them keeps the cache.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import struct
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# Read whole and hashed: what shapes the model or how text becomes tokens.
CONFIG_SUFFIXES = {".json", ".model", ".txt", ".tiktoken", ".py", ".vocab", ".bpe", ".spm"}
# Digested whole (cached): weights.
WEIGHT_SUFFIXES = {".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack", ".npz"}
# Files that do not change what the model computes for given tokens.
IGNORED_NAMES = {"generation_config.json", "README.md", "LICENSE", "LICENSE.txt", "USE_POLICY.md"}
MAX_CONFIG_FILE = 64 << 20  # larger "config" files are digested like weights
MAX_DEPTH = 2  # model/, model/original/, model/original/x/
MAX_FILES = 10_000
_BLOB = re.compile(r"[0-9a-f]{64}")  # a hub blob's name: its SHA-256


class ModelNotFound(Exception):
    """The model's files are not on this machine (a loader that streams them, say)."""


def fingerprint(path: str | os.PathLike[str]) -> str:
    """The identity of a model directory (or a single weight file, e.g. GGUF): 32 hex digits."""
    root = Path(path)
    digest = hashlib.sha256(b"kvstore-model-identity-v2\0")
    files = [root] if root.is_file() else _model_files(root)
    if not files:
        raise ModelNotFound(f"{root}: no model files")
    with _digests() as digests:
        weights = [f for f in files if f.suffix in WEIGHT_SUFFIXES or f.stat().st_size > MAX_CONFIG_FILE]
        with ThreadPoolExecutor(max(1, min(len(weights), os.cpu_count() or 1))) as threads:  # (hashing frees the GIL)
            weight_digests = dict(zip(weights, threads.map(lambda f: file_digest(f, digests), weights), strict=True))
        for file in files:
            name = file.name if file == root else file.relative_to(root).as_posix()
            digest.update(name.encode() + b"\0")
            size = file.stat().st_size
            digest.update(struct.pack("<Q", size))
            if file in weight_digests:
                digest.update(bytes.fromhex(weight_digests[file]))
            else:
                digest.update(file.read_bytes())
    return digest.hexdigest()[:32]


def file_digest(path: Path, cache: dict[str, str]) -> str:
    """The SHA-256 of a file's bytes (hex): a hub blob's name, the cache's entry, or read whole."""
    real = path.resolve()
    if real.parent.name == "blobs" and _BLOB.fullmatch(real.name):
        return real.name
    st = real.stat()
    key = f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"
    if key not in cache:
        with open(real, "rb") as f:
            cache[key] = hashlib.file_digest(f, "sha256").hexdigest()
    return cache[key]


@contextlib.contextmanager
def _digests() -> Iterator[dict[str, str]]:
    """The digest cache, held under the node's lock while the caller digests (other processes of the
    same model wait, then read); written back if it grew. Without a writable cache: an empty one."""
    path = Path(os.environ.get("KVSTORE_DIGEST_CACHE", "~/.cache/kvstore/file-digests.json")).expanduser()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_suffix(".lock"), "a")  # noqa: SIM115 - closed below
    except OSError:
        yield {}
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            cache = json.loads(path.read_text())
        except (OSError, ValueError):
            cache = {}
        known = len(cache)
        yield cache
        if len(cache) != known:
            with contextlib.suppress(OSError):
                temp = path.with_suffix(f".{os.getpid()}.tmp")
                temp.write_text(json.dumps(cache))
                temp.replace(path)


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
