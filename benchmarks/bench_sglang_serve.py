"""`python -m sglang.launch_server` on CPU with kvstore as its HiCache storage backend, end to end: a tiny
Llama (tests/support/vllm/tiny_model.py), SGLang's CPU gaps stood in (benchmarks/sglang_cpu/sitecustomize.py:
a benchmark, not a CI gate, since stood-in kernels return mocks silently).

    python benchmarks/bench_sglang_serve.py --sglang-python .sglang-venv/bin/python [--prompts 8]

One daemon; server 1 answers each prompt cold, then again after /flush_cache (SGLang's device and host
caches emptied: the pages come back from the pool), then server 2, a new process, answers them again.
Prints per pass the requests' mean latency, the tokens SGLang reports cached from storage, and whether
every greedy answer equals the cold one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from kvstore_service.harness import DaemonProcess

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
from support.ports import free_ports  # noqa: E402
from support.vllm.tiny_model import build_tiny_model  # noqa: E402


def post(url: str, body: dict | None = None, timeout: float = 300) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"},
                                     method="POST" if body is not None else "GET")
    with urllib.request.urlopen(request, timeout=timeout) as reply:
        text = reply.read().decode()
    return json.loads(text) if text.strip().startswith(("{", "[")) else {"text": text}


class Server:
    def __init__(self, python: str, model: Path, socket: str, log: Path) -> None:
        self.port = free_ports(1)[0]
        extra = {"backend_name": "kvstore", "module_path": "kvstore_client.sglang",
                 "class_name": "KVStoreHiCacheStorage", "interface_v1": 1, "allocator": "shm", "socket": socket,
                 "prefetch_threshold": 64}
        env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1", PYTHONPATH=str(HERE / "sglang_cpu"))
        self.log = log
        with open(log, "a") as out:
            self.proc = subprocess.Popen(
                [python, "-m", "sglang.launch_server", "--model-path", str(model), "--device", "cpu",
                 "--host", "127.0.0.1", "--port", str(self.port), "--max-total-tokens", "8192",
                 "--disable-cuda-graph", "--enable-hierarchical-cache", "--hicache-size", "1",
                 "--hicache-io-backend", "direct", "--hicache-mem-layout", "layer_first", "--page-size", "4",
                 "--hicache-write-policy", "write_through", "--hicache-storage-backend", "dynamic",
                 "--hicache-storage-backend-extra-config", json.dumps(extra)],
                stdout=out, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 900
        while True:
            if self.proc.poll() is not None:
                sys.exit(f"the server exited with {self.proc.returncode}; its log: {log}")
            try:
                post(f"{self.url}/health", timeout=5)
                return
            except OSError:
                if time.monotonic() > deadline:
                    sys.exit(f"the server did not come up in 15 min; its log: {log}")
                time.sleep(2)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def ask(self, prompt: str) -> tuple[str, float, dict]:
        started = time.perf_counter()
        reply = post(f"{self.url}/generate", {"text": prompt, "sampling_params": {"temperature": 0,
                                                                                  "max_new_tokens": 8}})
        return reply["text"], time.perf_counter() - started, reply.get("meta_info", {})

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def prompts(n: int) -> list[str]:
    """Distinct prompts of a few hundred tokens from the stdlib's text (the tokenizer was trained on it)."""
    text = (Path(json.__file__).parent / "decoder.py").read_text() + Path(argparse.__file__).read_text()
    return [f"Prompt {i}: " + text[i * 1500: i * 1500 + 1400] for i in range(n)]


def run_pass(server: Server, asked: list[str], name: str, answers: dict[str, str]) -> dict:
    times, storage, tokens = [], 0, 0
    same = True
    for prompt in asked:
        text, seconds, meta = server.ask(prompt)
        times.append(seconds)
        details = meta.get("cached_tokens_details") or {}
        storage += int(details.get("storage", 0)) if isinstance(details, dict) else 0
        tokens += int(meta.get("prompt_tokens", 0))
        same &= answers.setdefault(prompt, text) == text
    return {"pass": name, "mean_ms": round(statistics.mean(times) * 1e3, 1),
            "median_ms": round(statistics.median(times) * 1e3, 1), "prompt_tokens": tokens, "storage_tokens": storage,
            "answers_equal_cold": same}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sglang-python", required=True)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "kvstore-tiny-llama"))
    args = p.parse_args()
    model = build_tiny_model(args.model_dir)
    asked = prompts(args.prompts)
    answers: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        daemon = DaemonProcess(tmp, "1GiB", "64MiB").start()
        log = Path(tempfile.gettempdir()) / "kvstore-sglang-serve.log"
        log.unlink(missing_ok=True)
        try:
            server = Server(args.sglang_python, model, daemon.socket, log)
            results = [run_pass(server, asked, "cold", answers)]
            time.sleep(2)  # (write-through backups to the pool run behind the answers)
            post(f"{server.url}/flush_cache")
            results.append(run_pass(server, asked, "after /flush_cache (from the pool)", answers))
            server.stop()
            server = Server(args.sglang_python, model, daemon.socket, log)
            results.append(run_pass(server, asked, "a new server process (from the pool)", answers))
            server.stop()
            stats = daemon.client().stats()
        finally:
            daemon.cleanup()
            print(f"(SGLang's log: {log}; last lines)\n" + "".join(open(log).readlines()[-5:]) if log.exists() else "")
    print(f"{args.prompts} prompts, greedy, 8 new tokens each; SGLang pages of 4 tokens, kvstore zero-copy")
    for r in results:
        print(json.dumps(r))
    print(f"daemon: {stats.stored_blocks} pages stored, {stats.loaded_blocks} loaded into SGLang's host pools")


if __name__ == "__main__":
    main()
