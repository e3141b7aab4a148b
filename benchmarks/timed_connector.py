"""`KVStoreConnector` with every engine-facing method timed: the connector's cost per engine step.

Used by `benchmarks/bench_vllm.py`; load it with (benchmarks/ on sys.path)::

    {"kv_connector": "TimedKVStoreConnector", "kv_connector_module_path": "timed_connector",
     "kv_role": "kv_both", "kv_connector_extra_config": {"socket": ...}}

Only with `VLLM_ENABLE_V1_MULTIPROCESSING=0`: scheduler and worker then run in one process and thread,
and one module-level `RECORDER` sums both roles. A sample is one engine step, in the order vLLM runs it:
the scheduler's calls while it schedules the step (on_new_request of requests added since the last
step, get_num_new_matched_tokens, update_state_after_alloc, ..., build_connector_meta, which gives the
step's token count), the worker cycle (handle_preemptions ... clear_connector_metadata) and the
scheduler's handling of the step's output (update_connector_output, request_finished, ...). The next
scheduling call after a worker cycle opens the next step. Every call is counted in exactly one step;
one made from inside another timed call (`get_finished` calls `get_transfer_results`) is counted once,
by the outer one. (Until 2026-11-23 a sample closed at build_connector_meta, so the lookups of a
request arriving after a forward step, made while scheduling the next step, were counted in the
forward step.)

The samples go to the JSON file named by `$KVSTORE_BENCH_STEPS` when a connector shuts down (and at exit).
"""

from __future__ import annotations

import atexit
import json
import os
import time
from collections.abc import Callable
from typing import Any

from kvstore_client.vllm import KVStoreConnector

STEPS_ENV = "KVSTORE_BENCH_STEPS"

SCHEDULER_METHODS = (
    "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta", "update_connector_output",
    "request_finished", "on_new_request", "get_external_cache_hit_sources", "get_loaded_kv_cache_group_ids",
    "take_events", "has_pending_block_frees", "has_pending_push_work",
)
WORKER_METHODS = (
    "handle_preemptions", "bind_connector_metadata", "start_load_kv", "wait_for_layer_load", "save_kv_layer",
    "wait_for_save", "get_transfer_results", "get_finished", "get_block_ids_with_load_errors",
    "get_kv_connector_kv_cache_events", "build_connector_worker_meta", "clear_connector_metadata",
)
BOTH_METHODS = ("get_kv_connector_stats",)
# Called while vLLM schedules a step (or adds a request before it): after a worker cycle, one opens a step.
SCHEDULING_METHODS = frozenset(("on_new_request", "get_num_new_matched_tokens", "update_state_after_alloc",
                                "get_external_cache_hit_sources", "get_loaded_kv_cache_group_ids",
                                "build_connector_meta"))


class StepRecorder:
    """Per-step sums of the connector's time, split by role, plus per-method totals."""

    def __init__(self) -> None:
        self.depth = 0
        self.phase = ""
        self.sched_ns = 0
        self.worker_ns = 0
        self.calls = 0
        self.by_method: dict[str, int] = {}  # this step: method -> ns
        self.t0_ns = 0  # when this step's first call started
        self.step_phase = ""  # the phase when it started
        self.tokens = self.reqs = 0  # scheduled in this step (from its build_connector_meta)
        self.worked = False  # this step's worker cycle has begun: the next scheduling call opens a step
        self.steps: dict[str, list[Any]] = {k: [] for k in ("t_ns", "sched_ns", "worker_ns", "calls", "tokens",
                                                            "reqs", "phase", "by_method")}

    def add(self, name: str, scheduler: bool, t0_ns: int, ns: int) -> None:
        if name in SCHEDULING_METHODS:
            if self.worked:
                self.close_step()
        else:
            self.worked = self.worked or not scheduler
        if not self.calls:  # the step's first call
            self.t0_ns, self.step_phase = t0_ns, self.phase
        if scheduler:
            self.sched_ns += ns
        else:
            self.worker_ns += ns
        self.calls += 1
        self.by_method[name] = self.by_method.get(name, 0) + ns

    def scheduled(self, tokens: int, reqs: int) -> None:
        self.tokens, self.reqs = tokens, reqs

    def close_step(self) -> None:
        s = self.steps
        s["t_ns"].append(self.t0_ns)
        s["sched_ns"].append(self.sched_ns)
        s["worker_ns"].append(self.worker_ns)
        s["calls"].append(self.calls)
        s["tokens"].append(self.tokens)
        s["reqs"].append(self.reqs)
        s["phase"].append(self.step_phase)
        s["by_method"].append(self.by_method)
        self.sched_ns = self.worker_ns = self.calls = self.tokens = self.reqs = 0
        self.by_method = {}
        self.worked = False

    def set_phase(self, phase: str) -> None:
        self.phase = phase

    def dump(self, path: str | None = None) -> None:
        path = path or os.environ.get(STEPS_ENV)
        if not path:
            return
        data = {"steps": self.steps, "timer_overhead_ns": timer_overhead_ns()}
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)


RECORDER = StepRecorder()
atexit.register(RECORDER.dump)


def _noop() -> None:
    pass


def timer_overhead_ns(n: int = 20_000) -> int:
    """Median time the wrapper measures around a function that does nothing (the timer's own cost)."""
    now = time.perf_counter_ns
    samples = []
    for _ in range(n):
        t0 = now()
        _noop()
        samples.append(now() - t0)
    samples.sort()
    return samples[len(samples) // 2]


def _timed(name: str, inner: Callable[..., Any]) -> Callable[..., Any]:
    now = time.perf_counter_ns
    schedules = name == "build_connector_meta"

    def method(self: KVStoreConnector, *args: Any, **kwargs: Any) -> Any:
        rec = RECORDER
        if rec.depth:
            return inner(self, *args, **kwargs)
        rec.depth = 1
        t0 = now()
        try:
            return inner(self, *args, **kwargs)
        finally:
            rec.add(name, self.scheduler is not None, t0, now() - t0)
            rec.depth = 0
            if schedules:
                out = args[0] if args else kwargs["scheduler_output"]
                rec.scheduled(out.total_num_scheduled_tokens, len(out.num_scheduled_tokens))

    method.__name__ = method.__qualname__ = name
    return method


def make_timed(base: type[KVStoreConnector]) -> type[KVStoreConnector]:
    """A subclass of `base` whose engine-facing methods are timed and whose shutdown dumps the samples."""

    def shutdown(self: KVStoreConnector) -> None:
        base.shutdown(self)
        RECORDER.dump()

    cls = type(f"Timed{base.__name__}", (base,), {"shutdown": shutdown, "__module__": __name__})
    for name in SCHEDULER_METHODS + WORKER_METHODS + BOTH_METHODS:
        setattr(cls, name, _timed(name, getattr(base, name)))
    return cls


TimedKVStoreConnector = make_timed(KVStoreConnector)
