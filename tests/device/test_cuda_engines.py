"""CUDA engines against a real daemon, on a GPU (skipped without one; docs/devices.md says how to run
them): KV caches laid out as vLLM lays them out on CUDA cross processes byte-exact, copies wait for
the engine's in-flight kernels, and an engine killed mid-copy gives its GPU memory back."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest
import torch
from support import child_env
from support.blocks import key_of
from support.daemon import wait_for

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU: run on a GPU machine (docs/devices.md)")

CUDA_ENGINE = [sys.executable, "-m", "support.cuda_engine"]
MIB = 1 << 20


def device_used() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


@pytest.mark.parametrize("stored_as,loaded_as", [("LBNHC", "BLNHC"), ("BLNHC", "LBNHC")])
def test_vllm_layouts_round_trip_between_engine_processes(daemon, stored_as: str, loaded_as: str) -> None:
    """An engine process stores blocks it is still writing (a slow kernel on a side stream, no host
    sync); a second engine, laid out the other way, loads them into blocks it is also still writing:
    every byte arrives, in the right place, and no other block changes."""
    from support.cuda_engine import CudaEngine

    out = subprocess.run([*CUDA_ENGINE, "--socket", daemon.socket, "--namespace", "vllm", "--layout", stored_as,
                          "store", "--count", "16"], capture_output=True, text=True, timeout=120, env=child_env())
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == {"stored": 16}

    engine = CudaEngine(daemon.socket, "vllm", loaded_as)
    try:
        keys = [key_of("vllm", i) for i in range(16)]
        dst = list(range(40, 56))
        assert engine.load(keys, dst) == 16
        assert engine.wrong_blocks(keys, dst) == [], "a load landed before the engine's last writes, or elsewhere"
        untouched = torch.ones(engine.num_blocks, dtype=torch.bool, device="cuda")
        untouched[dst] = False
        assert all(int(v[untouched].count_nonzero()) == 0 for v in engine.views), "a load wrote outside its blocks"
        # And a store from this process (the same late writes) is read back by the first layout.
        mine = [key_of("vllm-2", i) for i in range(8)]
        assert engine.store(mine, list(range(8))) == 8
    finally:
        engine.close()
    first = CudaEngine(daemon.socket, "vllm", stored_as)
    try:
        assert first.load(mine, list(range(20, 28))) == 8
        assert first.wrong_blocks(mine, list(range(20, 28))) == []
    finally:
        first.close()


def test_without_the_event_the_same_late_writes_are_missed(daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    """The control of the test above: an engine that sends no ordering event (a version-1 handle,
    as an older client does) and writes the same way gets the stale bytes stored, and its loads
    overwritten by its own late writes. So the round trip above passes because copies wait."""
    from support.cuda_engine import CudaEngine

    import kvstore_client.device

    monkeypatch.setattr(kvstore_client.device, "cuda_order_event_handle", lambda index: b"")
    engine = CudaEngine(daemon.socket, "unordered", "LBNHC")
    try:
        keys = [key_of("unordered", i) for i in range(16)]
        assert engine.store(keys, list(range(16))) == 16  # copied before the late writes landed
        torch.cuda.synchronize()
        job = engine.session.load(keys, list(range(40, 56)))
        assert engine.session.wait([job])[job].blocks_ok == 16
        assert len(engine.wrong_blocks(keys, list(range(40, 56)))) == 16

        keys = [key_of("unordered-2", i) for i in range(16)]
        engine.write_late(list(range(16, 32)), engine.pages(keys))
        torch.cuda.synchronize()
        job = engine.session.store(keys, list(range(16, 32)))
        assert engine.session.wait([job])[job].blocks_ok == 16
        assert engine.load(keys, list(range(40, 56))) == 16  # then the late -1 writes land on top
        assert len(engine.wrong_blocks(keys, list(range(40, 56)))) == 16
    finally:
        engine.close()


def test_engine_killed_mid_copy_gives_its_gpu_memory_back(daemon_factory) -> None:
    """An engine process hammering the daemon with 256 MiB stores and loads is killed with SIGKILL
    while copies run: the daemon ends its session and closes its IPC mapping, so the GPU memory
    returns to where it was before the engine started, and another engine keeps working."""
    from support.cuda_engine import CudaEngine

    daemon = daemon_factory(pool_size="640MiB", segment_size="32MiB").start()
    client = daemon.client()
    survivor = CudaEngine(daemon.socket, "survivor", "LBNHC")
    keys = [key_of("survivor", i) for i in range(16)]
    assert survivor.store(keys, list(range(16))) == 16
    before = device_used()

    proc = subprocess.Popen([*CUDA_ENGINE, "--socket", daemon.socket, "--namespace", "victim", "--layers", "8",
                             "--num-blocks", "4096", "hammer"], stdout=subprocess.PIPE, text=True, env=child_env())
    try:
        assert json.loads(proc.stdout.readline()) == {"ready": True}  # type: ignore[union-attr]
        assert device_used() >= before + 512 * MIB  # its KV cache (and its context)
        assert wait_for(lambda: client.stats().jobs_in_flight > 0, timeout=10, interval=0.001)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()

    assert wait_for(lambda: client.stats().engines == 1, timeout=30), client.stats()
    assert wait_for(lambda: device_used() <= before + 64 * MIB, timeout=30), \
        f"{(device_used() - before) / MIB:.0f} MiB of GPU memory still held after the engine died"
    stats = client.stats()
    assert stats.jobs_in_flight == 0 and stats.leases == 0
    # The daemon keeps serving: the survivor loads its blocks and stores new ones.
    assert survivor.load(keys, list(range(32, 48))) == 16
    assert survivor.wrong_blocks(keys, list(range(32, 48))) == []
    more = [key_of("survivor-after", i) for i in range(8)]
    assert survivor.store(more, list(range(16, 24))) == 8
    survivor.close()
    client.close()
    assert daemon.proc.poll() is None
