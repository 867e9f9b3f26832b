"""A BLOOM decoder (transformers' `BloomForCausalLM` math) in plain torch, attention left to the caller.

What differs from `LlamaModel`: no rotary embeddings, positions enter only as ALiBi's per-head bias
`slope[h] * (key_pos - query_pos)`, which the attention kernels add to the logits (`alibi_slopes`);
LayerNorm with a bias, also right after the embeddings; a bias on every linear layer; an MLP of two
matrices with BLOOM's tanh GELU; multi-head attention (a KV head per query head).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from paged.kernels.features import alibi_slopes
from paged.kernels.torch_ops import layer_attention
from paged.model.arch import LlamaArch
from paged.model.llama import AttentionFn


@dataclass
class BloomLayer:
    attn_norm: tuple[torch.Tensor, torch.Tensor]  # LayerNorm weight, bias
    qkv: torch.Tensor
    qkv_bias: torch.Tensor
    dense: torch.Tensor
    dense_bias: torch.Tensor
    mlp_norm: tuple[torch.Tensor, torch.Tensor]
    up: torch.Tensor
    up_bias: torch.Tensor
    down: torch.Tensor
    down_bias: torch.Tensor


def bloom_gelu(x: torch.Tensor) -> torch.Tensor:
    """HF's `bloom_gelu_forward`, constant included: 0.79788456 rounds sqrt(2/pi), which
    `F.gelu(approximate="tanh")` uses exactly."""
    return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


def heads_first(fused: torch.Tensor, num_heads: int) -> torch.Tensor:
    """`query_key_value`'s output rows (weight or bias), laid out per head as `[heads, 3, head_dim]`,
    reordered to `[3, heads, head_dim]`: q, k and v then come out as `[T, heads, head_dim]` views whose
    heads are `head_dim` apart, as the kernels index them (HF's layout would make them copy first)."""
    return fused.unflatten(0, (num_heads, 3, -1)).transpose(0, 1).flatten(0, 2).contiguous()


class BloomModel:
    """Inference-only BLOOM decoder built from an HF-named state dict; `LlamaModel`'s interface plus
    `alibi_slopes` (fp32 `[num_heads]` on the model's device) for the attention kernels."""

    def __init__(
        self,
        arch: LlamaArch,
        state: dict[str, torch.Tensor],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        assert arch.architecture == "bloom", f"BloomModel needs a bloom architecture, got {arch.architecture!r}"
        self.arch = arch
        self.dtype = dtype
        self.device = torch.device(device)
        # save_pretrained keys the decoder under `transformer.`; bigscience's own checkpoints do not.
        prefix = "transformer." if "transformer.word_embeddings.weight" in state else ""

        def w(name: str) -> torch.Tensor:
            return state[prefix + name].to(device=self.device, dtype=dtype).contiguous()

        def norm(name: str) -> tuple[torch.Tensor, torch.Tensor]:
            return w(name + ".weight"), w(name + ".bias")

        self.embed = w("word_embeddings.weight")
        self.embed_norm = norm("word_embeddings_layernorm")
        self.final_norm = norm("ln_f")
        self.lm_head = self.embed if arch.tie_word_embeddings else (
            state["lm_head.weight"].to(device=self.device, dtype=dtype).contiguous()
        )
        self.layers: list[BloomLayer] = []
        for i in range(arch.num_layers):
            p = f"h.{i}."
            self.layers.append(
                BloomLayer(
                    attn_norm=norm(p + "input_layernorm"),
                    qkv=heads_first(w(p + "self_attention.query_key_value.weight"), arch.num_heads),
                    qkv_bias=heads_first(w(p + "self_attention.query_key_value.bias"), arch.num_heads),
                    dense=w(p + "self_attention.dense.weight"),
                    dense_bias=w(p + "self_attention.dense.bias"),
                    mlp_norm=norm(p + "post_attention_layernorm"),
                    up=w(p + "mlp.dense_h_to_4h.weight"),
                    up_bias=w(p + "mlp.dense_h_to_4h.bias"),
                    down=w(p + "mlp.dense_4h_to_h.weight"),
                    down_bias=w(p + "mlp.dense_4h_to_h.bias"),
                )
            )
        self.alibi_slopes = alibi_slopes(arch.num_heads).to(self.device)

    def _norm(self, x: torch.Tensor, norm: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        # HF's nn.LayerNorm runs in the model's dtype, without an fp32 round trip.
        return F.layer_norm(x, (x.shape[-1],), norm[0], norm[1], eps=self.arch.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionFn = layer_attention
    ) -> torch.Tensor:
        """Hidden states `[T, hidden]` after `ln_f`, for a flat batch of T tokens. `positions` is
        unused: the kernels add ALiBi's bias from the cache positions themselves."""
        n, d = self.arch.num_heads, self.arch.head_dim
        num_tokens = input_ids.shape[0]
        h = self._norm(self.embed[input_ids], self.embed_norm)
        for i, layer in enumerate(self.layers):
            qkv = F.linear(self._norm(h, layer.attn_norm), layer.qkv, layer.qkv_bias)
            q, k, v = (t.view(num_tokens, n, d) for t in qkv.split(n * d, dim=1))
            out = attn(i, q, k, v)
            # apply_residual_connection_post_layernorm=false: the residuals are the un-normed states.
            h = h + F.linear(out.reshape(num_tokens, n * d), layer.dense, layer.dense_bias)
            up = F.linear(self._norm(h, layer.mlp_norm), layer.up, layer.up_bias)
            h = h + F.linear(bloom_gelu(up), layer.down, layer.down_bias)
        return self._norm(h, self.final_norm)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits `[N, vocab]` for the N hidden rows that will be sampled."""
        return F.linear(hidden, self.lm_head).float()
