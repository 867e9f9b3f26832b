"""The cpu backend: native C++/OpenMP decode and prefill attention and block swaps (kernels_cu/cpu/).

Attention reads K/V straight from the paged cache through the block tables, so unlike the torch
reference it makes no gathered or permuted copies; a swap is one memcpy per cache and block pair.
It implements every cache dtype (fp8 with its scales) and attention feature (ALiBi, block-sparse)
of `paged.kernels.features`. Decode v3 splits each (sequence, KV head) into the KV splits of a
`paged.kernels.split_plan` plan, made once per step for the OpenMP threads (`decode_workspace`).
The library is built with the host compiler (`$CXX`, else `g++`) into the on-disk kernel cache,
keyed by the sources' hash, the compiler, the flags and the CPU, and loaded once per process
through ctypes. It targets this CPU (`-march=native`); `PAGED_CPU_MARCH` names another target (e.g.
`x86-64-v3`: AVX2 without AVX-512) to run the code paths of a CPU one does not have.
`attention_mass` and `copy_slots` (for the KV presses) are native too. Attention reads any float
cache dtype under any query dtype (a bf16 model over an fp32 cache, `kernel.kv_cache_dtype`).
`reshape_and_cache` is native for float caches, a copy in the activations' dtype or a converting
write into another (fp8 caches use the torch reference's quantising writer), `copy_blocks` is the
torch reference's. The same library holds the model's fused layer ops, which
`paged.kernels.layer_ops` calls.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import math
import os
import platform
import re
import threading
from functools import cache
from pathlib import Path

import numpy as np
import torch

from paged.kernels.backends.interface import CACHE_DTYPES, KERNEL_FEATURES, CacheView, require_contiguous
from paged.kernels.backends.torch_ref import TorchBackend
from paged.kernels.features import FP8_DTYPES, NONE, AttentionFeatures
from paged.kernels.limits import BLOCK_SIZES
from paged.kernels.split_plan import MAX_SPLITS, Hardware, SplitPlan, plan_splits
from paged.kernels.toolchain import host_compiler
from paged.kernels.toolchain.cache_dir import ArtifactCache
from paged.kernels.toolchain.source import source_dir

log = logging.getLogger(__name__)

SOURCE_DIR = "cpu"
MAIN = f"{SOURCE_DIR}/paged_attention_cpu.cpp"
# -fno-trapping-math lets the vectoriser evaluate both arms of a select (no FP traps are enabled);
# unlike -ffast-math it changes no result.
FLAGS = ("-std=c++17", "-O3", "-fno-trapping-math", "-fopenmp", "-fPIC", "-shared")
# common.h's DType codes: the query's and the cache's.
_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float8_e4m3fn: 3, torch.float8_e5m2: 4}
_STATUS = {
    1: f"block_size must be one of {BLOCK_SIZES}",
    2: "num_heads must be a multiple of num_kv_heads",
    3: "head_size must be a positive multiple of x = 16 // element_size",
    4: "partition_size must be a positive multiple of block_size",
    6: "the thread count must be positive",
    7: "unsupported dtype",
    8: "the kv cache dtype must be float32, float16 or bfloat16, or fp8 with k_scale and v_scale",
    9: "blocksparse needs local_blocks, vert_stride and block_size > 0, block_size a multiple of the cache's",
    10: "slot_mapping holds a slot >= num_blocks * block_size",
    11: "positions holds a position outside the cos/sin tables",
    12: "sizes must be positive (head_dim even) and exp_lanes 0, 8 or 16",
    13: f"the v3 split plan needs 1 <= num_splits <= {MAX_SPLITS} and split_blocks >= 1",
    14: "the v3 split plan's splits cannot hold the blocks a row of max_seq_len attends to",
    15: "the packed linear needs out_features a multiple of 16 (and in_features even in bf16)",
}
# v3 work items per OpenMP thread the planner aims for when it splits: with a few each, dynamic
# scheduling evens out the threads (one item per thread leaves them idle on a remainder).
V3_SLOTS_PER_THREAD = 8
# PAGED_CPU_COMMON_ARGS: dtypes, out, query and its strides, caches, block tables and their stride,
# seq_lens, the sizes, scale, sliding window, fp8 scales, ALiBi slopes, the four block-sparse ints.
_COMMON_ARGS = [
    ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
    ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_int,
    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
]
_Int64s = ctypes.POINTER(ctypes.c_int64)
_SIGNATURES = {
    # version, partition_size, max_seq_len, num_threads
    "paged_attention_cpu": [*_COMMON_ARGS, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int],
    # num_splits, split_blocks, max_seq_len, num_threads
    "paged_attention_v3_cpu": [*_COMMON_ARGS, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int],
    # query_start_loc, max_query_len, num_threads
    "prefill_attention_cpu": [*_COMMON_ARGS, ctypes.c_void_p, ctypes.c_int, ctypes.c_int],
    # query_start_loc, last_queries (0: all), max_seq_len, soft_cap (0: none), num_threads; `out` is the fp32 mass
    "attention_mass_cpu": [*_COMMON_ARGS, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_int],
    # element size, num_layers, key cache addresses, value cache addresses, slot_mapping, num_pairs, num_heads,
    # head_size, block_size, num_threads
    "copy_slots_cpu": [ctypes.c_int, ctypes.c_int, _Int64s, _Int64s, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int,
                       ctypes.c_int, ctypes.c_int, ctypes.c_int],
    # num_caches, src cache addresses, dst cache addresses, bytes per block, mapping, num_pairs, num_threads
    "swap_blocks_cpu": [ctypes.c_int, _Int64s, _Int64s, _Int64s, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int],
    # Layer ops (paged/kernels/layer_ops.py). out, out row stride, x, x row stride, weight, rows, hidden, eps,
    # num_threads
    "rms_norm_cpu": [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                     ctypes.c_int64, ctypes.c_int64, ctypes.c_float, ctypes.c_int],
    # The packed linear (paged/kernels/packed_linear.py), kind 0 fp32 / 1 bf16: lanes (0: not built for this
    # CPU); kind, weight, out_features, in_features, packed; kind, y, y row stride, x, x row stride, packed, rows,
    # out_features, in_features, num_threads
    "gemm_packed_lanes_cpu": [ctypes.c_int],
    "gemm_pack_cpu": [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p],
    "gemm_packed_cpu": [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                        ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int],
    # x, x row stride, residual, residual row stride, weight, rows, hidden, eps, num_threads
    "add_rms_norm_cpu": [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                         ctypes.c_int64, ctypes.c_int64, ctypes.c_float, ctypes.c_int],
    # out, out row stride, x, x row stride, rows, intermediate size, exp_lanes, num_threads
    "silu_and_mul_cpu": [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                         ctypes.c_int64, ctypes.c_int, ctypes.c_int],
    # out (int64), logits (fp32), logits row stride, rows, columns, num_threads
    "argmax_rows_cpu": [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int],
    # qk, row stride, positions, cos, sin, rows, table positions, num_heads, head_dim, num_threads
    "rotary_embedding_cpu": [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                             ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int],
    # The same ops on bf16 tensors; silu_and_mul_bf16_cpu has no exp_lanes.
    "rms_norm_bf16_cpu": [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                          ctypes.c_int64, ctypes.c_int64, ctypes.c_float, ctypes.c_int],
    "add_rms_norm_bf16_cpu": [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                              ctypes.c_int64, ctypes.c_int64, ctypes.c_float, ctypes.c_int],
    "silu_and_mul_bf16_cpu": [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                              ctypes.c_int64, ctypes.c_int],
    "rotary_embedding_bf16_cpu": [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                  ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int,
                                  ctypes.c_int],
    # element size, key, key strides[3], value, value strides[3], key cache, value cache, slot_mapping,
    # num_tokens, num_blocks * block_size, num_kv_heads, head_size, block_size, num_threads
    # dtypes (activations, cache), then reshape_and_cache_cpu's arguments from key on
    "convert_and_cache_cpu": [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, _Int64s, ctypes.c_void_p, _Int64s,
                              ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                              ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int],
    "reshape_and_cache_cpu": [ctypes.c_int, ctypes.c_void_p, _Int64s, ctypes.c_void_p, _Int64s, ctypes.c_void_p,
                              ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
                              ctypes.c_int, ctypes.c_int, ctypes.c_int],
    # A Llama decode step's layers (paged/model/decode_layers.py): kind, num_layers, rows, hidden, num_heads,
    # num_kv_heads, head_dim, intermediate size; x, residual, the qkv / attention / gate_up / activation scratch;
    # per-layer addresses of the qkv, o, gate_up and down packed weights, the mlp and next norms, the key and value
    # caches; eps, positions, cos, sin, table positions; slot_mapping, num_slots, block_size, block_tables, their
    # stride, seq_lens, scale, num_splits, split_blocks, max_seq_len, exp_lanes, num_threads
    "decode_layers_cpu": [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_int64, *[ctypes.c_void_p] * 6, *[ctypes.c_void_p] * 8, ctypes.c_float,
                          ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                          ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                          ctypes.c_float, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int],
}

_CACHE = ArtifactCache("cpu", ".so")
_LOCK = threading.Lock()
_library: ctypes.CDLL | None = None


def _host_id() -> str:
    """-march=native output depends on the CPU, so a shared cache directory keys on its features."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        flags = next((line for line in text.splitlines() if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return f"{platform.machine()}:{hashlib.sha256(flags.encode()).hexdigest()[:16]}"


def _sources_hash(root: Path) -> str:
    digest = hashlib.sha256()
    for file in sorted(f for f in (root / SOURCE_DIR).iterdir() if f.suffix in (".h", ".cpp")):
        digest.update(file.name.encode() + b"\0" + file.read_bytes() + b"\0")
    return digest.hexdigest()


def march() -> str:
    """The `-march` the library is built for: `PAGED_CPU_MARCH`, else `native`."""
    value = os.environ.get("PAGED_CPU_MARCH", "native")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.+-]*", value):
        raise ValueError(f"PAGED_CPU_MARCH={value!r} is not a -march value (native, x86-64-v3, x86-64-v4, ...)")
    return value


def build() -> Path:
    """Builds (or finds in the cache) the shared library; raises with the reason on failure."""
    root = source_dir()
    return host_compiler.build(
        _CACHE, f'#include "{MAIN}"\n', (*FLAGS, f"-march={march()}"), include_dir=root,
        key_parts=[_sources_hash(root), _host_id()],
    )


def load() -> ctypes.CDLL:
    """The loaded library, built on first use and cached for the process."""
    global _library
    with _LOCK:
        if _library is None:
            library = ctypes.CDLL(str(build()))
            for name, argtypes in _SIGNATURES.items():
                fn = getattr(library, name)
                fn.argtypes = argtypes
                fn.restype = ctypes.c_int
            _library = library
        return _library


@cache
def _load_failure() -> str | None:
    """Why the library does not build or load here, checked once per process; logged as a warning."""
    try:
        load()
    except Exception as exc:  # noqa: BLE001 - any failure means: this backend cannot run
        log.warning("native cpu attention unavailable: %s", exc)
        return str(exc)
    return None


def _call(
    entry: str, query: torch.Tensor, cache: CacheView, scale: float, sliding_window: int | None,
    features: AttentionFeatures, *tail: object, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Runs a library entry point on `PAGED_CPU_COMMON_ARGS` followed by `tail`, into `out` (a new
    tensor like the query when not given)."""
    # No-op copies for the executor's tensors: caches are allocated contiguous, index tensors fresh.
    key_cache, value_cache, block_tables, seq_lens = (
        t.contiguous() for t in (cache.key_cache, cache.value_cache, cache.block_tables, cache.seq_lens)
    )
    # The fp8 cache's scales and the ALiBi slopes, fp32 vectors or null.
    vectors = [None if t is None else t.float().contiguous()
               for t in (cache.k_scale, cache.v_scale, features.alibi_slopes)]
    sparse = features.blocksparse
    sparse_ints = (0, 0, 0, 0) if sparse is None else (
        sparse.local_blocks, sparse.vert_stride, sparse.block_size, sparse.head_sliding_step
    )
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype)
    status = getattr(load(), entry)(
        _DTYPES[query.dtype], _DTYPES[key_cache.dtype], out.data_ptr(), query.data_ptr(), *query.stride(),
        key_cache.data_ptr(), value_cache.data_ptr(), block_tables.data_ptr(), block_tables.stride(0),
        seq_lens.data_ptr(), seq_lens.shape[0], query.shape[1], cache.num_kv_heads, cache.head_size,
        cache.block_size, float(scale), sliding_window or 0, *(None if t is None else t.data_ptr() for t in vectors),
        *sparse_ints, *tail,
    )
    check_status(entry, status)
    return out


def check_status(entry: str, status: int) -> None:
    """Raises naming the entry point and why where the library refused a call (status != 0)."""
    if status:
        raise ValueError(f"cpu {entry} refused its arguments: {_STATUS.get(status, status)}")


def _addresses(values: list[int]) -> ctypes.Array[ctypes.c_int64]:
    return (ctypes.c_int64 * len(values))(*values)


class CpuBackend(TorchBackend):
    """Native decode and prefill attention, swaps, slot copies, attention mass and (non-fp8) cache
    writes; `copy_blocks` and fp8 cache writes are the torch reference's."""

    name = "cpu"
    description = "native C++/OpenMP"
    device_type = "cpu"
    block_sizes = BLOCK_SIZES
    cache_dtypes = CACHE_DTYPES
    converts_cache_dtype = True
    features = KERNEL_FEATURES

    def unavailable_reason(self) -> str | None:
        return _load_failure()

    def decode_workspace(
        self, num_seqs: int, num_heads: int, num_kv_heads: int, head_size: int, block_size: int, version: str,
        partition_size: int, max_seq_len: int, sliding_window: int | None, device: torch.device,
        cache_dtype: torch.dtype | None = None, num_splits: int | None = None, num_stages: int | None = None,
    ) -> SplitPlan | None:
        """v3's split plan for the step over a `cache_dtype` cache (None: 16-bit; the kernel
        allocates its small merge scratch per call), `num_splits` splits where given; `None` for
        v1 and v2. The native v3 prefetches its tiles itself: it has no pipeline depth to force."""
        if num_stages is not None:
            raise ValueError(f"num_stages={num_stages} forces a CUDA v3 pipeline, which backend='cpu' does not run; "
                             f"allowed: None")
        if version != "v3":
            return None
        element = 2 if cache_dtype is None else cache_dtype.itemsize
        return plan_splits(num_seqs, num_kv_heads, max_seq_len, block_size,
                           Hardware(torch.get_num_threads(), V3_SLOTS_PER_THREAD), sliding_window=sliding_window,
                           num_splits=num_splits, kv_bytes_per_token=2 * head_size * element)

    def paged_attention(
        self, query: torch.Tensor, cache: CacheView, scale: float, version: str, partition_size: int, max_seq_len: int,
        sliding_window: int | None, features: AttentionFeatures = NONE, workspace: object = None,
    ) -> torch.Tensor:
        """v3 runs `workspace`'s split plan, else plans one for these rows."""
        if version == "v3":
            plan = workspace
            if plan is None:
                plan = self.decode_workspace(query.shape[0], query.shape[1], cache.num_kv_heads, cache.head_size,
                                             cache.block_size, version, partition_size, max_seq_len, sliding_window,
                                             query.device, cache.key_cache.dtype)
            if not isinstance(plan, SplitPlan) or plan.block_size != cache.block_size:
                raise ValueError(f"cpu v3 needs a SplitPlan for block_size={cache.block_size}, got {plan!r}")
            return _call("paged_attention_v3_cpu", query, cache, scale, sliding_window, features, plan.num_splits,
                         plan.split_blocks, max_seq_len, torch.get_num_threads())
        version_number = 1 if version == "v1" else 2
        return _call("paged_attention_cpu", query, cache, scale, sliding_window, features, version_number,
                     partition_size, max_seq_len, torch.get_num_threads())

    def prefill_attention(
        self, query: torch.Tensor, cache: CacheView, query_start_loc: torch.Tensor, scale: float, max_query_len: int,
        max_seq_len: int, sliding_window: int | None, features: AttentionFeatures = NONE, plan: object = None,
    ) -> torch.Tensor:
        query_start_loc = query_start_loc.contiguous()
        # `query_start_loc` must outlive the call: `_call` only holds its address.
        return _call("prefill_attention_cpu", query, cache, scale, sliding_window, features,
                     query_start_loc.data_ptr(), max_query_len, torch.get_num_threads())

    def attention_mass(
        self, query: torch.Tensor, cache: CacheView, query_start_loc: np.ndarray, scale: float,
        last_queries: int | None = None, soft_cap: float | None = None,
    ) -> torch.Tensor:
        """Native over the paged cache in place, in parallel over (sequence, KV head)."""
        max_seq_len = int(cache.seq_lens.max())
        mass = torch.zeros(cache.seq_lens.shape[0], cache.num_kv_heads, max_seq_len, dtype=torch.float32)
        starts = torch.from_numpy(np.ascontiguousarray(query_start_loc, dtype=np.int32))
        return _call("attention_mass_cpu", query, cache, scale, None, NONE, starts.data_ptr(), last_queries or 0,
                     max_seq_len, soft_cap or 0.0, torch.get_num_threads(), out=mass)

    def copy_slots(
        self, key_caches: list[torch.Tensor], value_caches: list[torch.Tensor], slot_mapping: torch.Tensor
    ) -> None:
        """Native, the layers in parallel: each layer's sources gathered, then its destinations written."""
        if slot_mapping.numel() == 0:
            return
        for i, (k, v) in enumerate(zip(key_caches, value_caches)):
            require_contiguous(**{f"key_caches[{i}]": k, f"value_caches[{i}]": v})
        mapping = slot_mapping.contiguous()
        _, num_heads, _, block_size, _ = key_caches[0].shape
        status = load().copy_slots_cpu(
            key_caches[0].element_size(), len(key_caches), _addresses([c.data_ptr() for c in key_caches]),
            _addresses([c.data_ptr() for c in value_caches]), mapping.data_ptr(), mapping.shape[0], num_heads,
            value_caches[0].shape[2], block_size, torch.get_num_threads(),
        )
        check_status("copy_slots_cpu", status)

    def reshape_and_cache(
        self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
        slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
        has_padding: bool = True,
    ) -> None:
        """A bit copy per element (or, into a cache of another float dtype, a conversion rounding as
        torch's `.to`), in parallel over tokens; key/value may have any strides. Slots < 0 are skipped;
        of two tokens given one slot, which lands is unspecified (as with torch's index_put). fp8
        (quantising) and non-contiguous caches go to the torch reference."""
        if (key_cache.dtype in FP8_DTYPES or value.dtype != key.dtype or slot_mapping.dtype != torch.int64
                or not (key_cache.is_contiguous() and value_cache.is_contiguous())):
            super().reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, has_padding)
            return
        num_blocks, num_kv_heads, _, block_size, _ = key_cache.shape
        slots = slot_mapping.contiguous()
        tail = (_addresses(list(key.stride())), value.data_ptr(), _addresses(list(value.stride())),
                key_cache.data_ptr(), value_cache.data_ptr(), slots.data_ptr(), key.shape[0], num_blocks * block_size,
                num_kv_heads, key.shape[2], block_size, torch.get_num_threads())
        if key.dtype == key_cache.dtype:
            entry, status = "reshape_and_cache_cpu", load().reshape_and_cache_cpu(
                key.element_size(), key.data_ptr(), *tail)
        else:
            entry, status = "convert_and_cache_cpu", load().convert_and_cache_cpu(
                _DTYPES[key.dtype], _DTYPES[key_cache.dtype], key.data_ptr(), *tail)
        check_status(entry, status)

    def swap_blocks(
        self, src_caches: list[torch.Tensor], dst_caches: list[torch.Tensor], block_mapping: torch.Tensor
    ) -> None:
        """One memcpy per cache and pair, in parallel: blocks are addressed in place."""
        for i, (src, dst) in enumerate(zip(src_caches, dst_caches)):
            require_contiguous(**{f"src_caches[{i}]": src, f"dst_caches[{i}]": dst})
        mapping = block_mapping.contiguous()
        status = load().swap_blocks_cpu(
            len(src_caches), _addresses([c.data_ptr() for c in src_caches]),
            _addresses([c.data_ptr() for c in dst_caches]),
            _addresses([math.prod(c.shape[1:]) * c.element_size() for c in src_caches]), mapping.data_ptr(),
            mapping.shape[0], torch.get_num_threads(),
        )
        check_status("swap_blocks_cpu", status)


BACKEND = CpuBackend()
