"""Kernel instantiations: which template arguments exist and which compile unit each op needs.

A `Unit` is what one op configuration launches (v2 needs its reduce kernel too), and it is the
granularity of lazy compilation and of the on-disk caches of both native backends.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from paged.kernels.features import FP8_DTYPES
from paged.kernels.limits import BLOCK_SIZES, DEFAULT_PARTITION_SIZE, NATIVE_HEAD_SIZES
from paged.kernels.v3_layout import H100, MAX_STAGES, MIN_STAGES, v3_stages

NUM_THREADS = 128
CXX_TYPES = {torch.float32: "float", torch.float16: "__half", torch.bfloat16: "__nv_bfloat16"}
CXX_CACHE_TYPES = {torch.float8_e4m3fn: "__nv_fp8_e4m3", torch.float8_e5m2: "__nv_fp8_e5m2"}
OPS = ("attention_v1", "attention_v2", "attention_v3", "cache", "prefill", "layer", "mass")
# v3 CTAs hold this many query heads of a GQA group: the smallest tile that holds the group, else 8
# (larger groups take several head chunks).
GROUP_TILES = (1, 2, 4, 8)


@dataclass(frozen=True, order=True)
class Unit:
    op: str
    dtype: str
    head_size: int = 0
    block_size: int = 0
    partition_size: int = 0
    cache: str = ""  # the KV cache's element type when it is not `dtype` (fp8)
    features: bool = False  # ALiBi / block-sparse compiled in (attention only)
    group_tile: int = 0  # v3: query heads per CTA, of GROUP_TILES
    stages: int = 0  # v3: K/V stages of its pipeline, MIN_STAGES..MAX_STAGES

    def __post_init__(self) -> None:
        assert self.op in OPS, self.op
        assert self.dtype in CXX_TYPES.values(), self.dtype
        assert self.cache in ("", *CXX_CACHE_TYPES.values()), self.cache
        assert (self.op == "attention_v2") == (self.partition_size > 0), self
        assert not (self.features and self.op in ("cache", "layer", "mass")), self
        assert (self.op == "attention_v3") == (self.group_tile in GROUP_TILES), self
        assert (self.op == "attention_v3") == (MIN_STAGES <= self.stages <= MAX_STAGES), self

    @functools.cached_property  # read per launch, per layer
    def kernels(self) -> tuple[str, ...]:
        """C++ name expressions of the kernels this unit launches."""
        t, c, h, b, p = self.dtype, self.cache or self.dtype, self.head_size, self.block_size, self.partition_size
        f = str(self.features).lower()
        if self.op == "attention_v1":
            return (f"paged::paged_attention_v1_kernel<{t}, {c}, {h}, {b}, {NUM_THREADS}, {f}>",)
        if self.op == "attention_v2":
            return (
                f"paged::paged_attention_v2_kernel<{t}, {c}, {h}, {b}, {NUM_THREADS}, {p}, {f}>",
                f"paged::paged_attention_v2_reduce_kernel<{t}, {h}, {NUM_THREADS}, {p}>",
            )
        if self.op == "attention_v3":
            return (
                f"paged::paged_attention_v3_kernel<{t}, {c}, {h}, {b}, {self.group_tile}, {self.stages}, {f}>",
                f"paged::paged_attention_v3_merge_kernel<{t}, {h}>",
            )
        if self.op == "prefill":
            return (f"paged::prefill_attention_kernel<{t}, {c}, {h}, {b}, {f}>",)
        if self.op == "layer":
            return layer_kernels(t)
        if self.op == "mass":
            return (f"paged::attention_mass_lse_kernel<{t}, {c}>", f"paged::attention_mass_kernel<{t}, {c}>")
        return (f"paged::reshape_and_cache_kernel<{t}, {c}>", f"paged::copy_blocks_kernel<{c}>",
                f"paged::move_slots_kernel<{c}>")

    @property
    def label(self) -> str:
        cache = f"/{self.cache}" if self.cache else ""
        if self.op in ("cache", "layer", "mass"):
            return f"{self.op} {self.dtype}{cache}"
        label = f"{self.op.removeprefix('attention_')} {self.dtype}{cache} h{self.head_size} b{self.block_size}"
        label += f" p{self.partition_size}" if self.partition_size else ""
        label += f" g{self.group_tile} s{self.stages}" if self.group_tile else ""
        return label + " +features" * self.features


# The layer kernels that load whole 16-byte vectors where their rows allow it, else one element.
VECTOR_LAYER_OPS = ("rms_norm", "add_rms_norm", "silu_and_mul")
LAYER_OPS = (*VECTOR_LAYER_OPS, "rotary_embedding")


@functools.cache  # called per launch, per layer: the names and units are fixed per argument set
def layer_kernel(dtype: str, op: str, vectorized: bool = False) -> str:
    """The C++ name expression of layer op `op` (of `LAYER_OPS`) in activations of C++ type
    `dtype`; `vectorized`: the variant loading 16 bytes at a time (`VECTOR_LAYER_OPS` only)."""
    assert op in LAYER_OPS and not (vectorized and op not in VECTOR_LAYER_OPS), (op, vectorized)
    if op == "rotary_embedding":
        return f"paged::rotary_embedding_kernel<{dtype}>"
    element_size = next(t for t, name in CXX_TYPES.items() if name == dtype).itemsize
    return f"paged::{op}_kernel<{dtype}, {16 // element_size if vectorized else 1}>"


def layer_kernels(dtype: str) -> tuple[str, ...]:
    """The fused elementwise kernels of a Llama layer in activations of C++ type `dtype`
    (kernels_cu/layer_ops.cuh): each vector op in both variants, then RoPE."""
    vector_ops = [layer_kernel(dtype, op, vectorized) for op in VECTOR_LAYER_OPS for vectorized in (True, False)]
    return (*vector_ops, layer_kernel(dtype, "rotary_embedding"))


@functools.cache
def layer_unit(dtype: torch.dtype) -> Unit:
    """RMSNorm, residual add + RMSNorm, SiLU-and-mul and RoPE of a Llama layer in `dtype`."""
    return Unit("layer", CXX_TYPES[dtype])


@functools.cache
def prefill_unit(
    dtype: torch.dtype, head_size: int, block_size: int, cache_dtype: torch.dtype | None = None,
    features: bool = False,
) -> Unit:
    """The paged varlen prefill kernel (kernels_cu/prefill.cuh); `features`: ALiBi and block-sparse
    compiled in."""
    return Unit("prefill", CXX_TYPES[dtype], head_size, block_size, cache=_cache_type(dtype, cache_dtype),
                features=features)


def _cache_type(dtype: torch.dtype, cache_dtype: torch.dtype | None) -> str:
    return CXX_CACHE_TYPES[cache_dtype] if cache_dtype in FP8_DTYPES else ""


def group_tile(group: int) -> int:
    """v3's query heads per CTA for a GQA group of `group` heads."""
    return next((tile for tile in GROUP_TILES if tile >= group), GROUP_TILES[-1])


@functools.cache  # called per layer's attention: one unit per argument set
def attention_unit(
    dtype: torch.dtype, head_size: int, block_size: int, version: str, partition_size: int,
    cache_dtype: torch.dtype | None = None, features: bool = False, group: int = 1, stages: int | None = None,
) -> Unit:
    """`features`: the kernel with ALiBi and block-sparse compiled in (plain attention runs without);
    `group`: query heads per KV head, which picks v3's head tile; `stages`: v3's pipeline depth
    (None: an H100's, as `paged.kernels.v3_layout.v3_stages` picks it)."""
    cache = _cache_type(dtype, cache_dtype)
    if version == "v3":
        tile = group_tile(group)
        if stages is None:
            element = 1 if cache_dtype in FP8_DTYPES else dtype.itemsize
            stages = v3_stages(H100, element, head_size, tile)
        return Unit("attention_v3", CXX_TYPES[dtype], head_size, block_size, cache=cache, features=features,
                    group_tile=tile, stages=stages)
    if version == "v1":
        return Unit("attention_v1", CXX_TYPES[dtype], head_size, block_size, cache=cache, features=features)
    return Unit("attention_v2", CXX_TYPES[dtype], head_size, block_size, partition_size, cache, features)


@functools.cache
def mass_unit(dtype: torch.dtype, cache_dtype: torch.dtype | None = None) -> Unit:
    """The attention mass kernels (kernels_cu/attention_mass.cuh) of `dtype` queries over a cache of
    `dtype` or fp8; head and block size are run-time arguments (a press scores rarely)."""
    return Unit("mass", CXX_TYPES[dtype], cache=_cache_type(dtype, cache_dtype))


def cache_unit(dtype: torch.dtype, cache_dtype: torch.dtype | None = None) -> Unit:
    """The cache write kernel of `dtype` activations into a `cache_dtype` cache, with the block
    and slot copy kernels of that cache. `copy_blocks` and `copy_slots` know only the cache, so they
    take an fp8 cache's unit with float activations."""
    if dtype in FP8_DTYPES:
        dtype, cache_dtype = torch.float32, dtype
    return Unit("cache", CXX_TYPES[dtype], cache=_cache_type(dtype, cache_dtype))


def dispatchable_units(partition_size: int = DEFAULT_PARTITION_SIZE) -> list[Unit]:
    """Every unit the front end can pick with the given v2 partition size: each activation dtype
    with a cache of its own dtype or of either fp8 format, decode and prefill attention plain or with
    the features, and each dtype's layer ops. v3's pipeline is an H100's depth; another device's
    depth compiles when first used."""
    caches = (None, *FP8_DTYPES)
    units = [cache_unit(dtype, cache) for dtype in CXX_TYPES for cache in caches]
    units += [mass_unit(dtype, cache) for dtype in CXX_TYPES for cache in caches]
    for dtype in CXX_TYPES:
        for cache in caches:
            for head in NATIVE_HEAD_SIZES:
                for block in BLOCK_SIZES:
                    units += [attention_unit(dtype, head, block, v, partition_size, cache, features)
                              for features in (False, True) for v in ("v1", "v2")]
                    units += [attention_unit(dtype, head, block, "v3", 0, cache, features, tile)
                              for features in (False, True) for tile in GROUP_TILES]
                    units += [prefill_unit(dtype, head, block, cache, features) for features in (False, True)]
    return units + [layer_unit(dtype) for dtype in CXX_TYPES]


def default_units() -> list[Unit]:
    """The configurations models run with most: fp16/bf16, head 128, block 16, with a cache of the
    model's dtype or fp8 e4m3 (decode v1 / v2, v3 for GQA groups of 4 and 8, prefill, the cache ops),
    and the layer ops of both dtypes."""
    units = []
    for dtype in (torch.float16, torch.bfloat16):
        for cache in (None, torch.float8_e4m3fn):
            units.append(cache_unit(dtype, cache))
            units += [attention_unit(dtype, 128, 16, v, DEFAULT_PARTITION_SIZE, cache) for v in ("v1", "v2")]
            units += [attention_unit(dtype, 128, 16, "v3", 0, cache, group=group) for group in (4, 8)]
            units.append(prefill_unit(dtype, 128, 16, cache))
        units.append(layer_unit(dtype))
    return units
