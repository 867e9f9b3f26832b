"""FlashInfer's batch decode on torch tensors: a plan for a batch shape, then calls that a CUDA graph
can capture (FlashInfer's `use_cuda_graph` mode: the plan's grid is fixed, splits past a row's length
are masked on the device).

The cache is FlashInfer's HND page layout, `[pages, kv_heads, page_size, head_dim]` for K and V each;
a row's pages are `indices[indptr[i]:indptr[i + 1]]`, its last page holding `last_page_len[i]` tokens.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from flashinfer_peer.build import build

_PLAN_VALUES = 10  # DecodePlanInfo::ToVector's length
_VOID = ctypes.c_void_p


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    lib.peer_error.restype = ctypes.c_char_p
    i64p, i32p, u32 = ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int32), ctypes.c_uint32
    lib.peer_workspace_size.argtypes = [i32p, u32, u32, u32, u32, i64p, i64p]
    lib.peer_plan.argtypes = [_VOID, ctypes.c_int64, _VOID, _VOID, ctypes.c_int64, i32p, u32, u32, u32, u32, i64p,
                              _VOID]
    lib.peer_run.argtypes = [i64p, _VOID, _VOID, _VOID, _VOID, _VOID, _VOID, _VOID, _VOID, _VOID, u32, u32, u32, u32,
                             ctypes.c_double, _VOID]
    return lib


class BatchDecode:
    """Planned once for `num_seqs` rows of `pages_per_seq` pages (the last holding `last_page_len`
    tokens), then `run` per input set; the workspaces are shared, as calls on one stream are serial."""

    def __init__(self, src: Path, query_dtype: torch.dtype, kv_dtype: torch.dtype, num_seqs: int, num_qo_heads: int,
                 num_kv_heads: int, page_size: int, pages_per_seq: int, last_page_len: int, device: torch.device,
                 ) -> None:
        major, minor = torch.cuda.get_device_capability(device)
        name = str(query_dtype).removeprefix("torch."), str(kv_dtype).removeprefix("torch.")
        self.lib = _load(build(src, *name, f"sm_{major}{minor}"))
        self.shape = (num_seqs, num_qo_heads, num_kv_heads, page_size)
        indptr = torch.arange(num_seqs + 1, dtype=torch.int32) * pages_per_seq
        self.indptr = indptr.to(device)
        self.last_page_len = torch.full((num_seqs,), last_page_len, dtype=torch.int32, device=device)
        sizes = (ctypes.c_int64(), ctypes.c_int64())
        self._check(self.lib.peer_workspace_size(_int32s(indptr), *self.shape, *map(ctypes.byref, sizes)))
        float_bytes, int_bytes = (max(s.value, 16) for s in sizes)
        self.float_ws = torch.empty(float_bytes, dtype=torch.uint8, device=device)
        self.int_ws = torch.empty(int_bytes, dtype=torch.uint8, device=device)
        host = torch.empty(int_bytes, dtype=torch.uint8, pin_memory=True)
        self.plan = (ctypes.c_int64 * _PLAN_VALUES)()
        stream = torch.cuda.current_stream(device)
        self._check(self.lib.peer_plan(self.float_ws.data_ptr(), float_bytes, self.int_ws.data_ptr(), host.data_ptr(),
                                       int_bytes, _int32s(indptr), *self.shape, self.plan, stream.cuda_stream))
        stream.synchronize()  # the plan's copy from `host` is done before `host` goes

    def run(self, query: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, indices: torch.Tensor,
            scale: float) -> torch.Tensor:
        """Attention of `query` `[num_seqs, heads, head_dim]` over its rows' pages; `indices` int32."""
        out = torch.empty_like(query)
        stream = torch.cuda.current_stream(query.device).cuda_stream
        self._check(self.lib.peer_run(self.plan, self.float_ws.data_ptr(), self.int_ws.data_ptr(), query.data_ptr(),
                                      k_pages.data_ptr(), v_pages.data_ptr(), self.indptr.data_ptr(),
                                      indices.data_ptr(), self.last_page_len.data_ptr(), out.data_ptr(), *self.shape,
                                      scale, stream))
        return out

    def _check(self, status: int) -> None:
        if status:
            raise RuntimeError(f"FlashInfer: {self.lib.peer_error().decode()}")


def _int32s(tensor: torch.Tensor) -> ctypes.Array[ctypes.c_int32]:
    """A host int32 tensor as the C array FlashInfer's planner reads."""
    return (ctypes.c_int32 * tensor.numel())(*tensor.tolist())
