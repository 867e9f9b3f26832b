"""The fused layer ops of kernels_cu/layer_ops.cuh, run by the emu backend, against the torch formulas
(`TorchLayerOps`) in fp32, fp16 and bf16.

RoPE and the residual add are bit-identical to torch. RMSNorm is bit-identical to torch's formula
with the kernel's block-reduction order of the sum of squares (modelled here), and within a few ulp
of torch's own order; SiLU-and-mul is bit-identical to the formula with the host's libm expf (the
emulator's exp) and within a few ulp of torch's (Sleef's expf on x86). The emulator runs every CUDA
thread of a block in turn on one core, so the rows are few and short.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable, Sequence

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from paged.config import KernelConfig, ModelConfig
from paged.executor.model_executor import ModelExecutor
from paged.kernels.backends.emu import RUNNER, EmuBackend
from paged.kernels.backends.launch_api import BoundPart, Launch, Relaunches
from paged.kernels.toolchain import emulator, host_compiler, specs
from paged.kernels.toolchain.specs import Unit
from paged.model.layer_ops import TORCH_OPS, RunnerLayerOps, layer_ops_for
from paged.model.llama import rope_table
from paged.model.tiny import tiny_arch
from tests.test_executor import BLOCK, PROMPTS, generate

pytestmark = pytest.mark.compiles

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
EPS = 1e-5
# Measured over 64 rows of H = 64..2048: fp32 RMSNorm differs from torch's sum order by up to 4 ulp
# (an ulp or two of rstd, then two roundings), fp32 SiLU by up to 3 (Sleef's expf against libm's,
# then a division and a product); rounding to fp16 / bf16 absorbs all but the odd 1-ulp tie.
TORCH_ULPS = {torch.float32: 8, torch.float16: 1, torch.bfloat16: 1}


class RecordingEmu(EmuBackend):
    """The emu backend, keeping every launch it runs."""

    def __init__(self) -> None:
        self.launches: list[Launch] = []

    def runner(self, tensor: torch.Tensor) -> RecordingEmu:
        return self

    def run(self, unit: Unit, launches: Sequence[Launch]) -> None:
        self.launches += launches
        RUNNER.run(unit, launches)

    def bind(self, parts: Sequence[BoundPart]) -> Relaunches:
        return Relaunches(self, parts)


@pytest.fixture(scope="module", autouse=True)
def _emu_library() -> None:
    try:
        host_compiler.find_compiler()
    except host_compiler.CompilerNotFoundError as e:
        pytest.skip(f"emu backend unavailable: {e}")
    emulator.prepare([specs.layer_unit(dtype) for dtype in DTYPES])


@pytest.fixture
def emu() -> RecordingEmu:
    return RecordingEmu()


def _ordered(t: torch.Tensor) -> torch.Tensor:
    """The float bits as integers in the order of the values they encode."""
    bits = {4: torch.int32, 2: torch.int16}[t.element_size()]
    v = t.contiguous().view(bits).long()
    magnitude = v & (2 ** (8 * t.element_size() - 1) - 1)
    return torch.where(v < 0, -magnitude, magnitude)


def ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance in representable values between matching elements."""
    return int((_ordered(a) - _ordered(b)).abs().max())


def _rows(shape: tuple[int, int], dtype: torch.dtype, layout: str, gen: torch.Generator,
          scale: float = 1.0) -> torch.Tensor:
    """Random rows: packed, `offset` one element past an aligned start (no 16-byte vectors), or
    `strided` rows of a wider tensor."""
    rows, cols = shape
    if layout == "offset":
        flat = (scale * torch.randn(rows * cols + 1, generator=gen)).to(dtype)
        return flat[1:].view(rows, cols)
    if layout == "strided":
        return (scale * torch.randn(rows, cols + 24, generator=gen)).to(dtype)[:, :cols]
    return (scale * torch.randn(rows, cols, generator=gen)).to(dtype)


def _butterfly(lanes: np.ndarray) -> np.float32:
    """vec.cuh's warp_reduce: xor shuffles over 32 lanes; every lane ends with lane 0's sum."""
    for mask in (16, 8, 4, 2, 1):
        lanes = lanes + lanes[np.arange(32) ^ mask]
    return lanes[0]


def block_order_rstd(row: torch.Tensor, threads: int, vec: int) -> np.float32:
    """layer_ops.cuh's rstd of one row: thread t sums the squares of loads t, t + threads, ...
    (each load's `vec` elements in order), warps reduce by butterflies, then warp 0 the warps' sums."""
    values = row.float().numpy()
    partial = np.zeros(threads, dtype=np.float32)
    loads = values.reshape(-1, vec)
    for i, load in enumerate(loads):
        for f in load:
            partial[i % threads] = partial[i % threads] + np.float32(f * f)
    warp_sums = np.zeros(32, dtype=np.float32)
    for w in range(threads // 32):
        warp_sums[w] = _butterfly(partial[32 * w: 32 * (w + 1)])
    total = _butterfly(warp_sums)
    return np.float32(1) / np.sqrt(total / np.float32(row.shape[0]) + np.float32(EPS))


def block_order_rms_norm(x: torch.Tensor, weight: torch.Tensor, launch: Launch) -> torch.Tensor:
    """`weight * F.rms_norm(x)` with the kernel's rstd: x * rstd rounded to T, then * weight."""
    vec = int(launch.kernel.rsplit(", ", 1)[1].rstrip(">"))  # the kernel's VEC template argument
    rstd = torch.tensor([block_order_rstd(row, launch.block, vec) for row in x]).unsqueeze(1)
    normed = (x.float() * rstd).to(x.dtype)
    return (weight.float() * normed.float()).to(x.dtype)


_LIBM = ctypes.CDLL(ctypes.util.find_library("m"))
_LIBM.expf.restype, _LIBM.expf.argtypes = ctypes.c_float, [ctypes.c_float]


def libm_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`F.silu(gate) * up` with the host's libm expf, which the emulator's kernels call."""
    inter = x.shape[1] // 2
    gate, up = x[:, :inter].float(), x[:, inter:].float()
    exp = torch.tensor([_LIBM.expf(-g) for g in gate.flatten().tolist()], dtype=torch.float32).view(gate.shape)
    silu = (gate / (1 + exp)).to(x.dtype)
    return (silu.float() * up).to(x.dtype)


@pytest.mark.parametrize("layout", ["packed", "offset", "strided"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_is_torch_with_the_block_order_sum(emu: RecordingEmu, dtype: torch.dtype, layout: str) -> None:
    gen = torch.Generator().manual_seed(0)
    x = _rows((4, 256), dtype, layout, gen, scale=2.0)
    weight = (1 + 0.1 * torch.randn(256, generator=gen)).to(dtype)
    out = emu.rms_norm(x, weight, EPS)
    (launch,) = emu.launches
    assert launch.kernel == specs.layer_kernel(specs.CXX_TYPES[dtype], "rms_norm", layout != "offset")
    assert out.is_contiguous() and out.dtype == dtype
    assert torch.equal(out, block_order_rms_norm(x, weight, launch))
    assert ulps(out, TORCH_OPS.rms_norm(x, weight, EPS)) <= TORCH_ULPS[dtype]


@pytest.mark.parametrize("layout", ["packed", "offset", "strided"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_adds_the_residual_exactly_in_place(emu: RecordingEmu, dtype: torch.dtype, layout: str) -> None:
    gen = torch.Generator().manual_seed(1)
    x = _rows((3, 128), dtype, layout, gen)
    residual = _rows((3, 128), dtype, "packed", gen)
    weight = (1 + 0.1 * torch.randn(128, generator=gen)).to(dtype)
    want_residual = residual.clone()
    want = TORCH_OPS.add_rms_norm(x.clone(), want_residual, weight, EPS)
    out = emu.add_rms_norm(x, residual, weight, EPS)
    assert out is x
    assert torch.equal(residual, want_residual)
    (launch,) = emu.launches
    assert torch.equal(out, block_order_rms_norm(residual, weight, launch))
    assert ulps(out, want) <= TORCH_ULPS[dtype]


@pytest.mark.parametrize("layout", ["packed", "offset", "strided"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_is_torch_with_the_hosts_expf(emu: RecordingEmu, dtype: torch.dtype, layout: str) -> None:
    gen = torch.Generator().manual_seed(2)
    x = _rows((3, 2 * 160), dtype, layout, gen, scale=3.0)
    out = emu.silu_and_mul(x)
    (launch,) = emu.launches
    assert launch.kernel == specs.layer_kernel(specs.CXX_TYPES[dtype], "silu_and_mul", layout != "offset")
    assert out.shape == (3, 160) and out.is_contiguous()
    assert torch.equal(out, libm_silu_and_mul(x))
    assert ulps(out, TORCH_OPS.silu_and_mul(x)) <= TORCH_ULPS[dtype]


def _rope_inputs(dtype: torch.dtype, head_dim: int, num_tokens: int = 4) -> tuple[torch.Tensor, ...]:
    arch = tiny_arch({"head_dim": head_dim})
    cos, sin = rope_table(arch, 64)
    positions = torch.tensor([37, 0, 63, 5, 12][:num_tokens])
    return positions, cos.to(dtype), sin.to(dtype)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_rotates_the_fused_qkv_heads_in_place_bit_exactly(emu: RecordingEmu, dtype: torch.dtype,
                                                                head_dim: int) -> None:
    """q and k heads of each row of the fused qkv output, as the model passes them; v is untouched."""
    num_q, num_kv = 4, 2
    gen = torch.Generator().manual_seed(3)
    positions, cos, sin = _rope_inputs(dtype, head_dim)
    qkv = torch.randn(4, (num_q + 2 * num_kv) * head_dim, generator=gen).to(dtype)
    before = qkv.clone()
    want = TORCH_OPS.rope(before, TORCH_OPS.rotation(positions, cos, sin), num_q + num_kv, head_dim)
    ops = RunnerLayerOps(emu)
    got = ops.rope(qkv, ops.rotation(positions, cos, sin), num_q + num_kv, head_dim)
    assert got.data_ptr() == qkv.data_ptr() and got.shape == (4, num_q + num_kv, head_dim)
    assert torch.equal(got, want)
    rotated = (num_q + num_kv) * head_dim
    assert torch.equal(qkv[:, rotated:], before[:, rotated:])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_on_a_padded_row_view_leaves_the_padding(emu: RecordingEmu, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(4)
    positions, cos, sin = _rope_inputs(dtype, 64, num_tokens=3)
    wide = torch.randn(3, 2 * 64 + 40, generator=gen).to(dtype)
    before = wide.clone()
    emu.rotary_embedding(wide[:, 3:3 + 128], positions, cos, sin, 2, 64)
    want = TORCH_OPS.rope(before[:, 3:3 + 128], TORCH_OPS.rotation(positions, cos, sin), 2, 64)
    assert torch.equal(wide[:, 3:3 + 128].view(3, 2, 64), want)
    assert torch.equal(wide[:, :3], before[:, :3]) and torch.equal(wide[:, 131:], before[:, 131:])


def test_launch_shapes_cover_a_row_per_cta(emu: RecordingEmu) -> None:
    x = torch.randn(5, 200)  # fp32: 50 vectors of 4
    emu.rms_norm(x, torch.ones(200), EPS)
    emu.silu_and_mul(torch.randn(5, 2 * 1000, dtype=torch.float16))  # 125 vectors of 8
    emu.silu_and_mul(torch.randn(2, 2 * 37))  # odd width: one element a thread
    qkv = torch.randn(5, 3 * 64)
    emu.rotary_embedding(qkv, torch.zeros(5, dtype=torch.int64), torch.ones(4, 64), torch.zeros(4, 64), 2, 64)
    assert [(launch.grid, launch.block, launch.shared_memory) for launch in emu.launches] == [
        ((5, 1, 1), 64, 0), ((5, 1, 1), 128, 0), ((2, 1, 1), 64, 0), ((5, 1, 1), 64, 0)]


def _bad_calls() -> list[tuple[str, Callable[[EmuBackend], object], str]]:
    x, w = torch.randn(3, 64), torch.ones(64)
    pos, cos = torch.zeros(3, dtype=torch.int64), torch.ones(8, 64)
    qkv = torch.randn(3, 3 * 64)
    return [
        ("float64", lambda b: b.rms_norm(x.double(), w.double(), EPS), "x must be float32, float16 or bfloat16"),
        ("meta", lambda b: b.rms_norm(x.to("meta"), w, EPS), "x must be on a cpu device"),
        ("columns", lambda b: b.rms_norm(torch.randn(64, 3).t(), w, EPS), "x must have contiguous columns"),
        ("1-d", lambda b: b.rms_norm(w, w, EPS), "x must be 2-d"),
        ("weight", lambda b: b.rms_norm(x, torch.ones(32), EPS), r"weight must be a contiguous \[64\]"),
        ("weight-dtype", lambda b: b.rms_norm(x, w.half(), EPS), "weight must be torch.float32"),
        ("eps", lambda b: b.rms_norm(x, w, -1.0), "eps must be a number >= 0"),
        ("residual", lambda b: b.add_rms_norm(x, torch.randn(2, 64), w, EPS), r"residual must be \[3, 64\]"),
        ("residual-dtype", lambda b: b.add_rms_norm(x, x.half(), w, EPS), "residual must be torch.float32"),
        ("overlap", lambda b: b.add_rms_norm(x, x, w, EPS), "(x and residual|residual and x) overlap"),
        ("odd", lambda b: b.silu_and_mul(torch.randn(3, 63)), "odd or zero width"),
        ("head_dim", lambda b: b.rotary_embedding(qkv, pos, cos, cos, 2, 63), "head_dim must be a positive even"),
        ("num_heads", lambda b: b.rotary_embedding(qkv, pos, cos, cos, 0, 64), "num_heads must be a positive int"),
        ("narrow", lambda b: b.rotary_embedding(qkv, pos, cos, cos, 4, 64), r"qk must be \[T, >= 256\]"),
        ("qk-rows", lambda b: b.rotary_embedding(torch.randn(400).as_strided((3, 128), (64, 1)), pos, cos, cos, 2,
                                                 64), "qk rows overlap"),
        ("positions", lambda b: b.rotary_embedding(qkv, pos.int(), cos, cos, 2, 64), "positions must be a 1-d int64"),
        ("positions-rows", lambda b: b.rotary_embedding(qkv, pos[:2], cos, cos, 2, 64), r"positions must be \[3\]"),
        ("cos", lambda b: b.rotary_embedding(qkv, pos, torch.ones(8, 32), cos, 2, 64), r"cos must be a contiguous"),
        ("sin", lambda b: b.rotary_embedding(qkv, pos, cos, torch.ones(9, 64), 2, 64), r"sin must be a contiguous"),
        ("table-dtype", lambda b: b.rotary_embedding(qkv, pos, cos.half(), cos, 2, 64), "cos must be torch.float32"),
    ]


BAD = _bad_calls()


@pytest.mark.parametrize(("call", "message"), [(c, m) for _, c, m in BAD], ids=[name for name, _, _ in BAD])
def test_bad_arguments_raise_before_any_launch(emu: RecordingEmu, call: Callable[[EmuBackend], object],
                                               message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call(emu)
    assert emu.launches == []


def test_runner_backends_get_the_fused_ops_and_others_keep_theirs() -> None:
    from paged.kernels.backends.cpu import BACKEND as cpu
    from paged.kernels.backends.torch_ref import BACKEND as torch_backend
    from paged.model.layer_ops import NATIVE_CPU_OPS

    emu_ops = layer_ops_for(EmuBackend())
    assert isinstance(emu_ops, RunnerLayerOps) and emu_ops.name == "fused"
    assert layer_ops_for(cpu) is NATIVE_CPU_OPS and layer_ops_for(torch_backend) is TORCH_OPS


def test_tiny_model_generates_the_torch_formulas_tokens() -> None:
    """End to end in fp32 on the emu backend: the executor picks the fused ops, and greedy
    generation with them equals generation with the torch formulas (same attention kernels)."""
    ex = ModelExecutor(ModelConfig(name="tiny-random", source="random"),
                       KernelConfig(name="test", version="v1", backend="emu", partition_size=32))
    ex.init_kv_cache(num_blocks=64, block_size=BLOCK)
    assert isinstance(ex.model.ops, RunnerLayerOps) and "fused norms/RoPE/SwiGLU" in ex.description
    fused = generate(ex, PROMPTS, 6)
    ex.model.ops = TORCH_OPS
    assert generate(ex, PROMPTS, 6) == fused


class _KernelCount(TorchDispatchMode):
    """ATen ops that launch work: views (no kernel) are not counted."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's protocol
        self.count += not func.is_view and func.__name__.split(".")[0] not in ("view", "slice", "unsqueeze", "split")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(("dtype", "expected"), [(torch.float32, 21), (torch.float16, 25)])
def test_the_torch_formulas_cost_this_many_aten_kernels_per_layer(dtype: torch.dtype, expected: int) -> None:
    """What the fused ops replace (docs/kernels.md's launch comparison): RoPE 5, each add + RMSNorm
    7 (fp32) or 9 (fp16, with the casts), SwiGLU 2, on SmolLM2's shapes."""
    hidden, inter, heads, head_dim = 576, 1536, 12, 64
    x, residual, weight = (torch.randn(*shape).to(dtype) for shape in ((4, hidden), (4, hidden), (hidden,)))
    qkv, gate_up = torch.randn(4, 15 * head_dim).to(dtype), torch.randn(4, 2 * inter).to(dtype)
    positions, cos, sin = _rope_inputs(dtype, head_dim)
    rotation = TORCH_OPS.rotation(positions, cos, sin)
    with _KernelCount() as counted:
        TORCH_OPS.rope(qkv, rotation, heads, head_dim)
        for _ in range(2):
            TORCH_OPS.add_rms_norm(x, residual, weight, EPS)
        TORCH_OPS.silu_and_mul(gate_up)
    assert counted.count == expected


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_layouts_later_calls_run_its_bound_launch_with_their_own_tensors(emu: RecordingEmu,
                                                                           dtype: torch.dtype) -> None:
    """`RunnerLayerOps` (`paged.kernels.bound_calls`): a layer's ops over tensors laid out as an
    earlier layer's run that layer's launch, bound once, with their own addresses: the same values
    as the checked ops and one launch each; a call whose tensors share a start goes to the checked
    op and raises as it does."""
    ops = RunnerLayerOps(emu)
    positions, cos, sin = _rope_inputs(dtype, 64, num_tokens=3)
    for layer in range(3):
        gen = torch.Generator().manual_seed(20 + layer)
        # views of fused projections, as the model passes them
        qkv = torch.randn(3, 4 * 64 + 8, generator=gen).to(dtype)[:, 8:]
        x, residual, weight = (torch.randn(3, 128, generator=gen).to(dtype) for _ in range(3))
        weight = weight[0].contiguous()
        gate_up = torch.randn(3, 2 * 96, generator=gen).to(dtype)
        want_qkv, want_residual = qkv.clone(), residual.clone()
        emu.rotary_embedding(want_qkv, positions, cos, sin, 3, 64)
        want_norm = emu.rms_norm(x, weight, 1e-5)
        want_add = emu.add_rms_norm(x.clone(), want_residual, weight, 1e-5)
        want_silu = emu.silu_and_mul(gate_up)
        emu.launches.clear()
        ops.rope(qkv, ops.rotation(positions, cos, sin), 3, 64)
        assert torch.equal(qkv, want_qkv)
        assert torch.equal(ops.rms_norm(x, weight, 1e-5), want_norm)
        assert torch.equal(ops.add_rms_norm(x, residual, weight, 1e-5), want_add)
        assert torch.equal(residual, want_residual)
        assert torch.equal(ops.silu_and_mul(gate_up), want_silu)
        assert len(emu.launches) == 4  # one launch per op, bound or checked
    assert all(bound is not None for bound in ops.bound._bound.values())
    with pytest.raises(ValueError, match="overlap"):
        ops.add_rms_norm(x, x, weight, 1e-5)
