"""How often a session tries to register again (kvstore_client.client.next_retry_s): a daemon that is
away comes back within seconds; a refusal rarely changes by itself, and each retry of a device engine
exports its KV memory again (re-wrapping the live KV storage while the forward runs), so it backs off to
minutes."""

from __future__ import annotations

from kvstore_client.client import REFUSED_RETRY_MAX_S, RETRY_MAX_S, next_retry_s


def waits(refused: bool, n: int) -> list[float]:
    out = [0.2]
    for _ in range(n - 1):
        out.append(next_retry_s(out[-1], refused))
    return out


def test_a_daemon_away_is_retried_within_seconds() -> None:
    assert max(waits(False, 50)) == RETRY_MAX_S == 5.0


def test_a_refused_session_backs_off_to_minutes() -> None:
    refused = waits(True, 50)
    assert max(refused) == REFUSED_RETRY_MAX_S == 300.0
    assert sum(1 for w in refused[:20] if w < RETRY_MAX_S) == 5  # (the first few retries as quick as ever)
    assert len(refused) - refused.index(300.0) > 30  # then one attempt every 5 minutes, not every 5 s
