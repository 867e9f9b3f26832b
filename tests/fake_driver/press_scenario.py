"""The KV presses' CUDA launches on the recording fake driver (`tests/test_cuda_driver_press.py`):
the attention mass (kernels_cu/attention_mass.cuh, an fp8 cache with its scales, soft-capped, the
last 3 queries) and copy_slots (cache.cuh's move_slots_kernel over two layers), planned by the cuda
backend and launched by its runner, which checks each plan's argument sizes against the cubin's."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from paged import kernels
from paged.kernels.backends.interface import CacheView
from paged.kernels.testing import random_cache
from paged.kernels.toolchain.specs import cache_unit, mass_unit
from tests.fake_driver.scenario import Case, HostMemoryCuda, _lowered, _stream_id

HEADS, KV_HEADS, HEAD, BLOCK, NUM_BLOCKS = 4, 2, 64, 16, 6
SEQ_LENS, NUM_QUERIES, LAST, SCALE, SOFT_CAP = (40, 9), (5, 1), 3, 0.125, 30.0
SLOT_PAIRS = ((3, 17), (17, 40), (40, 3))


def mass_case(backend: HostMemoryCuda, stream: Any, arch: str) -> dict[str, Any]:
    query = torch.randn(sum(NUM_QUERIES), HEADS, HEAD).to(torch.float16)
    key_cache = torch.zeros(NUM_BLOCKS, KV_HEADS, HEAD // 16, BLOCK, 16, dtype=torch.float8_e4m3fn)
    value_cache = torch.zeros(NUM_BLOCKS, KV_HEADS, HEAD, BLOCK, dtype=torch.float8_e4m3fn)
    tables = torch.tensor([[0, 2, 4], [5, 0, 0]], dtype=torch.int32)
    k_scale = torch.tensor([0.5, 2.0])
    cache = CacheView(key_cache, value_cache, tables, torch.tensor(SEQ_LENS, dtype=torch.int32), k_scale, k_scale)
    starts = np.concatenate([[0], np.cumsum(NUM_QUERIES)])
    mass = backend.attention_mass(query, cache, starts, SCALE, LAST, SOFT_CAP)
    return {"query": query.data_ptr(), "key_cache": key_cache.data_ptr(), "k_scale": k_scale.data_ptr(),
            "mass_shape": list(mass.shape), "mass": mass.data_ptr(), "stream": _stream_id(stream),
            **_lowered(mass_unit(torch.float16, torch.float8_e4m3fn), arch)}


def slots_case(backend: HostMemoryCuda, stream: Any, arch: str) -> dict[str, Any]:
    caches = [random_cache(NUM_BLOCKS, KV_HEADS, HEAD, BLOCK, torch.bfloat16) for _ in range(2)]
    mapping = torch.tensor(SLOT_PAIRS, dtype=torch.int64)
    kernels.copy_slots([k for k, _ in caches], [v for _, v in caches], mapping, backend=backend)
    return {"caches": [[k.data_ptr(), v.data_ptr()] for k, v in caches], "mapping": mapping.data_ptr(),
            "stream": _stream_id(stream), **_lowered(cache_unit(torch.bfloat16), arch)}


def press_cases(arch: str) -> list[Case]:
    from cuda.core import Device

    from paged.kernels.backends.cuda import CudaRunner

    stream = Device(0).create_stream()
    backend = HostMemoryCuda(CudaRunner(0, stream_source=lambda index: int(stream.handle)))
    return [Case("mass", lambda: mass_case(backend, stream, arch)),
            Case("slots", lambda: slots_case(backend, stream, arch))]
