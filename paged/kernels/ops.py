"""The ops every backend provides, with the checks run once in front of all of them.

Tensors use vLLM's cache layout (DESIGN.md): key `[num_blocks, kv_heads, head_size/x, block_size, x]`
with `x = 16 // element_size`, value `[num_blocks, kv_heads, head_size, block_size]`. Each op
validates its arguments, asks the backend whether it serves the configuration, then runs it.
`backend=` is a name (`torch`, `cpu`, `cuda`, `emu`) or a `KernelBackend`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from paged.kernels.backends.interface import CacheView, KernelBackend, device_side
from paged.kernels.features import FP8_DTYPES, NONE, AttentionFeatures, BlockSparse
from paged.kernels.input_checks import (
    cache_scales,
    check_copy_blocks,
    check_copy_slots,
    check_features,
    check_max_len,
    check_paged_attention,
    check_prefill_attention,
    check_query_offsets,
    check_reshape_and_cache,
    check_sliding_window,
    check_swap_blocks,
    check_table_covers,
)
from paged.kernels.limits import DEFAULT_PARTITION_SIZE
from paged.kernels.registry import get_backend

V1_MAX_SEQ_LEN = 8192
V1_MIN_PARALLELISM = 512


# The backends on which v3 was measured to beat v1 and v2 (docs/kernels.md, "Choosing a decode
# kernel"): `auto` picks v3 there and keeps vLLM's rule elsewhere. cpu: 0.58-0.76x v2's time on
# every shape of experiments/cpu/cpu_decode_bench.py; cuda: every kernel row of the H100 and H200
# benchmarks, and 1.30x the output tok/s end to end on the H200 (issue 43). A simulated GPU prices
# the cuda backend's choice.
V3_BACKENDS: frozenset[str] = frozenset({"cpu", "cuda"})


def choose_version(
    max_seq_len: int, num_seqs: int, num_heads: int, partition_size: int = DEFAULT_PARTITION_SIZE, *,
    backend: str | None = None,
) -> str:
    """`kernel.version=auto`: v3 on a backend of `V3_BACKENDS`, else vLLM's rule: v1 when one
    partition suffices or the grid already has enough blocks, v2 otherwise. No `backend`: vLLM's
    rule (`kernel.version=vllm`)."""
    if backend in V3_BACKENDS:
        return "v3"
    num_partitions = -(-max_seq_len // partition_size)
    use_v1 = max_seq_len <= V1_MAX_SEQ_LEN and (
        num_partitions == 1 or num_seqs * num_heads > V1_MIN_PARALLELISM
    )
    return "v1" if use_v1 else "v2"


def step_version(
    version: str, max_seq_len: int, num_seqs: int, num_heads: int, partition_size: int = DEFAULT_PARTITION_SIZE, *,
    backend: str | None = None,
) -> str:
    """The decode kernel a step runs under `kernel.version`: v1 / v2 / v3 as named, `auto`'s choice on
    `backend`, or vLLM's rule for `vllm`."""
    if version == "auto":
        return choose_version(max_seq_len, num_seqs, num_heads, partition_size, backend=backend)
    if version == "vllm":
        return choose_version(max_seq_len, num_seqs, num_heads, partition_size)
    return version


def serving_backend(
    backend: str | KernelBackend, tensor: torch.Tensor, head_size: int, block_size: int,
    partition_size: int | None = None, cache_dtype: torch.dtype | None = None, features: AttentionFeatures = NONE,
) -> KernelBackend:
    """The backend for an op on `tensor` (activations, or for block copies a cache, whose dtype is
    then checked as `cache_dtype` only)."""
    impl = get_backend(backend)
    dtype = None if tensor.dtype in FP8_DTYPES else tensor.dtype
    reason = impl.unsupported_reason(tensor.device, dtype, head_size, block_size, partition_size, cache_dtype, features)
    if reason:
        raise ValueError(reason)
    return impl


def _serving_attention(
    backend: str | KernelBackend, query: torch.Tensor, cache: CacheView, partition_size: int | None,
    max_seq_len: int | None, features: AttentionFeatures,
) -> tuple[KernelBackend, int]:
    """The backend for attention over a checked `cache`, and the checked `max_seq_len`."""
    impl = serving_backend(
        backend, query, cache.head_size, cache.block_size, partition_size, cache.key_cache.dtype, features
    )
    max_seq_len = check_max_len("max_seq_len", cache.seq_lens, max_seq_len)
    check_table_covers(cache, max_seq_len)
    return impl, max_seq_len


def narrower_window(sliding_window: int | None, max_seq_len: int) -> int | None:
    """The window, or `None` where it covers every context: no query can see past position 0."""
    return sliding_window if sliding_window is not None and sliding_window < max_seq_len else None


def _view(
    key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
    k_scale: float | torch.Tensor | None, v_scale: float | torch.Tensor | None,
) -> CacheView:
    return CacheView(key_cache, value_cache, block_tables, seq_lens, *cache_scales(key_cache, k_scale, v_scale))


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    version: str = "v1",
    backend: str | KernelBackend = "torch",
    partition_size: int = DEFAULT_PARTITION_SIZE,
    max_seq_len: int | None = None,
    sliding_window: int | None = None,
    alibi_slopes: torch.Tensor | None = None,
    blocksparse: BlockSparse | None = None,
    soft_cap: float | None = None,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention, one query token per sequence: `[num_seqs, num_heads, head_size]`.

    `block_tables` int32 `[num_seqs, max_blocks]`, `seq_lens` int32 `[num_seqs]` (the context
    including the query's own token, already in the cache). `max_seq_len` may be passed when the
    caller knows it, which saves a device-to-host sync. `sliding_window` W limits each query to
    its last W positions, itself included (Mistral's window); table entries of blocks wholly
    before the window are never read, so they may be stale. `alibi_slopes` (`[num_heads]`),
    `blocksparse`, `soft_cap`, and the fp8 cache's `k_scale` / `v_scale` (a number or `[num_kv_heads]`; 1 when
    not given) are described in `paged.kernels.features`.
    """
    cache = _view(key_cache, value_cache, block_tables, seq_lens, k_scale, v_scale)
    check_paged_attention(query, cache, version, partition_size)
    sliding_window = check_sliding_window(sliding_window)
    features = check_features(query, cache.block_size, alibi_slopes, blocksparse, soft_cap)
    impl, max_seq_len = _serving_attention(
        backend, query, cache, partition_size if version == "v2" else None, max_seq_len, features
    )
    if query.shape[0] == 0 or max_seq_len == 0:
        return torch.zeros_like(query)
    window = narrower_window(sliding_window, max_seq_len)
    return impl.paged_attention(query, cache, scale, version, partition_size, max_seq_len, window, features)


def prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    backend: str | KernelBackend = "torch",
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    sliding_window: int | None = None,
    alibi_slopes: torch.Tensor | None = None,
    blocksparse: BlockSparse | None = None,
    soft_cap: float | None = None,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention over the paged cache for a variable-length batch: `[num_tokens, num_heads,
    head_size]`.

    Sequence i's queries are rows `query_start_loc[i]:query_start_loc[i + 1]` of `query` (int32
    `[S + 1]` offsets) and are the last of its `seq_lens[i]` context positions, whose K/V are
    already in the cache (`reshape_and_cache` wrote the new ones). Fewer queries than context is a
    prefix-cache hit or a chunk of a prefill; one query is a decode row, so a batch may mix both.
    Passing `max_query_len` / `max_seq_len` saves device-to-host syncs. `sliding_window` W: the
    query at position p attends to positions p - W < k <= p; blocks wholly before the first query's
    window are never read. The features and scales are `paged_attention`'s.
    """
    cache = _view(key_cache, value_cache, block_tables, seq_lens, k_scale, v_scale)
    check_prefill_attention(query, cache, query_start_loc)
    check_query_offsets(query, cache, query_start_loc)
    sliding_window = check_sliding_window(sliding_window)
    features = check_features(query, cache.block_size, alibi_slopes, blocksparse, soft_cap)
    impl, max_seq_len = _serving_attention(backend, query, cache, None, max_seq_len, features)
    max_query_len = check_max_len("max_query_len", query_start_loc.diff(), max_query_len, sizes_memory=False)
    if query.shape[0] == 0:
        return torch.empty_like(query)
    return impl.prefill_attention(
        query, cache, query_start_loc, scale, max_query_len, max_seq_len, narrower_window(sliding_window, max_seq_len),
        features,
    )


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    backend: str | KernelBackend = "torch",
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
) -> None:
    """Write `key`/`value` `[num_tokens, kv_heads, head_size]` into the cache at `slot_mapping` (-1
    skipped); an fp8 cache stores them divided by `k_scale` / `v_scale`, clamped and rounded."""
    head_size, block_size = check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    k_scale, v_scale = cache_scales(key_cache, k_scale, v_scale)
    impl = serving_backend(backend, key, head_size, block_size, cache_dtype=key_cache.dtype)
    impl.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)


def copy_blocks(
    key_caches: list[torch.Tensor],
    value_caches: list[torch.Tensor],
    block_mapping: torch.Tensor | Sequence[tuple[int, int]],
    *,
    backend: str | KernelBackend = "torch",
) -> None:
    """Copy-on-write: for every `(src, dst)` pair copy block src to dst in every layer's K and V."""
    if not isinstance(block_mapping, torch.Tensor):
        block_mapping = torch.tensor(list(block_mapping), dtype=torch.int64).reshape(-1, 2)
    head_size, block_size = check_copy_blocks(key_caches, value_caches, block_mapping)
    impl = serving_backend(backend, key_caches[0], head_size, block_size, cache_dtype=key_caches[0].dtype)
    impl.copy_blocks(key_caches, value_caches, block_mapping)


def copy_slots(
    key_caches: list[torch.Tensor],
    value_caches: list[torch.Tensor],
    slot_mapping: torch.Tensor | Sequence[tuple[int, int]],
    *,
    backend: str | KernelBackend = "torch",
) -> None:
    """KV compaction: for every `(src, dst)` pair of token slots (`block * block_size + offset`) copy
    slot src's K and V to slot dst in every layer. Every source is read before any destination is
    written; two pairs must not share a destination."""
    if not isinstance(slot_mapping, torch.Tensor):
        slot_mapping = _pairs(slot_mapping)
    head_size, block_size = check_copy_slots(key_caches, value_caches, slot_mapping)
    impl = serving_backend(backend, key_caches[0], head_size, block_size, cache_dtype=key_caches[0].dtype)
    impl.copy_slots(key_caches, value_caches, slot_mapping)


def _pairs(block_mapping: Sequence[tuple[int, int]]) -> torch.Tensor:
    pairs = list(block_mapping)
    if not pairs:
        return torch.empty((0, 2), dtype=torch.int64)
    return torch.tensor(pairs, dtype=torch.int64)


def swap_blocks(
    src_caches: list[torch.Tensor],
    dst_caches: list[torch.Tensor],
    block_mapping: torch.Tensor | Sequence[tuple[int, int]],
    *,
    backend: str | KernelBackend = "torch",
) -> None:
    """Move KV blocks between two pools (device <-> CPU swap space): for every cache pair i and every
    (src, dst) row of block_mapping, dst_caches[i][dst] = src_caches[i][src].

    The pools hold blocks of the same shape and dtype, in any number; one may be on the CPU and the
    other on a device, or both on one device. The backend runs where the device-side pool is (the
    CPU when both are). The cuda backend copies asynchronously on torch's current stream, as vLLM
    does: its host pool must be pinned, and blocks a swap-out wrote there may be read on the host
    once that stream has been synchronised.
    """
    if not isinstance(block_mapping, torch.Tensor):
        block_mapping = _pairs(block_mapping)
    head_size, block_size = check_swap_blocks(src_caches, dst_caches, block_mapping)
    side = device_side(src_caches, dst_caches)
    impl = serving_backend(backend, side, head_size, block_size, cache_dtype=side.dtype)
    if block_mapping.numel():
        impl.swap_blocks(src_caches, dst_caches, block_mapping)
