"""`vllm serve` in a child process, for tests and benchmarks: vLLM's own OpenAI server, started with
the CPU launcher (`python -m kvstore_client.vllm.cpu_cli serve ...`), on a loopback port, in a process
group of its own (API server, engine core, worker), so that `stop()` ends all of it. Plus the little
HTTP its users need (JSON POSTs, /health, the Prometheus counters of /metrics), with the stdlib only.

    with VllmServer(model, tmp / "a.log", threads_bind=first_cpu(), kv_transfer_config=cfg) as server:
        server.completion(prompt_ids, max_tokens=8)

Every configuration gets the same OpenMP thread binding (`threads_bind`, VLLM_CPU_OMP_THREADS_BIND):
on CPU, vLLM reserves a core for a KV connector when there is one, so left to itself it binds a
server with the connector differently from one without (on 2 cores: both cores against core 0).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

from support.ports import free_port

LAUNCHER = [sys.executable, "-m", "kvstore_client.vllm.cpu_cli"]

# A random model has no chat template; this one puts each message on a line of its own.
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def first_cpu() -> str:
    """The first CPU this process may run on: a binding every configuration can share."""
    return str(min(os.sched_getaffinity(0)))


def server_env(threads_bind: str, env: dict[str, str] | None = None) -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_HOST_IP": "127.0.0.1",
            "VLLM_CPU_OMP_THREADS_BIND": threads_bind, **(env or {})}


def connector_config(socket_path: str, **extra: Any) -> str:
    """--kv-transfer-config for the kvstore connector on the daemon at `socket_path`."""
    return json.dumps({"kv_connector": "KVStoreConnector", "kv_connector_module_path": "kvstore_client.vllm",
                       "kv_role": "kv_both", "kv_connector_extra_config": {"socket": socket_path, **extra}})


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text: each sample's value summed over its labels, by name."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        out[name] = out.get(name, 0.0) + float(value)
    return out


def group_members(group: int) -> list[int]:
    """The processes of process group `group` that have not exited (zombies left out)."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                state, _ppid, pgrp = f.read().rpartition(")")[2].split()[:3]
        except (OSError, ValueError):
            continue
        if int(pgrp) == group and state != "Z":
            members.append(int(entry))
    return members


class VllmServer:
    """One `vllm serve` on the tiny model's settings (float32, eager, prefix caching, 128-token blocks,
    256 MiB of KV cache by default), prompt token details in the usage; `args` are added to its
    command line."""

    def __init__(self, model: str | Path, log: Path, *args: str, threads_bind: str,
                 kv_transfer_config: str | None = None, max_model_len: int = 1024, block_size: int = 128,
                 kv_cache_bytes: int = 256 << 20, env: dict[str, str] | None = None) -> None:
        self.model = str(model)
        self.log = log
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = [*LAUNCHER, "serve", self.model, "--host", "127.0.0.1", "--port", str(self.port),
                        "--dtype", "float32", "--max-model-len", str(max_model_len), "--enforce-eager",
                        "--kv-cache-memory-bytes", str(kv_cache_bytes), "--block-size", str(block_size),
                        "--enable-prefix-caching", "--seed", "0", "--enable-prompt-tokens-details",
                        "--disable-uvicorn-access-log", *args]
        if kv_transfer_config is not None:
            self.command += ["--kv-transfer-config", kv_transfer_config]
        self.env = server_env(threads_bind, env)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 600.0) -> VllmServer:
        """Start it and return once /health answers 200; a server that exits or does not come up in
        `timeout` s is stopped and its log tail raised."""
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                         cwd=self.log.parent, start_new_session=True)
        deadline = time.monotonic() + timeout
        while not self.healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                why = f"exited with {self.proc.returncode}" if self.proc.poll() is not None else "did not come up"
                self.stop()
                raise RuntimeError(f"vllm serve {why}:\n{self.log_tail()}")
            time.sleep(0.5)
        return self

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=5) as reply:
                return bool(reply.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    def stop(self, timeout: float = 60.0) -> None:
        """SIGTERM to the whole process group (vLLM shuts its engine down), SIGKILL to what is left
        after `timeout` s; returns once no process of the group runs any more."""
        if self.proc is None:
            return
        group = self.proc.pid
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 30.0)):
            try:
                os.killpg(group, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait
            while group_members(group) and time.monotonic() < deadline:
                self.proc.poll()
                time.sleep(0.2)
            if not group_members(group):
                break
        self.proc.wait()

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.stop()

    def log_tail(self, chars: int = 6000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def post(self, path: str, body: dict[str, Any], timeout: float = 300.0) -> dict[str, Any]:
        request = urllib.request.Request(f"{self.url}{path}", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as reply:
                return dict(json.load(reply))
        except urllib.error.HTTPError as e:
            raise AssertionError(f"POST {path}: {e.code} {e.read().decode(errors='replace')}") from e

    def completion(self, prompt: str | list[int], max_tokens: int) -> dict[str, Any]:
        """/v1/completions, greedy, exactly `max_tokens` tokens (EOS ignored), token ids returned."""
        return self.post("/v1/completions", {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                                             "temperature": 0.0, "ignore_eos": True, "return_token_ids": True})

    def chat(self, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
        """/v1/chat/completions, greedy, exactly `max_tokens` tokens (needs --chat-template)."""
        return self.post("/v1/chat/completions", {"model": self.model, "messages": messages,
                                                  "max_tokens": max_tokens, "temperature": 0.0,
                                                  "ignore_eos": True, "return_token_ids": True})

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as reply:
            return parse_metrics(reply.read().decode())
