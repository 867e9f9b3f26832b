"""The emu backend (kernels_cu/ run on the CPU) against the torch reference over a covering grid."""

from __future__ import annotations

import pytest
import torch

from paged import kernels
from paged.kernels.backends import torch_ref
from paged.kernels.backends.interface import CacheView
from paged.kernels.limits import BLOCK_SIZES, NATIVE_HEAD_SIZES
from paged.kernels.testing import (
    DTYPES,
    AttentionCase,
    attention_grid,
    attention_inputs,
    default_partition_grid,
    random_cache,
    tolerance,
)
from paged.kernels.toolchain import emulator, host_compiler, specs

pytestmark = pytest.mark.compiles

GRID = attention_grid() + default_partition_grid()


def _units(case: AttentionCase) -> list[specs.Unit]:
    return [specs.attention_unit(case.dtype, case.head_size, case.block_size, v, case.partition_size)
            for v in ("v1", "v2")]


@pytest.fixture(scope="module", autouse=True)
def emu_library() -> None:
    """One parallel build of every unit the module uses instead of one compiler run per test."""
    try:
        host_compiler.find_compiler()
    except host_compiler.CompilerNotFoundError as e:
        pytest.skip(f"emu backend unavailable: {e}")
    units = [u for case in GRID for u in _units(case)] + [specs.cache_unit(d) for d in DTYPES]
    emulator.prepare(units)


def test_grid_covers_every_value_and_pair() -> None:
    cases = attention_grid()
    axes = [
        lambda c: c.head_size, lambda c: c.block_size, lambda c: c.dtype, lambda c: (c.group, c.num_kv_heads),
    ]
    sizes = [len(NATIVE_HEAD_SIZES), len(BLOCK_SIZES), len(DTYPES), 4]
    for a in range(len(axes)):
        for b in range(a + 1, len(axes)):
            pairs = {(axes[a](c), axes[b](c)) for c in cases}
            assert len(pairs) == sizes[a] * sizes[b]
    for case in cases:
        p, bs = case.partition_size, case.block_size
        assert {1, bs - 1, bs + 1, p - 1, p + 1} - {0} <= set(case.seq_lens)
        assert max(case.seq_lens) > 2 * p and max(case.seq_lens) % p
    assert {c.partition_size for c in GRID} == {32, 64, 512}


@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize("case", GRID, ids=lambda c: c.id)
def test_paged_attention_matches_reference(case: AttentionCase, version: str) -> None:
    x = attention_inputs(case)
    common = dict(version=version, partition_size=case.partition_size)
    expected = kernels.paged_attention(
        x.query, x.clean_key_cache, x.clean_value_cache, x.block_tables, x.seq_lens, x.scale, **common
    )
    got = kernels.paged_attention(
        x.query, x.key_cache, x.value_cache, x.block_tables, x.seq_lens, x.scale, backend="emu", **common
    )
    assert not got.isnan().any()
    torch.testing.assert_close(got, expected, **tolerance(case.dtype))


def test_paged_attention_reads_query_through_its_row_stride() -> None:
    case = AttentionCase(torch.float16, 64, 16, 4, 2, 32, (5, 40))
    x = attention_inputs(case)
    qkv = torch.cat([x.query, torch.randn_like(x.query)], dim=1)
    query = qkv[:, : case.num_heads]
    got = kernels.paged_attention(query, x.key_cache, x.value_cache, x.block_tables, x.seq_lens, x.scale,
                                  backend="emu", version="v2", partition_size=32)
    clean = CacheView(x.clean_key_cache, x.clean_value_cache, x.block_tables, x.seq_lens)
    expected = torch_ref.paged_attention_v1(x.query, clean, x.scale, 40)
    torch.testing.assert_close(got, expected, **tolerance(case.dtype))


def test_max_seq_len_shorter_than_a_sequence_is_refused() -> None:
    x = attention_inputs(AttentionCase(torch.float32, 64, 16, 1, 2, 32, (1, 40)))
    with pytest.raises(ValueError, match="max_seq_len=20 is below the longest sequence"):
        kernels.paged_attention(x.query, x.key_cache, x.value_cache, x.block_tables, x.seq_lens, x.scale,
                                backend="emu", max_seq_len=20)


CACHE_GRID = [
    (DTYPES[(i + j) % 3], head, block)
    for i, head in enumerate(NATIVE_HEAD_SIZES)
    for j, block in enumerate(BLOCK_SIZES)
    if (i + j) % 2 == 0 or head in (80, 256)
]


@pytest.mark.parametrize(("dtype", "head_size", "block_size"), CACHE_GRID, ids=str)
def test_reshape_and_cache_matches_reference_and_skips_padding(
    dtype: torch.dtype, head_size: int, block_size: int
) -> None:
    gen = torch.Generator().manual_seed(head_size + block_size)
    num_blocks, kv_heads, num_tokens = 6, 2, 12
    key_cache, value_cache = random_cache(num_blocks, kv_heads, head_size, block_size, dtype, generator=gen)
    key = torch.randn(num_tokens, kv_heads, head_size, generator=gen).to(dtype)
    value = torch.randn(num_tokens, kv_heads, head_size, generator=gen).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[2, 7]] = -1
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    torch_ref.reshape_and_cache(key, value, expected_k, expected_v, slots)
    before_k = key_cache.clone()
    kernels.reshape_and_cache(key, value, key_cache, value_cache, slots, backend="emu")
    assert torch.equal(key_cache, expected_k) and torch.equal(value_cache, expected_v)
    assert not torch.equal(key_cache, before_k)


def test_reshape_and_cache_with_only_padding_leaves_the_cache_untouched() -> None:
    key_cache, value_cache = random_cache(4, 2, 64, 16, torch.bfloat16)
    before = key_cache.clone(), value_cache.clone()
    key = torch.ones(3, 2, 64, dtype=torch.bfloat16)
    slots = torch.full((3,), -1, dtype=torch.int64)
    kernels.reshape_and_cache(key, key, key_cache, value_cache, slots, backend="emu")
    assert torch.equal(key_cache, before[0]) and torch.equal(value_cache, before[1])


@pytest.mark.parametrize(
    ("dtype", "head_size", "block_size"),
    [(torch.float32, 80, 8), (torch.float16, 128, 16), (torch.bfloat16, 64, 32)],
    ids=str,
)
def test_copy_blocks_copies_every_layer(dtype: torch.dtype, head_size: int, block_size: int) -> None:
    gen = torch.Generator().manual_seed(1)
    layers = [random_cache(12, 2, head_size, block_size, dtype, generator=gen) for _ in range(3)]
    key_caches, value_caches = [k for k, _ in layers], [v for _, v in layers]
    mapping = torch.tensor([[0, 5], [0, 6], [3, 9], [11, 1]], dtype=torch.int64)
    expected_k = [k.clone() for k in key_caches]
    expected_v = [v.clone() for v in value_caches]
    torch_ref.copy_blocks(expected_k, expected_v, mapping)
    kernels.copy_blocks(key_caches, value_caches, mapping, backend="emu")
    for got, want in zip(key_caches + value_caches, expected_k + expected_v):
        assert torch.equal(got, want)
    assert torch.equal(key_caches[2][9], key_caches[2][3]) and not torch.equal(key_caches[2][9], key_caches[2][8])
