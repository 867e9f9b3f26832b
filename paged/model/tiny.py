"""`model=tiny-random` / `model=tiny-bloom`: a two-layer Llama or BLOOM with seeded random weights
and SmolLM2's vocabulary.

Fast enough for unit tests of the whole engine. Weights are scaled to keep activations O(1) and the
untied LM head gives logits of std ~3: peaked enough that greedy outputs never hinge on float
near-ties between kernels, and (unlike tied embeddings, which make a random model echo its last
token) the output depends on the whole context, so a cache bug changes it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from paged.model.arch import LlamaArch

_LM_HEAD_GAIN = 3.0

TINY_ARCH: dict[str, Any] = {
    "vocab_size": 49152,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_layers": 2,
    "num_heads": 2,
    "num_kv_heads": 1,
    "head_dim": 64,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "max_position_embeddings": 4096,
    "bos_token_id": 1,
    "eos_token_ids": [2],
}

# `model.arch.architecture=bloom`'s shape: head_dim 64, the smallest head size the native kernels run.
TINY_BLOOM_ARCH: dict[str, Any] = {
    **TINY_ARCH,
    "architecture": "bloom",
    "hidden_size": 256,
    "intermediate_size": 1024,
    "num_heads": 4,
    "num_kv_heads": 4,
    "qkv_bias": True,
}


def tiny_arch(overrides: dict[str, Any] | None = None) -> LlamaArch:
    overrides = overrides or {}
    base = TINY_BLOOM_ARCH if overrides.get("architecture") == "bloom" else TINY_ARCH
    return LlamaArch.from_dict({**base, **overrides})


def random_state(
    arch: LlamaArch, seed: int = 0, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """HF-named weights: N(0, 1/fan_in) projections, N(0, 1) embeddings, ones for RMSNorms; drawn on
    `device` in `dtype` (a random Llama-3-8B's fp32 weights would be 32 GB of host memory first)."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, device=device, dtype=dtype)

    def linear(out_features: int, in_features: int) -> torch.Tensor:
        return randn(out_features, in_features) / math.sqrt(in_features)

    if arch.architecture == "bloom":
        return _bloom_state(arch, randn, linear)
    h, d = arch.hidden_size, arch.head_dim
    state = {
        "model.embed_tokens.weight": randn(arch.vocab_size, h),
        "model.norm.weight": ones(h),
    }
    if not arch.tie_word_embeddings:
        state["lm_head.weight"] = _LM_HEAD_GAIN * linear(arch.vocab_size, h)
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        state |= {
            p + "input_layernorm.weight": ones(h),
            p + "post_attention_layernorm.weight": ones(h),
            p + "self_attn.q_proj.weight": linear(arch.num_heads * d, h),
            p + "self_attn.k_proj.weight": linear(arch.num_kv_heads * d, h),
            p + "self_attn.v_proj.weight": linear(arch.num_kv_heads * d, h),
            p + "self_attn.o_proj.weight": linear(h, arch.num_heads * d),
            p + "mlp.gate_proj.weight": linear(arch.intermediate_size, h),
            p + "mlp.up_proj.weight": linear(arch.intermediate_size, h),
            p + "mlp.down_proj.weight": linear(h, arch.intermediate_size),
        }
        if arch.qkv_bias:
            for n, width in (("q", arch.num_heads * d), ("k", arch.num_kv_heads * d), ("v", arch.num_kv_heads * d)):
                state[f"{p}self_attn.{n}_proj.bias"] = 0.1 * randn(width)
    return state


def _bloom_state(
    arch: LlamaArch, randn: Callable[..., torch.Tensor], linear: Callable[[int, int], torch.Tensor]
) -> dict[str, torch.Tensor]:
    """`BloomForCausalLM`'s names. Biases and LayerNorm gains are perturbed away from 0 and 1, so a
    bias or norm parameter read wrongly changes the logits."""
    h, inter = arch.hidden_size, arch.intermediate_size

    def bias(n: int) -> torch.Tensor:
        return 0.1 * randn(n)

    def norm(name: str) -> dict[str, torch.Tensor]:
        return {f"{name}.weight": 1 + bias(h), f"{name}.bias": bias(h)}

    t = "transformer."
    state = {
        f"{t}word_embeddings.weight": randn(arch.vocab_size, h),
        **norm(f"{t}word_embeddings_layernorm"),
        **norm(f"{t}ln_f"),
    }
    if not arch.tie_word_embeddings:
        state["lm_head.weight"] = _LM_HEAD_GAIN * linear(arch.vocab_size, h)
    for i in range(arch.num_layers):
        p = f"{t}h.{i}."
        state |= {
            **norm(p + "input_layernorm"),
            **norm(p + "post_attention_layernorm"),
            p + "self_attention.query_key_value.weight": linear(3 * h, h),
            p + "self_attention.query_key_value.bias": bias(3 * h),
            p + "self_attention.dense.weight": linear(h, h),
            p + "self_attention.dense.bias": bias(h),
            p + "mlp.dense_h_to_4h.weight": linear(inter, h),
            p + "mlp.dense_h_to_4h.bias": bias(inter),
            p + "mlp.dense_4h_to_h.weight": linear(h, inter),
            p + "mlp.dense_4h_to_h.bias": bias(h),
        }
    return state
