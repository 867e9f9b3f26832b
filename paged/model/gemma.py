"""Gemma-2 and Gemma-3 (text): the Llama decoder with Gemma's changes, attention left to the caller.

What differs from `LlamaModel`, each as transformers computes it (so greedy outputs match its
`generate`): the embedding is scaled by sqrt(hidden_size) in the model's dtype; every RMSNorm
multiplies by (1 + weight) in fp32 before casting back; each layer normalises around both its
attention and its MLP ("sandwich" norms: pre and post each); the MLP is GeGLU with tanh-approximated
GELU; Gemma-3 RMS-normalises q and k per head before RoPE, rotates its sliding layers with a base
of its own (`rope_local_theta`) and may scale its global layers' positions linearly; Gemma-2
soft-caps the final logits. The softmax scale and attention soft-capping are the executor's
(`LlamaArch.softmax_scale`, `attn_logit_softcapping`), as are the per-layer windows.

The elementwise ops stay torch formulas (the native fused kernels implement Llama's norm, not
Gemma's); the linear layers take `model.gemm`'s kernel as Llama's do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from paged.kernels.torch_ops import layer_attention
from paged.model.arch import LlamaArch
from paged.model.layer_ops import apply_rope
from paged.model.linear import Linear
from paged.model.llama import AttentionFn, rope_frequencies


@dataclass
class GemmaLayer:
    input_norm: torch.Tensor  # each norm's (1 + weight), fp32
    qkv: Linear
    q_norm: torch.Tensor | None  # Gemma-3's per-head norms of q and k
    k_norm: torch.Tensor | None
    o: Linear
    post_attention_norm: torch.Tensor
    pre_feedforward_norm: torch.Tensor
    gate_up: Linear
    down: Linear
    post_feedforward_norm: torch.Tensor
    rope: int  # which of the model's RoPE tables the layer rotates with


class GemmaModel:
    """Inference-only Gemma-2 / Gemma-3 text decoder built from an HF-named state dict."""

    def __init__(
        self, arch: LlamaArch, state: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu", gemm: str = "torch",
    ) -> None:
        self.arch = arch
        self.dtype = dtype
        self.device = torch.device(device)

        def w(name: str) -> torch.Tensor:
            return state[name].to(device=self.device, dtype=dtype).contiguous()

        def norm(name: str) -> torch.Tensor:
            # transformers adds 1 to the weight in fp32, after the weight was cast to the model's dtype
            return 1.0 + w(name).float()

        self.embed = w("model.embed_tokens.weight")
        # HF's embed_scale: an fp32 tensor cast to the weights' dtype (sqrt(3072) is 55.5 in bf16)
        self.embed_scale = torch.tensor(arch.hidden_size**0.5).to(device=self.device, dtype=dtype)
        self.lm_head = Linear(self.embed if arch.tie_word_embeddings else w("lm_head.weight"), None, gemm)
        self.final_norm = norm("model.norm.weight")
        tables: dict[tuple[float, float], int] = {}
        self.layers: list[GemmaLayer] = []
        for i, window in enumerate(arch.windows):
            p = f"model.layers.{i}."
            attn, mlp = p + "self_attn.", p + "mlp."
            # Gemma-3's sliding layers rotate with their own base; its global layers may scale positions
            rope = (arch.rope_local_theta or arch.rope_theta, 1.0) if window is not None else (
                arch.rope_theta, arch.rope_linear_factor)
            self.layers.append(GemmaLayer(
                input_norm=norm(p + "input_layernorm.weight"),
                qkv=Linear(torch.cat([w(f"{attn}{n}_proj.weight") for n in "qkv"]), None, gemm),
                q_norm=norm(attn + "q_norm.weight") if arch.qk_norm else None,
                k_norm=norm(attn + "k_norm.weight") if arch.qk_norm else None,
                o=Linear(w(attn + "o_proj.weight"), None, gemm),
                post_attention_norm=norm(p + "post_attention_layernorm.weight"),
                pre_feedforward_norm=norm(p + "pre_feedforward_layernorm.weight"),
                gate_up=Linear(torch.cat([w(mlp + "gate_proj.weight"), w(mlp + "up_proj.weight")]), None, gemm),
                down=Linear(w(mlp + "down_proj.weight"), None, gemm),
                post_feedforward_norm=norm(p + "post_feedforward_layernorm.weight"),
                rope=tables.setdefault(rope, len(tables)),
            ))
        self.ropes = [
            tuple(t.to(self.device, dtype) for t in rope_frequencies(theta, arch.head_dim, arch.max_position_embeddings,
                                                                    factor))
            for theta, factor in tables
        ]

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Gemma's RMSNorm: normalised and scaled by (1 + weight) in fp32, then cast back."""
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.arch.rms_norm_eps) * weight).to(x.dtype)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionFn = layer_attention
    ) -> torch.Tensor:
        """Hidden states `[T, hidden]` after the final norm, for a flat batch of T tokens."""
        a = self.arch
        n_q, n_kv, d = a.num_heads, a.num_kv_heads, a.head_dim
        num_tokens = input_ids.shape[0]
        residual = self.embed[input_ids] * self.embed_scale
        rotations = [(cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)) for cos, sin in self.ropes]
        for i, layer in enumerate(self.layers):
            qkv = layer.qkv(self._norm(residual, layer.input_norm))
            q = qkv[:, : n_q * d].view(num_tokens, n_q, d)
            k = qkv[:, n_q * d : (n_q + n_kv) * d].view(num_tokens, n_kv, d)
            v = qkv[:, (n_q + n_kv) * d :].view(num_tokens, n_kv, d)
            if layer.q_norm is not None and layer.k_norm is not None:
                q, k = self._norm(q, layer.q_norm), self._norm(k, layer.k_norm)
            cos, sin = rotations[layer.rope]
            out = attn(i, apply_rope(q, cos, sin), apply_rope(k, cos, sin), v).reshape(num_tokens, n_q * d)
            residual = residual + self._norm(layer.o(out), layer.post_attention_norm)
            gate, up = layer.gate_up(self._norm(residual, layer.pre_feedforward_norm)).chunk(2, dim=-1)
            x = layer.down(F.gelu(gate, approximate="tanh") * up)
            residual = residual + self._norm(x, layer.post_feedforward_norm)
        return self._norm(residual, self.final_norm)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits `[N, vocab]` for the N hidden rows that will be sampled, soft-capped (Gemma-2)
        in the model's dtype as transformers does."""
        logits = self.lm_head(hidden)
        cap = self.arch.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
