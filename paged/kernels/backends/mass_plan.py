"""The attention mass launches of the cuda and emu backends (kernels_cu/attention_mass.cuh): the
`KernelBackend.attention_mass` a scoring press asks for (snapkv, h2o), on the paged cache in place.

Two launches: one block per counted (query row, KV head, sequence) finds each row's log-sum-exp over
the keys it sees, for the G query heads of the KV head; then one thread per (cached key, KV head,
sequence) sums its softmax weights over the counted rows and heads. Every output element has one
writer, so the result is the same on every run. Head and block size are run-time arguments, so one
unit per (query dtype, cache dtype) serves every model.
"""

from __future__ import annotations

import numpy as np
import torch

from paged.kernels.backends.interface import CacheView, require_contiguous
from paged.kernels.backends.launch_api import Launch, Ptr, Runner
from paged.kernels.toolchain.specs import CXX_TYPES, mass_unit
from paged.kernels.transfer import to_device

# kernels_cu/attention_mass.cuh's MASS_THREADS (its block reduction needs this power of two) and
# MASS_MAX_HEAD (the query row it holds in shared memory).
MASS_THREADS = 128
MASS_MAX_HEAD = 256


def unsupported(query: torch.Tensor, cache: CacheView) -> str | None:
    """Why the kernels cannot score these tensors (the backend then scores with torch), or None."""
    if query.dtype not in CXX_TYPES:
        return f"query dtype {query.dtype}"
    if not cache.fp8 and cache.key_cache.dtype != query.dtype:
        return f"a {cache.key_cache.dtype} cache under {query.dtype} queries"
    if cache.head_size > MASS_MAX_HEAD:
        return f"head_size={cache.head_size} > {MASS_MAX_HEAD}"
    return None


def run_attention_mass(
    runner: Runner, query: torch.Tensor, cache: CacheView, query_start_loc: np.ndarray, scale: float,
    last_queries: int | None, soft_cap: float | None,
) -> torch.Tensor:
    """fp32 `[num_seqs, num_kv_heads, max_seq_len]` (`KernelBackend.attention_mass`), `unsupported`
    having found nothing to refuse."""
    key_cache = cache.key_cache
    require_contiguous(key_cache=key_cache)
    device = query.device
    # rows as the kernels index them: row * stride(0) + head * head_size + d
    query = query if query.stride(2) == 1 and query.stride(1) == query.shape[2] else query.contiguous()
    block_tables = cache.block_tables.to(device=device, dtype=torch.int32).contiguous()
    seq_lens = cache.seq_lens.to(device=device, dtype=torch.int32).contiguous()
    host_lens = cache.seq_lens.cpu().numpy()
    starts_host = np.ascontiguousarray(query_start_loc, dtype=np.int32)
    starts = to_device(starts_host, device)
    num_seqs, max_seq_len = host_lens.shape[0], int(host_lens.max())
    counted = np.diff(starts_host.astype(np.int64))
    if last_queries is not None:
        counted = np.minimum(counted, last_queries)
    mass = torch.zeros(num_seqs, cache.num_kv_heads, max_seq_len, dtype=torch.float32, device=device)
    lse = torch.empty(query.shape[0], query.shape[1], dtype=torch.float32, device=device)
    unit = mass_unit(query.dtype, key_cache.dtype if cache.fp8 else None)
    k_scale = cache.k_scale.float().contiguous() if cache.fp8 and cache.k_scale is not None else None
    params = (
        Ptr(query.data_ptr()), Ptr(key_cache.data_ptr()), Ptr(block_tables.data_ptr()), Ptr(seq_lens.data_ptr()),
        Ptr(starts.data_ptr()), np.int32(query.shape[1]), np.int32(cache.num_kv_heads), np.int32(cache.head_size),
        np.int32(key_cache.shape[4]), np.int32(cache.block_size), np.int32(block_tables.shape[1]),
        np.int32(query.stride(0)), np.int32(key_cache.stride(0)), np.int32(key_cache.stride(1)),
        np.float32(scale), np.float32(soft_cap or 0.0), Ptr(0 if k_scale is None else k_scale.data_ptr()),
        np.int32(last_queries or 0),
    )
    launches = [
        Launch(unit.kernels[0], (max(int(counted.max()), 1), cache.num_kv_heads, num_seqs), MASS_THREADS, 0,
               (Ptr(lse.data_ptr()), *params)),
        Launch(unit.kernels[1], (-(-max_seq_len // MASS_THREADS), cache.num_kv_heads, num_seqs), MASS_THREADS, 0,
               (Ptr(mass.data_ptr()), Ptr(lse.data_ptr()), np.int32(max_seq_len), *params)),
    ]
    # what the launches read may go when this returns: torch's allocator hands its memory only to later
    # work on the stream they are queued on
    runner.run(unit, launches)
    return mass
