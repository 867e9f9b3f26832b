"""Attention through the paged KV cache, as the model's per-layer callback.

`PagedAttention` is built once per step from the step's `BatchInput` (`paged.executor.step_plan`):
it plans the cache write and the attention ops once (`paged.kernels.planned`: the rows' values
checked on the host, the backend's per-step work done), and the model calls it once per layer with
that layer's q, k and v. A step may mix decode rows (one new token) and prefill rows (several,
possibly after cached ones): decode rows run the `paged_attention` kernel (v1 or v2), prefill rows
`prefill_attention`, one call each, so tokens a prefix-cache hit already holds are never
recomputed. With a sliding window both ops attend only the last `sliding_window` positions, and
never read the blocks wholly before them (the block manager may have freed those).
"""

from __future__ import annotations

import torch

from paged.executor.kv_scales import KVScales
from paged.executor.step_plan import BatchInput
from paged.kernels.planned import AttentionSettings, CacheWrite, DecodeAttention, PrefillAttention


class PagedAttention:
    """The model's attention callback for one step: `(layer, q, k, v) -> out`, rows in batch order.
    `decode_version` (v1/v2/v3) is the kernel the decode rows run, `None` when the step has none;
    `kv_scales` the fp8 cache's scales (`None` for a cache in the model's dtype)."""

    def __init__(
        self,
        batch: BatchInput,
        key_caches: list[torch.Tensor],
        value_caches: list[torch.Tensor],
        settings: AttentionSettings,
        *,
        decode_version: str | None,
        num_heads: int,
        kv_scales: KVScales | None = None,
    ) -> None:
        assert (decode_version is None) == (batch.decode is None), "decode rows need a version, and only they"
        self.batch = batch
        self.key_caches = key_caches
        self.value_caches = value_caches
        self.kv_scales = kv_scales
        num_blocks, num_kv_heads, head_size, block_size = value_caches[0].shape
        self.write = CacheWrite(batch.slot_mapping, batch.host.slot_mapping, settings.backend, num_blocks * block_size)
        self.decode = None if batch.decode is None or decode_version is None else DecodeAttention(
            batch.decode, settings, decode_version, num_heads, num_kv_heads, head_size, num_blocks, block_size)
        self.prefill = None if batch.prefill is None else PrefillAttention(
            batch.prefill, settings, num_kv_heads, head_size, num_blocks, block_size)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b = self.batch
        caches = self.key_caches[layer], self.value_caches[layer]
        scales: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
        if self.kv_scales is not None:
            scales = self.kv_scales.for_layer(layer, k, v)
        self.write(k, v, *caches, *scales)
        if self.prefill is None:
            assert self.decode is not None
            return self.decode(q, *caches, *scales)
        if self.decode is None:
            return self.prefill(q, *caches, *scales)
        out = torch.empty_like(q)
        out[b.decode_tokens] = self.decode(q[b.decode_tokens], *caches, *scales)
        out[b.prefill_tokens] = self.prefill(q[b.prefill_tokens], *caches, *scales)
        return out
