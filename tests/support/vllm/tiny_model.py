"""Build a small random Llama model + BPE tokenizer offline, deterministically.

Usable as a library (``build_tiny_model(dir, size="tiny")``) or as a script::

    python tests/support/vllm/tiny_model.py DIR [--size bench]

Nothing is downloaded: the tokenizer is trained on a fixed list of Python stdlib
files and the weights are random (``torch.manual_seed(0)``).  A marker file is
written last; if it exists (for the same size) the build is skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import sysconfig
from pathlib import Path
from typing import Any, Literal

Size = Literal["tiny", "bench"]

MARKER = ".kvstore_model_ok"
BUILD_VERSION = 1
VOCAB_SIZE = 2048
SPECIAL_TOKENS = ["<s>", "</s>", "<pad>"]  # ids 0, 1, 2

# Fixed corpus: stdlib files (paths relative to the stdlib directory).
CORPUS_FILES = [
    "json/decoder.py",
    "json/encoder.py",
    "textwrap.py",
    "argparse.py",
    "collections/__init__.py",
    "functools.py",
    "pathlib.py",
    "string.py",
    "dataclasses.py",
    "typing.py",
]

MODEL_CONFIGS: dict[str, dict[str, Any]] = {
    # ~0.9M parameters, KV per token per layer: 2 * 2 heads * 32 * 4 B = 512 B.
    "tiny": dict(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=2048,
    ),
    # ~99.8M parameters (untied embeddings), KV per token (fp32, 12 layers):
    # 12 * 2 * 4 heads * 64 * 4 B = 24 KiB -> 3 MiB per 128-token block.
    "bench": dict(
        hidden_size=768,
        intermediate_size=2816,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=4096,
    ),
}


def _corpus() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for rel in CORPUS_FILES:
        path = stdlib / rel
        if path.is_file():
            texts.append(path.read_text(encoding="utf-8"))
    if not texts:
        raise RuntimeError(f"no corpus files found under {stdlib}")
    return texts


def _build_tokenizer(out_dir: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=MODEL_CONFIGS["bench"]["max_position_embeddings"],
    )
    fast.save_pretrained(str(out_dir))


def _build_model(out_dir: Path, size: Size) -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        tie_word_embeddings=False,
        **MODEL_CONFIGS[size],
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    num_params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(str(out_dir), safe_serialization=True)
    return num_params


def retrain(path: str | os.PathLike[str], seed: int, only: str | None = None) -> None:
    """Update the model in place as a fine-tune would: new values in the same tensors (every one, or
    the one named `only`), written over the old bytes, so the files keep their sizes and headers."""
    import struct

    import torch

    for file in sorted(Path(path).glob("*.safetensors")):
        with open(file, "r+b") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
            generator = torch.Generator().manual_seed(seed)
            for name, info in sorted(header.items()):
                if name == "__metadata__" or (only is not None and name != only):
                    continue
                assert info["dtype"] == "F32", info
                start, end = info["data_offsets"]
                f.seek(8 + header_len + start)
                old = torch.frombuffer(bytearray(f.read(end - start)), dtype=torch.float32)
                new = old + 0.02 * torch.randn(old.shape, generator=generator)
                f.seek(8 + header_len + start)
                f.write(new.numpy().tobytes())


def build_tiny_adapter(dir: str | os.PathLike[str], base: Path, seed: int = 1) -> Path:
    """A rank-8 LoRA adapter (PEFT's file layout) on the tiny model's q and v projections, random
    but large enough to change every output."""
    import torch
    from safetensors.torch import save_file

    path = Path(dir)
    path.mkdir(parents=True, exist_ok=True)
    config = MODEL_CONFIGS["tiny"]
    hidden, kv = config["hidden_size"], config["num_key_value_heads"] * config["head_dim"]
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, out in (("q_proj", hidden), ("v_proj", kv)):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = 0.5 * torch.randn(8, hidden, generator=generator)
            tensors[f"{prefix}.lora_B.weight"] = 0.5 * torch.randn(out, 8, generator=generator)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 8, "lora_alpha": 16, "lora_dropout": 0.0,
        "bias": "none", "target_modules": ["q_proj", "v_proj"], "base_model_name_or_path": str(base)}))
    return path


def _is_built(path: Path, size: Size) -> bool:
    marker = path / MARKER
    if not marker.is_file():
        return False
    try:
        info = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return info.get("size") == size and info.get("version") == BUILD_VERSION


def build_tiny_model(dir: str | os.PathLike[str], *, size: Size = "tiny") -> Path:
    """Build (once) a random Llama + tokenizer in ``dir`` and return its path.

    ``size="tiny"``: 2 layers, hidden 128 (a few MB, ~5 s).
    ``size="bench"``: ~100M parameters, max_position_embeddings 4096 (~400 MB).
    Idempotent: returns immediately when the marker file says it is built.
    """
    if size not in MODEL_CONFIGS:
        raise ValueError(f"unknown size {size!r}")
    path = Path(dir).resolve()
    if _is_built(path, size):
        return path

    # Build in a sibling temp dir, then move into place (safe against a
    # concurrent builder: whoever finishes second just drops its copy).
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        _build_tokenizer(tmp)
        num_params = _build_model(tmp, size)
        info = {"size": size, "version": BUILD_VERSION, "num_params": num_params}
        if _is_built(path, size):
            return path
        if path.exists() and not any(path.iterdir()):
            path.rmdir()
        if not path.exists():
            (tmp / MARKER).write_text(json.dumps(info))
            os.rename(tmp, path)
        else:
            # Existing non-empty dir without (matching) marker: overwrite files.
            (path / MARKER).unlink(missing_ok=True)
            for item in tmp.iterdir():
                shutil.move(str(item), str(path / item.name))
            (path / MARKER).write_text(json.dumps(info))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir")
    parser.add_argument("--size", choices=sorted(MODEL_CONFIGS), default="tiny")
    args = parser.parse_args(argv)
    path = build_tiny_model(args.dir, size=args.size)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
