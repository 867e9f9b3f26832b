"""The tensors an HF checkpoint holds for a `LlamaArch`: their names as `LlamaModel` / `GemmaModel` /
`BloomModel` read them, and the shapes config.json implies.

tests/test_hf_checkpoint_checks.py pins this table against both decoders (the names they read) and
against transformers' own modules (names and shapes), so it cannot drift from the loaders.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass

from paged.model.arch import LlamaArch

# Buffers some checkpoints carry that the decoders recompute rather than read (older Llama saves
# kept RoPE's inverse frequencies per layer).
_RECOMPUTED_SUFFIXES = (".rotary_emb.inv_freq",)

# The config.json keys a shape field is read from, in the order `LlamaArch.from_hf_config` tries
# them: error messages name the key the user wrote.
_LLAMA_KEYS: dict[str, tuple[str, ...]] = {
    "vocab_size": ("vocab_size",),
    "hidden_size": ("hidden_size",),
    "intermediate_size": ("intermediate_size",),
    "num_layers": ("num_hidden_layers",),
    "num_heads": ("num_attention_heads",),
    "num_kv_heads": ("num_key_value_heads", "num_attention_heads"),
    "head_dim": ("head_dim", "hidden_size"),
}
_CONFIG_KEYS: dict[str, dict[str, tuple[str, ...]]] = {
    "llama": _LLAMA_KEYS,
    # Gemma's head_dim is its own key, never hidden_size / num_heads
    "gemma": {**_LLAMA_KEYS, "head_dim": ("head_dim",)},
    "bloom": {
        "vocab_size": ("vocab_size",),
        "hidden_size": ("n_embed", "hidden_size"),
        "intermediate_size": ("n_embed", "hidden_size"),
        "num_layers": ("n_layer", "num_hidden_layers"),
        "num_heads": ("n_head", "num_attention_heads"),
        "num_kv_heads": ("n_head", "num_attention_heads"),
        "head_dim": ("n_embed", "hidden_size"),
    },
}
SHAPE_FIELDS = tuple(_CONFIG_KEYS["llama"])


@dataclass(frozen=True)
class Expected:
    shape: tuple[int, ...]
    formula: str  # the config keys the shape comes from, for error messages


def config_key(config: dict, architecture: str, field: str) -> str:
    """The config.json key `field` was read from: the first one present, else the one expected."""
    keys = _CONFIG_KEYS[architecture][field]
    return next((k for k in keys if config.get(k) is not None), keys[0])


def bloom_prefix(names: Collection[str]) -> str:
    """`transformer.` for a save_pretrained BLOOM, none for bigscience's own checkpoints (as
    `BloomModel` decides)."""
    return "transformer." if "transformer.word_embeddings.weight" in names else ""


def layer_prefix(arch: LlamaArch, names: Collection[str]) -> str:
    """What every tensor name of a decoder layer starts with, before its index."""
    return f"{bloom_prefix(names)}h." if arch.architecture == "bloom" else "model.layers."


def layer_indices(arch: LlamaArch, names: Collection[str]) -> dict[int, list[str]]:
    """The decoder-layer index of each layer tensor in `names`, and those tensors."""
    pattern = re.compile(re.escape(layer_prefix(arch, names)) + r"(\d+)\.")
    layers: dict[int, list[str]] = {}
    for name in names:
        match = pattern.match(name)
        if match:
            layers.setdefault(int(match.group(1)), []).append(name)
    return layers


def ignorable(arch: LlamaArch, name: str) -> bool:
    """A tensor the decoder does not read and does not need: a recomputed buffer, or an LM head that
    `tie_word_embeddings` replaces by the embeddings (as transformers ties them on load)."""
    return name.endswith(_RECOMPUTED_SUFFIXES) or (arch.tie_word_embeddings and name == "lm_head.weight")


def expected_tensors(arch: LlamaArch, names: Collection[str]) -> dict[str, Expected]:
    """Every tensor the decoder for `arch` reads, with its shape; `names` (the checkpoint's) only
    decides BLOOM's prefix."""
    table = _bloom_tensors(arch, bloom_prefix(names)) if arch.architecture == "bloom" else _llama_tensors(arch)
    if arch.architecture == "gemma":
        table |= _gemma_extra_tensors(arch)
    if not arch.tie_word_embeddings:
        table["lm_head.weight"] = Expected((arch.vocab_size, arch.hidden_size), "vocab_size x hidden_size")
    return table


def _llama_tensors(arch: LlamaArch) -> dict[str, Expected]:
    h, inter = arch.hidden_size, arch.intermediate_size
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    q_dim, kv_dim = "num_attention_heads*head_dim", "num_key_value_heads*head_dim"
    table = {
        "model.embed_tokens.weight": Expected((arch.vocab_size, h), "vocab_size x hidden_size"),
        "model.norm.weight": Expected((h,), "hidden_size"),
    }
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        attn, mlp = p + "self_attn.", p + "mlp."
        table |= {
            p + "input_layernorm.weight": Expected((h,), "hidden_size"),
            p + "post_attention_layernorm.weight": Expected((h,), "hidden_size"),
            attn + "q_proj.weight": Expected((q, h), f"{q_dim} x hidden_size"),
            attn + "k_proj.weight": Expected((kv, h), f"{kv_dim} x hidden_size"),
            attn + "v_proj.weight": Expected((kv, h), f"{kv_dim} x hidden_size"),
            attn + "o_proj.weight": Expected((h, q), f"hidden_size x {q_dim}"),
            mlp + "gate_proj.weight": Expected((inter, h), "intermediate_size x hidden_size"),
            mlp + "up_proj.weight": Expected((inter, h), "intermediate_size x hidden_size"),
            mlp + "down_proj.weight": Expected((h, inter), "hidden_size x intermediate_size"),
        }
        if arch.qkv_bias:
            table |= {
                attn + "q_proj.bias": Expected((q,), q_dim),
                attn + "k_proj.bias": Expected((kv,), kv_dim),
                attn + "v_proj.bias": Expected((kv,), kv_dim),
            }
    return table


def _gemma_extra_tensors(arch: LlamaArch) -> dict[str, Expected]:
    """Gemma's norms beyond Llama's: after attention's output and around the MLP, and Gemma-3's
    per-head q/k norms."""
    h, d = (arch.hidden_size,), (arch.head_dim,)
    table = {}
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        table |= {p + f"{n}_feedforward_layernorm.weight": Expected(h, "hidden_size") for n in ("pre", "post")}
        if arch.qk_norm:
            table |= {p + f"self_attn.{n}_norm.weight": Expected(d, "head_dim") for n in "qk"}
    return table


def _bloom_tensors(arch: LlamaArch, prefix: str) -> dict[str, Expected]:
    h, inter = arch.hidden_size, arch.intermediate_size

    def with_bias(name: str, shape: tuple[int, ...], formula: str) -> dict[str, Expected]:
        bias = Expected(shape[:1], formula.split(" x ")[0])
        return {f"{name}.weight": Expected(shape, formula), f"{name}.bias": bias}

    def norm(name: str) -> dict[str, Expected]:
        return with_bias(name, (h,), "hidden_size")

    table = {
        f"{prefix}word_embeddings.weight": Expected((arch.vocab_size, h), "vocab_size x hidden_size"),
        **norm(f"{prefix}word_embeddings_layernorm"),
        **norm(f"{prefix}ln_f"),
    }
    for i in range(arch.num_layers):
        p = f"{prefix}h.{i}."
        table |= {
            **norm(p + "input_layernorm"),
            **norm(p + "post_attention_layernorm"),
            **with_bias(p + "self_attention.query_key_value", (3 * h, h), "3*hidden_size x hidden_size"),
            **with_bias(p + "self_attention.dense", (h, h), "hidden_size x hidden_size"),
            **with_bias(p + "mlp.dense_h_to_4h", (inter, h), "4*hidden_size x hidden_size"),
            **with_bias(p + "mlp.dense_4h_to_h", (h, inter), "hidden_size x 4*hidden_size"),
        }
    return table
