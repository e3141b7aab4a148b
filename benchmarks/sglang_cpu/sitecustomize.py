"""Stand-ins that let `python -m sglang.launch_server --device cpu` run HiCache on a machine without a GPU
(SGLang 0.5.23; benchmarks/bench_sglang_serve.py puts this directory on PYTHONPATH, so every process
SGLang spawns loads it). Each fills a gap of SGLang's CPU path, none touches kvstore's backend:

1. `sgl_kernel` (no CPU build on PyPI) imports as a module of mocks, as SGLang's own tests do
   (`sglang.test.test_utils.maybe_stub_sgl_kernel`). A mocked kernel returns a mock silently: that
   greedy answers match with and without HiCache shows none changed the result, not that none ran.
2. The host pool pins its memory through CUDA (`pool_host/common.py: _cuda_host_register`): a no-op.
3. The device <-> host copy for `--hicache-io-backend direct --hicache-mem-layout layer_first`
   (`transfer_kv_direct`, imported only on cuda/hip/xpu): the same row copies in torch.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys


def _transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size=1):
    for src, dst in zip(src_layers, dst_layers, strict=True):
        dst[dst_indices.to(dst.device)] = src[src_indices.to(src.device)]


def _no_host_register(*args, **kwargs) -> None:
    return None


_PATCHES = {
    "sglang.srt.mem_cache.pool_host.common": {"_cuda_host_register": _no_host_register},
    "sglang.srt.mem_cache.pool_host.mha": {"transfer_kv_direct": _transfer_kv_direct},
}


class _Mocks(importlib.abc.Loader):
    def create_module(self, spec):
        return None

    def exec_module(self, module) -> None:
        from unittest.mock import MagicMock

        module.__getattr__ = lambda name: MagicMock()


class _Patched(importlib.abc.Loader):
    """Runs a module as usual, then sets the stand-ins in it."""

    def __init__(self, loader, names: dict) -> None:
        self.loader, self.names = loader, names

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        for name, value in self.names.items():
            setattr(module, name, value)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname == "sgl_kernel" or fullname.startswith("sgl_kernel."):
            return importlib.machinery.ModuleSpec(fullname, _Mocks(), is_package=True)
        names = _PATCHES.get(fullname)
        if names is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Patched(spec.loader, names)
        return spec


sys.meta_path.insert(0, _Finder())
