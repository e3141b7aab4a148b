"""The connector's decisions, with no I/O: which blocks to look up, load, store, offer and describe,
hits turned into tokens, leases to give back, the hybrid rule per KV cache group.

Plain data in (vLLM's requests and block tables, read duck-typed; lookup replies), decisions out
(transfers for the worker; leases, descriptions and pool questions handed to `Outside`). It imports
neither vLLM nor the client's I/O: client/vllm/scheduler.py turns vLLM's calls into planner calls and
carries its decisions out; tests/unit/test_plan.py specifies it in-process, in seconds.
"""

from kvstore_client.vllm.plan.keys import GROUP_TAG, group_key, group_keys, split_group_key
from kvstore_client.vllm.plan.planner import NO_MATCH, Outside, Planner
from kvstore_client.vllm.plan.records import Lookup, Req, Transfer

__all__ = ["GROUP_TAG", "NO_MATCH", "Lookup", "Outside", "Planner", "Req", "Transfer", "group_key", "group_keys",
           "split_group_key"]
