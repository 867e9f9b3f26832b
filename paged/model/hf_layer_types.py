"""Per-layer attention types and Gemma's keys, read from an HF config.json as transformers reads them.

Models whose layers differ name each layer's type in `layer_types` ("sliding_attention" or
"full_attention"); older configs imply it: Qwen2 windows layers `>= max_window_layers` (when
`use_sliding_window`), Gemma-2 every other layer from the first, Gemma-3 all but every
`sliding_window_pattern`-th. Gemma-2 and Gemma-3 (text) are the Llama decoder with Gemma's changes
(`paged.model.gemma`); `gemma_keys` returns what `LlamaArch` needs of them, and refuses what
`paged.model.gemma` does not run. Kept apart from `paged.model.arch` so that file stays about the
shape every decoder shares.
"""

from __future__ import annotations

from typing import Any

SLIDING, FULL = "sliding_attention", "full_attention"
GEMMA_MODEL_TYPES = ("gemma2", "gemma3_text")
# transformers' ACT2FN name of GeGLU's tanh-approximated GELU, the only activation Gemma ships with
GEMMA_ACTIVATION = "gelu_pytorch_tanh"


def layer_windows(layer_types: list[str], window: int | None) -> list[int | None]:
    """Each layer's window: `window` for a sliding layer, None for a full one (and for every layer
    when `window` is None, as transformers reads a config without one)."""
    unknown = sorted(set(layer_types) - {SLIDING, FULL})
    if unknown:
        raise NotImplementedError(f"layer_types {unknown} are not implemented; supported: {SLIDING}, {FULL}")
    return [window if kind == SLIDING else None for kind in layer_types]


def implied_layer_types(cfg: dict[str, Any]) -> list[str]:
    """`layer_types` as written, else as transformers derives it for the config's model type."""
    num_layers = cfg["num_hidden_layers"]
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers <= 0:
        raise ValueError(f"num_hidden_layers={num_layers!r} must be a positive integer")
    given = cfg.get("layer_types")
    if given is not None:
        if len(given) != num_layers:
            raise ValueError(f"layer_types names {len(given)} layers but num_hidden_layers={num_layers}")
        return list(given)
    model_type = cfg["model_type"]
    if model_type == "gemma2":
        return [SLIDING if (i + 1) % 2 else FULL for i in range(num_layers)]
    if model_type == "gemma3_text":
        pattern = cfg.get("sliding_window_pattern", 6)
        return [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]
    first = cfg.get("max_window_layers", 28)  # qwen2
    return [SLIDING if i >= first else FULL for i in range(num_layers)]


def _rope_theta(rope: dict[str, Any], fallback: float) -> float:
    return float(rope.get("rope_theta", fallback))


def _rope_type(rope: dict[str, Any]) -> str:
    return rope.get("rope_type", rope.get("type", "default"))


def _gemma3_rope(cfg: dict[str, Any]) -> dict[str, Any]:
    """Gemma-3's two RoPEs: global layers' (theta 1e6, linear scaling on the larger models) and the
    sliding layers' `rope_local_base_freq` (1e4); transformers 5 nests them by layer type under
    `rope_parameters`, older configs spell them `rope_theta` / `rope_local_base_freq` / `rope_scaling`."""
    params = cfg.get("rope_parameters") or {}
    if FULL in params or SLIDING in params:
        full, local = params.get(FULL) or {}, params.get(SLIDING) or {}
    else:
        full, local = {**(cfg.get("rope_scaling") or {}), **params}, {}
    if _rope_type(local) != "default":
        raise NotImplementedError(f"rope scaling {_rope_type(local)!r} on sliding layers is not implemented")
    kind = _rope_type(full)
    if kind not in ("default", "linear"):
        raise NotImplementedError(f"rope scaling {kind!r} is not implemented; only plain and linear RoPE are")
    return {
        "rope_theta": _rope_theta(full, cfg.get("rope_theta", 1_000_000.0)),
        "rope_local_theta": _rope_theta(local, cfg.get("rope_local_base_freq", 10_000.0)),
        "rope_linear_factor": float(full.get("factor", 1.0)) if kind == "linear" else 1.0,
    }


def _gemma2_rope(cfg: dict[str, Any]) -> dict[str, Any]:
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if _rope_type(rope) != "default":
        raise NotImplementedError(f"rope scaling {_rope_type(rope)!r} is not implemented for gemma2; "
                                  "only plain RoPE is")
    return {"rope_theta": _rope_theta(rope, cfg.get("rope_theta", 10_000.0))}


def gemma_keys(cfg: dict[str, Any]) -> dict[str, Any]:
    """`LlamaArch` keyword arguments of a Gemma-2 / Gemma-3 text config, with transformers' defaults."""
    model_type = cfg["model_type"]
    activation = cfg.get("hidden_activation") or cfg.get("hidden_act") or GEMMA_ACTIVATION
    if activation != GEMMA_ACTIVATION:
        raise NotImplementedError(f"{model_type} with hidden_activation={activation!r} is not implemented; "
                                  f"only {GEMMA_ACTIVATION!r} is")
    if cfg.get("attention_bias", False):
        raise NotImplementedError(f"{model_type} with attention_bias=true is not implemented")
    if cfg.get("use_bidirectional_attention"):
        raise NotImplementedError(f"{model_type} with use_bidirectional_attention=true is not implemented; "
                                  "only causal attention is")
    gemma3 = model_type == "gemma3_text"
    num_heads = cfg["num_attention_heads"]
    eos = cfg.get("eos_token_id", 1)
    window = cfg.get("sliding_window", 4096)
    return {
        "vocab_size": cfg["vocab_size"],
        "hidden_size": cfg["hidden_size"],
        "intermediate_size": cfg["intermediate_size"],
        "num_layers": cfg["num_hidden_layers"],
        "num_heads": num_heads,
        "num_kv_heads": cfg.get("num_key_value_heads") or num_heads,
        "head_dim": cfg.get("head_dim") or 256,
        "rms_norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True)),
        "max_position_embeddings": cfg.get("max_position_embeddings", 131_072 if gemma3 else 8192),
        "bos_token_id": cfg.get("bos_token_id", 2),
        "eos_token_ids": [] if eos is None else list(eos) if isinstance(eos, list) else [eos],
        "layer_windows": layer_windows(implied_layer_types(cfg), window),
        "architecture": "gemma",
        "query_pre_attn_scalar": float(cfg.get("query_pre_attn_scalar", 256)),
        # transformers' Gemma-3 attention never passes its attn_logit_softcapping on: neither do we
        "attn_logit_softcapping": None if gemma3 else cfg.get("attn_logit_softcapping", 50.0),
        "final_logit_softcapping": cfg.get("final_logit_softcapping", None if gemma3 else 30.0),
        "qk_norm": gemma3,
        **(_gemma3_rope(cfg) if gemma3 else _gemma2_rope(cfg)),
    }
