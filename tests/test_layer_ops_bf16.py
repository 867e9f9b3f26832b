"""The native fused layer ops on bf16 tensors (a `model.dtype=bfloat16` model on the CPU) against the
torch formulas they replace (`TorchLayerOps`, run in bf16).

The ops compute in fp32 and round to bf16 wherever torch's bf16 ops do, so every comparison here is
to the bit (NaN payloads aside: torch's own vector and scalar paths write different ones)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from paged.api.llm import LLM
from paged.kernels import fused_ops
from paged.kernels.toolchain import host_compiler
from paged.model.layer_ops import NATIVE_CPU_OPS, TORCH_OPS
from paged.model.llama import LlamaModel, rope_frequencies
from paged.model.tiny import random_state, tiny_arch
from paged.request import SamplingParams

_NO_COMPILER = host_compiler.unavailable_reason()
pytestmark = [
    pytest.mark.compiles,
    pytest.mark.skipif(_NO_COMPILER is not None, reason=f"cpu backend not buildable: {_NO_COMPILER}"),
]

BF16 = torch.bfloat16
ROWS = (1, 7, 300)  # 300 rows of 576 run on the thread pool, 7 on the calling thread
HIDDEN = (576, 37, 5, 1000)


def _same_bits(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype == BF16
    assert torch.equal(out.isnan(), ref.isnan())
    bits, ref_bits = out.view(torch.int16), ref.view(torch.int16)
    differ = (bits != ref_bits) & ~ref.isnan()
    assert not differ.any(), f"{int(differ.sum())} of {out.numel()} differ, e.g. {out[differ][:4]} vs {ref[differ][:4]}"


def _rows(num_rows: int, cols: int, strided: bool, scale: float = 3.0) -> torch.Tensor:
    """bf16 `[num_rows, cols]`, contiguous or a column slice of a wider tensor (rows cols + 11 apart)."""
    full = (torch.randn(num_rows, cols + 11 if strided else cols) * scale).to(BF16)
    return full[:, 3 : 3 + cols] if strided else full


def _weight(hidden: int) -> torch.Tensor:
    return (1 + 0.5 * torch.randn(hidden)).to(BF16)


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("num_rows", ROWS)
def test_rms_norm_matches_the_bf16_formula(num_rows: int, hidden: int, strided: bool) -> None:
    torch.manual_seed(num_rows * hidden)
    x, weight = _rows(num_rows, hidden, strided), _weight(hidden)
    before = x.clone()
    expected = TORCH_OPS.rms_norm(x, weight, 1e-5)
    out = fused_ops.rms_norm(x, weight, 1e-5)
    assert out.is_contiguous()
    _same_bits(out, expected)
    assert torch.equal(x, before)
    assert fused_ops.rms_norm(x, weight, 1e-5, out=x) is x  # in place, over a strided view too
    _same_bits(x, expected)


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("num_rows", ROWS)
def test_add_rms_norm_updates_residual_and_x_in_place(num_rows: int, hidden: int, strided: bool) -> None:
    torch.manual_seed(num_rows + hidden)
    x, residual, weight = _rows(num_rows, hidden, strided), _rows(num_rows, hidden, strided), _weight(hidden)
    ref_x, ref_residual = x.clone(), residual.clone()
    expected = TORCH_OPS.add_rms_norm(ref_x, ref_residual, weight, 1e-6)
    out = fused_ops.add_rms_norm(x, residual, weight, 1e-6)
    assert out is x
    _same_bits(residual, ref_residual)
    _same_bits(x, expected)


def test_rms_norm_long_rows_use_the_cascade() -> None:
    """Rows past 16 * 32 elements go through more than one level of torch's cascade sum."""
    torch.manual_seed(0)
    x, weight = (torch.randn(3, 70001) * 5).to(BF16), torch.rand(70001).to(BF16)
    _same_bits(fused_ops.rms_norm(x, weight, 1e-6), TORCH_OPS.rms_norm(x, weight, 1e-6))


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("inter", [1536, 37, 24, 3])
@pytest.mark.parametrize("num_rows", ROWS)
def test_silu_and_mul_matches_the_bf16_formula(num_rows: int, inter: int, strided: bool) -> None:
    """x as the fused gate/up output, or a column slice of a wider tensor."""
    torch.manual_seed(num_rows * inter)
    x = _rows(num_rows, 2 * inter, strided, scale=4.0)
    out = fused_ops.silu_and_mul(x)
    assert out.is_contiguous()
    _same_bits(out, TORCH_OPS.silu_and_mul(x))
    buffer = torch.empty(num_rows, inter + 5, dtype=BF16)[:, :inter]
    assert fused_ops.silu_and_mul(x, out=buffer) is buffer
    _same_bits(buffer, out)


@pytest.mark.parametrize("torch_path", ["vector", "scalar"])
def test_silu_of_every_bf16_value_rounds_as_torch_does(torch_path: str) -> None:
    """All 65536 bf16 gates (up = 1): the kernel's Sleef exp rounds to torch's bf16 silu, whether
    torch takes its vector loop (Sleef) or, on a strided row, its scalar one (libm's expf)."""
    gates = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(BF16).reshape(-1, 64)
    x = torch.cat([gates, torch.ones_like(gates)], dim=1)
    if torch_path == "vector":
        expected = F.silu(gates)
    else:
        spread = torch.zeros(gates.numel(), 2, dtype=BF16)
        spread[:, 0] = gates.flatten()
        expected = F.silu(spread[:, :1]).reshape(gates.shape)  # stride 2: torch's scalar loop
    _same_bits(fused_ops.silu_and_mul(x), expected)


def _tables(head_dim: int, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's cos/sin in bf16: computed in fp32 and cast once, as LlamaModel does."""
    cos, sin = rope_frequencies(10000.0, head_dim, positions)
    return cos.to(BF16), sin.to(BF16)


@pytest.mark.parametrize("head_dim", [64, 32, 6])
@pytest.mark.parametrize("num_rows", ROWS)
def test_rotary_embedding_is_bit_exact_on_a_qkv_view(num_rows: int, head_dim: int) -> None:
    """SmolLM2's 9 query + 3 KV heads, rotated in place in the fused qkv output; v is untouched."""
    torch.manual_seed(num_rows + head_dim)
    heads = 9 + 3
    cos, sin = _tables(head_dim, 4096)
    positions = torch.randint(0, 4096, (num_rows,))
    qkv = (torch.randn(num_rows, (heads + 3) * head_dim) * 2).to(BF16)
    expected = TORCH_OPS.rope(qkv, TORCH_OPS.rotation(positions, cos, sin), heads, head_dim)
    v = qkv[:, heads * head_dim :].clone()
    assert fused_ops.rotary_embedding(qkv, positions, cos, sin, heads, head_dim) is None
    _same_bits(qkv[:, : heads * head_dim].view(num_rows, heads, head_dim), expected)
    assert torch.equal(qkv[:, heads * head_dim :], v)


def test_rotary_embedding_takes_heads_view_and_leaves_other_heads() -> None:
    torch.manual_seed(1)
    cos, sin = _tables(64, 100)
    heads = torch.randn(5, 15, 64).to(BF16)
    positions = torch.tensor([0, 99, 3, 3, 50])
    expected = TORCH_OPS.rope(heads.view(5, -1), TORCH_OPS.rotation(positions, cos, sin), 12, 64)
    rest = heads[:, 12:].clone()
    fused_ops.rotary_embedding(heads, positions, cos, sin, 12, 64)
    _same_bits(heads[:, :12], expected)
    assert torch.equal(heads[:, 12:], rest)


def test_native_cpu_ops_run_bf16_natively() -> None:
    """NATIVE_CPU_OPS takes the native kernels for bf16 (RoPE in place, the norm over x) and gives
    the torch formulas' bits."""
    torch.manual_seed(4)
    cos, sin = _tables(64, 64)
    positions = torch.arange(7)
    qkv = torch.randn(7, 5 * 64).to(BF16)
    expected = TORCH_OPS.rope(qkv, TORCH_OPS.rotation(positions, cos, sin), 4, 64)
    rotated = NATIVE_CPU_OPS.rope(qkv, NATIVE_CPU_OPS.rotation(positions, cos, sin), 4, 64)
    assert rotated.data_ptr() == qkv.data_ptr()
    _same_bits(rotated, expected)
    x, residual, weight = _rows(7, 40, False), _rows(7, 40, False), _weight(40)
    ref_x, ref_residual = x.clone(), residual.clone()
    assert NATIVE_CPU_OPS.add_rms_norm(x, residual, weight, 1e-5) is x
    _same_bits(x, TORCH_OPS.add_rms_norm(ref_x, ref_residual, weight, 1e-5))


# ---- a bf16 model ---------------------------------------------------------------------------------


def _causal_attention(_: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One sequence, grouped-query heads: the same on both runs, so only the layer ops differ."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(group, dim=1).transpose(0, 1) for t in (k, v))
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, is_causal=True)
    return out.transpose(0, 1)


def test_a_bf16_model_gives_the_torch_formulas_hidden_states_to_the_bit() -> None:
    """The tiny Llama in bf16, its norm weights made random (the shipped ones are ones): every layer op
    feeds the next, and the final hidden states match the torch formulas' bit for bit."""
    arch = tiny_arch()
    state = random_state(arch)
    gen = torch.Generator().manual_seed(5)
    for name in [n for n in state if n.endswith("norm.weight")]:
        state[name] = 1 + 0.3 * torch.randn(state[name].shape, generator=gen)
    model = LlamaModel(arch, state, dtype=BF16)
    ids, positions = torch.randint(0, arch.vocab_size, (37,), generator=gen), torch.arange(37)
    expected = model.forward(ids, positions, _causal_attention)
    model.ops = NATIVE_CPU_OPS
    _same_bits(model.forward(ids, positions, _causal_attention), expected)


def test_a_bf16_model_generates_the_torch_formulas_greedy_tokens() -> None:
    """`model=tiny-random` in bf16 on the cpu backend: its native layer ops, then the torch formulas
    on the same engine, then `kernel.backend=torch` (torch attention and layer ops)."""
    prompts = [[(31 * n + 7 * i) % 40000 for i in range(n)] for n in (21, 40, 9)]
    greedy = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0)
    overrides = ["model.device=cpu", "model.dtype=bfloat16"]
    llm = LLM("tiny-random", overrides=[*overrides, "kernel.backend=cpu"])
    model = llm.engine.executor.model
    assert model.ops is NATIVE_CPU_OPS and model.dtype == BF16
    native = [o.token_ids for o in llm.generate(prompts, greedy)]
    model.ops = TORCH_OPS
    assert [o.token_ids for o in llm.generate(prompts, greedy)] == native
    reference = LLM("tiny-random", overrides=[*overrides, "kernel.backend=torch"])
    assert [o.token_ids for o in reference.generate(prompts, greedy)] == native


# ---- argument errors -----------------------------------------------------------------------------

_X, _W = torch.randn(4, 8).to(BF16), torch.randn(8).to(BF16)
_COS, _SIN = _tables(8, 16)
_POS = torch.zeros(4, dtype=torch.int64)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: fused_ops.rms_norm(_X, _W.float(), 1e-5), "weight must be bfloat16 like x, got torch.float32"),
        (lambda: fused_ops.rms_norm(_X.float(), _W, 1e-5), "weight must be float32 like x, got torch.bfloat16"),
        (lambda: fused_ops.rms_norm(_X.half(), _W, 1e-5), "x must be float32 or bfloat16, got torch.float16"),
        (lambda: fused_ops.rms_norm(_X, _W, 1e-5, out=torch.empty(4, 8)), "out must be bfloat16 like x"),
        (lambda: fused_ops.add_rms_norm(_X.clone(), _X.float(), _W, 1e-5),
         "residual must be bfloat16 like x, got torch.float32"),
        (lambda: fused_ops.add_rms_norm(_X.clone(), _X.clone(), _W.float(), 1e-5), "weight must be bfloat16 like x"),
        (lambda: fused_ops.silu_and_mul(_X, out=torch.empty(4, 4)), "out must be bfloat16 like x, got torch.float32"),
        (lambda: fused_ops.rotary_embedding(_X.clone(), _POS, _COS.float(), _SIN, 1, 8),
         "cos must be bfloat16 like qk, got torch.float32"),
        (lambda: fused_ops.rotary_embedding(_X.clone(), _POS, _COS, _SIN.float(), 1, 8),
         "sin must be bfloat16 like qk, got torch.float32"),
        (lambda: fused_ops.rotary_embedding(_X.float(), _POS, _COS, _SIN, 1, 8),
         "cos must be float32 like qk, got torch.bfloat16"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_mixed_dtypes_raise_value_error_naming_the_tensor(call, match: str) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match=match):
        call()
