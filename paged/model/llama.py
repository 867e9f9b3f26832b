"""A Llama-family decoder, with attention left to the caller.

The model knows nothing about the KV cache: each layer hands its rotated q, k and v to an
`AttentionFn`, by default `torch.ops.paged.attention` (`paged.kernels.torch_ops.layer_attention`),
which runs the step's attention that the executor set around the forward: where it writes the
paged cache and reads it back, so a traced or captured forward sees one op per layer's attention.
Weights are fused (q/k/v into one matmul, gate/up into another) because on a few CPU cores the
per-op overhead of a small model is a large share of a decode step. The linear layers' kernel is chosen at load
(`paged.model.linear`), the elementwise ops per executor (`paged.model.layer_ops`). Under tensor
parallelism a model is one rank's shard (`paged.model.tensor_parallel`), and `all_reduce` sums the
partial outputs of its row-parallel layers (o_proj, down_proj).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from paged.kernels.forward_context import current_stack
from paged.kernels.torch_ops import layer_attention
from paged.model.arch import LlamaArch
from paged.model.decode_layers import DecodeLayers
from paged.model.layer_ops import TORCH_OPS, TorchLayerOps
from paged.model.linear import Linear

AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""(layer_idx, q[T, heads, D], k[T, kv_heads, D], v[T, kv_heads, D]) -> out[T, heads, D]"""


@dataclass
class LlamaLayer:
    attn_norm: torch.Tensor
    qkv: Linear
    o: Linear
    mlp_norm: torch.Tensor
    gate_up: Linear
    down: Linear


def rope_table(arch: LlamaArch, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin `[max_positions, head_dim]` in HF's layout (the half-frequencies repeated twice)."""
    return rope_frequencies(arch.rope_theta, arch.head_dim, max_positions)


def rope_frequencies(
    theta: float, head_dim: int, max_positions: int, linear_factor: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rope_table` for a base `theta`, the frequencies divided by `linear_factor` (HF's linear
    RoPE scaling), computed in HF's order so the tables match its to the bit."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if linear_factor != 1.0:
        inv_freq /= linear_factor
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.int64).float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


class LlamaModel:
    """Inference-only Llama decoder built from an HF-named state dict."""

    def __init__(
        self,
        arch: LlamaArch,
        state: dict[str, torch.Tensor],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        gemm: str = "torch",
        all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        """`gemm`: the linear layers' kernel as `paged.model.linear.resolve_gemm` returns it;
        `all_reduce`: the sum over tensor-parallel ranks, in place (None: the model is whole)."""
        self.arch = arch
        self.all_reduce = all_reduce
        self.dtype = dtype
        self.device = torch.device(device)

        def w(name: str) -> torch.Tensor:
            return state[name].to(device=self.device, dtype=dtype).contiguous()

        self.embed = w("model.embed_tokens.weight")
        self.lm_head = Linear(self.embed if arch.tie_word_embeddings else w("lm_head.weight"), None, gemm)
        self.final_norm = w("model.norm.weight")
        self.layers: list[LlamaLayer] = []
        for i in range(arch.num_layers):
            p = f"model.layers.{i}."
            attn, mlp = p + "self_attn.", p + "mlp."
            bias = None
            if arch.qkv_bias:
                bias = torch.cat([w(f"{attn}{n}_proj.bias") for n in "qkv"])
            self.layers.append(
                LlamaLayer(
                    attn_norm=w(p + "input_layernorm.weight"),
                    qkv=Linear(torch.cat([w(f"{attn}{n}_proj.weight") for n in "qkv"]), bias, gemm),
                    o=Linear(w(attn + "o_proj.weight"), None, gemm),
                    mlp_norm=w(p + "post_attention_layernorm.weight"),
                    gate_up=Linear(torch.cat([w(mlp + "gate_proj.weight"), w(mlp + "up_proj.weight")]), None, gemm),
                    down=Linear(w(mlp + "down_proj.weight"), None, gemm),
                )
            )
        # Computed in fp32 and cast once, as HF does per step.
        cos, sin = rope_table(arch, arch.max_position_embeddings)
        self.cos, self.sin = cos.to(self.device, dtype), sin.to(self.device, dtype)
        # RMSNorm / RoPE / SwiGLU; the executor switches to the native CPU kernels where they run
        self.ops: TorchLayerOps = TORCH_OPS
        # the layers as one native call takes them (`DecodeLayers.of`), for the ops they were made with
        self._decode_layers: tuple[TorchLayerOps, DecodeLayers | None] | None = None

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionFn = layer_attention
    ) -> torch.Tensor:
        """Hidden states `[T, hidden]` after the final norm, for a flat batch of T tokens; `attn`
        replaces the torch op (a reference attention, the memory profile's zeros). A CPU decode step
        whose attention the executor offers in one native call's form (`current_stack`) runs its layers
        in that call (`paged.model.decode_layers`): the same kernel calls, the same bits."""
        a, ops, eps = self.arch, self.ops, self.arch.rms_norm_eps
        n_q, n_kv, d = a.num_heads, a.num_kv_heads, a.head_dim
        num_tokens = input_ids.shape[0]
        residual = self.embed[input_ids]
        x = ops.rms_norm(residual, self.layers[0].attn_norm, eps)
        stack = current_stack() if attn is layer_attention else None
        layers = None if stack is None else self.decode_layers()
        if layers is not None and layers.serves(num_tokens, stack):
            layers.run(x, residual, positions, self.cos, self.sin, stack, eps)
            return x
        rotation = ops.rotation(positions, self.cos, self.sin)
        for i, layer in enumerate(self.layers):
            qkv = layer.qkv(x)
            q, k = ops.rope(qkv, rotation, n_q + n_kv, d).split((n_q, n_kv), dim=1)
            v = qkv[:, (n_q + n_kv) * d :].view(num_tokens, n_kv, d)
            x = self._reduce(layer.o(attn(i, q, k, v).reshape(num_tokens, n_q * d)))
            x = ops.add_rms_norm(x, residual, layer.mlp_norm, eps)
            x = self._reduce(layer.down(ops.silu_and_mul(layer.gate_up(x))))
            # the residual add of this layer's MLP is fused into the next norm
            following = self.layers[i + 1].attn_norm if i + 1 < len(self.layers) else self.final_norm
            x = ops.add_rms_norm(x, residual, following, eps)
        return x

    def decode_layers(self) -> DecodeLayers | None:
        """The layers as `decode_layers_cpu` runs a decode step of them, or None where it cannot
        (`DecodeLayers.of`); made once per layer ops the executor sets."""
        if self._decode_layers is None or self._decode_layers[0] is not self.ops:
            self._decode_layers = self.ops, DecodeLayers.of(self)
        return self._decode_layers[1]

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.all_reduce is None else self.all_reduce(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits `[N, vocab]` for the N hidden rows that will be sampled."""
        return self.lm_head(hidden).float()
