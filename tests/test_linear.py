"""model.gemm: prepacked oneDNN linears and paged's packed loop against F.linear, and how the kernel is
chosen and refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from paged.kernels import packed_linear
from paged.model import linear
from paged.model.linear import (
    Linear,
    onednn_unsupported_reason,
    packed_unsupported_reason,
    resolve_gemm,
)

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


needs_f32_loop = pytest.mark.skipif(packed_linear.unavailable_reason(torch.float32) is not None,
                                    reason="no AVX-512 build of the cpu library")
needs_bf16_loop = pytest.mark.skipif(packed_linear.unavailable_reason(torch.bfloat16) is not None,
                                     reason="no AVX512-BF16 build of the cpu library")


@needs_onednn
def test_auto_takes_the_packed_loop_then_onednn_on_cpu_only() -> None:
    def expected(dtype: torch.dtype) -> str:
        if packed_unsupported_reason(dtype, CPU) is None:
            return "packed"
        return "onednn" if onednn_unsupported_reason(dtype, CPU) is None else "torch"

    assert resolve_gemm("auto", torch.float32, CPU) == expected(torch.float32)
    assert resolve_gemm("auto", torch.bfloat16, CPU) == expected(torch.bfloat16)
    if packed_linear.unavailable_reason(torch.float32) is None:
        assert resolve_gemm("auto", torch.float32, CPU) == "packed"
    assert resolve_gemm("auto", torch.float16, CPU) == "torch"
    assert resolve_gemm("auto", torch.float32, torch.device("cuda")) == "torch"
    assert resolve_gemm("torch", torch.float32, CPU) == "torch"
    assert resolve_gemm("onednn", torch.float32, CPU) == "onednn"


@needs_onednn
def test_auto_without_the_loop_is_onednn_and_packed_says_why(monkeypatch) -> None:
    """A CPU (or build) without AVX-512: auto keeps oneDNN's prepacked layers, and asking for the loop
    names what is missing."""
    monkeypatch.setattr(packed_linear, "unavailable_reason",
                        lambda dtype: "the native cpu library was built for a CPU without AVX-512")
    assert resolve_gemm("auto", torch.float32, CPU) == "onednn"
    with pytest.raises(ValueError, match="model.gemm=packed cannot run torch.float32 here: .* without AVX-512"):
        resolve_gemm("packed", torch.float32, CPU)


@pytest.mark.parametrize(
    ("gemm", "dtype", "device", "message"),
    [
        ("cublas", torch.float32, "cpu", "model.gemm='cublas' is not supported; allowed: auto, torch, onednn, packed"),
        ("onednn", torch.float32, "cuda", "model.gemm=onednn runs on a CPU, not on cuda"),
        ("onednn", torch.float16, "cpu", "supports float32 and bfloat16 models, not torch.float16"),
        ("packed", torch.float32, "cuda", "model.gemm=packed runs on a CPU, not on cuda"),
        ("packed", torch.float16, "cpu", "model.gemm=packed supports float32 and bfloat16 models, not torch.float16"),
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
    assert resolve_gemm("auto", torch.float32, CPU) in ("onednn", "packed")
    for gemm in ("onednn", "packed"):
        with pytest.raises(ValueError, match=f"model.gemm={gemm} runs bfloat16 only on a CPU with AVX512 bf16"):
            resolve_gemm(gemm, torch.bfloat16, CPU)


@needs_bf16_loop
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 6, 7, 9, 64, 300])
def test_a_bf16_layer_on_avx512_bf16_is_the_bf16_gemm(rows: int) -> None:
    """The packed loop in bf16 (over the threads at every row count; tiles of 6 rows and their
    remainders; 208 outputs: three tiles of 4 blocks and one block): fp32 sums of the bf16 products
    rounded once, as oneDNN's bf16 GEMM gives them (to its last bit at decode sizes in practice; to one
    bf16 ulp here); a 3-d input keeps its shape."""
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(208, 80, generator=g).bfloat16()
    x = torch.randn(rows, 80, generator=g).bfloat16()
    layer = Linear(weight, None, "packed")
    assert layer.loop is not None
    exact = (x.double() @ weight.double().T).bfloat16()
    torch.testing.assert_close(layer(x), exact, rtol=2**-7, atol=1e-2)
    assert layer(x.view(1, rows, 80)).shape == (1, rows, 208)
    assert torch.equal(layer(x.view(1, rows, 80))[0], layer(x))
    if layer.loop_rows is None:  # no AMX: one copy of the weight, the packed one
        assert layer.weight is None and not layer.packed


@needs_f32_loop
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 64, 300])
@pytest.mark.parametrize("out_features", [16, 112, 576, 592])
def test_an_fp32_layer_on_avx512_is_the_fp32_gemm(rows: int, out_features: int) -> None:
    """The packed loop in fp32 on every call: sums in the order of the inputs, equal to float64's to
    fp32 rounding, for output counts that split unevenly over threads (576: 9 tiles of 4 blocks of 16)
    or end in a partial tile (16, 112 and 592: 1, 3 and 1 blocks left), every row remainder of a 6-row tile, and
    rows split over the threads in blocks of 96 (300).
    The layer keeps one copy of its weight: the packed one."""
    g = torch.Generator().manual_seed(rows * out_features)
    weight, x = torch.randn(out_features, 96, generator=g), torch.randn(rows, 96, generator=g)
    layer = Linear(weight, None, "packed")
    assert layer.loop is not None and layer.loop_rows is None and layer.weight is None and not layer.packed
    exact = (x.double() @ weight.double().T).float()
    torch.testing.assert_close(layer(x), exact, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer(x), F.linear(x, weight), rtol=1e-5, atol=1e-5)
    strided = torch.randn(rows, 2 * 96, generator=g)[:, ::2]  # columns not contiguous: copied first
    torch.testing.assert_close(layer(strided), F.linear(strided, weight), rtol=1e-5, atol=1e-5)


@needs_f32_loop
@pytest.mark.parametrize("rows", [11, 20, 200])
def test_fp32_results_do_not_depend_on_the_thread_count(rows: int) -> None:
    """Every thread count gives the same result to the bit, whether the threads split the output tiles
    (a decode's rows) or the rows (past 96: 200 rows are two blocks of 96 and one of 8): each output's
    sum does not depend on who computes it. 576 outputs are 9 tiles of 4 blocks, an uneven split; from
    13 rows, 2 threads take 12 tiles of 3 blocks instead (20 rows), 3 threads keep the 9."""
    g = torch.Generator().manual_seed(5)
    weight, x = torch.randn(576, 64, generator=g), torch.randn(rows, 64, generator=g)
    loop = packed_linear.PackedLinear(weight)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append(loop(x))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(results[0], r) for r in results[1:])
    torch.testing.assert_close(results[0], F.linear(x, weight), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_layer_the_loop_cannot_tile_stays_with_onednn(dtype: torch.dtype) -> None:
    """Outputs not a multiple of 16, or a bias: oneDNN's packed layer, as before."""
    if packed_linear.unavailable_reason(dtype) is not None or onednn_unsupported_reason(dtype, CPU) is not None:
        pytest.skip(f"no packed loop or oneDNN for {dtype} here")
    weight = torch.randn(100, 80).to(dtype)
    layer = Linear(weight, None, "packed")
    assert layer.loop is None and layer.packed
    with_bias = Linear(torch.randn(128, 80).to(dtype), torch.zeros(128).to(dtype), "packed")
    assert with_bias.loop is None and with_bias.packed
    with pytest.raises(ValueError, match=rf"out a multiple of 16 .* got {dtype} \(100, 80\)"):
        packed_linear.PackedLinear(weight)


def test_the_loop_refuses_what_it_cannot_run() -> None:
    with pytest.raises(ValueError, match=r"got torch.float16 \(64, 16\)"):
        packed_linear.PackedLinear(torch.randn(64, 16).half())
    assert packed_linear.unavailable_reason(torch.float16) == (
        "the packed linear runs float32 and bfloat16 layers, not torch.float16")
    if packed_linear.unavailable_reason(torch.float32) is None:
        loop = packed_linear.PackedLinear(torch.randn(64, 16))
        with pytest.raises(ValueError, match=r"x must be torch.float32 \[rows, 16\] .* got torch.bfloat16"):
            loop(torch.randn(2, 16).bfloat16())


def test_the_description_says_which_calls_the_loop_takes() -> None:
    assert linear.describe_gemm("onednn", torch.float32) == "onednn"
    assert linear.describe_gemm("torch", torch.bfloat16) == "torch"
    assert linear.describe_gemm("packed", torch.float32).startswith("packed (the AVX-512 loop, every call")
    bf16 = linear.describe_gemm("packed", torch.bfloat16)
    assert ("calls of up to 4 rows" in bf16) == bool(torch.cpu._is_amx_tile_supported())
