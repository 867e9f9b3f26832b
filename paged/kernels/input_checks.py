"""Backend-agnostic argument checks, run before any backend so errors name the bad value.

What a particular backend supports (head sizes, block sizes, devices) is its own declaration
(`KernelBackend.unsupported_reason`, the pair of activation and cache dtypes included); here is only
what every backend needs: vLLM's cache layout, model dtypes, matching shapes, one device, caches that
do not overlap. Checks that read tensor values on an accelerator cost a device synchronisation, so
they run only on CPU tensors, except the `max_seq_len` check, which guards shared memory and runs
once per lengths tensor.
"""

from __future__ import annotations

import numbers
import weakref
from collections.abc import Callable

import torch

from paged.config.kernel_options import check_scale
from paged.kernels import step_checks
from paged.kernels.backends.interface import CACHE_DTYPES, DTYPES, CacheView, listing
from paged.kernels.features import FP8_DTYPES, AttentionFeatures, BlockSparse
from paged.kernels.limits import VERSIONS


def _dtype(name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...] = DTYPES) -> None:
    if t.dtype not in allowed:
        raise TypeError(f"{name} has dtype {t.dtype}; supported: {listing(allowed)}")


def _index(name: str, t: torch.Tensor, dtype: torch.dtype, ndim: int) -> None:
    if t.dtype != dtype or t.dim() != ndim:
        raise TypeError(f"{name} must be a {ndim}-d {dtype} tensor, got {t.dim()}-d {t.dtype}")


def _same_device(*named: tuple[str, torch.Tensor]) -> None:
    devices = {t.device for _, t in named}
    if len(devices) > 1:
        listed = ", ".join(f"{n} on {t.device}" for n, t in named)
        raise ValueError(f"tensors must share one device: {listed}")


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes `[start, end)` that `t`'s elements occupy."""
    if t.numel() == 0:
        return t.data_ptr(), t.data_ptr()
    last = sum((n - 1) * stride for n, stride in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def check_disjoint(*named: tuple[str, torch.Tensor]) -> None:
    """Tensors a kernel writes must not share memory with each other or with what it reads."""
    # Meta tensors have no memory to overlap.
    spans = sorted((*_span(t), name) for name, t in named if t.numel() and not t.is_meta)
    for (a0, a1, a), (b0, b1, b) in zip(spans, spans[1:]):
        if b0 < a1:
            raise ValueError(f"{a} and {b} overlap in memory ([{a0:#x}, {a1:#x}) and [{b0:#x}, {b1:#x})); "
                             "they must be separate tensors")


def check_cache_pair(key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """Returns (num_blocks, num_kv_heads, head_size, block_size) of a valid K/V cache pair."""
    _dtype("key_cache", key_cache, CACHE_DTYPES)
    if key_cache.dim() != 5:
        raise ValueError(
            f"key_cache must be [num_blocks, num_kv_heads, head_size/x, block_size, x], got {tuple(key_cache.shape)}"
        )
    num_blocks, num_kv_heads, d_over_x, block_size, x = key_cache.shape
    expected_x = 16 // key_cache.element_size()
    if x != expected_x:
        raise ValueError(f"key_cache last dim x={x}, expected 16 // element_size = {expected_x}")
    head_size = d_over_x * x
    expected_v = (num_blocks, num_kv_heads, head_size, block_size)
    if tuple(value_cache.shape) != expected_v:
        raise ValueError(
            f"value_cache shape {tuple(value_cache.shape)} does not match key_cache; expected {expected_v}"
        )
    if value_cache.dtype != key_cache.dtype:
        raise TypeError(f"value_cache dtype {value_cache.dtype} != key_cache dtype {key_cache.dtype}")
    _same_device(("key_cache", key_cache), ("value_cache", value_cache))
    check_disjoint(("key_cache", key_cache), ("value_cache", value_cache))
    return num_blocks, num_kv_heads, head_size, block_size


def _check_attention(query: torch.Tensor, cache: CacheView, rows: str) -> None:
    """What decode and prefill share; `rows` names query's first dimension."""
    _, num_kv_heads, head_size, _ = check_cache_pair(cache.key_cache, cache.value_cache)
    # a model dtype; one other than the cache's is a pair the backend serves or refuses (unsupported_reason)
    _dtype("query", query)
    if query.dim() != 3 or query.shape[2] != head_size:
        raise ValueError(f"query must be [{rows}, num_heads, {head_size}], got {tuple(query.shape)}")
    if query.shape[1] % num_kv_heads:
        raise ValueError(f"num_heads={query.shape[1]} is not a multiple of num_kv_heads={num_kv_heads}")
    _index("block_tables", cache.block_tables, torch.int32, 2)
    _index("seq_lens", cache.seq_lens, torch.int32, 1)
    _same_device(("query", query), ("key_cache", cache.key_cache), ("block_tables", cache.block_tables),
                 ("seq_lens", cache.seq_lens))


def check_paged_attention(query: torch.Tensor, cache: CacheView, version: str, partition_size: int) -> None:
    if version not in VERSIONS:
        raise ValueError(f"version={version!r} is not supported; allowed: {listing(VERSIONS)}")
    _check_attention(query, cache, "num_seqs")
    num_seqs, tables, lens = query.shape[0], cache.block_tables.shape[0], cache.seq_lens.shape[0]
    if tables != num_seqs or lens != num_seqs:
        raise ValueError(
            f"query has {num_seqs} sequences but block_tables has {tables} rows and seq_lens {lens} entries"
        )
    if partition_size <= 0 or partition_size % cache.block_size:
        raise ValueError(
            f"partition_size={partition_size} must be a positive multiple of block_size={cache.block_size}"
        )


def check_prefill_attention(query: torch.Tensor, cache: CacheView, query_start_loc: torch.Tensor) -> None:
    _check_attention(query, cache, "num_tokens")
    _index("query_start_loc", query_start_loc, torch.int32, 1)
    num_seqs = cache.seq_lens.shape[0]
    if cache.block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables has {cache.block_tables.shape[0]} rows for {num_seqs} sequences")
    if query_start_loc.shape[0] != num_seqs + 1:
        raise ValueError(f"query_start_loc has {query_start_loc.shape[0]} entries for {num_seqs} sequences; "
                         f"expected {num_seqs + 1}")
    _same_device(("query", query), ("query_start_loc", query_start_loc))


def check_query_offsets(query: torch.Tensor, cache: CacheView, query_start_loc: torch.Tensor) -> None:
    """The values of `query_start_loc` against the query and the lengths, where reading them
    costs no device synchronisation (a planned op checks them on their host copies instead)."""
    if query_start_loc.device.type == "cpu":
        step_checks.check_offsets(query_start_loc.numpy(), cache.seq_lens.numpy(), query.shape[0])


def check_sliding_window(sliding_window: int | None) -> int | None:
    """`sliding_window` as an int, or `None` for attention over the whole context."""
    if sliding_window is None:
        return None
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, numbers.Integral) or sliding_window <= 0:
        raise ValueError(f"sliding_window={sliding_window!r} is not allowed; it must be None (the whole context) "
                         "or a positive int (the tokens a query attends to, itself included)")
    return int(sliding_window)


# id(lengths) -> (a weak reference to it, its version counter, its maximum): the model passes one
# lengths tensor to every layer, so a step pays for one device sync, not one per layer.
_MAX_LENS: dict[int, tuple[weakref.ref[torch.Tensor], int, int]] = {}


def _version(t: torch.Tensor) -> int:
    # Inference-mode tensors keep no version counter; the executor builds new ones every step.
    return -1 if t.is_inference() else t._version


def _max_of(lengths: torch.Tensor) -> int:
    key = id(lengths)
    known = _MAX_LENS.get(key)
    if known is not None and known[0]() is lengths and known[1] == _version(lengths):
        return known[2]
    if lengths.is_cuda and torch.cuda.is_current_stream_capturing():
        raise ValueError("max_seq_len cannot be checked while a CUDA graph is being captured (it reads the "
                         "lengths); run the op once with the same lengths tensor before capturing")
    longest = int(lengths.max())
    _MAX_LENS[key] = (weakref.ref(lengths, lambda _: _MAX_LENS.pop(key, None)), _version(lengths), longest)
    return longest


def check_max_len(name: str, lengths: torch.Tensor, given: int | None, *, sizes_memory: bool = True) -> int:
    """`given`, checked against `lengths`, else `lengths.max()`. A value that `sizes_memory` (shared
    memory, scratch buffers) is checked on every device, where an understated one would overflow
    it; other values only where the check needs no device sync."""
    if not lengths.numel():
        return 0 if given is None else given
    if given is not None and not sizes_memory and not lengths.is_cpu:
        return given
    longest = _max_of(lengths)
    if given is None:
        return longest
    if longest > given:
        raise ValueError(f"{name}={given} is below the longest sequence ({longest})")
    return given


def check_table_covers(cache: CacheView, max_seq_len: int) -> None:
    step_checks.check_covers(cache.block_tables.shape[1], cache.block_size, max_seq_len)


def check_reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[int, int]:
    """Returns (head_size, block_size)."""
    _, num_kv_heads, head_size, block_size = check_cache_pair(key_cache, value_cache)
    expected = (key.shape[0], num_kv_heads, head_size)
    if key.dim() != 3 or tuple(key.shape) != expected or tuple(value.shape) != expected:
        raise ValueError(
            f"key/value must be [num_tokens, {num_kv_heads}, {head_size}], "
            f"got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    _dtype("key", key)
    if value.dtype != key.dtype:
        raise TypeError(f"value dtype {value.dtype} != key dtype {key.dtype}")
    _index("slot_mapping", slot_mapping, torch.int64, 1)
    if slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {key.shape[0]} tokens")
    _same_device(("key", key), ("value", value), ("key_cache", key_cache), ("slot_mapping", slot_mapping))
    check_disjoint(("key_cache", key_cache), ("value_cache", value_cache), ("key", key))
    check_disjoint(("key_cache", key_cache), ("value_cache", value_cache), ("value", value))
    return head_size, block_size


def check_copy_blocks(
    key_caches: list[torch.Tensor], value_caches: list[torch.Tensor], block_mapping: torch.Tensor
) -> tuple[int, int]:
    """Returns (head_size, block_size)."""
    if len(key_caches) != len(value_caches) or not key_caches:
        raise ValueError(
            f"need one key and one value cache per layer, got {len(key_caches)} and {len(value_caches)}"
        )
    num_blocks, _, head_size, block_size = check_cache_pair(key_caches[0], value_caches[0])
    for k, v in zip(key_caches, value_caches):
        if k.shape != key_caches[0].shape or check_cache_pair(k, v)[0] != num_blocks:
            raise ValueError("all layers' caches must have the same shape")
    named = [(f"key_caches[{i}]", k) for i, k in enumerate(key_caches)]
    check_disjoint(*named, *[(f"value_caches[{i}]", v) for i, v in enumerate(value_caches)])
    if block_mapping.dtype != torch.int64 or block_mapping.dim() != 2 or block_mapping.shape[1] != 2:
        raise TypeError(f"block_mapping must be an int64 [num_pairs, 2] tensor, got {block_mapping.dtype} "
                        f"{tuple(block_mapping.shape)}")
    if block_mapping.numel() and (int(block_mapping.min()) < 0 or int(block_mapping.max()) >= num_blocks):
        raise ValueError(f"block_mapping ids must be in [0, {num_blocks}), got {block_mapping.tolist()}")
    return head_size, block_size


def check_copy_slots(
    key_caches: list[torch.Tensor], value_caches: list[torch.Tensor], slot_mapping: torch.Tensor
) -> tuple[int, int]:
    """`check_copy_blocks` for a mapping of token slots; returns (head_size, block_size)."""
    no_blocks = torch.empty((0, 2), dtype=torch.int64)
    head_size, block_size = check_copy_blocks(key_caches, value_caches, no_blocks)
    if slot_mapping.dtype != torch.int64 or slot_mapping.dim() != 2 or slot_mapping.shape[1] != 2:
        raise TypeError(f"slot_mapping must be an int64 [num_pairs, 2] tensor, got {slot_mapping.dtype} "
                        f"{tuple(slot_mapping.shape)}")
    num_slots = key_caches[0].shape[0] * block_size
    if slot_mapping.numel() and (int(slot_mapping.min()) < 0 or int(slot_mapping.max()) >= num_slots):
        raise ValueError(f"slot_mapping slots must be in [0, {num_slots}), got min {int(slot_mapping.min())} and "
                         f"max {int(slot_mapping.max())}")
    return head_size, block_size


def _block_geometry(name: str, cache: torch.Tensor) -> tuple[int, int]:
    """(head_size, block_size) of a key or a value cache."""
    if cache.dim() == 5:
        return cache.shape[2] * cache.shape[4], cache.shape[3]
    if cache.dim() == 4:
        return cache.shape[2], cache.shape[3]
    raise ValueError(f"{name} must be a key cache [num_blocks, num_kv_heads, head_size/x, block_size, x] or a value "
                     f"cache [num_blocks, num_kv_heads, head_size, block_size], got shape {tuple(cache.shape)}")


def _pool_blocks(name: str, caches: list[torch.Tensor]) -> int:
    """The number of blocks of caches that form one pool: one device, one number of blocks."""
    _same_device(*[(f"{name}[{i}]", c) for i, c in enumerate(caches)])
    counts = [c.shape[0] for c in caches]
    if len(set(counts)) > 1:
        raise ValueError(f"{name} form one pool and must hold the same number of blocks, got {counts}")
    return counts[0]


def _check_swap_mapping(block_mapping: torch.Tensor, src_blocks: int, dst_blocks: int) -> None:
    if block_mapping.dtype != torch.int64 or block_mapping.dim() != 2 or block_mapping.shape[1] != 2:
        raise ValueError(f"block_mapping must be an int64 [num_pairs, 2] tensor of (src, dst) rows or a list of "
                         f"(src, dst) pairs, got a {block_mapping.dtype} tensor of shape {tuple(block_mapping.shape)}")
    if block_mapping.device.type != "cpu":
        raise ValueError(f"block_mapping must be on the CPU (the copies are planned on the host), "
                         f"got it on {block_mapping.device}")
    for column, (side, num_blocks) in enumerate((("source", src_blocks), ("destination", dst_blocks))):
        ids = block_mapping[:, column]
        bad = ids[(ids < 0) | (ids >= num_blocks)]
        if bad.numel():
            raise ValueError(f"block_mapping {side} ids must be in [0, {num_blocks}), got {bad.tolist()}")
    dst, counts = block_mapping[:, 1].unique(return_counts=True)
    repeated = dst[counts > 1]
    if repeated.numel():
        raise ValueError(f"block_mapping writes destination block(s) {repeated.tolist()} more than once; "
                         "each destination may be written once")


def check_swap_blocks(
    src_caches: list[torch.Tensor], dst_caches: list[torch.Tensor], block_mapping: torch.Tensor
) -> tuple[int, int]:
    """Returns (head_size, block_size) of the first cache."""
    if not src_caches or len(src_caches) != len(dst_caches):
        raise ValueError(f"need one destination cache per source cache, and at least one, got {len(src_caches)} "
                         f"source and {len(dst_caches)} destination caches")
    for i, (src, dst) in enumerate(zip(src_caches, dst_caches)):
        _block_geometry(f"src_caches[{i}]", src)
        if dst.dtype != src.dtype or dst.shape[1:] != src.shape[1:]:
            raise ValueError(f"dst_caches[{i}] holds {dst.dtype} blocks of shape {tuple(dst.shape[1:])} but "
                             f"src_caches[{i}] {src.dtype} blocks of shape {tuple(src.shape[1:])}; both pools must "
                             "hold blocks of the same shape and dtype")
    src_blocks, dst_blocks = _pool_blocks("src_caches", src_caches), _pool_blocks("dst_caches", dst_caches)
    src_device, dst_device = src_caches[0].device, dst_caches[0].device
    if src_device != dst_device and "cpu" not in (src_device.type, dst_device.type):
        raise ValueError(f"src_caches are on {src_device} and dst_caches on {dst_device}; a swap moves blocks "
                         "between one device and the CPU, or within one device")
    writes = [(f"dst_caches[{i}]", c) for i, c in enumerate(dst_caches)]
    reads = [(f"src_caches[{i}]", c) for i, c in enumerate(src_caches)] if src_device == dst_device else []
    check_disjoint(*writes, *reads)
    _check_swap_mapping(block_mapping, src_blocks, dst_blocks)
    return _block_geometry("src_caches[0]", src_caches[0])


# id(tensor) -> (a weak reference to it, its version counter) of the scale and slope tensors whose
# values passed their check: the executor hands the same ones to every layer of every step, and a
# check costs ~15 µs, so each is read once.
_CHECKED: dict[int, tuple[weakref.ref[torch.Tensor], int]] = {}


def _check_values_once(t: torch.Tensor, check: Callable[[torch.Tensor], None]) -> None:
    """`check(t)` unless `t`, unchanged, passed it before. Device values cost a sync to read, so
    like the other value checks it runs on CPU tensors only."""
    key = id(t)
    known = _CHECKED.get(key)
    if not t.is_cpu or (known is not None and known[0]() is t and known[1] == _version(t)):
        return
    check(t)
    _CHECKED[key] = (weakref.ref(t, lambda _: _CHECKED.pop(key, None)), _version(t))


def _positive_finite(name: str) -> Callable[[torch.Tensor], None]:
    def check(t: torch.Tensor) -> None:
        if not bool((torch.isfinite(t) & (t > 0)).all()):
            raise ValueError(f"{name}={t.tolist()} must be finite numbers > 0")
    return check


def _finite(name: str) -> Callable[[torch.Tensor], None]:
    def check(t: torch.Tensor) -> None:
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"{name} must be finite, got {t.tolist()}")
    return check


def _kv_scale(name: str, scale: float | torch.Tensor | None, num_kv_heads: int, device: torch.device) -> torch.Tensor:
    """fp32 `[num_kv_heads]` on `device`: a per-tensor scale repeated, or per-head scales checked.
    `None` is 1 (an fp8 cache without calibration stores values as they are)."""
    if scale is None:
        return torch.ones(num_kv_heads, dtype=torch.float32, device=device)
    if not isinstance(scale, torch.Tensor):
        check_scale(name, scale)
        return torch.full((num_kv_heads,), float(scale), dtype=torch.float32, device=device)
    if scale.numel() != 1 and tuple(scale.shape) != (num_kv_heads,):
        raise ValueError(f"{name} has shape {tuple(scale.shape)}; expected one scale per tensor or "
                         f"[num_kv_heads={num_kv_heads}]")
    _check_values_once(scale, _positive_finite(name))
    return scale.detach().float().reshape(-1).expand(num_kv_heads).to(device).contiguous()


def cache_scales(
    key_cache: torch.Tensor, k_scale: float | torch.Tensor | None, v_scale: float | torch.Tensor | None
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """fp32 `[num_kv_heads]` scales on the cache's device for an fp8 cache (1 where not given);
    scales for any other cache are an error, since nothing would apply them."""
    if key_cache.dtype not in FP8_DTYPES:
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"k_scale/v_scale apply to fp8 KV caches only; this cache is {key_cache.dtype}")
        return None, None
    num_kv_heads = key_cache.shape[1]
    return (_kv_scale("k_scale", k_scale, num_kv_heads, key_cache.device),
            _kv_scale("v_scale", v_scale, num_kv_heads, key_cache.device))


def check_features(
    query: torch.Tensor, block_size: int, alibi_slopes: torch.Tensor | None, blocksparse: BlockSparse | None,
    soft_cap: float | None = None,
) -> AttentionFeatures:
    """ALiBi slopes as fp32 `[num_heads]` on the query's device, a block-sparse pattern whose
    sparse blocks hold whole cache blocks, and a positive finite soft-cap."""
    if soft_cap is not None and (isinstance(soft_cap, bool) or not isinstance(soft_cap, int | float)
                                 or not 0 < soft_cap < float("inf")):
        raise ValueError(f"soft_cap={soft_cap!r} must be a positive finite number or None")
    if alibi_slopes is not None:
        num_heads = query.shape[1]
        if not isinstance(alibi_slopes, torch.Tensor) or alibi_slopes.dim() != 1 or alibi_slopes.numel() != num_heads:
            shape = tuple(alibi_slopes.shape) if isinstance(alibi_slopes, torch.Tensor) else type(alibi_slopes).__name__
            raise ValueError(f"alibi_slopes must be a 1-d tensor of num_heads={num_heads} slopes, got {shape}")
        _same_device(("query", query), ("alibi_slopes", alibi_slopes))
        _check_values_once(alibi_slopes, _finite("alibi_slopes"))
        alibi_slopes = alibi_slopes.float().contiguous()
    if blocksparse is not None:
        blocksparse.check(block_size)
    return AttentionFeatures(alibi_slopes, blocksparse, None if soft_cap is None else float(soft_cap))
