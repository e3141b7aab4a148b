"""Where each KV cache block lives in vLLM's KV memory, byte for byte, so the kvstore daemon can copy it.

The daemon copies a block between the engine's KV memory and its pool as plain runs: run i of block b is
`block_bytes` bytes at `offset + b * block_stride` of one allocation. vLLM 0.32 places the KV cache by a
KVCacheLayout, an order of the axes [layer, block, head, token, content], so a block is one run of all layers
(BLHNC, BLNHC), one run per layer (LBHNC, LBNHC) or one run per layer and head (LHBNC, BHLNC). `describe_kv_cache`
derives those runs from vLLM's own placement (`KVCacheConfig.kv_cache_tensors` and the layer specs), not from
tensor shapes, for the *manager* block ids the connector addresses (the worker may view a block as several kernel
blocks), and cross-checks the tensors vLLM hands the connector against it. What it cannot describe exactly raises
UnsupportedKVCache: a wrong run would silently hand one request another request's KV.

Block b is each layer's page in layer order, a page as the manager block's logical [H, N, C] (heads-first layouts)
or [N, H, C] (tokens-first), whatever the kernel block size, and only a page's real bytes, never its padding. So
layouts that differ only in where the layer and block axes sit (LBHNC, LHBNC, BLHNC, BHLNC; or LBNHC, BLNHC) give
the same bytes for the same KV, with or without kernel blocks.

vllm-ascend hands the connector per-layer tuples of separately allocated (k, v, ...) tensors, which
kv_cache_tensors does not describe; those are described from the tensors themselves (layout "KV_TUPLES").

vLLM is imported inside the functions, so this module loads without it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from math import prod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheSpec, KVCacheTensor
    from vllm.v1.kv_cache_layout import KVCacheLayout

KV_TUPLES = "KV_TUPLES"


@dataclass(frozen=True, slots=True)
class KVRegion:
    """Manager block b's run of this region: `block_bytes` bytes at `offset + b * block_stride` of memory `memory`."""

    memory: int  # index into KVCacheDescription.memories
    offset: int  # bytes from the start of that allocation (its untyped storage) to block 0's run
    block_stride: int  # bytes between manager block b and b + 1
    block_bytes: int  # bytes of the run per block


@dataclass(frozen=True)
class KVCacheDescription:
    memories: list[torch.Tensor]  # one tensor per distinct backing allocation, in first-seen order of kv_caches
    num_blocks: int  # manager blocks (kv_cache_config.num_blocks)
    regions: list[KVRegion]  # block b = concatenation of every region's run, in this order
    layout: str  # KVCacheLayout name, e.g. "LBNHC"; "KV_TUPLES" for per-layer (k, v) tuples
    # With by_layer: layer name -> how many leading regions hold its pages (a copy in region order has
    # brought that layer in once they landed). Empty otherwise.
    layer_regions: dict[str, int] = field(default_factory=dict)


class UnsupportedKVCache(ValueError):
    """The KV cache cannot be described as block runs; the message says what and why."""


def describe_kv_cache(
    kv_cache_config: KVCacheConfig,
    kv_caches: Mapping[str, torch.Tensor | tuple[torch.Tensor, ...] | list[torch.Tensor]],
    layout: str | None,
    by_layer: bool = False,
) -> KVCacheDescription:
    """The runs of every manager block of the KV cache that vLLM handed a connector.

    `kv_caches` is what `register_kv_caches` receives. `layout` is the resolved KVCacheLayout name
    (`vllm_config.cache_config.kv_cache_layout`), used when `kv_cache_config.kv_cache_layout` is not set.
    Entries of `kv_caches` for layers outside the config's group (layers that share another layer's KV, layers
    the worker adds after the connector is made) are not part of the blocks and are ignored.
    `by_layer`: runs of different layers stay separate regions (a block-outermost layout then gives one run
    per layer, not one for all) and `layer_regions` says where each layer ends; not for per-layer tuples.
    """
    groups = served_groups(kv_cache_config)
    if len(groups) > 1:
        return _describe_aliased_groups(kv_cache_config, groups, kv_caches, layout)
    group = groups[0]
    num_blocks = kv_cache_config.num_blocks
    if num_blocks < 1:
        raise UnsupportedKVCache(f"the KV cache config has {num_blocks} blocks")
    missing = [name for name in group.layer_names if name not in kv_caches]
    if missing:
        raise UnsupportedKVCache(f"layers {missing} of the KV cache group are missing from kv_caches")
    members = set(group.layer_names)
    names = [name for name in kv_caches if name in members]  # kv_caches order: the order memories are seen in
    tuples = [name for name in names if isinstance(kv_caches[name], (tuple, list))]
    memories = _Memories()

    if tuples:
        if len(tuples) != len(names):
            raise UnsupportedKVCache(f"kv_caches mixes per-layer tuples ({tuples[:3]}) with single tensors")
        layer_tensors: dict[str, list[torch.Tensor]] = {}
        for name in names:
            value = kv_caches[name]
            assert isinstance(value, (tuple, list))
            layer_tensors[name] = list(value)
        regions = _tuple_regions(layer_tensors, num_blocks, memories)
        layers = [""] * len(regions)  # not tracked
        layout_name = KV_TUPLES
    else:
        views: dict[str, torch.Tensor] = {}
        for name in names:
            view = kv_caches[name]
            assert not isinstance(view, (tuple, list))
            memories.index(view)  # number the allocations in kv_caches order; regions follow kv_cache_tensors
            views[name] = view
        resolved = _resolve_layout(kv_cache_config, layout)
        regions, layers = _view_regions(kv_cache_config, group, views, resolved, memories)
        layout_name = resolved.name

    regions, layers = _coalesce(regions, layers if by_layer else [""] * len(regions))
    _check_bounds(regions, num_blocks, memories.tensors)
    layer_regions = {name: i + 1 for i, name in enumerate(layers) if name}
    return KVCacheDescription(memories=memories.tensors, num_blocks=num_blocks, regions=regions, layout=layout_name,
                              layer_regions=layer_regions)


# -- what can be described --------------------------------------------------------------------------------------------


def served_groups(config: KVCacheConfig) -> list[KVCacheGroupSpec]:
    """The config's cache groups, if a block id means one page per layer of its group: full-attention and
    sliding-window groups (a sliding-window block holds its tokens' KV while in the window) of one block size,
    and beside them Mamba groups in vLLM's "align" mode (a block then holds the state at its end)."""
    from vllm.v1 import kv_cache_interface
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    # (vLLM 0.23 has neither helper: every full-attention spec there is a FullAttentionSpec, MLA's too)
    is_full_attention_spec = getattr(kv_cache_interface, "is_full_attention_spec",
                                     lambda spec: isinstance(spec, FullAttentionSpec))
    iter_layer_specs = getattr(kv_cache_interface, "iter_layer_specs", lambda spec: [spec])
    groups = config.kv_cache_groups
    for group in groups:
        spec = group.kv_cache_spec
        if isinstance(spec, MambaSpec):
            if spec.mamba_cache_mode != "align":
                raise UnsupportedKVCache(f"Mamba states in mamba_cache_mode {spec.mamba_cache_mode!r}: only 'align' "
                                         "(vLLM's default with prefix caching) keeps a state per block")
        elif not (is_full_attention_spec(spec) or isinstance(spec, SlidingWindowSpec)):
            kinds = sorted({type(s).__name__ for g in groups for s in iter_layer_specs(g.kv_cache_spec)})
            raise UnsupportedKVCache(f"the KV cache's layers use {kinds} in {len(groups)} KV cache group(s); only "
                                     "full-attention (FullAttentionSpec, MLAAttentionSpec), sliding-window and "
                                     "Mamba ('align' mode) groups hold one block per page")
        if getattr(group, "host_resident", False):  # (vLLM 0.23 has no host_resident)
            raise UnsupportedKVCache("host_resident KV cache memory (HiSparse host pool) is not described")
    if all(isinstance(g.kv_cache_spec, MambaSpec) for g in groups):
        raise UnsupportedKVCache("every KV cache group holds Mamba states: a state is served beside attention only")
    sizes = sorted({g.kv_cache_spec.block_size for g in groups})
    if len(sizes) != 1:
        raise UnsupportedKVCache(f"the KV cache groups have block sizes {sizes}; only one block size is served")
    if any(getattr(tensor, "host_resident", False) for tensor in config.kv_cache_tensors):
        raise UnsupportedKVCache("host_resident KV cache memory (HiSparse host pool) is not described")
    return list(groups)


def _describe_aliased_groups(config: KVCacheConfig, groups: list[KVCacheGroupSpec],
                             kv_caches: Mapping[str, torch.Tensor | tuple[torch.Tensor, ...] | list[torch.Tensor]],
                             layout: str | None) -> KVCacheDescription:
    """Several groups (vLLM's hybrid allocator): one description for all, where every group's block b is the same
    bytes. vLLM overlays the groups' tensors on one allocation and one block-id space (a block id belongs to one
    group at a time), so a block's pages are those of whichever group holds it; the group is in the key."""
    from vllm.v1.kv_cache_interface import MambaSpec

    first: KVCacheDescription | None = None
    states = [g for g in groups if isinstance(g.kv_cache_spec, MambaSpec)]
    for group in groups:
        if group in states:
            continue
        members = set(group.layer_names)
        tensors = [t for t in config.kv_cache_tensors if members.intersection(t.layers)]
        mixed = [t.layers for t in tensors if not members.issuperset(t.layers)]
        if mixed:
            raise UnsupportedKVCache(f"KVCacheTensors {mixed} mix layers of several KV cache groups")
        one = replace(config, kv_cache_tensors=tensors, kv_cache_groups=[group])
        description = describe_kv_cache(one, {n: v for n, v in kv_caches.items() if n in members}, layout)
        if first is None:
            first = description
        elif (description.regions != first.regions or description.layout != first.layout
              or [m.untyped_storage().data_ptr() for m in description.memories]
              != [m.untyped_storage().data_ptr() for m in first.memories]):
            raise UnsupportedKVCache(f"KV cache group {group.layer_names} is not laid over the same bytes as group "
                                     f"{groups[0].layer_names} (regions {description.regions} vs {first.regions})")
    assert first is not None
    for group in states:
        for name in group.layer_names:
            _check_state_view(name, kv_caches.get(name), first)
    return first


def _check_state_view(name: str, view: object, described: KVCacheDescription) -> None:
    """A Mamba layer's raw state view ([blocks, 1, 1, state bytes], vLLM's MambaBase.bind_kv_cache) must hold
    block b's state inside block b's pages of the attention groups it is laid over: a block's copy then
    carries the state whole (with the page's padding)."""
    import torch

    if (not isinstance(view, torch.Tensor) or view.dim() != 4 or view.shape[0] != described.num_blocks
            or view.stride(3) != 1):
        raise UnsupportedKVCache(f"Mamba layer {name}'s KV cache is not a [blocks, 1, 1, bytes] view: {view!r:.80}")
    size = view.element_size()
    start, stride, nbytes = view.storage_offset() * size, view.stride(0) * size, prod(view.shape[1:]) * size
    storage = view.untyped_storage().data_ptr()
    for region in described.regions:
        if (described.memories[region.memory].untyped_storage().data_ptr() == storage
                and region.block_stride == stride and region.offset <= start
                and start + nbytes <= region.offset + region.block_bytes):
            return
    raise UnsupportedKVCache(f"Mamba layer {name}'s states ({nbytes} bytes at {start} + b * {stride}) are not inside "
                             f"the pages of the attention groups they are laid over ({described.regions})")


def _resolve_layout(config: KVCacheConfig, layout: str | None) -> KVCacheLayout:
    from vllm.v1.kv_cache_layout import KVCacheLayout

    names = {name for name in (config.kv_cache_layout, layout) if name is not None}
    if not names:
        raise UnsupportedKVCache("the KV cache layout is not resolved (neither kv_cache_config.kv_cache_layout nor "
                                 "the layout argument is set)")
    if len(names) > 1:
        raise UnsupportedKVCache(f"kv_cache_config.kv_cache_layout is {config.kv_cache_layout!r} but the layout "
                                 f"argument is {layout!r}")
    name = names.pop()
    if name not in KVCacheLayout.__members__:
        raise UnsupportedKVCache(f"unknown KV cache layout {name!r}; vLLM's are {list(KVCacheLayout.__members__)}")
    return KVCacheLayout[name]


class _Memories:
    """Distinct backing allocations, one tensor of each, in the order they are first seen."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self._index: dict[tuple[str, int], int] = {}

    def index(self, tensor: torch.Tensor) -> int:
        key = (str(tensor.device), tensor.untyped_storage().data_ptr())
        if key not in self._index:
            self._index[key] = len(self.tensors)
            self.tensors.append(tensor)
        return self._index[key]


# -- vLLM's per-layer views of its KV cache tensors -------------------------------------------------------------------


def _view_regions(config: KVCacheConfig, group: KVCacheGroupSpec, views: dict[str, torch.Tensor],
                  layout: KVCacheLayout, memories: _Memories) -> tuple[list[KVRegion], list[str]]:
    """Runs from kv_cache_tensors: layer l's page of block b starts at offset + l * layer_stride + b * block_stride.
    Also returns the layer of each run."""
    regions: list[KVRegion] = []
    layers: list[str] = []
    described: set[str] = set()
    for tensor in config.kv_cache_tensors:
        if not tensor.layers:
            continue
        unknown = [name for name in tensor.layers if name not in views]
        if unknown:
            raise UnsupportedKVCache(f"KVCacheTensor layers {unknown} are not in the KV cache group")
        spec = _layer_spec(group, tensor.layers[0])
        if any(_layer_spec(group, name) != spec for name in tensor.layers):
            raise UnsupportedKVCache(f"the layers of one KVCacheTensor ({tensor.layers}) have different specs")
        memory = memories.index(views[tensor.layers[0]])
        storage = memories.tensors[memory].untyped_storage()
        if storage.nbytes() < tensor.size:
            raise UnsupportedKVCache(f"layer {tensor.layers[0]}'s allocation has {storage.nbytes()} bytes, less than "
                                     f"its KVCacheTensor's size {tensor.size}")
        ratios = set()
        for index, name in enumerate(tensor.layers):
            if memories.index(views[name]) != memory:
                raise UnsupportedKVCache(f"layer {name}'s tensor is not in the allocation of its KVCacheTensor's "
                                         f"first layer {tensor.layers[0]}")
            ratios.add(_check_view(name, views[name], index, tensor, spec, layout, config.num_blocks))
        if len(ratios) > 1:
            raise UnsupportedKVCache(f"the layers {tensor.layers} split blocks into {sorted(ratios)} kernel blocks")
        runs = _page_runs(spec, tensor, layout, config.num_blocks, ratios.pop())
        for index in range(len(tensor.layers)):
            page = tensor.offset + index * tensor.layer_stride
            regions.extend(KVRegion(memory, page + start, tensor.block_stride, length) for start, length in runs)
            layers.extend([tensor.layers[index]] * len(runs))
        described.update(tensor.layers)
    undescribed = [name for name in group.layer_names if name not in described]
    if undescribed:
        raise UnsupportedKVCache(f"layers {undescribed} are in no KVCacheTensor of the KV cache config")
    return regions, layers


def _layer_spec(group: KVCacheGroupSpec, name: str) -> KVCacheSpec:
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    spec = group.kv_cache_spec
    return spec.kv_cache_specs[name] if isinstance(spec, UniformTypeKVCacheSpecs) else spec


def _vllm_strides(spec: KVCacheSpec, num_blocks: int, tensor: KVCacheTensor, layout: KVCacheLayout,
                  kernel_block_size: int | None, block_stride: int) -> tuple[int, ...]:
    """Byte strides of the [L, B, H, N, C] axes, as create_kv_cache_views computes them."""
    from vllm.v1.kv_cache_interface import compute_layout_strides

    try:
        return compute_layout_strides(spec, num_blocks, len(tensor.layers), layout, kernel_block_size,
                                      fixed_strides=(tensor.layer_stride, block_stride, None, None, None))
    except AssertionError as e:  # vLLM states its own limits (e.g. padding in a layout that splits pages) so
        raise UnsupportedKVCache(f"vLLM cannot place layers {tensor.layers} in layout {layout.name}: {e}") from e


def heads_first(layout: str) -> bool:
    """The layout orders a page by head, then token (HNC); else by token, then head (NHC)."""
    return layout.index("H") < layout.index("N")


def _page_runs(spec: KVCacheSpec, tensor: KVCacheTensor, layout: KVCacheLayout, num_blocks: int,
               ratio: int) -> list[tuple[int, int]]:
    """(start from the page's first byte, length) of one layer's page, as runs in canonical order.

    The page is vLLM's logical [H, N, C] of the manager block (C in bytes), real bytes only: padding lies past
    it. Runs come in (H, N) order for heads-first layouts, (N, H) order otherwise, whatever the kernel block size:
    a manager block split into `ratio` kernel blocks holds tokens [j * N / ratio, (j + 1) * N / ratio) in kernel
    block j, so a split heads-first page is [ratio, H, N / ratio, C] in memory, and is read back as [H, N, C]. Pool
    bytes then depend only on the layout's head/token order: engines that split blocks differently (or lay out
    layers and blocks differently) share them.
    """
    from vllm.v1.kv_cache_interface import compute_layer_kv_cache_shape_bytes

    heads, tokens, content = compute_layer_kv_cache_shape_bytes(spec, 1)[1:]
    real = getattr(spec, "real_page_size_bytes", spec.page_size_bytes)
    if heads * tokens * content != real:
        raise UnsupportedKVCache(f"the {type(spec).__name__} page of layers {tensor.layers} is [H, N, C] = "
                                 f"{(heads, tokens, content)} ({heads * tokens * content} bytes), not its {real} "
                                 "real bytes")
    kernel = spec.block_size // ratio if ratio > 1 else None
    _, block, head, token, _ = _vllm_strides(spec, num_blocks, tensor, layout, kernel, tensor.block_stride // ratio)
    per_kernel = tokens // ratio
    order = ((h, n) for h in range(heads) for n in range(tokens)) if heads_first(layout.name) \
        else ((h, n) for n in range(tokens) for h in range(heads))
    runs: list[list[int]] = []
    for h, n in order:  # once per KVCacheTensor: H x N steps
        start = (n // per_kernel) * block + h * head + (n % per_kernel) * token
        if runs and runs[-1][0] + runs[-1][1] == start:
            runs[-1][1] += content
        else:
            runs.append([start, content])
    return [(start, length) for start, length in runs]


def _check_view(name: str, view: torch.Tensor, index: int, tensor: KVCacheTensor, spec: KVCacheSpec,
                layout: KVCacheLayout, num_blocks: int) -> int:
    """Refuse unless `view` is the view create_kv_cache_views makes of layer `index` of `tensor`: same address,
    shape and strides, possibly with each manager block split into kernel blocks. Returns that ratio."""
    from vllm.v1.kv_cache_interface import compute_layer_kv_cache_shape_bytes

    start = view.data_ptr() - view.untyped_storage().data_ptr()
    expected_start = tensor.offset + index * tensor.layer_stride
    if start != expected_start:
        raise UnsupportedKVCache(f"layer {name}'s tensor starts at byte {start} of its allocation, not at byte "
                                 f"{expected_start} where its KVCacheTensor places it")
    if view.dim() != 4 or view.shape[0] == 0 or view.shape[0] % num_blocks:
        raise UnsupportedKVCache(f"layer {name}'s tensor has shape {tuple(view.shape)}: vLLM's views are "
                                 f"[blocks, H, N, C] with a multiple of the {num_blocks} manager blocks in dim 0")
    ratio = view.shape[0] // num_blocks
    kernel_block_size = None
    if ratio > 1:
        dense_page = prod(compute_layer_kv_cache_shape_bytes(spec, 1)[1:])
        if spec.block_size % ratio or tensor.block_stride != dense_page:
            raise UnsupportedKVCache(f"layer {name}'s tensor splits {num_blocks} manager blocks into {ratio} kernel "
                                     f"blocks each, but a manager block of {spec.block_size} tokens and stride "
                                     f"{tensor.block_stride} is not {ratio} adjacent pages of {dense_page // ratio} "
                                     "bytes")
        kernel_block_size = spec.block_size // ratio
    size = view.element_size()
    shape = compute_layer_kv_cache_shape_bytes(spec, num_blocks, kernel_block_size)
    strides = _vllm_strides(spec, num_blocks, tensor, layout, kernel_block_size, tensor.block_stride // ratio)
    expected_shape = (*shape[:3], shape[3] // size)
    expected_strides = (*strides[1:4], size)  # C, in bytes in vLLM's terms, is the dtype's elements here
    actual_strides = tuple(stride * size for stride in view.stride())
    # A stride along an axis of size 1 is never used, so it need not match.
    if tuple(view.shape) != expected_shape or shape[3] % size or any(
            n > 1 and a != e for n, a, e in zip(expected_shape, actual_strides, expected_strides, strict=True)):
        raise UnsupportedKVCache(f"layer {name}'s tensor has shape {tuple(view.shape)} and byte strides "
                                 f"{actual_strides}, but vLLM's {layout.name} view of it has shape {expected_shape} "
                                 f"and byte strides {expected_strides}: it is not laid out as described")
    # The manager page is read as its kernel blocks' rows: together they must be exactly the page.
    if ratio > 1 and not _dense([(ratio, view.stride(0)), *zip(view.shape[1:], view.stride()[1:], strict=True)]):
        raise UnsupportedKVCache(f"layer {name}'s {ratio} kernel blocks per manager block (shape "
                                 f"{tuple(view.shape)}, strides {view.stride()}) do not tile the block's page")
    return ratio


# -- vllm-ascend: per-layer tuples of separate tensors ----------------------------------------------------------------


def _tuple_regions(layer_tensors: dict[str, list[torch.Tensor]], num_blocks: int,
                   memories: _Memories) -> list[KVRegion]:
    """One run per tensor, in layer then tuple order. Each tensor has its blocks in dim 0, and a block's bytes
    (possibly permuted, e.g. heads before tokens) must fill one dense run."""
    regions = []
    for name, tensors in layer_tensors.items():
        if not tensors:
            raise UnsupportedKVCache(f"layer {name}'s KV cache is an empty tuple")
        for i, tensor in enumerate(tensors):
            what = f"tensor {i} of layer {name} (shape {tuple(tensor.shape)}, strides {tensor.stride()})"
            if tensor.dim() < 1 or tensor.numel() == 0 or tensor.shape[0] % num_blocks:
                raise UnsupportedKVCache(f"{what} needs a multiple of the {num_blocks} manager blocks in dim 0")
            ratio = tensor.shape[0] // num_blocks
            if not _dense(zip(tensor.shape[1:], tensor.stride()[1:], strict=True)):
                raise UnsupportedKVCache(f"{what}: a block's elements do not fill one dense run of bytes")
            size = tensor.element_size()
            dense = prod(tensor.shape[1:]) * size
            stride = tensor.stride(0) * size
            if ratio > 1 and stride != dense:
                raise UnsupportedKVCache(f"{what}: {ratio} kernel blocks per manager block are {stride} bytes "
                                         f"apart, not adjacent {dense}-byte blocks")
            start = tensor.data_ptr() - tensor.untyped_storage().data_ptr()
            regions.append(KVRegion(memories.index(tensor), start, stride * ratio, dense * ratio))
    return regions


def _dense(dims: Iterable[tuple[int, int]]) -> bool:
    """Whether axes of these (size, stride in elements) reach every element of one contiguous run exactly once."""
    run = 1
    for stride, size in sorted((stride, size) for size, stride in dims if size > 1):
        if stride != run:
            return False
        run *= size
    return True


# -- all regions ------------------------------------------------------------------------------------------------------


def _coalesce(regions: list[KVRegion], layers: list[str]) -> tuple[list[KVRegion], list[str]]:
    """Merge a region into the one before it when its run continues that run in every block: same memory and
    stride, starting where the previous run ends, and the same entry of `layers` (a layer name, or "" for
    any). Block order (runs concatenated in region order) is kept."""
    merged: list[KVRegion] = []
    merged_layers: list[str] = []
    for region, layer in zip(regions, layers, strict=True):
        last = merged[-1] if merged else None
        if (last is not None and last.memory == region.memory and last.block_stride == region.block_stride
                and last.offset + last.block_bytes == region.offset and merged_layers[-1] == layer):
            merged[-1] = KVRegion(last.memory, last.offset, last.block_stride, last.block_bytes + region.block_bytes)
        else:
            merged.append(region)
            merged_layers.append(layer)
    return merged, merged_layers


def _check_bounds(regions: list[KVRegion], num_blocks: int, memories: list[torch.Tensor]) -> None:
    if not regions:
        raise UnsupportedKVCache("the KV cache has no layers to describe")
    for i, region in enumerate(regions):
        end = region.offset + (num_blocks - 1) * region.block_stride + region.block_bytes
        nbytes = memories[region.memory].untyped_storage().nbytes()
        if region.offset < 0 or region.block_bytes <= 0 or end > nbytes:
            raise UnsupportedKVCache(f"region {i} ({region}) spans bytes {region.offset}..{end}, outside its "
                                     f"{nbytes}-byte allocation")
        if num_blocks > 1 and region.block_stride < region.block_bytes:
            raise UnsupportedKVCache(f"region {i} ({region}) overlaps itself from one block to the next")
