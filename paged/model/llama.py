"""A Llama-family decoder in plain torch, with attention left to the caller.

The model knows nothing about the KV cache: each layer hands its rotated q, k and v to an
`AttentionFn`, which is where the executor writes the paged cache and reads it back. Weights are
fused (q/k/v into one matmul, gate/up into another) because on a few CPU cores the per-op overhead
of a small model is a large share of a decode step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from paged.model.config import LlamaArch

AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""(layer_idx, q[T, heads, D], k[T, kv_heads, D], v[T, kv_heads, D]) -> out[T, heads, D]"""


@dataclass
class LlamaLayer:
    attn_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    mlp_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


def rope_table(arch: LlamaArch, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin `[max_positions, head_dim]` in HF's layout (the half-frequencies repeated twice)."""
    inv_freq = 1.0 / (arch.rope_theta ** (torch.arange(0, arch.head_dim, 2, dtype=torch.int64).float() / arch.head_dim))
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.int64).float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's rotate_half convention: dimension i pairs with i + head_dim / 2."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class LlamaModel:
    """Inference-only Llama decoder built from an HF-named state dict."""

    def __init__(
        self,
        arch: LlamaArch,
        state: dict[str, torch.Tensor],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.arch = arch
        self.dtype = dtype
        self.device = torch.device(device)

        def w(name: str) -> torch.Tensor:
            return state[name].to(device=self.device, dtype=dtype).contiguous()

        self.embed = w("model.embed_tokens.weight")
        self.lm_head = self.embed if arch.tie_word_embeddings else w("lm_head.weight")
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
                    qkv=torch.cat([w(f"{attn}{n}_proj.weight") for n in "qkv"]),
                    qkv_bias=bias,
                    o=w(attn + "o_proj.weight"),
                    mlp_norm=w(p + "post_attention_layernorm.weight"),
                    gate_up=torch.cat([w(mlp + "gate_proj.weight"), w(mlp + "up_proj.weight")]),
                    down=w(mlp + "down_proj.weight"),
                )
            )
        # Computed in fp32 and cast once, as HF does per step.
        cos, sin = rope_table(arch, arch.max_position_embeddings)
        self.cos, self.sin = cos.to(self.device, dtype), sin.to(self.device, dtype)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # HF normalises in fp32 and casts back before scaling; a no-op cast for fp32 models.
        y = F.rms_norm(x.float(), (x.shape[-1],), eps=self.arch.rms_norm_eps)
        return weight * y.to(self.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionFn) -> torch.Tensor:
        """Hidden states `[T, hidden]` after the final norm, for a flat batch of T tokens."""
        a = self.arch
        n_q, n_kv, d = a.num_heads, a.num_kv_heads, a.head_dim
        num_tokens = input_ids.shape[0]
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        h = self.embed[input_ids]
        for i, layer in enumerate(self.layers):
            qkv = F.linear(self._norm(h, layer.attn_norm), layer.qkv, layer.qkv_bias)
            # q and k are rotated together: one set of RoPE ops instead of two.
            qk = apply_rope(qkv[:, : (n_q + n_kv) * d].view(num_tokens, n_q + n_kv, d), cos, sin)
            q, k = qk.split((n_q, n_kv), dim=1)
            v = qkv[:, (n_q + n_kv) * d :].view(num_tokens, n_kv, d)
            out = attn(i, q, k, v)
            h = h + F.linear(out.reshape(num_tokens, n_q * d), layer.o)
            gate, up = F.linear(self._norm(h, layer.mlp_norm), layer.gate_up).chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, layer.down)
        return self._norm(h, self.final_norm)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits `[N, vocab]` for the N hidden rows that will be sampled."""
        return F.linear(hidden, self.lm_head).float()
