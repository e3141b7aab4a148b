"""The asyncio client against a real daemon."""

from __future__ import annotations

import asyncio

import pytest
from support.blocks import key_of
from support.engine import content_tensor

from kvstore_client import InvalidArgument, NotFound, Unavailable
from kvstore_client.aio import AsyncKVStoreClient
from kvstore_client.shm import block_cache

KB64 = 64 * 1024


def test_async_session_store_load_lookup(daemon) -> None:
    async def main() -> None:
        memory, spec = block_cache(16, KB64)
        blocks = memory.tensor.view(16, KB64)
        keys = [key_of("aio", i) for i in range(4)]
        for i, k in enumerate(keys):
            blocks[i].copy_(content_tensor(k, KB64))
        async with AsyncKVStoreClient(daemon.socket) as client:
            assert await client.health() == "SERVING"
            session = await client.session("aio-ns", spec)
            job = await session.store(keys, [0, 1, 2, 3])
            assert (await session.wait([job]))[job].blocks_ok == 4
            assert await client.lookup("aio-ns", keys) == 4
            hits, lease = await session.lookup(keys, lease=True)
            assert hits == 4 and lease
            job = await session.load(keys, [8, 9, 10, 11])
            assert (await session.wait([job]))[job].ok
            for i, k in enumerate(keys):
                assert bytes(blocks[8 + i].numpy()) == bytes(content_tensor(k, KB64).numpy())
            await session.release_lease(lease)
            with pytest.raises(NotFound):
                await session.release_lease(lease)
            with pytest.raises(InvalidArgument):
                await session.load(keys, [99, 1, 2, 3])
            assert (await client.stats()).loaded_blocks == 4
            await session.close()
            assert await client.clear("aio-ns") == 4
        memory.close()

    asyncio.run(main())


def test_async_client_unreachable(tmp_path) -> None:
    async def main() -> None:
        async with AsyncKVStoreClient(str(tmp_path / "none.sock"), timeout=1) as client:
            with pytest.raises(Unavailable):
                await client.stats()

    asyncio.run(main())
