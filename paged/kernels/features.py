"""The kernel options beyond plain attention, vLLM's names and meanings: an fp8 KV cache with
per-head scales, ALiBi slopes, block-sparse attention, and Gemma-2's attention logit soft-capping.
Checked here once, for every backend.

fp8 (`kv_cache_dtype` fp8_e4m3 / fp8_e5m2): the cache tensors have torch's `float8_e4m3fn` /
`float8_e5m2` dtype. `reshape_and_cache` stores `fp8(clamp(x / scale, -max, max))`, rounding to
nearest even, and attention reads `float(fp8) * scale`, with one scale per KV head (a per-tensor
scale is the same number for every head). Every backend rounds the same way: the clamp makes the
saturating CUDA conversion and torch's (which overflows to NaN / inf) agree.

Block-sparse (`BlockSparse`): positions are grouped in sparse blocks of `block_size` tokens; a
query in sparse block q attends to sparse block k (k <= q) when it is one of the `local_blocks`
last ones (k > q - local_blocks) or a "vertical" one, (k + offset) % vert_stride == 0, where the
offset slides with the head: head * head_sliding_step + 1 (a negative step slides per KV head).

A float cache dtype other than the model's (`kv_cache_dtype` float32 / bfloat16 under a bfloat16 /
float32 model) stores K/V converted as they are written (torch's `.to`, rounding to nearest even) and
is read as fp32, like every cache; backends that cannot convert refuse the pair
(`KernelBackend.converts_cache_dtype`).

Soft-capping (`soft_cap` c, Gemma-2's `attn_logit_softcapping`): each scaled logit s becomes
c * tanh(s / c) before masking and the softmax, so no logit's magnitude exceeds c.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from paged.config.choices import FLOAT_KV_CACHE_DTYPES, FP8_KV_CACHE_DTYPES
from paged.config.kernel_options import BlockSparseSpec

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# kernel.kv_cache_dtype -> the cache tensors' dtype (auto: the model's, `cache_dtype`)
KV_CACHE_DTYPES = {
    **{name: getattr(torch, name) for name in FLOAT_KV_CACHE_DTYPES},
    **dict(zip(FP8_KV_CACHE_DTYPES, FP8_DTYPES, strict=True)),
}
# The largest finite value of each format: stored values are clamped to it.
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of the KV cache for `kernel.kv_cache_dtype` (auto: the model's)."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is not supported; allowed: auto, "
                         f"{', '.join(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[kv_cache_dtype]


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` `[..., num_kv_heads, head_size]` stored as fp8 `dtype` with per-head `scale`."""
    limit = FP8_MAX[dtype]
    return (x.float() / scale[:, None]).clamp(-limit, limit).to(dtype)


@dataclass(frozen=True)
class BlockSparse(BlockSparseSpec):
    """The block-sparse pattern the kernels apply (module docstring); settings and checks are
    `BlockSparseSpec`'s."""

    def offsets(self, num_heads: int, num_kv_heads: int, device: torch.device) -> torch.Tensor:
        """int64 `[num_heads]`: each query head's vertical offset."""
        heads = torch.arange(num_heads, device=device)
        if self.head_sliding_step >= 0:
            return heads * self.head_sliding_step + 1
        return heads // (num_heads // num_kv_heads) * -self.head_sliding_step + 1

    def allowed(
        self, query_pos: torch.Tensor, key_pos: torch.Tensor, offsets: torch.Tensor
    ) -> torch.Tensor:
        """bool, broadcast of `query_pos` `[..., Q, 1]`, `key_pos` `[..., 1, K]` and `offsets`
        `[H, 1, 1]`: the sparse pattern (causality is the caller's)."""
        q_block = torch.div(query_pos, self.block_size, rounding_mode="floor")
        k_block = torch.div(key_pos, self.block_size, rounding_mode="floor")
        local = k_block > q_block - self.local_blocks
        remote = (k_block + offsets) % self.vert_stride == 0
        return local | remote


@dataclass(frozen=True)
class AttentionFeatures:
    """What attention adds to q·k: ALiBi slopes (fp32 `[num_heads]`, bias slope * (k - q)), a
    block-sparse pattern and a logit soft-cap. `NONE` is plain attention."""

    alibi_slopes: torch.Tensor | None = None
    blocksparse: BlockSparse | None = None
    soft_cap: float | None = None

    @property
    def plain(self) -> bool:
        return self.alibi_slopes is None and self.blocksparse is None and self.soft_cap is None

    @property
    def names(self) -> tuple[str, ...]:
        """The features in use, as backends declare them (`KernelBackend.features`)."""
        used = (("alibi", self.alibi_slopes is not None), ("blocksparse", self.blocksparse is not None),
                ("softcap", self.soft_cap is not None))
        return tuple(name for name, on in used if on)


NONE = AttentionFeatures()


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """ALiBi's geometric slopes (Press et al.; BLOOM's build_alibi_tensor), fp32 `[num_heads]`."""
    closest = 2 ** math.floor(math.log2(num_heads))
    base = 2.0 ** (-(2.0 ** -(math.log2(closest) - 3)))
    slopes = [base ** (i + 1) for i in range(closest)]
    if closest != num_heads:
        extra = 2.0 ** (-(2.0 ** -(math.log2(2 * closest) - 3)))
        slopes += [extra ** (2 * i + 1) for i in range(min(closest, num_heads - closest))]
    return torch.tensor(slopes, dtype=torch.float32)
