"""A Llama decode step's layers in one native call on a CPU (kernels_cu/cpu: `decode_layers_cpu`).

A bf16 decode forward of 32 rows of SmolLM2-135M on a 2-core EPYC (AVX512-BF16) took 36.5 ms, 5.9 of
them outside the native kernels: the Python around its ~300 calls (four linears, RoPE, the cache write,
attention through `torch.ops.paged`, two norms and SwiGLU per layer), each gap long enough for the
second OpenMP thread to stop spinning, so that the next call had to wake it. `decode_layers_cpu` makes
the same calls with the same arguments in the same order from C++, so its hidden states are the Python
forward's to the bit, and the threads stay awake between them.

It takes a step where it makes every call the Python forward would: the native layer ops
(`NativeCpuLayerOps`) and the packed loop for every linear (no bias, every row count: an AMX CPU's bf16
loop takes only calls of a few rows), one rank, fp32 or bf16 on the CPU, and the step's attention one
the executor offers as a `StackAttention` (decode rows only, the cpu backend's v3, no feature).
Everything else runs the Python forward; `model.native_decode=false` runs it always.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from paged.kernels import fused_ops
from paged.kernels.backends import cpu as _cpu
from paged.kernels.stack_attention import StackAttention
from paged.model.arch import LlamaArch
from paged.model.layer_ops import NativeCpuLayerOps, TorchLayerOps

# the packed loop's kind codes (kernels_cu/cpu/paged_attention_cpu.cpp: gemm_packed_cpu)
_KINDS = {torch.float32: 0, torch.bfloat16: 1}
# decode_layers_cpu's calls, in order, as its status names them
_CALLS = ("qkv", "rope", "cache write", "attention", "o", "mlp norm", "gate_up", "silu_and_mul", "down", "next norm")


class Llama(Protocol):
    """What `DecodeLayers` reads of a model (`paged.model.llama.LlamaModel`, which imports this module):
    its layers (`LlamaLayer`: norms and four `Linear`s), final norm, dtype, device, ops and all-reduce."""

    arch: LlamaArch
    layers: Sequence[Any]
    final_norm: torch.Tensor
    dtype: torch.dtype
    device: torch.device
    ops: TorchLayerOps
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None


def _addresses(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64)


class DecodeLayers:
    """A Llama model's layers as `decode_layers_cpu` takes them: each weight's address, per layer.
    The weights never move, so the addresses are made once (`of`); the caches' once per list of them."""

    def __init__(self, model: Llama) -> None:
        a, layers = model.arch, model.layers
        self.dtype, self.kind = model.dtype, _KINDS[model.dtype]
        self.dims = (len(layers), a.hidden_size, a.num_heads, a.num_kv_heads, a.head_dim)
        self.inter = layers[0].gate_up.out_features // 2
        # fp32 SiLU's vector width (`fused_ops.silu_lanes`); bf16's takes none
        self.exp_lanes = fused_ops.exp_lanes() if model.dtype == torch.float32 else 0
        # a packed layer on an AMX CPU takes calls of up to `loop_rows` rows (`paged.model.linear`)
        caps = [lin.loop_rows for layer in layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        self.max_rows = min((c for c in caps if c is not None), default=None)
        following = [layer.attn_norm for layer in layers[1:]] + [model.final_norm]
        self._weights = [_addresses([getattr(layer, name).loop.packed for layer in layers])
                         for name in ("qkv", "o", "gate_up", "down")]
        self._norms = [_addresses([layer.mlp_norm for layer in layers]), _addresses(following)]
        # what the addresses point to lives as long as the model, which holds this
        self._caches: tuple[Sequence[torch.Tensor], Sequence[torch.Tensor], torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def of(cls, model: Llama) -> DecodeLayers | None:
        """The model's layers, or None where a call of its forward is not one `decode_layers_cpu` makes."""
        linears = [lin for layer in model.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        if (not isinstance(model.ops, NativeCpuLayerOps) or model.all_reduce is not None
                or model.device.type != "cpu" or model.dtype not in _KINDS or not model.layers
                or any(lin.loop is None or lin.bias is not None for lin in linears)
                or fused_ops.unavailable_reason() is not None):
            return None
        return cls(model)

    def serves(self, num_tokens: int, attention: StackAttention) -> bool:
        """Whether a step of `num_tokens` rows runs every linear on the packed loop, over caches in the
        activations' dtype (a cache of another dtype is converted on its write: the Python forward's)."""
        return ((self.max_rows is None or num_tokens <= self.max_rows)
                and attention.key_caches[0].dtype == self.dtype)

    def run(self, x: torch.Tensor, residual: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor, attention: StackAttention, eps: float) -> None:
        """Every layer over `x` (the first layer's normed input, `[rows, hidden]`, replaced by the final
        norm's output) and `residual` (the embeddings, carried through in place), as the Python forward
        runs them; raises naming the layer and call a kernel refused."""
        num_layers, hidden, num_heads, num_kv_heads, head_dim = self.dims
        rows = x.shape[0]
        qkv = torch.empty(rows, (num_heads + 2 * num_kv_heads) * head_dim, dtype=x.dtype)
        attn_out = torch.empty(rows, num_heads * head_dim, dtype=x.dtype)
        gate_up = torch.empty(rows, 2 * self.inter, dtype=x.dtype)
        act = torch.empty(rows, self.inter, dtype=x.dtype)
        key_caches, value_caches = self._cache_addresses(attention)
        block_tables, seq_lens = attention.block_tables.contiguous(), attention.seq_lens.contiguous()
        positions = positions.to(torch.int64).contiguous()  # the executor's are already
        status = _cpu.load().decode_layers_cpu(
            self.kind, num_layers, rows, hidden, num_heads, num_kv_heads, head_dim, self.inter, x.data_ptr(),
            residual.data_ptr(), qkv.data_ptr(), attn_out.data_ptr(), gate_up.data_ptr(), act.data_ptr(),
            *(w.data_ptr() for w in self._weights), *(n.data_ptr() for n in self._norms), key_caches.data_ptr(),
            value_caches.data_ptr(), float(eps), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), cos.shape[0],
            attention.slot_mapping.data_ptr(), attention.num_slots, attention.block_size, block_tables.data_ptr(),
            block_tables.stride(0), seq_lens.data_ptr(), float(attention.scale), attention.num_splits,
            attention.split_blocks, attention.max_seq_len, self.exp_lanes, torch.get_num_threads(),
        )
        if status:
            # below 256: the call's own sizes; above: the layer and call that refused, and its status
            layer, call = divmod(status // 256, 16)
            where = f" (layer {layer}, {_CALLS[call - 1]})" if call else ""
            _cpu.check_status(f"decode_layers_cpu{where}", status % 256)

    def _cache_addresses(self, attention: StackAttention) -> tuple[torch.Tensor, torch.Tensor]:
        """The caches' addresses, made again only when the executor's lists of them change."""
        kept = self._caches
        if kept is None or kept[0] is not attention.key_caches or kept[1] is not attention.value_caches:
            kept = self._caches = (attention.key_caches, attention.value_caches,
                                   _addresses(attention.key_caches), _addresses(attention.value_caches))
        return kept[2], kept[3]
