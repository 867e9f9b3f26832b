"""The native fused layer ops (paged/kernels/layer_ops.py) and the cpu backend's native
reshape_and_cache against the torch formulas they replace.

On x86 they reproduce torch's arithmetic, so the comparisons there are bit-exact (rms_norm's
summation order, silu's Sleef exp); elsewhere they hold to a few ulp."""

from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F

from paged import kernels
from paged.kernels import fused_ops as layer_ops
from paged.kernels.backends import cpu as cpu_backend
from paged.kernels.backends import torch_ref
from paged.kernels.toolchain import host_compiler

_NO_COMPILER = host_compiler.unavailable_reason()
pytestmark = [
    pytest.mark.compiles,
    pytest.mark.skipif(_NO_COMPILER is not None, reason=f"cpu backend not buildable: {_NO_COMPILER}"),
]

# Where the ops mirror torch's kernels operation by operation (layer_ops.h).
EXACT = platform.machine().lower() in ("x86_64", "amd64") and torch.backends.cpu.get_cpu_capability() in (
    "AVX2", "AVX512",
)
ROWS = (1, 7, 300)  # 300 rows of 576 run on the thread pool, 7 on the calling thread
HIDDEN = (576, 37, 5, 1000)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance between `a` and `b` in units in the last place (same-sign values)."""
    return int((a.view(torch.int32).long() - b.view(torch.int32).long()).abs().max()) if a.numel() else 0


def _same(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    if EXACT:
        assert torch.equal(out, ref), f"max {_ulps(out, ref)} ulp apart"
    else:
        torch.testing.assert_close(out, ref, rtol=2e-6, atol=1e-6)


def _rows(num_rows: int, cols: int, strided: bool, scale: float = 3.0) -> torch.Tensor:
    """`[num_rows, cols]`, contiguous or a column slice of a wider tensor (rows cols + 11 apart)."""
    full = torch.randn(num_rows, cols + 11 if strided else cols) * scale
    return full[:, 3 : 3 + cols] if strided else full


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("num_rows", ROWS)
def test_rms_norm_matches_torch(num_rows: int, hidden: int, strided: bool) -> None:
    torch.manual_seed(num_rows * hidden)
    x, weight = _rows(num_rows, hidden, strided), torch.randn(hidden)
    before = x.clone()
    out = layer_ops.rms_norm(x, weight, 1e-5)
    assert out.is_contiguous()
    _same(out, weight * F.rms_norm(x, (hidden,), eps=1e-5))
    assert torch.equal(x, before)


def test_out_buffers_are_written_and_returned() -> None:
    torch.manual_seed(3)
    x, weight = torch.randn(7, 576), torch.randn(576)
    expected = layer_ops.rms_norm(x, weight, 1e-5)
    out = torch.full((7, 600), float("nan"))[:, :576]
    assert layer_ops.rms_norm(x, weight, 1e-5, out=out) is out
    assert torch.equal(out, expected)
    assert layer_ops.rms_norm(x, weight, 1e-5, out=x) is x  # in place
    assert torch.equal(x, expected)
    gate_up = torch.randn(7, 2 * 40)
    out = torch.empty(7, 40)
    assert layer_ops.silu_and_mul(gate_up, out=out) is out
    assert torch.equal(out, layer_ops.silu_and_mul(gate_up))


def test_rms_norm_long_rows_use_the_cascade() -> None:
    """Rows past 16 * 32 elements go through more than one level of torch's cascade sum."""
    torch.manual_seed(0)
    x, weight = torch.randn(3, 70001) * 5, torch.rand(70001)
    _same(layer_ops.rms_norm(x, weight, 1e-6), weight * F.rms_norm(x, (70001,), eps=1e-6))


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("num_rows", ROWS)
def test_add_rms_norm_updates_residual_and_x_in_place(num_rows: int, hidden: int, strided: bool) -> None:
    torch.manual_seed(num_rows + hidden)
    x, residual, weight = _rows(num_rows, hidden, strided), _rows(num_rows, hidden, strided), torch.randn(hidden)
    summed = residual + x
    expected = weight * F.rms_norm(summed, (hidden,), eps=1e-6)
    x_ptr, residual_ptr = x.data_ptr(), residual.data_ptr()
    out = layer_ops.add_rms_norm(x, residual, weight, 1e-6)
    assert out is x and x.data_ptr() == x_ptr and residual.data_ptr() == residual_ptr
    assert torch.equal(residual, summed)  # one IEEE add: exact everywhere
    _same(x, expected)


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("inter", [1536, 37, 24, 3])
@pytest.mark.parametrize("num_rows", ROWS)
def test_silu_and_mul_matches_torch(num_rows: int, inter: int, strided: bool) -> None:
    torch.manual_seed(num_rows * inter)
    x = _rows(num_rows, 2 * inter, strided, scale=4.0)
    gate, up = x.chunk(2, dim=-1)
    out = layer_ops.silu_and_mul(x)
    assert out.is_contiguous()
    _same(out, F.silu(gate) * up)


def test_silu_and_mul_extremes() -> None:
    """exp(-g) overflowing, underflowing and of infinities and NaN, through the vector and tail paths."""
    special = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 87.0, -87.0, 89.0, -89.0, 100.5, -100.5, 104.5, -104.5,
                            200.0, -200.0, float("inf"), float("-inf"), float("nan")])
    inter = 48
    gate = special.repeat(3)[:inter]
    x = torch.cat([gate, torch.linspace(-3, 3, inter)]).repeat(2, 1)
    x[1, :inter] = x[1, :inter].flip(0)
    out = layer_ops.silu_and_mul(x)
    ref = F.silu(x[:, :inter]) * x[:, inter:]
    assert torch.equal(out.isnan(), ref.isnan())
    _same(out.nan_to_num(), ref.nan_to_num())


def _rope_tables(head_dim: int, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's cos/sin `[positions, head_dim]`: the half-frequencies repeated twice."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = torch.outer(torch.arange(positions, dtype=torch.int64).float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The model's torch RoPE: HF's rotate_half, dimension i paired with i + head_dim / 2."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


@pytest.mark.parametrize("head_dim", [64, 32, 6])
@pytest.mark.parametrize("num_rows", ROWS)
def test_rotary_embedding_is_bit_exact_on_a_qkv_view(num_rows: int, head_dim: int) -> None:
    """SmolLM2's 9 query + 3 KV heads, rotated in place in the fused qkv output; v is untouched."""
    torch.manual_seed(num_rows + head_dim)
    n_q, n_kv = 9, 3
    cos, sin = _rope_tables(head_dim, 4096)
    positions = torch.randint(0, 4096, (num_rows,))
    qkv = torch.randn(num_rows, (n_q + 2 * n_kv) * head_dim) * 2
    qk = qkv[:, : (n_q + n_kv) * head_dim]
    expected = apply_rope(qk.reshape(num_rows, n_q + n_kv, head_dim), cos[positions].unsqueeze(1),
                          sin[positions].unsqueeze(1))
    v = qkv[:, (n_q + n_kv) * head_dim :].clone()
    assert layer_ops.rotary_embedding(qk, positions, cos, sin, n_q + n_kv, head_dim) is None
    assert torch.equal(qk.reshape(num_rows, n_q + n_kv, head_dim), expected)  # bit-exact on every CPU
    assert torch.equal(qkv[:, (n_q + n_kv) * head_dim :], v)


def test_rotary_embedding_takes_heads_view_and_leaves_other_heads() -> None:
    """A 3-d `[T, heads, D]` view; only the first `num_heads` heads turn."""
    torch.manual_seed(1)
    cos, sin = _rope_tables(64, 100)
    qkv = torch.randn(5, 15 * 64)
    heads = qkv.view(5, 15, 64)
    positions = torch.tensor([0, 99, 3, 3, 50])
    expected = apply_rope(heads[:, :12], cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))
    rest = heads[:, 12:].clone()
    layer_ops.rotary_embedding(heads, positions, cos, sin, 12, 64)
    assert torch.equal(heads[:, :12], expected)
    assert torch.equal(heads[:, 12:], rest)
    assert torch.equal(heads[0, 0], expected[0, 0])  # position 0: cos 1, sin 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_results_do_not_depend_on_the_thread_count(dtype: torch.dtype) -> None:
    torch.manual_seed(2)
    x, weight = torch.randn(300, 576).to(dtype), torch.randn(576).to(dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = layer_ops.rms_norm(x, weight, 1e-5), layer_ops.silu_and_mul(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single[0], layer_ops.rms_norm(x, weight, 1e-5))
    assert torch.equal(single[1], layer_ops.silu_and_mul(x))


# ---- reshape_and_cache ---------------------------------------------------------------------------


def _caches(dtype: torch.dtype, num_blocks: int, kv_heads: int, head: int, block: int) -> list[torch.Tensor]:
    """Random (not zero) caches, so a write to a wrong or skipped slot shows."""
    x = 16 // torch.empty((), dtype=dtype).element_size()
    gen = torch.Generator().manual_seed(7)
    return [torch.randn(num_blocks, kv_heads, head // x, block, x, generator=gen).to(dtype),
            torch.randn(num_blocks, kv_heads, head, block, generator=gen).to(dtype)]


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "qkv-view"])
@pytest.mark.parametrize("block", [8, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("num_tokens", ROWS)
def test_native_reshape_and_cache_matches_torch_bits(
    num_tokens: int, dtype: torch.dtype, block: int, strided: bool
) -> None:
    torch.manual_seed(num_tokens + block)
    kv_heads, head, num_blocks = 3, 64, 64
    if strided:  # k and v as the executor gets them: views of the fused qkv output
        qkv = torch.randn(num_tokens, (9 + 2 * kv_heads) * head).to(dtype)
        key = qkv[:, 9 * head : (9 + kv_heads) * head].view(num_tokens, kv_heads, head)
        value = qkv[:, (9 + kv_heads) * head :].view(num_tokens, kv_heads, head)
        assert num_tokens == 1 or not key.is_contiguous()
    else:
        key, value = (torch.randn(num_tokens, kv_heads, head).to(dtype) for _ in range(2))
    slots = torch.randperm(num_blocks * block)[:num_tokens]
    slots[::3] = -1  # padding
    expected = _caches(dtype, num_blocks, kv_heads, head, block)
    got = [c.clone() for c in expected]
    torch_ref.reshape_and_cache(key, value, *expected, slots)
    kernels.reshape_and_cache(key, value, *got, slots, backend="cpu")
    for g, e in zip(got, expected):
        assert torch.equal(g.view(torch.int8), e.view(torch.int8))


def test_native_reshape_and_cache_takes_any_strides() -> None:
    """Key/value whose head and dim strides are not (head_size, 1), straight to the backend."""
    key = torch.randn(64, 5, 3).permute(2, 1, 0)[:, :2]  # [3, 2, 64], dim stride 15
    value = torch.randn(2, 3, 64).transpose(0, 1)  # head stride 192
    slots = torch.tensor([5, -1, 17])
    expected = _caches(torch.float32, 4, 2, 64, 8)
    got = [c.clone() for c in expected]
    torch_ref.reshape_and_cache(key, value, *expected, slots)
    cpu_backend.BACKEND.reshape_and_cache(key, value, *got, slots)
    for g, e in zip(got, expected):
        assert torch.equal(g, e)


def test_reshape_and_cache_only_padding_and_no_tokens_leave_cache() -> None:
    caches = _caches(torch.float32, 4, 2, 64, 8)
    before = [c.clone() for c in caches]
    key = torch.randn(3, 2, 64)
    kernels.reshape_and_cache(key, key, *caches, torch.full((3,), -1), backend="cpu")
    kernels.reshape_and_cache(key[:0], key[:0], *caches, torch.zeros(0, dtype=torch.int64), backend="cpu")
    assert all(torch.equal(c, b) for c, b in zip(caches, before))


def test_reshape_and_cache_fp8_cache_uses_the_torch_writer() -> None:
    key, value = torch.randn(5, 2, 64), torch.randn(5, 2, 64)
    slots = torch.tensor([0, 9, -1, 31, 4])
    expected = [torch.zeros(4, 2, 4, 8, 16, dtype=torch.uint8), torch.zeros(4, 2, 64, 8, dtype=torch.uint8)]
    expected = [c.view(torch.float8_e4m3fn) for c in expected]
    got = [c.clone() for c in expected]
    kernels.reshape_and_cache(key, value, *expected, slots, backend="torch", k_scale=0.5, v_scale=2.0)
    kernels.reshape_and_cache(key, value, *got, slots, backend="cpu", k_scale=0.5, v_scale=2.0)
    for g, e in zip(got, expected):
        assert torch.equal(g.view(torch.uint8), e.view(torch.uint8))


def test_reshape_and_cache_slot_past_the_cache_is_refused_before_writing() -> None:
    caches = _caches(torch.float32, 2, 2, 64, 8)
    before = [c.clone() for c in caches]
    key = torch.randn(2, 2, 64)
    with pytest.raises(ValueError, match="slot >= num_blocks \\* block_size"):
        kernels.reshape_and_cache(key, key, *caches, torch.tensor([3, 16]), backend="cpu")
    assert all(torch.equal(c, b) for c, b in zip(caches, before))


# ---- argument errors -----------------------------------------------------------------------------

_X, _W = torch.randn(4, 8), torch.randn(8)
_COS, _SIN = _rope_tables(8, 16)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: layer_ops.rms_norm(_X.double(), _W, 1e-5), "x must be float32 or bfloat16, got torch.float64"),
        (lambda: layer_ops.rms_norm(_X.bfloat16(), _W, 1e-5), "weight must be bfloat16 like x, got torch.float32"),
        (lambda: layer_ops.rms_norm(_X.to("meta"), _W, 1e-5), "x must be on the cpu, got meta"),
        (lambda: layer_ops.rms_norm(_X[0], _W, 1e-5), r"x must be 2-d \[T, H\], got shape \(8,\)"),
        (lambda: layer_ops.rms_norm(_X, _W[:7], 1e-5), r"weight must be \[8\], got shape \(7,\)"),
        (lambda: layer_ops.rms_norm(_X, _W.double(), 1e-5), "weight must be float32"),
        (lambda: layer_ops.rms_norm(_X.t(), _W[:4], 1e-5), "x must have contiguous columns"),
        (lambda: layer_ops.rms_norm(_X, _W, -1.0), "eps must be a number >= 0, got -1.0"),
        (lambda: layer_ops.rms_norm(_X.tolist(), _W, 1e-5), "x must be a torch.Tensor, got list"),
        (lambda: layer_ops.add_rms_norm(_X.clone(), torch.randn(4, 9), _W, 1e-5),
         r"residual must be \[T, 8\], got shape \(4, 9\)"),
        (lambda: layer_ops.add_rms_norm(_X.clone(), torch.randn(3, 8), _W, 1e-5),
         r"residual must be \[4, 8\] like x, got shape \(3, 8\)"),
        (lambda: layer_ops.add_rms_norm(_X, _X, _W, 1e-5), "residual and x overlap in memory"),
        (lambda: layer_ops.add_rms_norm(_X.clone(), _W.expand(4, 8), _W.clone(), 1e-5),
         "residual rows overlap"),
        (lambda: layer_ops.silu_and_mul(torch.randn(4, 7)), r"x must be \[T, 2 \* intermediate\]"),
        (lambda: layer_ops.silu_and_mul(_X, out=_X[:, :4]), "out and x overlap in memory"),
        (lambda: layer_ops.silu_and_mul(_X, out=torch.empty(3, 4)), r"out must be \[4, 4\]"),
        (lambda: layer_ops.rms_norm(_X, _W, 1e-5, out=_X[:, 1:].contiguous()), r"out must be \[T, 8\]"),
        (lambda: layer_ops.rms_norm(_X, _W, 1e-5, out=torch.empty(4, 8, dtype=torch.float64)), "out must be float32"),
        (lambda: layer_ops.silu_and_mul(torch.randn(4, 8, dtype=torch.float16)), "x must be float32"),
        (lambda: layer_ops.rotary_embedding(_X, torch.zeros(4, dtype=torch.int64), _COS, _SIN, 1, 7),
         "head_dim must be a positive even int, got 7"),
        (lambda: layer_ops.rotary_embedding(_X, torch.zeros(4, dtype=torch.int64), _COS, _SIN, 2, 8),
         r"qk must be \[T, >= 16\]"),
        (lambda: layer_ops.rotary_embedding(_X, torch.zeros(4, dtype=torch.int32), _COS, _SIN, 1, 8),
         "positions must be a 1-d int64 tensor, got 1-d torch.int32"),
        (lambda: layer_ops.rotary_embedding(_X, torch.zeros(3, dtype=torch.int64), _COS, _SIN, 1, 8),
         r"positions must be \[4\]"),
        (lambda: layer_ops.rotary_embedding(_X, torch.tensor([0, 1, 16, 2]), _COS, _SIN, 1, 8),
         "positions holds a position outside the cos/sin tables"),
        (lambda: layer_ops.rotary_embedding(_X, torch.tensor([0, 1, -1, 2]), _COS, _SIN, 1, 8),
         "positions holds a position outside the cos/sin tables"),
        (lambda: layer_ops.rotary_embedding(_X, torch.zeros(4, dtype=torch.int64), _COS[:, :4], _SIN, 1, 8),
         r"cos must be \[P, 8\], got shape \(16, 4\)"),
        (lambda: layer_ops.rotary_embedding(_X, torch.zeros(4, dtype=torch.int64), _COS, _SIN[:8], 1, 8),
         r"sin must be \[16, 8\] like cos"),
        (lambda: layer_ops.rotary_embedding(_X, torch.zeros(4, dtype=torch.int64), _COS.double(), _SIN, 1, 8),
         "cos must be float32"),
        (lambda: layer_ops.rotary_embedding(_X.to("meta"), torch.zeros(4, dtype=torch.int64), _COS, _SIN, 1, 8),
         "qk must be on the cpu"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_bad_arguments_raise_value_error_naming_them(call, match: str) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match=match):
        call()


def test_rejected_rotary_leaves_qk_untouched() -> None:
    qk = _X.clone()
    with pytest.raises(ValueError):
        layer_ops.rotary_embedding(qk, torch.tensor([0, 1, 99, 2]), _COS, _SIN, 1, 8)
    assert torch.equal(qk, _X)
