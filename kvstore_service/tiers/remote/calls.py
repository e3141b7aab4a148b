"""The remote tier's calls to its store: each one bounded by the timeout, its failed keys counted (errors,
timeouts) and its outcome told to the circuit breaker.

`StoreCalls` is the base of `RemoteTier` (tiers/remote/__init__.py) and of its parts that upload the
blocks written behind (uploading.py) and fetch blocks back (fetching.py): it declares the state they
share, which `RemoteTier.__init__` sets up.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from concurrent.futures import Executor
from typing import TypeVar

from redis.exceptions import TimeoutError as RedisTimeoutError

from kvstore_service.tiers.remote.breaker import Breaker
from kvstore_service.tiers.remote.codec import Keyring
from kvstore_service.tiers.remote.store import RemoteStore

log = logging.getLogger("kvstore_service.tiers.remote")

T = TypeVar("T")


class StoreCalls:
    """`_call`: one call to the store, under the timeout and the breaker; see the module docstring."""

    store: RemoteStore
    keyring: Keyring
    breaker: Breaker
    timeout_s: float
    _threads: Executor  # wrapping and opening values (the daemon's `Threads.remote`)
    _counts: dict[str, int]  # RemoteStats' counters

    async def _call(self, op: Awaitable[list[T]], n: int) -> list[T | BaseException]:
        """Await one store call under the timeout; count its failures and tell the breaker."""
        results: list[T | BaseException]
        try:
            async with asyncio.timeout(self.timeout_s):
                results = list(await op)
        except Exception as e:  # TimeoutError included: a failed call fails each of its keys
            results = [e] * n
        failed = [r for r in results if isinstance(r, BaseException)]
        self._counts["errors"] += len(failed)
        self._counts["timeouts"] += sum(isinstance(r, (TimeoutError, RedisTimeoutError)) for r in failed)
        if failed:
            log.debug("remote store: %d of %d keys failed: %r", len(failed), n, failed[0])
            self.breaker.failure(failed[0])
        else:
            self.breaker.success()
        return results
