"""Decode v3 on the native cpu backend (kernels_cu/cpu/decode_v3.h) against a float64 reference
over the paged cache.

The grid is covering, not cartesian: every feature set (fp8 e4m3 / e5m2 caches with per-KV-head
scales, ALiBi, sliding windows, block-sparse patterns, and their mixes) meets every query dtype,
with GQA 1, 2, 3, 4, 8, head sizes 64-256 and block sizes 8, 16, 32 rotating through them, each
case under the planner's split plan and forced plans of 1, 3 and more splits than the contexts
need (empty trailing splits); a few long cases reach 16K tokens.

Every slot a row must not read holds NaN: past its context, before its window (whole blocks
there are stale table entries naming an all-NaN block), and under block-sparse attention every
(block, KV head) tile no head of the group sees. A NaN in the output means the kernel read one.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import pytest
import torch

from paged import kernels
from paged.kernels.backends import cpu as cpu_backend
from paged.kernels.backends.interface import DTYPES, CacheView
from paged.kernels.features import FP8_MAX, AttentionFeatures, BlockSparse, alibi_slopes
from paged.kernels.ops import narrower_window
from paged.kernels.split_plan import MAX_SPLITS, Hardware, SplitPlan, plan_splits
from paged.kernels.testing import tolerance
from paged.kernels.toolchain import host_compiler

pytestmark = [
    pytest.mark.compiles,
    pytest.mark.skipif(host_compiler.unavailable_reason() is not None, reason="no host compiler"),
]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SPARSE = BlockSparse(local_blocks=2, vert_stride=3, block_size=32, head_sliding_step=1)
# A negative step: one pattern per KV head, so whole tiles go unseen (and hold NaN here).
SPARSE_PER_KV_HEAD = BlockSparse(local_blocks=1, vert_stride=4, block_size=64, head_sliding_step=-2)
GROUPS = ((1, 2), (2, 2), (3, 3), (4, 2), (8, 1))  # (query heads per KV head, KV heads)
HEADS = (64, 96, 128, 192, 256)
BLOCKS = (8, 16, 32)
# None: the planner's plan through the front end; a number: a plan forced to that many splits
# (MAX_SPLITS: more than any context here needs, so the planner trims it to one per tile).
SPLITS = (None, 1, 3, MAX_SPLITS)


@dataclass(frozen=True)
class V3Case:
    dtype: torch.dtype
    head_size: int
    block_size: int
    group: int
    num_kv_heads: int
    seq_lens: tuple[int, ...]
    cache: torch.dtype | None = None  # fp8, else the query's dtype
    alibi: bool = False
    window: int | None = None
    sparse: BlockSparse | None = None

    @property
    def num_heads(self) -> int:
        return self.group * self.num_kv_heads

    @property
    def id(self) -> str:
        parts = [str(self.dtype).removeprefix("torch."), f"h{self.head_size}", f"b{self.block_size}",
                 f"q{self.num_heads}kv{self.num_kv_heads}"]
        if self.cache is not None:
            parts.append(str(self.cache).removeprefix("torch.float8_"))
        parts += ["alibi"] * self.alibi + [f"w{self.window}"] * (self.window is not None)
        if self.sparse is not None:
            parts.append(f"sparse{self.sparse.head_sliding_step}")
        return "-".join(parts)


# (name, fp8 cache, ALiBi, window, block-sparse)
FEATURE_SETS = (
    ("plain", None, False, None, None),
    ("e4m3", E4M3, False, None, None),
    ("e5m2-alibi", E5M2, True, None, None),
    ("alibi", None, True, None, None),
    ("window", None, False, 37, None),
    ("sparse", None, False, None, SPARSE),
    ("sparse-per-kv-head", None, False, None, SPARSE_PER_KV_HEAD),
    ("e4m3-alibi-window-sparse", E4M3, True, 100, SPARSE),
    ("e5m2-window-sparse-per-kv-head", E5M2, False, 50, SPARSE_PER_KV_HEAD),
)


def _grid() -> list[V3Case]:
    cases = []
    for f, (_, cache, alibi, window, sparse) in enumerate(FEATURE_SETS):
        for i, dtype in enumerate(DTYPES):
            block = BLOCKS[(f + i) % len(BLOCKS)]
            group, kv_heads = GROUPS[(f + 2 * i) % len(GROUPS)]
            head = HEADS[(2 * f + i) % len(HEADS)]
            lens = (1, block - 1, block + 1, 70, 301, 1000)
            cases.append(V3Case(dtype, head, block, group, kv_heads, lens, cache, alibi, window, sparse))
    return cases


GRID = _grid()
LONG = (
    V3Case(torch.float32, 64, 16, 3, 3, (16384, 5000, 1)),  # SmolLM2's attention shape
    # the same in bf16 (the AVX512-BF16 path where the CPU has it: groups of 4 blocks), and with
    # ALiBi (the reference max moves) and a window whose first slot is mid-group
    V3Case(torch.bfloat16, 64, 16, 3, 3, (16384, 5000, 1)),
    V3Case(torch.bfloat16, 64, 16, 3, 3, (16384, 5003, 70), alibi=True, window=4001),
    V3Case(torch.bfloat16, 128, 32, 8, 1, (16000, 33), cache=E4M3, alibi=True),
    V3Case(torch.float16, 256, 8, 4, 2, (16384, 9001), window=4000, sparse=SPARSE),
)


@dataclass
class Inputs:
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    scale: float
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    alibi_slopes: torch.Tensor | None


def _visible_start(case: V3Case, seq_len: int) -> int:
    return max(seq_len - case.window, 0) if case.window is not None else 0


def make_inputs(case: V3Case, seed: int = 0) -> Inputs:
    """Private blocks per sequence in a random order, block 0 all NaN (what stale entries name),
    NaN in every slot a row must not read; an fp8 cache stores K and V divided by per-KV-head
    scales of different sizes."""
    gen = torch.Generator().manual_seed(seed)
    bs, kv, d = case.block_size, case.num_kv_heads, case.head_size
    counts = [-(-n // bs) for n in case.seq_lens]
    num_blocks = 1 + sum(counts)
    # Logical K / V [block, kv head, slot, dim] within ±1/sqrt(d), as vLLM's tests make them.
    k = (torch.rand(num_blocks, kv, bs, d, generator=gen) * 2 - 1) * d**-0.5
    v = (torch.rand(num_blocks, kv, bs, d, generator=gen) * 2 - 1) * d**-0.5
    tables = torch.zeros(len(counts), max(counts), dtype=torch.int32)
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).to(torch.int32)
    poison = torch.zeros(num_blocks, kv, bs, dtype=torch.bool)  # the slots that get NaN
    poison[0] = True
    offsets = case.sparse.offsets(case.num_heads, kv, torch.device("cpu")) if case.sparse else None
    for s, (blocks, n) in enumerate(zip(order.split(counts), case.seq_lens)):
        tables[s, : len(blocks)] = blocks
        first = _visible_start(case, n)
        positions = torch.arange(len(blocks) * bs).view(-1, 1, bs)
        poison[blocks.long()] |= (positions >= n) | (positions < first)
        if case.sparse is not None:  # the tiles of KV heads none of whose query heads see the block
            seen = case.sparse.allowed(torch.tensor(n - 1), torch.arange(len(blocks)) * bs, offsets[:, None])
            unseen = ~seen.view(kv, case.group, -1).any(dim=1)  # [kv, blocks]
            poison[blocks.long()] |= unseen.T[:, :, None]
        tables[s, : first // bs] = 0  # freed by the window: stale entries
    k.masked_fill_(poison[..., None], float("nan"))
    v.masked_fill_(poison[..., None], float("nan"))
    k_scale = v_scale = None
    cache_dtype = case.cache or case.dtype
    if case.cache is not None:
        # Stored values up to ~256 (e4m3 clamps the largest of the half-scale head at 448).
        k_scale = d**-0.5 / 256 * (0.5 + 0.75 * torch.arange(kv, dtype=torch.float32))
        v_scale = 2 * d**-0.5 / 256 * (1.5 - 0.5 * torch.arange(kv, dtype=torch.float32) / kv)
        limit = FP8_MAX[case.cache]
        k = (k / k_scale.view(1, kv, 1, 1)).clamp(-limit, limit)
        v = (v / v_scale.view(1, kv, 1, 1)).clamp(-limit, limit)
    x = 16 // torch.tensor([], dtype=cache_dtype).element_size()
    key_cache = k.to(cache_dtype).view(num_blocks, kv, bs, d // x, x).permute(0, 1, 3, 2, 4).contiguous()
    value_cache = v.to(cache_dtype).permute(0, 1, 3, 2).contiguous()
    # Queries large enough that the softmax is far from uniform.
    query = (torch.randn(len(counts), case.num_heads, d, generator=gen) * (3 * d**0.5)).to(case.dtype)
    slopes = alibi_slopes(case.num_heads) if case.alibi else None
    return Inputs(query, key_cache, value_cache, tables, torch.tensor(case.seq_lens, dtype=torch.int32), d**-0.5,
                  k_scale, v_scale, slopes)


def reference64(case: V3Case, x: Inputs) -> torch.Tensor:
    """Row by row in float64, gathering only the positions in the row's window from the cache."""
    kv, group, bs = case.num_kv_heads, case.group, case.block_size
    heads = torch.arange(case.num_heads)
    offsets = case.sparse.offsets(case.num_heads, kv, torch.device("cpu")) if case.sparse else None
    out = torch.empty(x.query.shape, dtype=torch.float64)
    for s, n in enumerate(case.seq_lens):
        keys = torch.arange(_visible_start(case, n), n)
        blocks, slots = x.block_tables[s, keys // bs].long(), keys % bs
        k = x.key_cache[blocks, :, :, slots, :].flatten(2).double()  # [keys, kv, d]
        v = x.value_cache[blocks, :, :, slots].double()
        if x.k_scale is not None:
            k = k * x.k_scale.double().view(1, kv, 1)
            v = v * x.v_scale.double().view(1, kv, 1)
        k, v = k[:, heads // group].transpose(0, 1), v[:, heads // group].transpose(0, 1)  # [heads, keys, d]
        logits = torch.einsum("hd,hkd->hk", x.query[s].double(), k) * x.scale
        if x.alibi_slopes is not None:
            logits = logits + x.alibi_slopes.double()[:, None] * (keys - (n - 1)).double()
        if case.sparse is not None:
            seen = case.sparse.allowed(torch.tensor([[n - 1]]), keys[None, :], offsets[:, None, None])[:, 0]
            logits = logits.masked_fill(~seen, float("-inf"))
            v = v.masked_fill(~seen[..., None], 0)  # tiles no head of a group sees hold NaN
        out[s] = torch.einsum("hk,hkd->hd", torch.softmax(logits, dim=-1), v)
    return out


@functools.cache
def prepared(case: V3Case) -> tuple[Inputs, torch.Tensor]:
    """A case's inputs and reference, made once for all its split plans (nothing writes them)."""
    x = make_inputs(case, seed=len(case.id))
    return x, reference64(case, x)


def run_v3(case: V3Case, x: Inputs, num_splits: int | None) -> torch.Tensor:
    """The front end with the backend's own plan (None), or the backend's op on a forced plan."""
    options = dict(sliding_window=case.window, alibi_slopes=x.alibi_slopes, blocksparse=case.sparse,
                   k_scale=x.k_scale, v_scale=x.v_scale)
    args = (x.query, x.key_cache, x.value_cache, x.block_tables, x.seq_lens, x.scale)
    if num_splits is None:
        return kernels.paged_attention(*args, version="v3", backend="cpu", **options)
    max_seq_len = max(case.seq_lens)
    window = narrower_window(case.window, max_seq_len)
    plan = plan_splits(len(case.seq_lens), case.num_kv_heads, max_seq_len, case.block_size,
                       Hardware(torch.get_num_threads()), sliding_window=window, num_splits=num_splits)
    cache = CacheView(x.key_cache, x.value_cache, x.block_tables, x.seq_lens, x.k_scale, x.v_scale)
    return cpu_backend.BACKEND.paged_attention(x.query, cache, x.scale, "v3", 512, max_seq_len, window,
                                               AttentionFeatures(x.alibi_slopes, case.sparse), workspace=plan)


def _assert_matches(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype and out.shape == ref.shape
    assert not out.isnan().any(), "read a slot or tile the row must not read"
    torch.testing.assert_close(out.double(), ref, **tolerance(dtype))


@pytest.mark.parametrize("num_splits", SPLITS, ids=lambda n: "planned" if n is None else f"splits{n}")
@pytest.mark.parametrize("case", GRID, ids=lambda c: c.id)
def test_v3_matches_a_float64_reference(case: V3Case, num_splits: int | None) -> None:
    x, ref = prepared(case)
    _assert_matches(run_v3(case, x, num_splits), ref, case.dtype)


@pytest.mark.parametrize("case", LONG, ids=lambda c: c.id)
def test_v3_long_contexts(case: V3Case) -> None:
    x = make_inputs(case, seed=1)
    ref = reference64(case, x)
    for num_splits in (None, 1, 7):
        _assert_matches(run_v3(case, x, num_splits), ref, case.dtype)


def test_v3_equals_v1() -> None:
    case = next(c for c in GRID if c.cache is E4M3 and c.alibi and c.window and c.sparse)
    x = make_inputs(case)
    args = (x.query, x.key_cache, x.value_cache, x.block_tables, x.seq_lens, x.scale)
    options = dict(sliding_window=case.window, alibi_slopes=x.alibi_slopes, blocksparse=case.sparse,
                   k_scale=x.k_scale, v_scale=x.v_scale)
    v1 = kernels.paged_attention(*args, version="v1", backend="cpu", **options)
    for num_splits in (None, 1, 3):
        torch.testing.assert_close(run_v3(case, x, num_splits), v1, **tolerance(case.dtype))


def test_planned_decode_uses_the_split_plan_made_for_the_step() -> None:
    """Through `DecodeAttention`: the workspace is the planner's plan for the OpenMP threads (split,
    since one sequence of two KV heads leaves threads idle), reused by every layer's call."""
    from paged.kernels.planned import AttentionSettings, DecodeAttention, Rows

    case = V3Case(torch.float32, 64, 16, 4, 2, (2000,), alibi=True, window=1500)
    x = make_inputs(case)
    starts = torch.arange(2, dtype=torch.int32)
    rows = Rows(x.block_tables, x.seq_lens, starts, x.block_tables.numpy(), x.seq_lens.numpy(), starts.numpy(),
                max_seq_len=2000, max_query_len=1)
    settings = AttentionSettings(cpu_backend.BACKEND, x.scale, 512, sliding_window=1500, alibi_slopes=x.alibi_slopes)
    decode = DecodeAttention(rows, settings, "v3", 8, 2, 64, x.key_cache.shape[0], 16)
    hardware = Hardware(torch.get_num_threads(), cpu_backend.V3_SLOTS_PER_THREAD)
    assert decode.workspace == plan_splits(1, 2, 2000, 16, hardware, sliding_window=1500)
    assert decode.workspace.num_splits > 1
    ref = reference64(case, x)
    for _ in range(2):
        _assert_matches(decode(x.query, x.key_cache, x.value_cache), ref, case.dtype)


def test_decode_workspace_is_a_plan_for_v3_only() -> None:
    backend = cpu_backend.BACKEND
    args = (4, 9, 3, 64, 16)
    assert backend.decode_workspace(*args, "v1", 512, 1000, None, torch.device("cpu")) is None
    assert backend.decode_workspace(*args, "v2", 512, 1000, None, torch.device("cpu")) is None
    plan = backend.decode_workspace(*args, "v3", 512, 1000, None, torch.device("cpu"))
    assert isinstance(plan, SplitPlan) and plan.block_size == 16
    assert plan.num_splits * plan.split_blocks * 16 >= 1000


def test_a_bad_split_plan_is_a_value_error() -> None:
    case = V3Case(torch.float32, 64, 16, 3, 3, (1000, 5))
    x = make_inputs(case)
    cache = CacheView(x.key_cache, x.value_cache, x.block_tables, x.seq_lens)

    def run(plan: object) -> torch.Tensor:
        return cpu_backend.BACKEND.paged_attention(x.query, cache, x.scale, "v3", 512, 1000, None, workspace=plan)

    with pytest.raises(ValueError, match=f"num_splits={MAX_SPLITS + 1} is outside"):
        plan_splits(2, 3, 1000, 16, Hardware(2), num_splits=MAX_SPLITS + 1)
    with pytest.raises(ValueError, match=rf"1 <= num_splits <= {MAX_SPLITS}"):
        run(SplitPlan(MAX_SPLITS + 1, 1, 16))
    with pytest.raises(ValueError, match=r"1 <= num_splits <= .* split_blocks >= 1"):
        run(SplitPlan(4, 0, 16))
    with pytest.raises(ValueError, match="cannot hold the blocks a row of max_seq_len attends to"):
        run(SplitPlan(3, 20, 16))  # 60 blocks < the 63 of 1000 tokens
    with pytest.raises(ValueError, match="needs a SplitPlan for block_size=16"):
        run(SplitPlan(1, 64, 32))
    torch.testing.assert_close(run(SplitPlan(3, 21, 16)), reference64(case, x).float(), **tolerance(torch.float32))
