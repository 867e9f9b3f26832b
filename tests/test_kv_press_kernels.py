"""The KV presses' kernels on the native backends: the attention mass of the cpu and emu backends
(kernels_cu/cpu/attention_mass.h, kernels_cu/attention_mass.cuh, the CUDA source run on the CPU)
against the float64 reference in every cache dtype, with and without soft-capping; and copy_slots
(kernels_cu/cpu/slots.h, kernels_cu/cache.cuh's move_slots_kernel) against the torch one, bit for
bit, in every cache dtype, with a destination that is another pair's source."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from paged import kernels
from paged.kernels.backends import cpu, emu
from paged.kernels.backends.interface import CACHE_DTYPES, CacheView
from paged.kernels.backends.slot_copy import copy_slots as torch_copy_slots
from paged.kernels.features import FP8_DTYPES
from paged.kernels.toolchain import emulator, host_compiler, specs
from tests.test_kv_press_scores import paged_cache

pytestmark = pytest.mark.compiles

# (query dtype, cache dtype): every cache dtype, each fp8 format under a 16-bit and a float32 query
MASS_CASES = [(torch.float32, torch.float32), (torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
              (torch.float16, torch.float8_e4m3fn), (torch.bfloat16, torch.float8_e5m2),
              (torch.float32, torch.float8_e4m3fn)]
BACKENDS = {"cpu": cpu.BACKEND, "emu": emu.BACKEND}


@pytest.fixture(scope="module", autouse=True)
def native_builds() -> None:
    """One parallel emulator build of every unit the module launches, instead of one per test."""
    reason = host_compiler.unavailable_reason()
    if reason is not None:
        pytest.skip(f"no host compiler: {reason}")
    units = [specs.mass_unit(q, c if c in FP8_DTYPES else None) for q, c in MASS_CASES]
    emulator.prepare(units + [specs.cache_unit(c) for c in CACHE_DTYPES])


def reference_mass(q: torch.Tensor, k: torch.Tensor, scale: float, last: int | None,
                   soft_cap: float | None) -> torch.Tensor:
    """float64 `[Hk, L]`: the mass of q's last `last` queries (the last of the L positions) on k."""
    length, num_kv_heads = k.shape[0], k.shape[1]
    group = q.shape[1] // num_kv_heads
    total = torch.zeros(num_kv_heads, length, dtype=torch.float64)
    first = length - q.shape[0]
    for j in range(q.shape[0] - (q.shape[0] if last is None else min(last, q.shape[0])), q.shape[0]):
        for h in range(q.shape[1]):
            logits = (k[: first + j + 1, h // group].double() @ q[j, h].double()) * scale
            if soft_cap is not None:
                logits = torch.tanh(logits / soft_cap) * soft_cap
            total[h // group, : first + j + 1] += torch.softmax(logits, dim=0)
    return total


@pytest.mark.parametrize("backend", ["cpu", "emu"])
@pytest.mark.parametrize(("dtype", "cache_dtype"), MASS_CASES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize(("last", "soft_cap"), [(None, None), (3, 2.0)])
def test_attention_mass_equals_the_float64_reference(backend: str, dtype: torch.dtype, cache_dtype: torch.dtype,
                                                     last: int | None, soft_cap: float | None) -> None:
    torch.manual_seed(2)
    heads, kv_heads, d, bs = 4, 2, 32, 8
    x = 16 // cache_dtype.itemsize
    lengths, num_queries = [21, 8, 33], [21, 1, 5]  # a prompt, a decode row, a chunk after a prefix hit
    k_scale = torch.tensor([0.5, 2.0]) if cache_dtype in FP8_DTYPES else None
    stored = [torch.randn(n, kv_heads, d).to(cache_dtype) for n in lengths]  # keys as the cache holds them
    keys = [s.float() * (1.0 if k_scale is None else k_scale.view(1, -1, 1)) for s in stored]
    key_cache, tables = paged_cache([s.float() for s in stored], bs, x)
    key_cache = key_cache.to(cache_dtype)
    value_cache = torch.zeros(key_cache.shape[0], kv_heads, d, bs, dtype=cache_dtype)
    queries = [torch.randn(n, heads, d).to(dtype) for n in num_queries]
    cache = CacheView(key_cache, value_cache, tables, torch.tensor(lengths, dtype=torch.int32), k_scale, k_scale)
    starts = np.concatenate([[0], np.cumsum(num_queries)])
    mass = BACKENDS[backend].attention_mass(torch.cat(queries), cache, starts, 0.3, last, soft_cap)
    assert mass.shape == (3, kv_heads, max(lengths)) and mass.dtype == torch.float32
    for i, n in enumerate(lengths):
        expected = reference_mass(queries[i], keys[i], 0.3, last, soft_cap)
        torch.testing.assert_close(mass[i, :, :n].double(), expected, rtol=1e-5, atol=1e-6)
        assert not mass[i, :, n:].any()


@pytest.mark.parametrize("backend", ["cpu", "emu"])
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_copy_slots_equals_torch_bit_for_bit(backend: str, cache_dtype: torch.dtype) -> None:
    torch.manual_seed(3)
    num_blocks, kv_heads, d, bs, layers = 6, 2, 64, 8, 3  # a head size the CUDA kernels are built for
    x = 16 // cache_dtype.itemsize
    key_caches = [torch.randn(num_blocks, kv_heads, d // x, bs, x).to(cache_dtype) for _ in range(layers)]
    value_caches = [torch.randn(num_blocks, kv_heads, d, bs).to(cache_dtype) for _ in range(layers)]
    # 17 -> 40 and 40 -> 3: each pair reads its source as it was before any pair wrote
    mapping = torch.tensor([[3, 17], [17, 40], [40, 3], [5, 9], [47, 0]], dtype=torch.int64)
    expected_k, expected_v = [c.clone() for c in key_caches], [c.clone() for c in value_caches]
    torch_copy_slots(expected_k, expected_v, mapping)
    assert not torch.equal(expected_k[0].view(torch.uint8), key_caches[0].view(torch.uint8))
    kernels.copy_slots(key_caches, value_caches, mapping, backend=backend)
    for got, want in zip(key_caches + value_caches, expected_k + expected_v, strict=True):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
