"""Our kernels as torch ops, `torch.ops.paged.*`, defined once per process when this module is imported.

They are defined as vLLM defines its `_C` ops: `torch.library.Library("paged", "DEF")`, a schema per
op, an implementation per dispatch key; not through the `custom_op` decorator, whose set-up per op
(56 ms in the profiled GPU run of issue 43) is what this avoids. Each op has a CPU, a CUDA and a
Meta implementation; the Meta one checks shapes and writes nothing, so the meta device,
FakeTensorMode and torch.compile trace through them, and a compiled graph can be split at the
layer-level op as vLLM's piecewise capture splits at its attention.

- The layer-level op the models call (`layer_attention`), vLLM's `unified_attention_with_output`:
  `attention(q, k, v, out, layer)` writes the layer's new K/V into the cache and its attention into
  `out`, through the step's planned attention that the executor set in the forward context
  (`paged.kernels.forward_context`). Whatever backend the executor planned with runs behind it:
  cpu, cuda, and also torch and emu (on the CPU dispatch key, through the same planned Python path).
- Kernel-level ops with vLLM-like schemas: `reshape_and_cache`, `paged_attention` (the decode
  version, v1 / v2 / v3, an argument), `prefill_attention`: tensors and scalars, results written in
  place, run by the native cpu backend on CPU tensors and the NVRTC kernels (cuda backend) on CUDA
  ones. Every argument is checked as `paged.kernels.ops` checks it, which on CUDA reads the lengths
  on the host: they serve eager callers and tracing, and the attention ones copy the kernel's
  result into `out`. A CUDA graph captures the layer-level op, whose step was checked once.

`REGISTRATION_MS` is what defining the ops cost this process (`experiments/host_overhead.py`
prints it).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from paged.kernels import ops
from paged.kernels.features import BlockSparse
from paged.kernels.forward_context import current_attention
from paged.kernels.limits import DEFAULT_PARTITION_SIZE

NAMESPACE = "paged"
# vLLM's block-sparse ints; vert_stride 0 is dense attention.
_BLOCKSPARSE = ("int blocksparse_local_blocks=0, int blocksparse_vert_stride=0, int blocksparse_block_size=64, "
                "int blocksparse_head_sliding_step=0")
_FEATURES = ("int? sliding_window=None, Tensor? alibi_slopes=None, Tensor? k_scale=None, Tensor? v_scale=None, "
             f"{_BLOCKSPARSE}")
SCHEMAS = {
    "attention": "attention(Tensor q, Tensor k, Tensor v, Tensor(a!) out, int layer) -> ()",
    "reshape_and_cache": "reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
                         "Tensor slot_mapping, Tensor? k_scale=None, Tensor? v_scale=None) -> ()",
    "paged_attention": "paged_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
                       "Tensor block_tables, Tensor seq_lens, float scale, int max_seq_len, str version='v1', "
                       f"int partition_size={DEFAULT_PARTITION_SIZE}, {_FEATURES}) -> ()",
    "prefill_attention": "prefill_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
                         "Tensor block_tables, Tensor query_start_loc, Tensor seq_lens, float scale, "
                         f"int max_query_len, int max_seq_len, {_FEATURES}) -> ()",
}
# the backend each dispatch key's kernel-level implementation runs on
BACKEND_OF_KEY = {"CPU": "cpu", "CUDA": "cuda"}


def _check_out(op: str, out: torch.Tensor, query: torch.Tensor) -> None:
    if out.shape != query.shape or out.dtype != query.dtype or out.device != query.device:
        raise ValueError(f"paged::{op}: out must be {query.dtype} {tuple(query.shape)} on {query.device} like the "
                         f"query, got {out.dtype} {tuple(out.shape)} on {out.device}")


def _blocksparse(local_blocks: int, vert_stride: int, block_size: int, head_sliding_step: int) -> BlockSparse | None:
    return BlockSparse(local_blocks, vert_stride, block_size, head_sliding_step) if vert_stride else None


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, layer: int) -> None:
    # the kernels write `out` where it is, as the first layer's output was laid out: a wrong one would overflow
    _check_out("attention", out, q)
    current_attention()(layer, q, k, v, out)


def _attention_meta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, layer: int) -> None:
    _check_out("attention", out, q)


def _reshape_and_cache(backend: str) -> Callable[..., None]:
    def run(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
            slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
            v_scale: torch.Tensor | None = None) -> None:
        ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, backend=backend, k_scale=k_scale,
                              v_scale=v_scale)

    return run


def _reshape_and_cache_meta(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                            value_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                            v_scale: torch.Tensor | None = None) -> None:
    if key.shape != value.shape or slot_mapping.shape != key.shape[:1]:
        raise ValueError(f"paged::reshape_and_cache: key, value [T, kv_heads, D] and slot_mapping [T] must agree, got "
                         f"{tuple(key.shape)}, {tuple(value.shape)} and {tuple(slot_mapping.shape)}")


def _paged_attention(backend: str) -> Callable[..., None]:
    def run(out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
            block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, max_seq_len: int, version: str = "v1",
            partition_size: int = DEFAULT_PARTITION_SIZE, sliding_window: int | None = None,
            alibi_slopes: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
            v_scale: torch.Tensor | None = None, blocksparse_local_blocks: int = 0, blocksparse_vert_stride: int = 0,
            blocksparse_block_size: int = 64, blocksparse_head_sliding_step: int = 0) -> None:
        _check_out("paged_attention", out, query)
        out.copy_(ops.paged_attention(
            query, key_cache, value_cache, block_tables, seq_lens, scale, version=version, backend=backend,
            partition_size=partition_size, max_seq_len=max_seq_len, sliding_window=sliding_window,
            alibi_slopes=alibi_slopes, blocksparse=_blocksparse(
                blocksparse_local_blocks, blocksparse_vert_stride, blocksparse_block_size,
                blocksparse_head_sliding_step), k_scale=k_scale, v_scale=v_scale,
        ))

    return run


def _paged_attention_meta(out: torch.Tensor, query: torch.Tensor, *rest: object) -> None:
    _check_out("paged_attention", out, query)


def _prefill_attention(backend: str) -> Callable[..., None]:
    def run(out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
            block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float,
            max_query_len: int, max_seq_len: int, sliding_window: int | None = None,
            alibi_slopes: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
            v_scale: torch.Tensor | None = None, blocksparse_local_blocks: int = 0, blocksparse_vert_stride: int = 0,
            blocksparse_block_size: int = 64, blocksparse_head_sliding_step: int = 0) -> None:
        _check_out("prefill_attention", out, query)
        out.copy_(ops.prefill_attention(
            query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale, backend=backend,
            max_query_len=max_query_len, max_seq_len=max_seq_len, sliding_window=sliding_window,
            alibi_slopes=alibi_slopes, blocksparse=_blocksparse(
                blocksparse_local_blocks, blocksparse_vert_stride, blocksparse_block_size,
                blocksparse_head_sliding_step), k_scale=k_scale, v_scale=v_scale,
        ))

    return run


def _prefill_attention_meta(out: torch.Tensor, query: torch.Tensor, *rest: object) -> None:
    _check_out("prefill_attention", out, query)


def _defined() -> bool:
    return hasattr(getattr(torch.ops, NAMESPACE), "attention")


def _register() -> torch.library.Library:
    library = torch.library.Library(NAMESPACE, "DEF")
    for schema in SCHEMAS.values():
        library.define(schema)
    for key, backend in BACKEND_OF_KEY.items():
        library.impl("attention", _attention, key)
        library.impl("reshape_and_cache", _reshape_and_cache(backend), key)
        library.impl("paged_attention", _paged_attention(backend), key)
        library.impl("prefill_attention", _prefill_attention(backend), key)
    library.impl("attention", _attention_meta, "Meta")
    library.impl("reshape_and_cache", _reshape_and_cache_meta, "Meta")
    library.impl("paged_attention", _paged_attention_meta, "Meta")
    library.impl("prefill_attention", _prefill_attention_meta, "Meta")
    return library


# The library holds the registrations: they last while it does. A reload of this module keeps the one
# it made (and its cost); another copy of the module (imported under a second name) finds the ops
# defined and uses them.
if "_LIBRARY" not in globals():
    _start = time.perf_counter()
    _LIBRARY: torch.library.Library | None = None if _defined() else _register()
    REGISTRATION_MS = (time.perf_counter() - _start) * 1e3

_ATTENTION = torch.ops.paged.attention.default


def layer_attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """A model layer's attention through `torch.ops.paged.attention`: the output `[T, heads, D]`, a
    new contiguous tensor (the `paged.model.llama.AttentionFn` the models call by default)."""
    out = torch.empty_like(q, memory_format=torch.contiguous_format)  # a third of torch.empty's host time
    _ATTENTION(q, k, v, out, layer)
    return out
