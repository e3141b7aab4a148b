"""The house's import rules, read from the source with ast (nothing is imported or run):

- no import cycle inside kvstore_service, not even one imported for types only;
- servicer.py translates: of the daemon it imports the Daemon facade and the types and errors it
  decodes into and encodes from, no part (index, sessions' registry, jobs, tiers, pool, ...);
- the daemon imports only kvstore_client.protocol of the client package; the command line and the
  harness that drive a daemon as a client does (`kvstore stats`, `kvstore bench`) are named here;
- the client package imports nothing of the daemon's, and ships no harness;
- the vLLM connector's planner (kvstore_client.vllm.plan) has no I/O: it imports neither vLLM nor
  the client's I/O (sessions, sockets, threads, time), only the protocol's pure helpers and itself;
- every sleep and wait of the vLLM connector is in pacing.py;
- an engine (vllm, sglang) is imported only by its adapter (kvstore_client.vllm, kvstore_client.sglang);
- threads.py makes every thread the daemon hands work to: no other module of kvstore_service starts a
  thread or a pool (ThreadPoolExecutor, threading.Thread, asyncio.to_thread, run_in_executor, ...);
  the exceptions are named here with their reason.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOTS = {"kvstore_service": REPO / "kvstore_service", "kvstore_client": REPO / "client"}

# What servicer.py may take from the daemon's package, by module: the facade, and what a request is
# decoded into (a registration, its layout, who calls) or a reply is encoded from.
SERVER_MAY_IMPORT = {
    "kvstore_service": {"__version__"},
    "kvstore_service.daemon": {"Daemon"},
    "kvstore_service.errors": {"KVError", "invalid"},
    "kvstore_service.events": {"Batch"},
    "kvstore_service.config": {"Config"},
    "kvstore_service.registered_layout": {"Layout", "Region"},
    "kvstore_service.sessions": {"Registration", "Session"},
    "kvstore_service.stats": {"to_proto"},
    "kvstore_service.tenants": {"Caller", "Tenancy", "check_namespace"},
    "kvstore_service.peercred": {"Handshake", "PeerCredServer", "close_fds"},
}
# Modules of the daemon's package that are clients of a daemon: they may import the whole client.
CLIENT_SIDE = {"kvstore_service.cli", "kvstore_service.bench", "kvstore_service.bench_limits",
               "kvstore_service.harness"}
# What starts a thread (a call of one of these names, or a class deriving from one). run_in_executor
# and asyncio.to_thread count: without an executor of threads.py's they run on one asyncio makes.
THREAD_MAKERS = {"ThreadPoolExecutor", "ProcessPoolExecutor", "Thread", "Timer", "to_thread", "run_in_executor",
                 "start_new_thread", "set_default_executor"}
# The one module that may, and the threads made elsewhere, each with why it is not a pool of threads.py's.
THREADS_MODULE = "kvstore_service.threads"
OWN_THREADS = {
    ("kvstore_service.metrics", "Thread"):
        "the /healthz and /metrics HTTP server (http.server's blocking serve_forever): it answers while the "
        "pool is being set up and while the loop is busy, so it neither waits on the loop nor queues behind "
        "the daemon's work, and it runs none of it",
    ("kvstore_service.backends.cpu", "Thread"):
        "a CPU mapping's page populator: one per mapping, living as long as it (stopped and joined at unmap, "
        "before the memory goes), not a piece of work handed to a pool and awaited",
}


def modules(package: str) -> dict[str, Path]:
    root = ROOTS[package]
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        if any(p.startswith(".") or p in ("build", "dist") for p in parts):
            continue
        found[".".join([package, *parts])] = path
    return found


def _is_module(name: str) -> bool:
    package, _, rest = name.partition(".")
    if package not in ROOTS:
        return False
    base = ROOTS[package].joinpath(*rest.split(".")) if rest else ROOTS[package]
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def imports(module: str, path: Path) -> Iterator[tuple[str, str | None, int]]:
    """(module imported, name taken from it or None, line) of every import in the file, wherever it is
    (inside functions and `if TYPE_CHECKING:` too); `from package import submodule` names the submodule."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if _is_module(sub):
                    yield sub, None, node.lineno
                else:
                    yield base, alias.name, node.lineno


def graph() -> dict[str, set[str]]:
    """kvstore_service's modules and the ones of it each imports."""
    ours = modules("kvstore_service")
    return {m: {target for target, _, _ in imports(m, path) if target in ours and target != m}
            for m, path in ours.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_the_rules_see_the_imports_they_judge() -> None:
    edges = graph()
    assert {"kvstore_service.daemon", "kvstore_service.servicer", "kvstore_service.jobs",
            "kvstore_service.sessions"} <= edges.keys()
    assert "kvstore_service.daemon" in edges["kvstore_service.servicer"]
    assert "kvstore_service.sessions" in edges["kvstore_service.jobs"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle_in_the_daemon() -> None:
    edges = graph()
    found = cycles(edges)
    described = ["; ".join(f"{m} -> {sorted(edges[m] & set(c))}" for m in c) for c in found]
    assert found == [], "import cycles (type-only imports count):\n" + "\n".join(described)


def test_the_server_imports_the_daemon_facade_and_the_types_it_translates_only() -> None:
    path = ROOTS["kvstore_service"] / "servicer.py"
    wrong = []
    for target, name, line in imports("kvstore_service.servicer", path):
        if target.split(".")[0] != "kvstore_service":
            continue
        allowed = SERVER_MAY_IMPORT.get(target, set())
        if name is None or name not in allowed:
            wrong.append(f"servicer.py:{line}: {target}{'.' + name if name else ''}")
    assert wrong == [], "servicer.py reaches into the daemon's parts:\n" + "\n".join(wrong)


def test_the_daemon_imports_only_the_protocol_of_the_client() -> None:
    wrong = []
    for module, path in modules("kvstore_service").items():
        if module in CLIENT_SIDE:
            continue
        for target, name, line in imports(module, path):
            if target.split(".")[0] != "kvstore_client":
                continue
            if not (target == "kvstore_client.protocol" or target.startswith("kvstore_client.protocol.")):
                wrong.append(f"{path.relative_to(REPO)}:{line}: {target}{'.' + name if name else ''}")
    assert wrong == [], "the daemon imports more of the client than its protocol:\n" + "\n".join(wrong)


def test_the_client_ships_no_daemon_and_no_harness() -> None:
    client = modules("kvstore_client")
    wrong = [f"{path.relative_to(REPO)}:{line}: {target}" for module, path in client.items()
             for target, _, line in imports(module, path) if target.split(".")[0] == "kvstore_service"]
    assert wrong == []
    assert not [m for m in client if m.rpartition(".")[2] in ("process", "harness", "bench", "testing")]


# What the planner may import: the standard library's pure parts, the protocol's key rules, itself.
PLANNER = "kvstore_client.vllm.plan"
PLANNER_MAY_IMPORT = {"__future__", "collections.abc", "dataclasses", "typing", "logging",
                      "kvstore_client.protocol.groups"}
# Calls that sleep or wait, and the one module of the vLLM connector that may make them.
WAITS = {"sleep", "wait", "wait_posted"}
PACING = "kvstore_client.vllm.pacing"
OWN_WAITS = {("kvstore_client.vllm.events", "self._closed.wait"):
             "the announcer's own thread, between watches of the daemon's stream: never an engine step"}


def test_the_planner_imports_no_io() -> None:
    planner = {m: p for m, p in modules("kvstore_client").items() if m == PLANNER or m.startswith(PLANNER + ".")}
    assert len(planner) >= 4
    wrong = [f"{path.relative_to(REPO)}:{line}: {target}" for module, path in planner.items()
             for target, _, line in imports(module, path)
             if target not in PLANNER_MAY_IMPORT and not target.startswith(PLANNER)]
    assert wrong == [], "the planner imports I/O (or vLLM):\n" + "\n".join(wrong)


def test_engine_adapters_stay_apart() -> None:
    """Each engine's adapter imports its engine; nothing else of the client imports an engine or an
    adapter of another (the SGLang backend runs where vLLM is not installed, and the other way)."""
    adapters = {"vllm": "kvstore_client.vllm", "sglang": "kvstore_client.sglang"}
    # kvstore_client.layouts describes vLLM's KV cache tensors (the vLLM adapter's, and device.py's for them).
    homes = {"kvstore_client.layouts": "vllm"}
    wrong = []
    for module, path in modules("kvstore_client").items():
        home = homes.get(module) or next((engine for engine, adapter in adapters.items()
                                          if module == adapter or module.startswith(adapter + ".")), None)
        for target, _, line in imports(module, path):
            for engine, adapter in adapters.items():
                if engine != home and (target.split(".")[0] == engine or target == adapter
                                       or target.startswith(adapter + ".")):
                    wrong.append(f"{path.relative_to(REPO)}:{line}: {target}")
    sglang = modules("kvstore_client")["kvstore_client.sglang"]
    assert any(t.startswith("sglang.") for t, _, _ in imports("kvstore_client.sglang", sglang))  # (the rule sees)
    assert wrong == [], "an engine imported outside its adapter:\n" + "\n".join(wrong)


def test_only_pacing_sleeps_or_waits_in_the_vllm_connector() -> None:
    wrong = []
    for module, path in modules("kvstore_client").items():
        if not module.startswith("kvstore_client.vllm") or module == PACING:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in WAITS
                    and (module, ast.unparse(node.func)) not in OWN_WAITS):
                wrong.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node.func)}")
    assert wrong == [], "a sleep or wait outside pacing.py:\n" + "\n".join(wrong)


def thread_makers(source: str, filename: str = "<source>") -> Iterator[tuple[str, int]]:
    """(name, line) of each call that starts a thread or pool, and of each class deriving from one."""
    for node in ast.walk(ast.parse(source, filename)):
        targets = [node.func] if isinstance(node, ast.Call) else node.bases if isinstance(node, ast.ClassDef) else []
        for target in targets:
            name = target.attr if isinstance(target, ast.Attribute) else target.id if isinstance(target, ast.Name) \
                else None
            if name in THREAD_MAKERS:
                yield name, node.lineno


def test_the_thread_rule_sees_what_makes_threads() -> None:
    source = """
import asyncio, threading
from concurrent.futures import ThreadPoolExecutor as Pool, ThreadPoolExecutor
ThreadPoolExecutor(max_workers=2)
threading.Thread(target=print).start()
asyncio.to_thread(print)
asyncio.get_running_loop().run_in_executor(None, print)
class Worker(threading.Thread): ...
threading.Lock(); threading.Event()
"""
    assert sorted(name for name, _ in thread_makers(source)) == [
        "Thread", "Thread", "ThreadPoolExecutor", "run_in_executor", "to_thread"]
    made = {name for name, _ in thread_makers(ROOTS["kvstore_service"].joinpath("threads.py").read_text())}
    assert {"ThreadPoolExecutor", "run_in_executor"} <= made


def test_only_threads_py_makes_threads_in_the_daemon() -> None:
    wrong, excepted = [], set()
    for module, path in modules("kvstore_service").items():
        if module == THREADS_MODULE:
            continue
        for name, line in thread_makers(path.read_text(), str(path)):
            if (module, name) in OWN_THREADS:
                excepted.add((module, name))
            else:
                wrong.append(f"{path.relative_to(REPO)}:{line}: {name}")
    assert wrong == [], "threads made outside threads.py (take them from Threads):\n" + "\n".join(wrong)
    assert excepted == OWN_THREADS.keys(), f"exceptions no longer needed: {sorted(OWN_THREADS.keys() - excepted)}"


def test_the_architecture_map_names_every_module_of_the_daemon() -> None:
    """docs/architecture.md's table of rooms: each module of kvstore_service (a subpackage as `name/`)."""
    table = [line for line in (REPO / "docs" / "architecture.md").read_text().splitlines() if line.startswith("| `")]
    named = {name for line in table for name in line.split(" | ")[0].strip("| ").replace("`", "").split(", ")}
    rooms = {path.name if path.is_file() else path.name + "/" for path in (REPO / "kvstore_service").iterdir()
             if (path.suffix == ".py" and path.name != "__init__.py") or (path / "__init__.py").is_file()}
    assert len(rooms) > 20
    assert sorted(rooms - named) == [], "modules docs/architecture.md does not name"


def test_the_architecture_map_names_every_file_of_the_native_engine() -> None:
    """docs/architecture.md's table of csrc/: each C++ file of the extension, and setup.py builds each."""
    doc = (REPO / "docs" / "architecture.md").read_text()
    files = sorted(path.name for path in (REPO / "csrc").glob("*.cpp"))
    assert len(files) > 10
    assert [name for name in files if f"`{name}`" not in doc] == [], "csrc files docs/architecture.md does not name"
    setup = (REPO / "setup.py").read_text()
    assert [name for name in files if f'"{name.removesuffix(".cpp")}"' not in setup] == [], "csrc files not built"


def test_every_lock_of_the_daemon_is_named_in_the_architecture() -> None:
    """What runs off the event loop takes the locks architecture.md names, and no others: a threading
    lock made anywhere in kvstore_service is in its table."""
    doc = (REPO / "docs" / "architecture.md").read_text()
    locks = []
    for module, path in modules("kvstore_service").items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, ast.AnnAssign) else []
            value = getattr(node, "value", None)
            made = [ast.unparse(v) for v in (value.elts if isinstance(value, ast.Tuple) else [value])
                    if isinstance(v, ast.Call) and ast.unparse(v.func).endswith(("threading.Lock", "threading.RLock"))]
            annotated = isinstance(node, ast.AnnAssign) and ast.unparse(node.annotation) in ("threading.Lock",
                                                                                             "threading.RLock")
            if made or annotated:
                for target in targets:
                    for name in (target.elts if isinstance(target, ast.Tuple) else [target]):
                        locks.append((module, ast.unparse(name).removeprefix("self.")))
    assert len(locks) >= 5, locks
    assert sorted(f"{m}: {name}" for m, name in locks if f"`{name}`" not in doc) == []
