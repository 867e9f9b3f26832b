"""fp8 KV caches, ALiBi and block-sparse attention (`paged.kernels.features`) on the native backends
against the torch reference, the torch reference against a naive per-query loop, fp8 stores byte for
byte, fp8.h's conversions against torch's, and the front end's checks of the new arguments.

The grid is covering, not cartesian: every feature set meets every dtype, block size and head
size, and every pair of dtype, block size and head size appears; each case runs decode v1, v2 at
two partition sizes and prefill with whole prompts, chunks and decode rows, over contexts that end
mid-block.
"""

from __future__ import annotations

import ctypes
import math
import subprocess
import zlib
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

from paged import kernels
from paged.kernels.backends.interface import DTYPES
from paged.kernels.features import FP8_MAX, BlockSparse, alibi_slopes
from paged.kernels.limits import BLOCK_SIZES
from paged.kernels.testing import (
    AttentionCase,
    AttentionInputs,
    attention_inputs,
    gather_kv,
    prefill_inputs,
    random_cache,
    tolerance,
)
from paged.kernels.toolchain import host_compiler
from paged.kernels.toolchain.source import source_dir

pytestmark = pytest.mark.compiles

# Backends checked against the torch reference; each runs on its declared device (cuda: skipped
# without a GPU). emu runs the CUDA sources slowly (one g++ build per instantiation), so it takes one
# case per feature set (EMU_CASES).
BACKENDS = ["cpu", "emu", "cuda"]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
HEADS = (64, 128)
GROUPS = ((1, 2), (3, 3), (4, 2))  # (query heads per KV head, KV heads): MHA, 9 heads (ALiBi's odd count), GQA
SPARSE = BlockSparse(local_blocks=2, vert_stride=3, block_size=32, head_sliding_step=1)
# A negative step slides the vertical blocks per KV head; sparse blocks of 64 leave whole v2
# partitions of 32 unseen by a head.
SPARSE_PER_KV_HEAD = BlockSparse(local_blocks=1, vert_stride=4, block_size=64, head_sliding_step=-2)
_NO_COMPILER = host_compiler.unavailable_reason()


@dataclass(frozen=True)
class Features:
    """One feature set: an fp8 cache with per-tensor or per-head scales, ALiBi, a block-sparse
    pattern, a sliding window."""

    name: str
    cache_dtype: torch.dtype | None = None
    per_head_scales: bool = False
    alibi: bool = False
    blocksparse: BlockSparse | None = None
    sliding_window: int | None = None


FEATURE_SETS = (
    Features("e4m3", E4M3),
    Features("e5m2-per-head", E5M2, per_head_scales=True),
    Features("alibi", alibi=True),
    Features("sparse", blocksparse=SPARSE),
    Features("sparse-per-kv-head", blocksparse=SPARSE_PER_KV_HEAD),
    Features("all-e4m3-per-head", E4M3, per_head_scales=True, alibi=True, blocksparse=SPARSE),
    Features("all-e5m2-window", E5M2, alibi=True, blocksparse=SPARSE_PER_KV_HEAD, sliding_window=50),
    Features("e4m3-alibi-window", E4M3, per_head_scales=True, alibi=True, sliding_window=37),
    Features("sparse-window", blocksparse=SPARSE, sliding_window=100),
)


def _seq_lens(block: int) -> tuple[int, ...]:
    """1, around one block, and longer contexts over several sparse blocks, all ending mid-block."""
    return (1, block - 1, block + 1, 70, 133, 301)


# Per sequence of `_seq_lens`: a one-token prompt, a whole prompt, a chunk, a decode row, a whole
# prompt and a chunk both longer than the cpu kernel's 32-query tile.
def _q_lens(block: int) -> tuple[int, ...]:
    return (1, block - 1, 3, 1, 133, 37)


def _grid() -> list[tuple[Features, AttentionCase]]:
    cases = []
    for f, features in enumerate(FEATURE_SETS):
        for i, dtype in enumerate(DTYPES):
            block = BLOCK_SIZES[(f + i) % len(BLOCK_SIZES)]
            group, kv_heads = GROUPS[(f + 2 * i) % len(GROUPS)]
            case = AttentionCase(dtype, HEADS[(f + i) % len(HEADS)], block, group, kv_heads, 32, _seq_lens(block))
            cases.append((features, case))
    return cases


GRID = [pytest.param(features, case, id=f"{features.name}-{case.id}") for features, case in _grid()]
EMU_CASES = {(features, case) for f, (features, case) in enumerate(_grid()) if f % len(DTYPES) == f // len(DTYPES) % 3}


def _skip_unserved(backend: str, features: Features, case: AttentionCase, partition: int | None = None) -> None:
    if backend == "emu" and (features, case) not in EMU_CASES:
        pytest.skip("emu runs one case per feature set")
    supported = kernels.get_backend(backend).partition_sizes
    if partition is not None and supported is not None and partition not in supported:
        pytest.skip(f"backend={backend!r} has no partition size {partition}")


def _seed(case: AttentionCase) -> int:
    return zlib.crc32(case.id.encode()) % 1000


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    reason = kernels.get_backend(request.param).unavailable_reason()
    if reason:
        pytest.skip(f"backend={request.param!r} cannot run here: {reason}")
    return request.param


def _device(backend: str) -> torch.device:
    return torch.device(kernels.get_backend(backend).device_type or "cpu")


@dataclass
class Case:
    """Inputs of one feature set: `cache` has NaN in the slots past each context (fp8 NaN bytes in
    an fp8 cache), which no backend may read; `clean` has zeros there, for the reference."""

    query: torch.Tensor  # decode
    cache: tuple[torch.Tensor, torch.Tensor]
    clean: tuple[torch.Tensor, torch.Tensor]
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    scale: float
    options: dict[str, object]  # the ops' keyword arguments for the features


def _scales(base: float, num_kv_heads: int, per_head: bool) -> float | torch.Tensor:
    """A per-tensor scale, or per-head scales from half of it up (that head's largest values clamp)."""
    if not per_head:
        return base
    return base * (0.5 + 0.75 * torch.arange(num_kv_heads, dtype=torch.float32))


def to_fp8(
    x: AttentionInputs, cache_dtype: torch.dtype, k_scale: float | torch.Tensor, v_scale: float | torch.Tensor
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """The caches of `x` stored as fp8 by the torch `reshape_and_cache`, so every backend reads the
    same bytes: (with NaN past each context, as in `x`), (with zeros there)."""
    num_blocks, num_kv_heads, head_size, block_size = x.clean_value_cache.shape
    slots = num_blocks * block_size
    key = x.clean_key_cache.permute(0, 3, 1, 2, 4).reshape(slots, num_kv_heads, head_size)
    value = x.clean_value_cache.permute(0, 3, 1, 2).reshape(slots, num_kv_heads, head_size)
    key_cache = torch.empty(num_blocks, num_kv_heads, head_size // 16, block_size, 16, dtype=cache_dtype)
    value_cache = torch.empty(num_blocks, num_kv_heads, head_size, block_size, dtype=cache_dtype)
    kernels.reshape_and_cache(key, value, key_cache, value_cache, torch.arange(slots), k_scale=k_scale,
                              v_scale=v_scale)
    past = x.value_cache.isnan().any(dim=2)  # [num_blocks, num_kv_heads, block_size]: the NaN-tailed slots
    nan = torch.tensor(0x7F, dtype=torch.uint8)  # NaN in both formats
    key_nan = torch.where(past[:, :, None, :, None], nan, key_cache.view(torch.uint8)).view(cache_dtype)
    value_nan = torch.where(past[:, :, None, :], nan, value_cache.view(torch.uint8)).view(cache_dtype)
    return (key_nan, value_nan), (key_cache, value_cache)


def make_case(features: Features, case: AttentionCase, x: AttentionInputs, seed: int = 0) -> Case:
    gen = torch.Generator().manual_seed(seed)
    # Queries large enough that the softmax is far from uniform, as prefill_inputs makes them.
    query = torch.randn(x.query.shape, generator=gen) * (3 * case.head_size**0.5)
    options: dict[str, object] = {"blocksparse": features.blocksparse, "sliding_window": features.sliding_window}
    if features.alibi:
        options["alibi_slopes"] = alibi_slopes(case.num_heads)
    cache, clean = (x.key_cache, x.value_cache), (x.clean_key_cache, x.clean_value_cache)
    if features.cache_dtype is not None:
        # K and V lie within ±head_size**-0.5: stored up to 256 (512 for a head at half scale,
        # which e4m3 clamps to 448).
        base = case.head_size**-0.5 / 256
        options["k_scale"] = _scales(base, case.num_kv_heads, features.per_head_scales)
        options["v_scale"] = _scales(2 * base, case.num_kv_heads, features.per_head_scales)
        cache, clean = to_fp8(x, features.cache_dtype, options["k_scale"], options["v_scale"])
    return Case(query.to(case.dtype), cache, clean, x.block_tables, x.seq_lens, x.scale, options)


def _on(device: torch.device, options: dict[str, object]) -> dict[str, object]:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in options.items()}


def _decode(c: Case, backend: str, clean: bool, version: str, partition: int) -> torch.Tensor:
    device = _device(backend)
    key_cache, value_cache = c.clean if clean else c.cache
    tensors = (c.query, key_cache, value_cache, c.block_tables, c.seq_lens)
    out = kernels.paged_attention(*(t.to(device) for t in tensors), c.scale, version=version, backend=backend,
                                  partition_size=partition, **_on(device, c.options))
    return out.cpu()


def _prefill(c: Case, query: torch.Tensor, starts: torch.Tensor, backend: str, clean: bool) -> torch.Tensor:
    device = _device(backend)
    key_cache, value_cache = c.clean if clean else c.cache
    tensors = (query, key_cache, value_cache, c.block_tables, starts, c.seq_lens)
    out = kernels.prefill_attention(*(t.to(device) for t in tensors), c.scale, backend=backend,
                                    **_on(device, c.options))
    return out.cpu()


def _assert_matches(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype and out.shape == ref.shape
    assert not out.isnan().any(), "read a cache slot past seq_len"
    torch.testing.assert_close(out.float(), ref.float(), **tolerance(dtype))


@pytest.mark.parametrize(("version", "partition"), [("v1", 512), ("v2", 32), ("v2", 96)])
@pytest.mark.parametrize(("features", "case"), GRID)
def test_decode_matches_torch_reference(
    backend: str, features: Features, case: AttentionCase, version: str, partition: int
) -> None:
    _skip_unserved(backend, features, case, partition if version == "v2" else None)
    c = make_case(features, case, attention_inputs(case, seed=_seed(case)))
    out = _decode(c, backend, clean=False, version=version, partition=partition)
    _assert_matches(out, _decode(c, "torch", clean=True, version=version, partition=partition), case.dtype)


@pytest.mark.parametrize(("features", "case"), GRID)
def test_prefill_matches_torch_reference(backend: str, features: Features, case: AttentionCase) -> None:
    _skip_unserved(backend, features, case)
    x = prefill_inputs(case, _q_lens(case.block_size), seed=_seed(case))
    c = make_case(features, case, x.paged)
    out = _prefill(c, x.query, x.query_start_loc, backend, clean=False)
    _assert_matches(out, _prefill(c, x.query, x.query_start_loc, "torch", clean=True), case.dtype)


def _private_blocks(case: AttentionCase, q_lens: tuple[int, ...]) -> tuple[AttentionInputs, torch.Tensor, torch.Tensor]:
    """Inputs whose sequences own all their blocks, none shared: (decode inputs, prefill query,
    query_start_loc)."""
    gen = torch.Generator().manual_seed(1)
    bs = case.block_size
    counts = [-(-n // bs) for n in case.seq_lens]
    key, value = random_cache(sum(counts), case.num_kv_heads, case.head_size, bs, case.dtype, generator=gen)
    tables = torch.zeros(len(counts), max(counts), dtype=torch.int32)
    for s, blocks in enumerate(torch.randperm(sum(counts), generator=gen).split(counts)):
        tables[s, : len(blocks)] = blocks
    shape = (len(counts), case.num_heads, case.head_size)
    seq_lens = torch.tensor(case.seq_lens, dtype=torch.int32)
    x = AttentionInputs(torch.empty(shape, dtype=case.dtype), key, value, tables, seq_lens, case.head_size**-0.5,
                        key.clone(), value.clone())
    query = torch.randn(sum(q_lens), *shape[1:], generator=gen) * (3 * case.head_size**0.5)
    starts = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return x, query.to(case.dtype), starts


def _unseen_tiles(c: Case, q_lens: tuple[int, ...], sparse: BlockSparse, num_heads: int) -> list[tuple[int, int]]:
    """(cache block, KV head) tiles that no query of their sequence sees under `sparse`, whose
    negative step gives a KV head's query heads one pattern."""
    assert sparse.head_sliding_step < 0
    bs, num_kv_heads = c.cache[1].shape[3], c.cache[1].shape[1]
    offsets = sparse.offsets(num_heads, num_kv_heads, torch.device("cpu"))[:: num_heads // num_kv_heads]
    tiles = []
    for s, (n, q_len) in enumerate(zip(c.seq_lens.tolist(), q_lens)):
        query_pos = torch.arange(n - q_len, n)[:, None]
        for col in range(-(-n // bs)):
            key_pos = torch.arange(col * bs, min((col + 1) * bs, n))[None, :]
            seen = sparse.allowed(query_pos, key_pos, offsets[:, None, None]) & (key_pos <= query_pos)
            block = int(c.block_tables[s, col])
            tiles += [(block, kvh) for kvh in range(num_kv_heads) if not bool(seen[kvh].any())]
    return tiles


def _poison(c: Case, tiles: list[tuple[int, int]]) -> None:
    for cache in c.cache:
        raw = cache.view(torch.uint8) if cache.element_size() == 1 else cache
        for block, kv_head in tiles:
            raw[block, kv_head] = 0x7F if cache.element_size() == 1 else float("nan")


@pytest.mark.parametrize("cache_dtype", [None, E4M3], ids=["float32", "e4m3"])
def test_blocksparse_never_reads_unseen_blocks(backend: str, cache_dtype: torch.dtype | None) -> None:
    """K and V tiles that no query head of their KV head sees are NaN, and nothing turns NaN."""
    case = AttentionCase(torch.float32, 64, 16, 4, 2, 32, (1, 60, 250, 301))
    q_lens = (1, 1, 40, 1)
    x, query, starts = _private_blocks(case, q_lens)
    c = make_case(Features("sparse", cache_dtype, blocksparse=SPARSE_PER_KV_HEAD), case, x)
    prefill_tiles = _unseen_tiles(c, q_lens, SPARSE_PER_KV_HEAD, case.num_heads)
    decode_tiles = _unseen_tiles(c, (1,) * len(q_lens), SPARSE_PER_KV_HEAD, case.num_heads)
    assert len(prefill_tiles) >= 10 and set(prefill_tiles) <= set(decode_tiles)
    _poison(c, prefill_tiles)
    _assert_matches(_prefill(c, query, starts, backend, clean=False), _prefill(c, query, starts, "torch", clean=True),
                    case.dtype)
    _poison(c, decode_tiles)
    for version in ("v1", "v2"):
        _assert_matches(_decode(c, backend, clean=False, version=version, partition=32),
                        _decode(c, "torch", clean=True, version=version, partition=32), case.dtype)


# ---- the torch reference against a naive loop ----------------------------------------------------


def naive_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, query_pos: int, scale: float,
    slopes: torch.Tensor | None, sparse: BlockSparse | None, sliding_window: int | None,
) -> torch.Tensor:
    """One query `[H, D]` at `query_pos` over one sequence's contiguous fp32 K/V `[L, Hk, D]`,
    head by head and written out from the definitions, not with `paged.kernels.features`."""
    num_heads, num_kv_heads = query.shape[0], key.shape[1]
    group = num_heads // num_kv_heads
    keys = torch.arange(query_pos + 1)
    out = torch.empty(query.shape, dtype=torch.float32)
    for h in range(num_heads):
        kv = h // group
        kept = torch.ones(query_pos + 1, dtype=torch.bool)
        if sliding_window is not None:
            kept &= keys > query_pos - sliding_window
        if sparse is not None:
            step = sparse.head_sliding_step
            offset = h * step + 1 if step >= 0 else kv * -step + 1
            q_block, k_blocks = query_pos // sparse.block_size, keys // sparse.block_size
            kept &= (k_blocks > q_block - sparse.local_blocks) | ((k_blocks + offset) % sparse.vert_stride == 0)
        logits = key[: query_pos + 1, kv] @ query[h].float() * scale
        if slopes is not None:
            logits += slopes[h] * (keys - query_pos).float()
        weights = torch.softmax(logits[kept], dim=0)
        out[h] = weights @ value[: query_pos + 1, kv][kept]
    return out


def _dequantised(c: Case, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence `seq`'s K/V `[L, Hk, D]` from the clean cache, as fp32 values times their scales."""
    k, v = gather_kv(*c.clean, c.block_tables[seq], int(c.seq_lens[seq]))
    k, v = k.float(), v.float()
    if "k_scale" in c.options:
        num_kv_heads = k.shape[1]
        for t, name in ((k, "k_scale"), (v, "v_scale")):
            t *= torch.as_tensor(c.options[name], dtype=torch.float32).expand(num_kv_heads)[:, None]
    return k, v


NAIVE = [
    Features("e4m3-per-head", E4M3, per_head_scales=True),
    Features("e5m2", E5M2),
    Features("alibi", alibi=True),
    Features("sparse", blocksparse=SPARSE),
    Features("sparse-per-kv-head", blocksparse=SPARSE_PER_KV_HEAD),
    Features("all-window", E4M3, alibi=True, blocksparse=SPARSE, sliding_window=45),
]


@pytest.mark.parametrize("features", NAIVE, ids=lambda f: f.name)
def test_torch_reference_matches_naive_loop(features: Features) -> None:
    case = AttentionCase(torch.float32, 64, 16, 3, 3, 32, (1, 17, 100, 161))
    q_lens = (1, 5, 1, 40)
    x = prefill_inputs(case, q_lens)
    c = make_case(features, case, x.paged)
    slopes = c.options.get("alibi_slopes")
    decode = {v: _decode(c, "torch", clean=True, version=v, partition=32) for v in ("v1", "v2")}
    prefill = _prefill(c, x.query, x.query_start_loc, "torch", clean=True)
    starts = x.query_start_loc.tolist()
    for s, (n, q_len) in enumerate(zip(c.seq_lens.tolist(), q_lens)):
        k, v = _dequantised(c, s)
        expected = naive_attention(c.query[s], k, v, n - 1, c.scale, slopes, features.blocksparse,
                                   features.sliding_window)
        for out in decode.values():
            torch.testing.assert_close(out[s], expected, atol=1e-5, rtol=1e-5)
        for j in range(q_len):
            expected = naive_attention(x.query[starts[s] + j], k, v, n - q_len + j, c.scale, slopes,
                                       features.blocksparse, features.sliding_window)
            torch.testing.assert_close(prefill[starts[s] + j], expected, atol=1e-5, rtol=1e-5)


# ---- fp8 stores ----------------------------------------------------------------------------------


def _fp8_grid() -> list[torch.Tensor]:
    """Every finite fp8 value of both formats, scaled to cover either, with the midpoints between
    neighbours (ties round to even) and one ulp either side of them."""
    values = []
    for dtype in (E4M3, E5M2):
        finite = torch.arange(256, dtype=torch.uint8).view(dtype).float()
        finite = finite[finite.isfinite()].unique()
        mids = (finite[1:] + finite[:-1]) / 2
        values += [finite, mids, torch.nextafter(mids, finite[1:]), torch.nextafter(mids, finite[:-1])]
    return values


def _write_fp8(
    backend: str, key: torch.Tensor, value: torch.Tensor, mapping: torch.Tensor, cache_dtype: torch.dtype,
    num_blocks: int, scales: dict[str, object],
) -> tuple[torch.Tensor, torch.Tensor]:
    """`reshape_and_cache` on `backend` into fresh zeroed fp8 caches, returned on the CPU."""
    device, (_, kv_heads, head_size), block_size = _device(backend), key.shape, 16
    key_cache = torch.zeros(num_blocks, kv_heads, head_size // 16, block_size, 16, dtype=cache_dtype, device=device)
    value_cache = torch.zeros(num_blocks, kv_heads, head_size, block_size, dtype=cache_dtype, device=device)
    kernels.reshape_and_cache(key.to(device), value.to(device), key_cache, value_cache, mapping.to(device),
                              backend=backend, **_on(device, scales))
    return key_cache.cpu(), value_cache.cpu()


def _assert_same_bytes(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """Equal bytes, except that a NaN only has to be a NaN (its sign bit is the converter's choice)."""
    nan = theirs.float().isnan()
    assert torch.equal(ours.float().isnan(), nan)
    assert torch.equal(ours.view(torch.uint8)[~nan], theirs.view(torch.uint8)[~nan])


@pytest.mark.parametrize("cache_dtype", [E4M3, E5M2], ids=str)
def test_fp8_reshape_and_cache_matches_torch_bytes(backend: str, cache_dtype: torch.dtype) -> None:
    """The stored bytes equal torch's, for ties, clamped values and specials too, and attention
    over each backend's own cache agrees."""
    gen = torch.Generator().manual_seed(3)
    num_blocks, kv_heads, head_size, dtype = 12, 2, 64, torch.bfloat16
    slots = num_blocks * 16
    scales = {"k_scale": 0.25, "v_scale": torch.tensor([0.25, 0.5])}
    # Every fp8 value, tie and near-tie at power-of-two scales (x / scale is exact), then values
    # that clamp and the specials, spread over the slots by a shuffled mapping with skipped slots.
    special = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 1e30, -1e30, float("inf"), float("-inf"), float("nan")])
    grid = torch.cat(_fp8_grid())
    values = torch.cat([grid, -grid, special]) * 0.5
    padded = torch.cat([values, torch.zeros(-values.numel() % (kv_heads * head_size))]).view(-1, kv_heads, head_size)
    key, value = padded.to(dtype), padded.flip(0).to(dtype)
    mapping = torch.randperm(slots, generator=gen)[: key.shape[0]]
    mapping[::7] = -1
    ours = _write_fp8(backend, key, value, mapping, cache_dtype, num_blocks, scales)
    theirs = _write_fp8("torch", key, value, mapping, cache_dtype, num_blocks, scales)
    assert bool((theirs[0].float().abs() == FP8_MAX[cache_dtype]).any()), "no value clamped"
    for a, b in zip(ours, theirs):
        _assert_same_bytes(a, b)

    key = (torch.randn(slots, kv_heads, head_size, generator=gen) * 4).to(dtype)
    value = torch.randn(slots, kv_heads, head_size, generator=gen).to(dtype)
    mapping = torch.randperm(slots, generator=gen)
    ours = _write_fp8(backend, key, value, mapping, cache_dtype, num_blocks, scales)
    theirs = _write_fp8("torch", key, value, mapping, cache_dtype, num_blocks, scales)
    for a, b in zip(ours, theirs):
        _assert_same_bytes(a, b)
    tables = torch.arange(num_blocks, dtype=torch.int32).view(3, 4)
    lens = torch.tensor([5, 40, 64], dtype=torch.int32)
    query = (torch.randn(3, 4, head_size, generator=gen) * 8).to(dtype)
    device = _device(backend)
    out = kernels.paged_attention(query.to(device), *(t.to(device) for t in ours), tables.to(device), lens.to(device),
                                  head_size**-0.5, backend=backend, **_on(device, scales)).cpu()
    ref = kernels.paged_attention(query, *theirs, tables, lens, head_size**-0.5, **scales)
    _assert_matches(out, ref, dtype)


def test_fp8_header_matches_torch(tmp_path: Path) -> None:
    """kernels_cu/cpu/fp8.h, compiled on its own: decoding every byte and encoding (after the
    callers' clamp) equal torch's conversions; unclamped values saturate and NaN encodes as 0x7f."""
    if _NO_COMPILER is not None:
        pytest.skip(f"no host compiler: {_NO_COMPILER}")
    harness = tmp_path / "fp8.cpp"
    harness.write_text('#include "cpu/fp8.h"\n' + "".join(
        f'extern "C" void decode_{f}(const uint8_t* in, float* out, int n) {{\n'
        f"  for (int i = 0; i < n; ++i) out[i] = paged_fp8::{f}_to_float(in[i]);\n}}\n"
        f'extern "C" void encode_{f}(const float* in, uint8_t* out, int n) {{\n'
        f"  for (int i = 0; i < n; ++i) out[i] = paged_fp8::float_to_{f}(in[i]);\n}}\n"
        for f in ("e4m3", "e5m2")
    ))
    library = tmp_path / "fp8.so"
    compiler = host_compiler.find_compiler().path
    subprocess.run([compiler, "-std=c++17", "-O2", "-Wall", "-Werror", "-fPIC", "-shared", "-I", str(source_dir()),
                    str(harness), "-o", str(library)], check=True)
    lib = ctypes.CDLL(str(library))

    def call(fn: str, src: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(src.shape, dtype=out_dtype)
        getattr(lib, fn)(ctypes.c_void_p(src.data_ptr()), ctypes.c_void_p(out.data_ptr()), src.numel())
        return out

    gen = torch.Generator().manual_seed(0)
    random_bits = torch.randint(-(2**31), 2**31, (1 << 20,), generator=gen, dtype=torch.int64).to(torch.int32)
    random_floats = random_bits.view(torch.float32)
    tiny = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 2.0**-10, 2.0**-17, 3 * 2.0**-11, 1e-38])
    for name, dtype in (("e4m3", E4M3), ("e5m2", E5M2)):
        limit = FP8_MAX[dtype]
        codes = torch.arange(256, dtype=torch.uint8)
        decoded, expected = call(f"decode_{name}", codes, torch.float32), codes.view(dtype).float()
        assert torch.equal(decoded.isnan(), expected.isnan())
        finite = ~expected.isnan()
        assert torch.equal(decoded[finite], expected[finite])
        assert torch.equal(decoded[finite].signbit(), expected[finite].signbit())

        values = torch.cat([*_fp8_grid(), random_floats, tiny, random_floats * 2.0**-100])
        values = torch.cat([values, -values])
        values = values[~values.isnan()].clamp(-limit, limit)
        encoded = call(f"encode_{name}", values, torch.uint8)
        mismatch = (encoded != values.to(dtype).view(torch.uint8)).nonzero().flatten()
        assert mismatch.numel() == 0, f"{dtype}: {values[mismatch[:5]].tolist()} -> {encoded[mismatch[:5]].tolist()}"

        unclamped = torch.tensor([1e6, -1e6, float("inf"), float("-inf"), limit * 1.07, -limit * 1.07, math.nan])
        largest = torch.tensor(limit).to(dtype).view(torch.uint8).item()
        assert call(f"encode_{name}", unclamped, torch.uint8).tolist() == [largest, largest | 0x80] * 3 + [0x7F]


# ---- the front end's checks ----------------------------------------------------------------------


def _small() -> tuple[AttentionInputs, AttentionInputs]:
    """Small inputs with a dense and an fp8 cache (the fp8 one reuses the dense block tables)."""
    case = AttentionCase(torch.float32, 64, 16, 2, 2, 32, (5, 20))
    x = attention_inputs(case)
    (key_cache, value_cache), _ = to_fp8(x, E4M3, 1.0, 1.0)
    return x, replace(x, key_cache=key_cache, value_cache=value_cache)


@pytest.fixture
def nothing_runs(backend: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The backend, with every op replaced by a failure: the checks must reject first."""
    impl = type(kernels.get_backend(backend))

    def ran(*args: object, **kwargs: object) -> None:
        raise AssertionError("a backend op ran on arguments the front end should have rejected")

    for op in ("paged_attention", "prefill_attention", "reshape_and_cache"):
        monkeypatch.setattr(impl, op, ran)
    return backend


def _run_op(op: str, x: AttentionInputs, backend: str, **options: object) -> None:
    if op == "decode":
        kernels.paged_attention(x.query, x.key_cache, x.value_cache, x.block_tables, x.seq_lens, x.scale,
                                backend=backend, **options)
    elif op == "prefill":
        starts = torch.arange(x.query.shape[0] + 1, dtype=torch.int32)
        kernels.prefill_attention(x.query, x.key_cache, x.value_cache, x.block_tables, starts, x.seq_lens, x.scale,
                                  backend=backend, **options)
    else:
        tokens = torch.zeros(3, *x.value_cache.shape[1:3], dtype=torch.float32)
        kernels.reshape_and_cache(tokens, tokens.clone(), x.key_cache, x.value_cache, torch.arange(3),
                                  backend=backend, **options)


@pytest.mark.parametrize("op", ["decode", "prefill"])
@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"alibi_slopes": torch.ones(3)}, r"num_heads=4 slopes, got \(3,\)"),
        ({"alibi_slopes": torch.ones(2, 2)}, r"num_heads=4 slopes, got \(2, 2\)"),
        ({"alibi_slopes": torch.tensor([1.0, float("nan"), 1.0, 1.0])}, r"finite, got \[1.0, nan, 1.0, 1.0\]"),
        ({"blocksparse": BlockSparse(1, 2, 24)}, r"block_size=24 must be a multiple of the KV cache block size 16"),
        ({"blocksparse": BlockSparse(0, 2, 32)}, r"local_blocks=0 must be > 0"),
    ],
    ids=["alibi-length", "alibi-2d", "alibi-nan", "sparse-block", "sparse-local"],
)
def test_bad_features_are_rejected_first(nothing_runs: str, op: str, options: dict, message: str) -> None:
    x, _ = _small()
    with pytest.raises(ValueError, match=message):
        _run_op(op, x, nothing_runs, **options)


@pytest.mark.parametrize("op", ["decode", "prefill", "reshape_and_cache"])
@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"k_scale": 0.0}, r"k_scale=0.0 must be a finite number > 0"),
        ({"v_scale": -1.5}, r"v_scale=-1.5 must be a finite number > 0"),
        ({"k_scale": math.nan}, r"k_scale=nan must be"),
        ({"v_scale": math.inf}, r"v_scale=inf must be"),
        ({"k_scale": torch.tensor([1.0, 0.0])}, r"k_scale=\[1.0, 0.0\] must be finite numbers > 0"),
        ({"v_scale": torch.tensor([float("nan"), 1.0])}, r"v_scale=\[nan, 1.0\] must be finite"),
        ({"k_scale": torch.ones(3)}, r"k_scale has shape \(3,\); expected one scale per tensor or \[num_kv_heads=2\]"),
    ],
    ids=["zero", "negative", "nan", "inf", "head-zero", "head-nan", "shape"],
)
def test_bad_scales_are_rejected_first(nothing_runs: str, op: str, options: dict, message: str) -> None:
    _, fp8 = _small()
    before = fp8.key_cache.clone(), fp8.value_cache.clone()
    with pytest.raises(ValueError, match=message):
        _run_op(op, fp8, nothing_runs, **options)
    for cache, unchanged in zip((fp8.key_cache, fp8.value_cache), before):
        assert torch.equal(cache.view(torch.uint8), unchanged.view(torch.uint8))


@pytest.mark.parametrize("op", ["decode", "prefill", "reshape_and_cache"])
@pytest.mark.parametrize("name", ["k_scale", "v_scale"])
def test_scales_on_a_dense_cache_are_rejected_first(nothing_runs: str, op: str, name: str) -> None:
    dense, _ = _small()
    with pytest.raises(ValueError, match=r"k_scale/v_scale apply to fp8 KV caches only; this cache is torch.float32"):
        _run_op(op, dense, nothing_runs, **{name: 0.5})
