"""The model's lean calls of the fused layer ops (`paged.kernels.fused_calls`): on a forward's own
tensors they give the checked functions' results to the bit; anything else goes to the checked
functions, which serve it or raise naming the bad argument."""

from __future__ import annotations

import pytest
import torch

from paged.kernels import fused_calls, fused_ops
from paged.kernels.toolchain import host_compiler

_NO_COMPILER = host_compiler.unavailable_reason()
pytestmark = [
    pytest.mark.compiles,
    pytest.mark.skipif(_NO_COMPILER is not None, reason=f"cpu backend not buildable: {_NO_COMPILER}"),
]

DTYPES = (torch.float32, torch.bfloat16)
HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTER = 9, 3, 64, 576, 1536


def _randn(*shape: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [1, 17, 300])
def test_a_forwards_tensors_get_the_checked_results(dtype: torch.dtype, rows: int) -> None:
    x, weight = _randn(rows, HIDDEN, dtype=dtype), _randn(HIDDEN, dtype=dtype, seed=1)
    assert torch.equal(fused_calls.rms_norm(x, weight, 1e-5), fused_ops.rms_norm(x, weight, 1e-5))

    residual = _randn(rows, HIDDEN, dtype=dtype, seed=2)
    x2, r2 = x.clone(), residual.clone()
    out = fused_calls.add_rms_norm(x, residual, weight, 1e-5)
    ref = fused_ops.add_rms_norm(x2, r2, weight, 1e-5)
    assert out.data_ptr() == x.data_ptr() and torch.equal(out, ref) and torch.equal(residual, r2)

    gate_up = _randn(rows, 2 * INTER, dtype=dtype, seed=3)
    assert torch.equal(fused_calls.silu_and_mul(gate_up), fused_ops.silu_and_mul(gate_up))

    qkv = _randn(rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM, dtype=dtype, seed=4)
    positions = torch.randint(0, 2048, (rows,), generator=torch.Generator().manual_seed(5))
    cos, sin = _randn(2048, HEAD_DIM, dtype=dtype, seed=6), _randn(2048, HEAD_DIM, dtype=dtype, seed=7)
    ours, ref_qkv = qkv.clone(), qkv.clone()
    fused_calls.rotary_embedding(ours, positions, cos, sin, HEADS + KV_HEADS, HEAD_DIM)
    fused_ops.rotary_embedding(ref_qkv, positions, cos, sin, HEADS + KV_HEADS, HEAD_DIM)
    assert torch.equal(ours, ref_qkv) and not torch.equal(ours, qkv)


def test_other_layouts_go_to_the_checked_functions() -> None:
    wide = _randn(5, 2 * HIDDEN, dtype=torch.float32)
    x, weight = wide[:, :HIDDEN], _randn(HIDDEN, dtype=torch.float32, seed=1)  # strided rows
    assert torch.equal(fused_calls.rms_norm(x, weight, 1e-5), fused_ops.rms_norm(x.contiguous(), weight, 1e-5))
    gate_up = _randn(5, 4 * INTER, dtype=torch.float32)[:, : 2 * INTER]
    assert torch.equal(fused_calls.silu_and_mul(gate_up), fused_ops.silu_and_mul(gate_up.contiguous()))


def test_bad_arguments_still_raise_naming_them() -> None:
    x = _randn(4, HIDDEN, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="weight must be bfloat16 like x"):
        fused_calls.rms_norm(x, torch.ones(HIDDEN), 1e-5)
    with pytest.raises(ValueError, match=r"weight must be \[576\]"):
        fused_calls.add_rms_norm(x, x.clone(), torch.ones(HIDDEN + 1, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(ValueError, match="odd or zero width"):
        fused_calls.silu_and_mul(_randn(4, 7, dtype=torch.float32))
    qkv, cos = _randn(2, 12 * HEAD_DIM, dtype=torch.float32), _randn(16, HEAD_DIM, dtype=torch.float32)
    with pytest.raises(ValueError, match="refused its arguments"):  # the kernel's own range check
        fused_calls.rotary_embedding(qkv, torch.tensor([3, 16]), cos, cos.clone(), 12, HEAD_DIM)
