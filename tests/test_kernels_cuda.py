"""The cuda backend (NVRTC-compiled kernels_cu/ on a GPU) against the torch reference, over the
same covering grid as the emulator. Skipped on machines without a CUDA device."""

from __future__ import annotations

import pytest
import torch

from paged import kernels
from paged.kernels.backends import torch_ref
from paged.kernels.testing import (
    DTYPES,
    AttentionCase,
    attention_grid,
    attention_inputs,
    default_partition_grid,
    prefill_inputs,
    prefill_reference,
    random_cache,
    tolerance,
)

pytestmark = [
    pytest.mark.compiles,
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False)"
    ),
]


@pytest.mark.parametrize("version", ["v1", "v2", "v3"])
@pytest.mark.parametrize("case", attention_grid() + default_partition_grid(), ids=lambda c: c.id)
def test_paged_attention_matches_reference(case: AttentionCase, version: str) -> None:
    x = attention_inputs(case, device="cuda")
    common = dict(version=version, partition_size=case.partition_size)
    expected = kernels.paged_attention(
        x.query, x.clean_key_cache, x.clean_value_cache, x.block_tables, x.seq_lens, x.scale, **common
    )
    got = kernels.paged_attention(
        x.query, x.key_cache, x.value_cache, x.block_tables, x.seq_lens, x.scale, backend="cuda", **common
    )
    torch.testing.assert_close(got, expected, **tolerance(case.dtype))


def test_v1_beyond_48kb_of_shared_memory_opts_in() -> None:
    case = AttentionCase(torch.float16, 128, 16, 8, 1, 512, (3, 16_000))
    x = attention_inputs(case, device="cuda")
    expected = kernels.paged_attention(x.query, x.clean_key_cache, x.clean_value_cache, x.block_tables,
                                       x.seq_lens, x.scale)
    got = kernels.paged_attention(x.query, x.key_cache, x.value_cache, x.block_tables, x.seq_lens, x.scale,
                                  backend="cuda", version="v1")
    torch.testing.assert_close(got, expected, **tolerance(case.dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cache_ops_match_reference(dtype: torch.dtype) -> None:
    key_cache, value_cache = random_cache(16, 2, 128, 16, dtype, device="cuda")
    key = torch.randn(20, 2, 128, device="cuda").to(dtype)
    slots = torch.randperm(16 * 16, device="cuda")[:20]
    slots[3] = -1
    expected = key_cache.clone(), value_cache.clone()
    torch_ref.reshape_and_cache(key, key, *expected, slots)
    kernels.reshape_and_cache(key, key, key_cache, value_cache, slots, backend="cuda")
    assert torch.equal(key_cache, expected[0]) and torch.equal(value_cache, expected[1])
    mapping = torch.tensor([[0, 7], [0, 8], [5, 2]], dtype=torch.int64)
    expected_k, expected_v = [key_cache.clone()], [value_cache.clone()]
    torch_ref.copy_blocks(expected_k, expected_v, mapping)
    kernels.copy_blocks([key_cache], [value_cache], mapping, backend="cuda")
    assert torch.equal(key_cache, expected_k[0]) and torch.equal(value_cache, expected_v[0])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_matches_reference(dtype: torch.dtype) -> None:
    case = AttentionCase(dtype, 128, 16, 4, 2, 512, (40, 17, 300))
    x = prefill_inputs(case, (40, 1, 77))
    query, *rest = (a.cuda() if isinstance(a, torch.Tensor) else a for a in x.args)
    got = kernels.prefill_attention(query, *rest, backend="cuda")
    torch.testing.assert_close(got.cpu().float(), prefill_reference(x).float(), **tolerance(dtype))
