"""Sliding-window attention (Mistral's: the query at position p sees p - W < k <= p) on every backend
against a dense reference with explicit masks: decode v1 and v2 over several partition counts,
prefill with prefixes, chunks and decode rows mixed, windows shorter than a block, not a multiple of
it, and covering the whole context. Table entries of blocks wholly before a window name a block of
NaN (the block manager frees such blocks; another sequence may own them now), and every slot of a
sequence's own blocks outside what its queries may see is NaN too, so an output that read any of
them is not finite."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch

from paged import kernels
from paged.kernels.testing import AttentionCase, attention_grid, causal_attention, gather_kv, random_cache, tolerance
from paged.kernels.toolchain import host_compiler

pytestmark = pytest.mark.compiles

_NO_COMPILER = host_compiler.unavailable_reason()
_needs_compiler = pytest.mark.skipif(_NO_COMPILER is not None, reason=f"no host compiler: {_NO_COMPILER}")
_needs_gpu = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
BACKENDS = [
    "torch",
    pytest.param("cpu", marks=_needs_compiler),
    pytest.param("emu", marks=_needs_compiler),
    pytest.param("cuda", marks=_needs_gpu),
]
STALE = 0  # the block that stale table entries name: all NaN


def _with_lens(case: AttentionCase) -> AttentionCase:
    """A single token, a block's edges, and contexts over two and three partitions."""
    bs, p = case.block_size, case.partition_size
    return AttentionCase(case.dtype, case.head_size, case.block_size, case.group, case.num_kv_heads, p,
                         (1, bs - 1, bs + 1, 2 * p + 5, 3 * p + 1))


# Head size 64 with (fp32, block 8, partition 32, MHA), (bf16, 16, 64, GQA 4), (fp16, 32, 32, GQA 8):
# instantiations the emulator tests build anyway.
CASES = [_with_lens(case) for case in attention_grid()[:3]]


def _windows(case: AttentionCase) -> list[int]:
    """Shorter than a block, not a multiple of it, a multiple of it, over a partition; each shorter
    than the longest context and longer than the shortest."""
    bs = case.block_size
    return sorted({5, bs + 3, 2 * bs, case.partition_size + 7})


WINDOWED = [pytest.param(case, window, id=f"{case.id}-w{window}") for case in CASES for window in _windows(case)]


@dataclass
class WindowInputs:
    query: torch.Tensor  # [sum(q_lens), num_heads, head_size]
    key_cache: torch.Tensor  # NaN wherever no query may look
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # entries of blocks wholly before a window name STALE
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    scale: float
    expected: torch.Tensor

    def to(self, device: str) -> WindowInputs:
        tensors = (self.query, self.key_cache, self.value_cache, self.block_tables, self.seq_lens,
                   self.query_start_loc)
        return WindowInputs(*(t.to(device) for t in tensors), self.scale, self.expected)


def _hide(key: torch.Tensor, value: torch.Tensor, block: int, hidden: torch.Tensor) -> None:
    key[block][:, :, hidden] = float("nan")
    value[block][:, :, hidden] = float("nan")


def window_inputs(case: AttentionCase, window: int | None, q_lens: Sequence[int], seed: int = 0) -> WindowInputs:
    """Private blocks per sequence in a shuffled pool behind the NaN block STALE; `q_lens[i]` queries
    for the last positions of sequence i. `expected` is the dense reference on the clean caches."""
    gen = torch.Generator().manual_seed(seed)
    bs, lens = case.block_size, case.seq_lens
    blocks_per_seq = [-(-n // bs) for n in lens]
    key, value = random_cache(1 + sum(blocks_per_seq), case.num_kv_heads, case.head_size, bs, case.dtype,
                              generator=gen)
    own = (torch.randperm(sum(blocks_per_seq), generator=gen) + 1).split(blocks_per_seq)
    # One column past every sequence's last block, still naming STALE.
    tables = torch.full((len(lens), max(blocks_per_seq) + 1), STALE, dtype=torch.int32)
    for s, blocks in enumerate(own):
        tables[s, : len(blocks)] = blocks
    query = torch.randn(sum(q_lens), case.num_heads, case.head_size, generator=gen) * (3 * case.head_size**0.5)
    query = query.to(case.dtype)
    starts = torch.tensor([0, *q_lens]).cumsum(0).tolist()
    scale = case.head_size**-0.5
    expected = torch.empty_like(query)
    for s, n in enumerate(lens):
        k, v = gather_kv(key, value, tables[s], n)
        expected[starts[s] : starts[s + 1]] = causal_attention(query[starts[s] : starts[s + 1]], k, v, scale, window)
    for s, (n, q_len) in enumerate(zip(lens, q_lens)):
        first = max(0, n - q_len + 1 - window) if window else 0  # the first query's first position
        for column, block in enumerate(own[s].tolist()):
            positions = column * bs + torch.arange(bs)
            _hide(key, value, block, (positions < first) | (positions >= n))
        tables[s, : first // bs] = STALE
    _hide(key, value, STALE, torch.ones(bs, dtype=torch.bool))
    return WindowInputs(query, key, value, tables, torch.tensor(lens, dtype=torch.int32),
                        torch.tensor(starts, dtype=torch.int32), scale, expected)


def _decode(x: WindowInputs, backend: str, version: str, partition_size: int, window: int | None) -> torch.Tensor:
    return kernels.paged_attention(x.query, x.key_cache, x.value_cache, x.block_tables, x.seq_lens, x.scale,
                                   version=version, backend=backend, partition_size=partition_size,
                                   sliding_window=window).cpu()


def _prefill(x: WindowInputs, backend: str, window: int | None) -> torch.Tensor:
    return kernels.prefill_attention(x.query, x.key_cache, x.value_cache, x.block_tables, x.query_start_loc,
                                     x.seq_lens, x.scale, backend=backend, sliding_window=window).cpu()


def _device(backend: str) -> str:
    return "cuda" if backend == "cuda" else "cpu"


def _check(got: torch.Tensor, x: WindowInputs, dtype: torch.dtype) -> None:
    assert got.isfinite().all(), "read a block or slot outside the window"
    torch.testing.assert_close(got.float(), x.expected.float(), **tolerance(dtype))


def _prefill_q_lens(lens: Sequence[int]) -> tuple[int, ...]:
    """A decode row, whole prompts, a short chunk, and a prefix-cache hit (a third of the context)."""
    return (1, lens[1], min(3, lens[2]), lens[3], max(1, lens[4] // 3))


@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize(("case", "window"), WINDOWED)
@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_sees_only_its_window(backend: str, case: AttentionCase, window: int, version: str) -> None:
    x = window_inputs(case, window, [1] * len(case.seq_lens), seed=window).to(_device(backend))
    _check(_decode(x, backend, version, case.partition_size, window), x, case.dtype)


@pytest.mark.parametrize(("case", "window"), WINDOWED)
@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_sees_only_each_querys_window(backend: str, case: AttentionCase, window: int) -> None:
    x = window_inputs(case, window, _prefill_q_lens(case.seq_lens), seed=window).to(_device(backend))
    _check(_prefill(x, backend, window), x, case.dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_v2_at_the_default_partition_skips_whole_partitions(backend: str) -> None:
    """Contexts of up to four partitions of 512; windows that skip whole partitions and start inside one."""
    case = AttentionCase(torch.float16, 128, 16, 4, 2, 512, (40, 600, 1100, 1537))
    for window in (100, 513, 1030):
        x = window_inputs(case, window, [1] * 4, seed=window).to(_device(backend))
        _check(_decode(x, backend, "v2", 512, window), x, case.dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_window_covering_every_context_is_no_window(backend: str) -> None:
    case = CASES[1]
    longest = max(case.seq_lens)
    decode = window_inputs(case, None, [1] * len(case.seq_lens)).to(_device(backend))
    prefill = window_inputs(case, None, _prefill_q_lens(case.seq_lens)).to(_device(backend))
    for window in (longest, longest + 1, 10**6):
        for version in ("v1", "v2"):
            got = _decode(decode, backend, version, case.partition_size, window)
            assert torch.equal(got, _decode(decode, backend, version, case.partition_size, None))
            _check(got, decode, case.dtype)
        got = _prefill(prefill, backend, window)
        assert torch.equal(got, _prefill(prefill, backend, None))
        _check(got, prefill, case.dtype)


@pytest.mark.parametrize("window", [0, -3, 2.5, True, "16"])
def test_a_window_that_is_not_a_positive_int_is_refused(window: object) -> None:
    case = CASES[0]
    x = window_inputs(case, None, [1] * len(case.seq_lens))
    message = f"sliding_window={window!r} is not allowed; it must be None .* or a positive int"
    with pytest.raises(ValueError, match=message):
        _decode(x, "torch", "v1", case.partition_size, window)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=message):
        _prefill(x, "torch", window)  # type: ignore[arg-type]
