"""`LlamaArch`: the shape of a Llama-family (or BLOOM) decoder, from GGUF metadata, an HF config.json or a dict."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from paged.model.hf_layer_types import GEMMA_MODEL_TYPES, gemma_keys, implied_layer_types, layer_windows

# Llama, Mistral and Qwen2 are the Llama decoder (Qwen2 adds a bias to q/k/v, Mistral a sliding
# window); Gemma-2 and Gemma-3 (text) the Llama decoder with Gemma's changes; BLOOM is a decoder
# of its own.
HF_MODEL_TYPES = ("llama", "mistral", "qwen2", *GEMMA_MODEL_TYPES, "bloom")
# The decoder's math, `LlamaArch.architecture`: llama is RoPE, RMSNorm and a gated SiLU MLP
# (paged.model.llama); gemma adds a scaled embedding, (1 + weight) RMSNorms around both attention
# and MLP, GeGLU, and Gemma's attention options (paged.model.gemma); bloom is ALiBi, LayerNorm, a
# GELU MLP and a bias on every linear layer (paged.model.bloom), its intermediate_size 4 * hidden_size.
ARCHITECTURES = ("llama", "gemma", "bloom")


@dataclass
class LlamaArch:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5  # the norms' epsilon: LayerNorm's for bloom
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    qkv_bias: bool = False
    # Mistral's local attention: a query at position p sees keys p - W < k <= p; None: all of them.
    sliding_window: int | None = None
    architecture: str = "llama"
    # Per layer, its window (None: full attention), for models whose layers differ (Gemma-2/3,
    # Qwen2's max_window_layers); None: every layer has `sliding_window`. It decides
    # `sliding_window`: equal entries fold into it, mixed ones leave it None, so code that reads
    # only `sliding_window` treats a mixed model as full attention and never frees a block that a
    # full layer still reads (`windows` is each layer's).
    layer_windows: list[int | None] | None = None
    # Gemma's: the softmax scale is query_pre_attn_scalar ** -0.5 (None: head_dim's), attention
    # and final logits are soft-capped to c * tanh(x / c) (None: not), Gemma-3 RMS-normalises q and
    # k per head (`qk_norm`), its sliding layers rotate with `rope_local_theta` (None:
    # `rope_theta`) and its full layers divide positions by `rope_linear_factor`.
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    qk_norm: bool = False
    rope_local_theta: float | None = None
    rope_linear_factor: float = 1.0

    def __post_init__(self) -> None:
        window = self.sliding_window
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
            raise ValueError(f"sliding_window={window!r} must be a positive integer or None")
        if self.layer_windows is not None:
            self._fold_layer_windows()
        if self.architecture not in ARCHITECTURES:
            allowed = ", ".join(ARCHITECTURES)
            raise ValueError(f"architecture={self.architecture!r} is not supported; allowed: {allowed}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.architecture == "bloom" and self.num_kv_heads != self.num_heads:
            raise ValueError(f"bloom has one KV head per query head: num_kv_heads={self.num_kv_heads} must be "
                             f"num_heads={self.num_heads}")
        if self.architecture != "bloom" and self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        gemma_only = [name for name in ("query_pre_attn_scalar", "final_logit_softcapping", "rope_local_theta")
                      if getattr(self, name) is not None] + ["qk_norm"] * self.qk_norm
        gemma_only += ["rope_linear_factor"] * (self.rope_linear_factor != 1.0)
        if self.architecture != "gemma" and gemma_only:
            raise ValueError(f"{', '.join(gemma_only)} apply to architecture=gemma only, not {self.architecture!r}")
        positive = ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping", "rope_linear_factor")
        for name in positive:
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or value <= 0):
                raise ValueError(f"{name}={value!r} must be a positive number")

    def _fold_layer_windows(self) -> None:
        windows = self.layer_windows
        if not isinstance(windows, list | tuple) or len(windows) != self.num_layers:
            raise ValueError(f"layer_windows={windows!r} must list one window per layer ({self.num_layers})")
        for w in windows:
            if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w <= 0):
                raise ValueError(f"layer_windows entry {w!r} must be a positive integer or None (full attention)")
        if len(set(windows)) == 1:
            self.sliding_window, self.layer_windows = windows[0], None
        else:
            self.sliding_window, self.layer_windows = None, list(windows)

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Each layer's attention window in tokens; None: full attention."""
        if self.layer_windows is not None:
            return tuple(self.layer_windows)
        return (self.sliding_window,) * self.num_layers

    @property
    def softmax_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LlamaArch:
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown LlamaArch keys {sorted(unknown)}; known: {sorted(known)}")
        return cls(**d)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> LlamaArch:
        """From a parsed HF config.json (Llama, SmolLM, Mistral, Qwen2, Gemma-2, Gemma-3 text or BLOOM)."""
        model_type = cfg.get("model_type")
        if model_type == "gemma3":
            raise ValueError("model_type='gemma3' is Gemma-3's image-text checkpoint; only its text model is "
                             "supported (model_type gemma3_text, as Gemma3ForCausalLM saves it)")
        if model_type not in HF_MODEL_TYPES:
            raise ValueError(f"model_type={model_type!r} is not supported; supported: {', '.join(HF_MODEL_TYPES)}")
        if model_type == "bloom":
            return cls._from_bloom_config(cfg)
        if model_type in GEMMA_MODEL_TYPES:
            return cls(**gemma_keys(cfg))
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise NotImplementedError(f"rope scaling {rope_type!r} is not implemented; only plain RoPE is")
        num_heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=[] if eos is None else list(eos) if isinstance(eos, list) else [eos],
            qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            sliding_window=_hf_sliding_window(cfg),
            layer_windows=_hf_layer_windows(cfg),
        )

    @classmethod
    def _from_bloom_config(cls, cfg: dict[str, Any]) -> LlamaArch:
        """BloomConfig's keys and defaults: `n_embed` (older configs) wins over `hidden_size`, and
        `n_layer` / `n_head` may be spelled `num_hidden_layers` / `num_attention_heads`."""
        if cfg.get("apply_residual_connection_post_layernorm", False):
            raise NotImplementedError("bloom with apply_residual_connection_post_layernorm=true is not implemented")
        hidden = cfg.get("n_embed") or cfg.get("hidden_size", 64)
        num_heads = cfg.get("n_head") or cfg.get("num_attention_heads", 8)
        if hidden % num_heads:
            raise ValueError(f"bloom hidden_size={hidden} is not a multiple of n_head={num_heads}")
        eos = cfg.get("eos_token_id", 2)
        return cls(
            vocab_size=cfg.get("vocab_size", 250880),
            hidden_size=hidden,
            intermediate_size=4 * hidden,
            num_layers=cfg.get("n_layer") or cfg.get("num_hidden_layers", 2),
            num_heads=num_heads,
            num_kv_heads=num_heads,
            head_dim=hidden // num_heads,
            rms_norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
            bos_token_id=cfg.get("bos_token_id", 1),
            eos_token_ids=[] if eos is None else list(eos) if isinstance(eos, list) else [eos],
            qkv_bias=True,
            architecture="bloom",
        )

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]]) -> LlamaArch:
        """From GGUF scalar key/values (`llama.*`, `tokenizer.ggml.*`) and the stored tensors' shapes
        (torch order, `[out, in]`)."""
        arch = meta["general.architecture"]
        if arch not in ("llama", "qwen2"):
            raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: llama, qwen2")

        def key(name: str, default: Any = None) -> Any:
            return meta.get(f"{arch}.{name}", default)

        num_heads = key("attention.head_count")
        hidden = key("embedding_length")
        eos = meta.get("tokenizer.ggml.eos_token_id")
        return cls(
            vocab_size=key("vocab_size") or tensor_shapes["token_embd.weight"][0],
            hidden_size=hidden,
            intermediate_size=key("feed_forward_length"),
            num_layers=key("block_count"),
            num_heads=num_heads,
            num_kv_heads=key("attention.head_count_kv", num_heads),
            head_dim=key("rope.dimension_count") or hidden // num_heads,
            rope_theta=float(key("rope.freq_base", 10000.0)),
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
            tie_word_embeddings="output.weight" not in tensor_shapes,
            max_position_embeddings=key("context_length", 2048),
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=[] if eos is None else [eos],
            qkv_bias="blk.0.attn_q.bias" in tensor_shapes,
            sliding_window=key("attention.sliding_window"),
        )


def _hf_sliding_window(cfg: dict[str, Any]) -> int | None:
    """The window of every layer: Mistral's `sliding_window` (null: none); Llama has none; Qwen2's
    is per layer (`_hf_layer_windows`)."""
    return cfg.get("sliding_window") if cfg["model_type"] == "mistral" else None


def _hf_layer_windows(cfg: dict[str, Any]) -> list[int | None] | None:
    """Each layer's window where they may differ, as transformers reads the config: Qwen2 ignores
    `sliding_window` unless `use_sliding_window`, and then windows only layers `>= max_window_layers`
    (or those `layer_types` names). None: every layer has `_hf_sliding_window`'s."""
    window = cfg.get("sliding_window")
    if cfg["model_type"] != "qwen2" or window is None or not cfg.get("use_sliding_window"):
        return None
    return layer_windows(implied_layer_types(cfg), window)
