"""Inputs and the covering grid for checking a native backend against the torch reference, and a
per-sequence prefill reference.

The grid is pairwise, not cartesian: every pair of values of (head size, GQA ratio, block size,
dtype) appears in some case, each case runs v1 and v2 over sequence lengths that hit the edges
(1, block_size ± 1, partition_size ± 1, several partitions with a partial last one), and block
tables are random with shared blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from paged.kernels.backends.interface import DTYPES
from paged.kernels.limits import BLOCK_SIZES, NATIVE_HEAD_SIZES

# (query heads per KV head, KV heads); the last is MQA.
GQA = ((1, 2), (4, 2), (8, 2), (4, 1))
SMALL_PARTITIONS = (32, 64)


@dataclass(frozen=True)
class AttentionCase:
    dtype: torch.dtype
    head_size: int
    block_size: int
    group: int
    num_kv_heads: int
    partition_size: int
    seq_lens: tuple[int, ...]

    @property
    def num_heads(self) -> int:
        return self.group * self.num_kv_heads

    @property
    def id(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return (f"{dtype}-h{self.head_size}-b{self.block_size}-q{self.num_heads}kv{self.num_kv_heads}"
                f"-p{self.partition_size}")


def edge_seq_lens(block_size: int, partition_size: int) -> tuple[int, ...]:
    lens = {1, block_size - 1, block_size + 1, partition_size - 1, partition_size + 1, 2 * partition_size + 5}
    return tuple(sorted(n for n in lens if n > 0))


def attention_grid() -> list[AttentionCase]:
    cases = []
    for i, head in enumerate(NATIVE_HEAD_SIZES):
        for r, (group, kv_heads) in enumerate(GQA):
            block = BLOCK_SIZES[(i + r) % len(BLOCK_SIZES)]
            dtype = DTYPES[(i + 2 * r) % len(DTYPES)]
            partition = SMALL_PARTITIONS[(i + r) % len(SMALL_PARTITIONS)]
            cases.append(AttentionCase(dtype, head, block, group, kv_heads, partition,
                                       edge_seq_lens(block, partition)))
    return cases


def default_partition_grid() -> list[AttentionCase]:
    """A few cases at vLLM's partition size 512, one per dtype."""
    return [
        AttentionCase(dtype, 128, block, 4, 2, 512, (1, 511, 513, 1100))
        for dtype, block in zip(DTYPES, BLOCK_SIZES)
    ]


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    """fp32 tight; 16-bit at vLLM's atol 1e-3 (one output rounding can differ by one ulp)."""
    if dtype == torch.float32:
        return {"atol": 1e-5, "rtol": 1e-5}
    return {"atol": 1e-3, "rtol": 1e-5}


@dataclass
class AttentionInputs:
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    scale: float
    clean_key_cache: torch.Tensor
    clean_value_cache: torch.Tensor


def random_cache(
    num_blocks: int, num_kv_heads: int, head_size: int, block_size: int, dtype: torch.dtype,
    device: str | torch.device = "cpu", generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's test factory: K `[n, h, d/x, b, x]` and V `[n, h, d, b]`, uniform in ±1/sqrt(d)."""
    x = 16 // torch.tensor([], dtype=dtype).element_size()
    scale = head_size**-0.5
    key = torch.empty(num_blocks, num_kv_heads, head_size // x, block_size, x, dtype=dtype, device=device)
    value = torch.empty(num_blocks, num_kv_heads, head_size, block_size, dtype=dtype, device=device)
    key.uniform_(-scale, scale, generator=generator)
    value.uniform_(-scale, scale, generator=generator)
    return key, value


def attention_inputs(case: AttentionCase, seed: int = 0, device: str | torch.device = "cpu") -> AttentionInputs:
    """Random inputs where sequences share blocks and each sequence's last block is private with
    NaN in its slots past seq_len, so a kernel that reads them fails. `clean_*` are the caches with
    those NaNs zeroed, for the reference (which multiplies masked slots by 0 and would turn NaN)."""
    gen = torch.Generator().manual_seed(seed)
    bs, lens = case.block_size, case.seq_lens
    blocks_per_seq = [-(-n // bs) for n in lens]
    max_blocks = max(blocks_per_seq)
    shared_pool = max(2, sum(blocks_per_seq) // 2)
    num_blocks = shared_pool + len(lens)
    key, value = random_cache(num_blocks, case.num_kv_heads, case.head_size, bs, case.dtype, generator=gen)
    tables = torch.randint(0, shared_pool, (len(lens), max_blocks), dtype=torch.int32, generator=gen)
    clean_key, clean_value = key.clone(), value.clone()
    for s, (n, nb) in enumerate(zip(lens, blocks_per_seq)):
        private = shared_pool + s
        tables[s, nb - 1] = private
        tail = n - (nb - 1) * bs
        key[private, :, :, tail:] = float("nan")
        value[private, :, :, tail:] = float("nan")
        clean_key[private, :, :, tail:] = 0
        clean_value[private, :, :, tail:] = 0
    scale = case.head_size**-0.5
    query = torch.empty(len(lens), case.num_heads, case.head_size, dtype=case.dtype)
    query.uniform_(-scale, scale, generator=gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    tensors = [query, key, value, tables, seq_lens, clean_key, clean_value]
    query, key, value, tables, seq_lens, clean_key, clean_value = (t.to(device) for t in tensors)
    return AttentionInputs(query, key, value, tables, seq_lens, scale, clean_key, clean_value)


@dataclass
class PrefillInputs:
    """`paged` holds the caches, block tables, seq_lens and scale (its decode query is unused)."""

    paged: AttentionInputs
    query: torch.Tensor  # [sum(q_lens), num_heads, head_size]
    query_start_loc: torch.Tensor  # int32 [S + 1]

    @property
    def args(self) -> tuple[torch.Tensor | float, ...]:
        """The positional arguments of `prefill_attention`, with the NaN-tailed caches."""
        p = self.paged
        return (self.query, p.key_cache, p.value_cache, p.block_tables, self.query_start_loc, p.seq_lens, p.scale)


def prefill_inputs(case: AttentionCase, q_lens: Sequence[int], seed: int = 0) -> PrefillInputs:
    """`attention_inputs` for `case.seq_lens` contexts, with `q_lens[i]` queries for the last
    positions of sequence i, spread wide enough that the softmax is far from uniform."""
    assert len(q_lens) == len(case.seq_lens) and all(0 < q <= n for q, n in zip(q_lens, case.seq_lens))
    paged = attention_inputs(case, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    query = torch.randn(sum(q_lens), case.num_heads, case.head_size, generator=gen) * (3 * case.head_size**0.5)
    starts = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return PrefillInputs(paged, query.to(case.dtype), starts)


def gather_kv(
    key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor, context_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's first `context_len` tokens as `[L, num_kv_heads, head_size]` K and V."""
    block_size = key_cache.shape[3]
    num_blocks = -(-context_len // block_size)
    blocks = block_table[:num_blocks].long()
    k = key_cache[blocks]
    k = k.permute(0, 3, 1, 2, 4).reshape(num_blocks * block_size, k.shape[1], -1)
    v = value_cache[blocks].permute(0, 3, 1, 2).reshape(num_blocks * block_size, k.shape[1], -1)
    return k[:context_len], v[:context_len]


def causal_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """Attention of the last `T` of `L` positions to positions up to their own, in fp32:
    q `[T, H, D]`, k/v `[L, Hk, D]`. With `sliding_window` W, the query at p sees only p - W < k;
    `soft_cap` c caps the scaled scores to c * tanh(s / c)."""
    num_new, num_heads, _ = query.shape
    context_len, num_kv_heads, _ = key.shape
    group = num_heads // num_kv_heads
    q = query.float().transpose(0, 1)
    k = key.float().transpose(0, 1).repeat_interleave(group, dim=0)
    v = value.float().transpose(0, 1).repeat_interleave(group, dim=0)
    scores = q @ k.transpose(1, 2) * scale
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    positions = torch.arange(context_len - num_new, context_len)
    keys = torch.arange(context_len)[None, :]
    hidden = keys > positions[:, None]
    if sliding_window is not None:
        hidden |= keys <= positions[:, None] - sliding_window
    weights = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1)
    return (weights @ v).transpose(0, 1).to(query.dtype)


def prefill_reference(x: PrefillInputs) -> torch.Tensor:
    """Sequence by sequence: gather the context from the NaN-free caches, then `causal_attention`."""
    p = x.paged
    out = torch.empty_like(x.query)
    starts = x.query_start_loc.tolist()
    for i, context_len in enumerate(p.seq_lens.tolist()):
        k, v = gather_kv(p.clean_key_cache, p.clean_value_cache, p.block_tables[i], context_len)
        out[starts[i] : starts[i + 1]] = causal_attention(x.query[starts[i] : starts[i + 1]], k, v, p.scale)
    return out
