"""Per-layer fp8 scales of the KV cache: given by config, or calibrated on the first K/V written.

Calibration is vLLM's `calculate_kv_scales` idea with per-head scales: the first step that writes a
layer's cache (a prefill) measures each KV head's largest |K| and |V| and sets
scale = amax * CALIBRATION_HEADROOM / the format's max, so values up to twice those seen land in
range and the rest saturate. The scales then stay fixed: cached bytes must keep one meaning.
"""

from __future__ import annotations

import torch

from paged.kernels.features import FP8_MAX

# Later tokens may be larger than the calibration batch's: keep 2x of range in reserve.
CALIBRATION_HEADROOM = 2.0
# A head whose values are all zero still needs a positive scale.
MIN_SCALE = 1e-6


class KVScales:
    """`k[layer]`, `v[layer]`: fp32 `[num_kv_heads]` scales on the cache device, once known."""

    def __init__(
        self, num_layers: int, num_kv_heads: int, dtype: torch.dtype, device: torch.device,
        k_scale: float | None, v_scale: float | None,
    ) -> None:
        self.dtype = dtype

        def given(value: float | None) -> list[torch.Tensor | None]:
            if value is None:
                return [None] * num_layers
            return [torch.full((num_kv_heads,), float(value), dtype=torch.float32, device=device)] * num_layers

        self.k, self.v = given(k_scale), given(v_scale)

    def _measure(self, x: torch.Tensor) -> torch.Tensor:
        amax = x.detach().float().abs().amax(dim=(0, 2))  # [num_kv_heads]
        return (amax * CALIBRATION_HEADROOM / FP8_MAX[self.dtype]).clamp_min(MIN_SCALE)

    def for_layer(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's scales, calibrated from this step's `k`, `v` `[T, kv_heads, D]` if not known."""
        if self.k[layer] is None:
            self.k[layer] = self._measure(k)
        if self.v[layer] is None:
            self.v[layer] = self._measure(v)
        return self.k[layer], self.v[layer]
