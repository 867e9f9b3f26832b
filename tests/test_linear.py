"""model.gemm: prepacked oneDNN linears against F.linear, and how the kernel is chosen and refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from paged.kernels import bf16_linear
from paged.model import linear
from paged.model.linear import Linear, onednn_bf16_supported, onednn_unsupported_reason, resolve_gemm

CPU = torch.device("cpu")
needs_onednn = pytest.mark.skipif(
    onednn_unsupported_reason(torch.float32, CPU) is not None, reason="this torch build has no oneDNN"
)


@needs_onednn
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_prepacked_linear_matches_f_linear(rows: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 80, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    x = torch.randn(rows, 80, generator=g)
    packed = Linear(weight, b, "onednn")
    assert packed.packed and (packed.out_features, packed.in_features) == (96, 80)
    # the two GEMMs sum in different orders: equal to rounding, not to the bit
    torch.testing.assert_close(packed(x), F.linear(x, weight, b), rtol=1e-5, atol=1e-5)


def test_torch_gemm_is_f_linear_to_the_bit() -> None:
    weight, x = torch.randn(24, 16), torch.randn(5, 16)
    assert torch.equal(Linear(weight, None, "torch")(x), F.linear(x, weight))


@needs_onednn
def test_auto_prepacks_fp32_and_bf16_on_cpu_only() -> None:
    assert resolve_gemm("auto", torch.float32, CPU) == "onednn"
    assert resolve_gemm("auto", torch.bfloat16, CPU) == ("onednn" if onednn_bf16_supported() else "torch")
    assert resolve_gemm("auto", torch.float16, CPU) == "torch"
    assert resolve_gemm("auto", torch.float32, torch.device("cuda")) == "torch"
    assert resolve_gemm("torch", torch.float32, CPU) == "torch"


@pytest.mark.parametrize(
    ("gemm", "dtype", "device", "message"),
    [
        ("cublas", torch.float32, "cpu", "model.gemm='cublas' is not supported; allowed: auto, torch, onednn"),
        ("onednn", torch.float32, "cuda", "model.gemm=onednn runs on a CPU, not on cuda"),
        ("onednn", torch.float16, "cpu", "supports float32 and bfloat16 models, not torch.float16"),
    ],
)
def test_refused_gemm_names_the_value_and_what_is_allowed(gemm, dtype, device, message) -> None:
    with pytest.raises(ValueError) as err:
        resolve_gemm(gemm, dtype, torch.device(device))
    assert message in str(err.value)


@needs_onednn
def test_bf16_without_cpu_support_falls_back_to_torch_and_onednn_is_refused(monkeypatch) -> None:
    """A CPU without AVX512 bf16: auto takes F.linear, and asking for onednn says why not."""
    monkeypatch.setattr(linear, "onednn_bf16_supported", lambda: False)
    assert resolve_gemm("auto", torch.bfloat16, CPU) == "torch"
    assert resolve_gemm("auto", torch.float32, CPU) == "onednn"
    with pytest.raises(ValueError, match="runs bfloat16 only on a CPU with AVX512 bf16 support"):
        resolve_gemm("onednn", torch.bfloat16, CPU)


@pytest.mark.skipif(bf16_linear.unavailable_reason() is not None, reason="no AVX512-BF16 build of the cpu library")
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9, 64, 300])
def test_a_bf16_layer_on_avx512_bf16_is_the_bf16_gemm(rows: int) -> None:
    """`paged.kernels.bf16_linear` (one core up to 4 rows, the threads past them): fp32 sums of the
    bf16 products rounded once, as oneDNN's bf16 GEMM gives them (to its last bit at decode sizes in
    practice; to one bf16 ulp here); a 3-d input keeps its shape."""
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(192, 80, generator=g).bfloat16()
    x = torch.randn(rows, 80, generator=g).bfloat16()
    layer = Linear(weight, None, "onednn")
    assert layer.bf16 is not None
    exact = (x.double() @ weight.double().T).bfloat16()
    torch.testing.assert_close(layer(x), exact, rtol=2**-7, atol=1e-2)
    assert layer(x.view(1, rows, 80)).shape == (1, rows, 192)
    assert torch.equal(layer(x.view(1, rows, 80))[0], layer(x))
    if layer.bf16_rows is None:  # no AMX: one copy of the weight, the packed one
        assert layer.weight is None


@pytest.mark.skipif(bf16_linear.unavailable_reason() is not None, reason="no AVX512-BF16 build of the cpu library")
def test_a_bf16_layer_the_loop_cannot_tile_stays_with_onednn() -> None:
    """Outputs not a multiple of 64, or a bias: oneDNN's packed layer, as before."""
    weight = torch.randn(96, 80).bfloat16()
    assert Linear(weight, None, "onednn").bf16 is None
    assert Linear(torch.randn(128, 80).bfloat16(), torch.zeros(128).bfloat16(), "onednn").bf16 is None
    with pytest.raises(ValueError, match=r"out a multiple of 64 .* got torch.bfloat16 \(96, 80\)"):
        bf16_linear.PackedBf16(weight)


def test_the_description_says_where_bf16_layers_run_the_loop() -> None:
    assert linear.describe_gemm("onednn", torch.float32) == "onednn"
    assert linear.describe_gemm("torch", torch.bfloat16) == "torch"
    if bf16_linear.unavailable_reason() is None:
        assert linear.describe_gemm("onednn", torch.bfloat16).startswith(
            "onednn (the AVX512-BF16 loop for the bf16 layers it tiles")
    else:
        assert linear.describe_gemm("onednn", torch.bfloat16) == "onednn"
