"""Where a simulated deployment's GPU memory goes, and how much is left for the KV cache.

As vLLM profiles it: `gpu_memory_utilization` of every GPU's memory, less that GPU's share of the
weights, less the activation peak of one `max_num_batched_tokens` step, holds the KV cache. Weights
and activations are at the model's dtype whatever the cache's: an fp8 cache gets the same bytes,
and its blocks (priced by `SimExecutor.kv_cache_spec`) are smaller.
"""

from __future__ import annotations

from dataclasses import dataclass

from paged.config import ConfigError
from paged.model.spec import ModelSpec
from paged.sim.hardware import Hardware

GB = 1e9


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per GPU, except `kv_cache_bytes` (all GPUs together)."""

    usable_bytes: int
    weights_bytes: int
    activation_bytes: int
    kv_cache_bytes: int

    def describe(self, hw: Hardware, utilization: float, kv_cache: str) -> str:
        """`kv_cache` names the cache's element type, e.g. "fp8_e4m3 (1 B/elem)"."""
        return (
            f"{hw.num_gpus} x {hw.name}: {utilization:g} x {hw.memory / GB:.1f} GB = {self.usable_bytes / GB:.1f} GB "
            f"per GPU, less {self.weights_bytes / GB:.1f} GB weights and {self.activation_bytes / GB:.2f} GB "
            f"activations, leaves {self.kv_cache_bytes / GB:.1f} GB of KV cache {kv_cache} in all"
        )


def splits(spec: ModelSpec, num_gpus: int) -> bool:
    """Tensor parallelism splits the attention heads evenly; KV heads split or are replicated."""
    kv = spec.num_kv_heads
    return not spec.num_heads % num_gpus and not (kv % num_gpus and num_gpus % kv)


def check_parallelism(spec: ModelSpec, num_gpus: int) -> None:
    if not splits(spec, num_gpus):
        allowed = [g for g in range(1, spec.num_heads + 1) if splits(spec, g)]
        raise ConfigError(
            f"hardware.num_gpus={num_gpus} does not divide {spec.name}'s {spec.num_heads} attention heads "
            f"({spec.num_kv_heads} KV heads); allowed: {', '.join(map(str, allowed))}"
        )


def activation_bytes(spec: ModelSpec, num_gpus: int, dtype_bytes: int, num_tokens: int, num_seqs: int) -> int:
    """The live activations at the peak of one step (per GPU): the residual stream and its normed
    copy plus the widest layer intermediate (attention's q/k/v/out or the MLP's up and activation),
    and fp32 logits with their softmax for every sampled row."""
    h, inter = spec.hidden_size, spec.intermediate_size // num_gpus
    q = spec.num_heads * spec.head_dim // num_gpus
    kv = max(1, spec.num_kv_heads // num_gpus) * spec.head_dim
    up = 2 * inter if spec.mlp == "gated-silu" else inter
    widest = max(2 * q + 2 * kv, up + inter)
    logits = 2 * min(num_seqs, num_tokens) * spec.vocab_size * 4
    return num_tokens * (2 * h + widest) * dtype_bytes + logits


def plan_memory(
    spec: ModelSpec, hw: Hardware, dtype_bytes: int, *, utilization: float, max_num_batched_tokens: int,
    max_num_seqs: int,
) -> MemoryPlan:
    """The KV budget, or a ConfigError saying by how much the weights miss and how many GPUs fit."""
    check_parallelism(spec, hw.num_gpus)
    usable = int(utilization * hw.memory)
    weights = spec.num_params * dtype_bytes // hw.num_gpus
    activations = activation_bytes(spec, hw.num_gpus, dtype_bytes, max_num_batched_tokens, max_num_seqs)
    free = usable - weights - activations
    if free <= 0:
        raise ConfigError(
            f"model={spec.name} does not fit on {hw.num_gpus} x {hw.name}: each GPU needs "
            f"{weights / GB:.1f} GB of weights and {activations / GB:.2f} GB of activations but has "
            f"{usable / GB:.1f} GB ({utilization:g} x {hw.memory / GB:.1f} GB), short by {-free / GB:.1f} GB; "
            f"{_suggestion(spec, hw, dtype_bytes, utilization, max_num_batched_tokens, max_num_seqs)}"
        )
    return MemoryPlan(usable, weights, activations, free * hw.num_gpus)


def _suggestion(
    spec: ModelSpec, hw: Hardware, dtype_bytes: int, utilization: float, tokens: int, seqs: int
) -> str:
    usable = utilization * hw.memory
    for g in range(hw.num_gpus + 1, spec.num_heads + 1):
        needed = spec.num_params * dtype_bytes / g + activation_bytes(spec, g, dtype_bytes, tokens, seqs)
        if splits(spec, g) and needed < usable:
            return f"try hardware.num_gpus={g}"
    return "no tensor-parallel degree that divides its heads fits; use GPUs with more memory"
