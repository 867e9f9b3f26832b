"""The `layer` scenario of scenario.py: one decode step of a small Llama model whose layer ops are
the fused CUDA kernels (`RunnerLayerOps`) and whose attention is the executor's (`PagedAttention`:
the planned cache write and decode attention), all through `HostMemoryCuda` and the real
`CudaRunner` on the recording fake driver.

    python -m tests.fake_driver.scenario layer OUT.json

Each case reports the lowered kernel names and, for every layer-op call in order, what the test
needs to derive that launch's arguments (addresses, row strides, widths) independently of the
launch plan, and each layer's attention tensors (their addresses).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from paged.executor.attention import PagedAttention
from paged.executor.step_plan import HostBatch, HostRows, InputBuffers
from paged.kernels.planned import AttentionSettings
from paged.kernels.testing import random_cache
from paged.kernels.toolchain.specs import attention_unit, cache_unit, layer_unit
from paged.model.layer_ops import Rotation, RunnerLayerOps
from paged.model.llama import LlamaModel
from paged.model.tiny import random_state, tiny_arch
from tests.fake_driver.scenario import Case, HostMemoryCuda, _lowered, _stream_id

# Two layers of hidden 128: q heads 2 and one KV head of 64 (a native head size).
ARCH = {"vocab_size": 256, "hidden_size": 128, "intermediate_size": 256, "num_layers": 2, "num_heads": 2,
        "num_kv_heads": 1, "head_dim": 64, "max_position_embeddings": 64}
BLOCK, NUM_BLOCKS, PARTITION = 16, 8, 32
# Context lengths after the step: one short row, one spanning two v2 partitions.
SEQ_LENS = [5, 40]
TABLES = [[0, 0, 0], [1, 2, 3]]


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


class RecordingOps(RunnerLayerOps):
    """`RunnerLayerOps`, noting for each call the tensors its launch should be given."""

    def __init__(self, backend: HostMemoryCuda) -> None:
        super().__init__(backend)
        self.calls: list[dict[str, Any]] = []

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        out = super().rms_norm(x, weight, eps)
        self.calls.append({"op": "rms_norm", "out": _ptr(out), "x": _ptr(x), "weight": _ptr(weight),
                           "out_stride": out.stride(0), "x_stride": x.stride(0), "rows": x.shape[0],
                           "width": x.shape[1], "eps": eps})
        return out

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        self.calls.append({"op": "add_rms_norm", "x": _ptr(x), "residual": _ptr(residual), "weight": _ptr(weight),
                           "x_stride": x.stride(0), "residual_stride": residual.stride(0), "rows": x.shape[0],
                           "width": x.shape[1], "eps": eps})
        return super().add_rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        out = super().silu_and_mul(x)
        self.calls.append({"op": "silu_and_mul", "out": _ptr(out), "x": _ptr(x), "out_stride": out.stride(0),
                           "x_stride": x.stride(0), "rows": x.shape[0], "width": out.shape[1]})
        return out

    def rope(self, qkv: torch.Tensor, rotation: Rotation, num_heads: int, head_dim: int) -> torch.Tensor:
        positions, cos, sin = rotation
        self.calls.append({"op": "rotary_embedding", "qk": _ptr(qkv), "positions": _ptr(positions),
                           "cos": _ptr(cos), "sin": _ptr(sin), "row_stride": qkv.stride(0), "rows": qkv.shape[0],
                           "num_heads": num_heads, "head_dim": head_dim})
        return super().rope(qkv, rotation, num_heads, head_dim)


def decode_case(version: str, dtype: torch.dtype, backend: HostMemoryCuda, stream: Any, arch: str) -> dict[str, Any]:
    """One decode step (a token for each of two sequences) through every layer."""
    model_arch = tiny_arch(ARCH)
    model = LlamaModel(model_arch, random_state(model_arch), dtype)
    ops = model.ops = RecordingOps(backend)
    head, kv_heads = model_arch.head_dim, model_arch.num_kv_heads
    gen = torch.Generator().manual_seed(5)
    caches = [random_cache(NUM_BLOCKS, kv_heads, head, BLOCK, dtype, generator=gen)
              for _ in range(model_arch.num_layers)]
    tables = np.array(TABLES, dtype=np.int32)
    seq_lens = np.array(SEQ_LENS, dtype=np.int32)
    positions = seq_lens.astype(np.int64) - 1
    slots = tables[np.arange(len(SEQ_LENS)), positions // BLOCK].astype(np.int64) * BLOCK + positions % BLOCK
    starts = np.arange(len(SEQ_LENS) + 1, dtype=np.int32)
    rows = np.arange(len(SEQ_LENS))
    host = HostBatch(rows, positions, slots, rows, HostRows(None, tables, seq_lens, starts, max(SEQ_LENS), 1), None)
    # the executor's per-layer attention: its later layers write and attend in one bound call
    step = PagedAttention(InputBuffers(torch.device("cpu")).upload(host), [c[0] for c in caches],
                          [c[1] for c in caches], AttentionSettings(backend, head**-0.5, PARTITION),
                          decode_version=version, num_heads=model_arch.num_heads)
    tensors: list[dict[str, int]] = []

    def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = step(layer, q, k, v)
        tensors.append({"q": _ptr(q), "k": _ptr(k), "v": _ptr(v), "key_cache": _ptr(caches[layer][0]),
                        "value_cache": _ptr(caches[layer][1]), "out": _ptr(out)})
        return out

    # The fake driver runs no kernel: the step's values are meaningless, only its launches count.
    model.forward(torch.tensor([7, 11]), torch.from_numpy(positions), attention)
    names: dict[str, str] = {}
    for unit in (layer_unit(dtype), cache_unit(dtype), attention_unit(dtype, head, BLOCK, version, PARTITION)):
        lowered = _lowered(unit, arch)
        names |= dict(zip(lowered["kernels"], lowered["names"]))
    return {"calls": ops.calls, "names": names, "stream": _stream_id(stream), "layers": model_arch.num_layers,
            "tensors": tensors, "joined": step.layers[0][0].joined is not None}


def layer_cases(arch: str) -> list[Case]:
    from cuda.core import Device

    from paged.kernels.backends.cuda import CudaRunner

    stream = Device(0).create_stream()
    backend = HostMemoryCuda(CudaRunner(0, stream_source=lambda index: int(stream.handle)))
    return [Case(f"decode-{version}-{str(dtype).removeprefix('torch.')}",
                 lambda v=version, d=dtype: decode_case(v, d, backend, stream, arch))
            for version in ("v1", "v2") for dtype in (torch.float16, torch.float32)]
