"""prefill_attention on every CPU-runnable backend against a per-sequence reference: variable query
and context lengths (prefix hits, chunks, decode rows mixed in), GQA, every dtype and block size.
`emu` runs kernels_cu/prefill.cuh, the cuda backend's kernel, on the CPU."""

from __future__ import annotations

import pytest
import torch

from paged import kernels
from paged.kernels.backends import torch_prefill_plan
from paged.kernels.backends.interface import DTYPES
from paged.kernels.limits import BLOCK_SIZES
from paged.kernels.testing import AttentionCase, PrefillInputs, prefill_inputs, prefill_reference, tolerance
from paged.kernels.toolchain import host_compiler

pytestmark = pytest.mark.compiles

_NO_COMPILER = host_compiler.unavailable_reason()
_needs_compiler = pytest.mark.skipif(_NO_COMPILER is not None, reason=f"no host compiler: {_NO_COMPILER}")
CPU = pytest.param("cpu", marks=_needs_compiler)
EMU = pytest.param("emu", marks=_needs_compiler)
HEADS = (64, 128)
GROUPS = ((1, 2), (3, 3), (4, 1))  # (query heads per KV head, KV heads): MHA, SmolLM2's GQA, MQA


def _lens(block: int) -> tuple[tuple[int, int], ...]:
    """(q_len, seq_len) pairs: whole prompts, prefix hits and chunks (q_len < seq_len), decode rows,
    lengths at block edges and past one 32-query tile of the cpu kernel."""
    return ((1, 1), (block + 1, block + 1), (5, 3 * block + 2), (1, 2 * block), (40, 40), (33, 70),
            (2, block - 1), (1, 77))


def _cases() -> list:
    """Every (dtype, block) pair; head size and GQA ratio rotate through their values."""
    cases = []
    for i, dtype in enumerate(DTYPES):
        for j, block in enumerate(BLOCK_SIZES):
            group, kv = GROUPS[(i + 2 * j) % len(GROUPS)]
            lens = _lens(block)
            case = AttentionCase(dtype, HEADS[(i + j) % 2], block, group, kv, 512, tuple(n for _, n in lens))
            cases.append(pytest.param(case, tuple(q for q, _ in lens), id=case.id))
    return cases


def _check(x: PrefillInputs, backend: str, dtype: torch.dtype) -> None:
    out = kernels.prefill_attention(*x.args, backend=backend)
    assert out.dtype == dtype and out.shape == x.query.shape
    assert not out.isnan().any(), "read a cache slot past seq_len"
    torch.testing.assert_close(out.float(), prefill_reference(x).float(), **tolerance(dtype))


@pytest.mark.parametrize(("case", "q_lens"), _cases())
@pytest.mark.parametrize("backend", ["torch", CPU, EMU])
def test_prefill_matches_the_per_sequence_reference(backend: str, case: AttentionCase, q_lens: tuple[int, ...]) -> None:
    _check(prefill_inputs(case, q_lens, seed=hash(case.id) % 1000), backend, case.dtype)


@pytest.mark.parametrize("backend", [CPU, EMU])
def test_long_prompts_span_many_tiles_and_blocks(backend: str) -> None:
    case = AttentionCase(torch.float32, 64, 16, 3, 3, 512, (300, 513, 96, 1100))
    _check(prefill_inputs(case, (300, 200, 1, 64)), backend, torch.float32)


@pytest.mark.parametrize("backend", ["torch", CPU, EMU])
def test_query_may_be_a_view_of_fused_qkv(backend: str) -> None:
    """The executor's query is a strided slice of the qkv projection, not a contiguous tensor."""
    case = AttentionCase(torch.bfloat16, 64, 16, 3, 3, 512, (20, 45))
    x = prefill_inputs(case, (20, 7))
    num_tokens, num_heads, head = x.query.shape
    fused = torch.randn(num_tokens, (num_heads + 6) * head).to(torch.bfloat16)
    query = fused[:, : num_heads * head].view(num_tokens, num_heads, head)
    query.copy_(x.query)
    assert not query.is_contiguous()
    out = kernels.prefill_attention(query, *x.args[1:], backend=backend)
    torch.testing.assert_close(out.float(), prefill_reference(x).float(), **tolerance(torch.bfloat16))


def test_torch_prefill_splits_a_group_past_its_memory_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    case = AttentionCase(torch.float32, 64, 8, 2, 2, 512, (30, 31, 29, 100))
    x = prefill_inputs(case, (30, 1, 12, 50))
    monkeypatch.setattr(torch_prefill_plan, "PREFILL_GROUP_ELEMENTS", 1)  # one sequence per SDPA call
    _check(x, "torch", torch.float32)


def test_bad_offsets_and_lengths_are_refused() -> None:
    case = AttentionCase(torch.float32, 64, 16, 1, 2, 512, (20, 5))
    x = prefill_inputs(case, (4, 5))
    query, key_cache, value_cache, tables, starts, seq_lens, scale = x.args
    with pytest.raises(ValueError, match="query_start_loc must rise from 0 to num_tokens=9"):
        kernels.prefill_attention(query, key_cache, value_cache, tables, starts - 1, seq_lens, scale)
    with pytest.raises(ValueError, match="query_start_loc has 2 entries for 2 sequences"):
        kernels.prefill_attention(query, key_cache, value_cache, tables, starts[:2], seq_lens, scale)
    with pytest.raises(ValueError, match="more queries than context"):
        kernels.prefill_attention(query, key_cache, value_cache, tables, starts, torch.tensor([20, 4]).int(), scale)
    with pytest.raises(ValueError, match="block_tables has 1 columns of 16 tokens, fewer than max_seq_len=20"):
        kernels.prefill_attention(query, key_cache, value_cache, tables[:, :1], starts, seq_lens, scale)
    with pytest.raises(ValueError, match="max_query_len=4 is below the longest sequence \\(5\\)"):
        kernels.prefill_attention(query, key_cache, value_cache, tables, starts, seq_lens, scale, max_query_len=4)
