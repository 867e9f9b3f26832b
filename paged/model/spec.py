"""`ModelSpec`: a decoder's shape without its weights, enough to cost a step and size a KV cache.

Spec-only models (`model.source=spec`, e.g. `model=opt-13b`) describe their architecture in
`model.arch`; a model with weights (gguf / hf / random) is described by its `LlamaArch`. OPT is
not a Llama: learned absolute positions, multi-head attention, a ReLU MLP of two matrices
(fc1 h -> 4h, fc2 4h -> h), LayerNorm, and a bias on every linear layer; the fields below say so
rather than forcing it into Llama's gated-SiLU, RoPE and RMSNorm shape. BLOOM (a `LlamaArch` with
architecture bloom) is OPT's shape with a GELU MLP and ALiBi, which adds no position parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from paged.config import ModelConfig
from paged.model.arch import LlamaArch
from paged.model.weights import arch_overrides, load_arch

MLP_KINDS = ("gated-silu", "relu", "gelu")
POSITION_KINDS = ("rope", "learned", "alibi")
NORM_KINDS = ("rmsnorm", "layernorm")
# HF's `layer_types` entries: a layer attends within `sliding_window`, or to the whole context
LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass(frozen=True)
class ModelSpec:
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int = 2048
    mlp: str = "gated-silu"  # gated-silu: gate, up, down (Llama); relu: fc1, fc2 (OPT); gelu: the same two (BLOOM)
    # rope: rotary on q/k; learned: a position embedding table (OPT); alibi: a bias in attention (BLOOM)
    positions: str = "rope"
    norm: str = "rmsnorm"
    linear_bias: bool = False  # a bias on every linear layer (OPT), else none
    qkv_bias: bool = False  # a bias on q/k/v only (Qwen2)
    tie_word_embeddings: bool = False
    sliding_window: int | None = None  # attention window in tokens (Mistral); None: the whole context
    # Models whose layers differ (Gemma-2/3), spelled as HF configs do: every `sliding_window_pattern`-th
    # layer (the n-th, 2n-th, ...) attends to the whole context and the others within `sliding_window`
    # (Gemma-3's key; Gemma-2 alternates, pattern 2), or `layer_types` names each layer's type. Neither:
    # every layer has `sliding_window`.
    sliding_window_pattern: int | None = None
    layer_types: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        for key, value, allowed in (
            ("mlp", self.mlp, MLP_KINDS), ("positions", self.positions, POSITION_KINDS), ("norm", self.norm, NORM_KINDS)
        ):
            if value not in allowed:
                raise ValueError(f"model.arch.{key}={value!r} is not supported; allowed: {', '.join(allowed)}")
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "int" and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"model.arch.{f.name}={value!r} must be a positive integer")
        window = self.sliding_window
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
            raise ValueError(f"model.arch.sliding_window={window!r} must be a positive integer or null")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        self._check_layer_types()

    def _check_layer_types(self) -> None:
        pattern, types = self.sliding_window_pattern, self.layer_types
        if pattern is not None and types is not None:
            raise ValueError("model.arch.sliding_window_pattern and model.arch.layer_types both give the layer types; "
                             "set one of them")
        if pattern is not None and (isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 2):
            raise ValueError(f"model.arch.sliding_window_pattern={pattern!r} must be an integer >= 2 "
                             "(every n-th layer attends to the whole context)")
        if types is not None:
            object.__setattr__(self, "layer_types", tuple(types))  # a YAML list arrives as a list
            if len(self.layer_types) != self.num_layers or not set(self.layer_types) <= set(LAYER_TYPES):
                raise ValueError(f"model.arch.layer_types must name one of {', '.join(LAYER_TYPES)} for each of "
                                 f"the {self.num_layers} layers, got {list(types)!r}")
        if (pattern is not None or types is not None) and self.sliding_window is None:
            raise ValueError("model.arch.sliding_window must be set for the sliding layers that "
                             "sliding_window_pattern / layer_types name")

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's attention window in tokens (None: the whole context)."""
        window, n = self.sliding_window, self.num_layers
        if self.sliding_window_pattern is not None:
            return tuple(None if (i + 1) % self.sliding_window_pattern == 0 else window for i in range(n))
        if self.layer_types is not None:
            return tuple(window if t == "sliding_attention" else None for t in self.layer_types)
        return (window,) * n

    @classmethod
    def from_dict(cls, name: str, d: dict[str, Any]) -> ModelSpec:
        known = {f.name for f in fields(cls)} - {"name"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"model.arch has unknown keys {unknown}; known: {', '.join(sorted(known))}")
        return cls(name=name, **d)

    @classmethod
    def from_llama(cls, name: str, arch: LlamaArch) -> ModelSpec:
        """Gemma's GeGLU MLP has a gated MLP's three matrices: costed as gated-silu."""
        bloom = arch.architecture == "bloom"
        windows = arch.windows
        sliding = {w for w in windows if w is not None}
        if len(sliding) > 1:
            raise ValueError(f"{name}: layers with windows {sorted(sliding)} cannot be simulated (one window size)")
        types = tuple("full_attention" if w is None else "sliding_attention" for w in windows)
        return cls(
            name=name,
            vocab_size=arch.vocab_size,
            hidden_size=arch.hidden_size,
            intermediate_size=arch.intermediate_size,
            num_layers=arch.num_layers,
            num_heads=arch.num_heads,
            num_kv_heads=arch.num_kv_heads,
            head_dim=arch.head_dim,
            max_position_embeddings=arch.max_position_embeddings,
            mlp="gelu" if bloom else "gated-silu",
            positions="alibi" if bloom else "rope",
            norm="layernorm" if bloom else "rmsnorm",
            linear_bias=bloom,
            qkv_bias=arch.qkv_bias,
            tie_word_embeddings=arch.tie_word_embeddings,
            sliding_window=sliding.pop() if sliding else None,
            layer_types=types if len(set(windows)) > 1 else None,
        )

    # -- per layer ---------------------------------------------------------------------------------

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attention_params(self) -> int:
        """q, k, v and output projections (with their biases)."""
        h = self.hidden_size
        params = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.linear_bias:
            params += self.q_size + 2 * self.kv_size + h
        elif self.qkv_bias:
            params += self.q_size + 2 * self.kv_size
        return params

    @property
    def mlp_params(self) -> int:
        h, i = self.hidden_size, self.intermediate_size
        matrices = 3 if self.mlp == "gated-silu" else 2
        bias = (i + h) if self.linear_bias else 0
        return matrices * h * i + bias

    @property
    def layer_params(self) -> int:
        norms = 2 * self.hidden_size * (2 if self.norm == "layernorm" else 1)
        return self.attention_params + self.mlp_params + norms

    # -- whole model -------------------------------------------------------------------------------

    @property
    def embedding_params(self) -> int:
        """Token embeddings, plus OPT's learned positions (its table has 2 offset rows)."""
        params = self.vocab_size * self.hidden_size
        if self.positions == "learned":
            params += (self.max_position_embeddings + 2) * self.hidden_size
        return params

    @property
    def lm_head_params(self) -> int:
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        final_norm = self.hidden_size * (2 if self.norm == "layernorm" else 1)
        return self.num_layers * self.layer_params + self.embedding_params + self.lm_head_params + final_norm

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of one token in every layer: OPT-13B in fp16 takes 800 KB (the paper's figure)."""
        return 2 * self.num_layers * self.kv_size * dtype_bytes


def model_spec(model: ModelConfig) -> tuple[ModelSpec, Any]:
    """The model's shape, and its tokenizer source when it has weights (a spec-only model has none)."""
    if model.source == "spec":
        return ModelSpec.from_dict(model.name, arch_overrides(model)), None
    arch, tokenizer_source = load_arch(model)  # metadata only: the weights stay on disk
    return ModelSpec.from_llama(model.name, arch), tokenizer_source
