"""Native fused layer ops for the fp32 and bf16 CPU model paths (kernels_cu/cpu/layer_ops.h).

Each op replaces a few torch elementwise ops of a Llama layer with one pass over its rows, in
parallel over `torch.get_num_threads()` OpenMP threads, and reproduces torch's arithmetic on this
CPU (see layer_ops.h), so a model that uses them stays bit-identical to its torch formulation:

- `rms_norm(x, w, eps, out=None)` == `w * F.rms_norm(x, (H,), eps=eps)`
- `add_rms_norm(x, residual, w, eps)`: `residual += x` in place, then `x = rms_norm(residual)` in
  place (vLLM's fused_add_rms_norm, with the normalised rows written over `x`); returns `x`
- `silu_and_mul(x, out=None)` == `F.silu(x[:, :I]) * x[:, I:]` for x `[T, 2I]`
- `rotary_embedding(qk, positions, cos, sin, num_heads, head_dim)`: the model's torch RoPE
  `x * cos + rotate_half(x) * sin` (HF's layout) on `num_heads` heads of every row, in place

`out` takes a reused buffer: a fresh tensor of tens of MB costs its page faults on every call,
more than the op itself at prefill sizes.

Exactness: rope and the residual add are bit-exact everywhere (no FMA contraction); rms_norm
reproduces the summation order of ATen's x86 sum kernel and silu ATen's exp (Sleef's expf_u10 on
AVX2/AVX512, libm otherwise), so both are bit-exact with torch on x86 (checked on an AVX512 CPU;
the AVX2 variant follows the same code with 8 lanes) and within a few ulp elsewhere.

bf16 tensors compute in fp32 and round to bf16 where the torch formulas of a bf16 model do (the
norm as HF's `weight * F.rms_norm(x.float()).to(bf16)`, silu before its product, each RoPE product
and their sum), so they are bit-identical to those formulas too (NaN payloads aside).

Tensors are float32 or bfloat16 on the CPU, all of one call in one dtype (a bf16 model's norm
weights and RoPE tables are bf16), with contiguous columns; rows may be strided (e.g. views of a
fused projection's output). Anything else raises `ValueError` naming the bad argument, so callers
can fall back to the torch formulas; so does a native library that cannot be built
(`unavailable_reason`).
"""

from __future__ import annotations

from functools import cache

import torch

from paged.kernels.backends import cpu as _cpu
from paged.kernels.input_checks import check_disjoint

__all__ = ["DTYPES", "add_rms_norm", "entry_point", "exp_lanes", "rms_norm", "rotary_embedding", "run", "silu_and_mul",
           "silu_lanes", "unavailable_reason"]

# The entry points' name endings per dtype (paged_attention_cpu.cpp: `rms_norm_cpu`, `rms_norm_bf16_cpu`, ...).
_SUFFIX = {torch.float32: "_cpu", torch.bfloat16: "_bf16_cpu"}
DTYPES = tuple(_SUFFIX)


@cache
def exp_lanes() -> int:
    """Vectorized<float>::size() where torch's exp is Sleef's vector expf (its AVX512 / AVX2
    builds), else 0: libm's expf for every element."""
    return {"AVX512": 16, "AVX2": 8}.get(torch.backends.cpu.get_cpu_capability(), 0)


def silu_lanes(dtype: torch.dtype) -> tuple[int, ...]:
    """The silu_and_mul entry point's extra argument for `dtype`: fp32's `exp_lanes`; bf16 takes none
    (its silu comes from a table, which rounds as torch's for every input: layer_ops.h)."""
    return (exp_lanes(),) if dtype == torch.float32 else ()


def unavailable_reason() -> str | None:
    """Why the native library cannot run in this process; `None` when it can."""
    return _cpu._load_failure()


def _lib():  # noqa: ANN202 - a ctypes.CDLL
    reason = _cpu._load_failure()
    if reason is not None:
        raise ValueError(f"native cpu layer ops unavailable: {reason}")
    return _cpu.load()


def _float_cpu(name: str, t: object, like: tuple[str, torch.dtype] | None = None) -> torch.Tensor:
    """A cpu tensor in one of `DTYPES`, or, with `like` (the call's first tensor's name and dtype), in that dtype."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if like is None and t.dtype not in _SUFFIX:
        raise ValueError(f"{name} must be float32 or bfloat16, got {t.dtype}")
    if like is not None and t.dtype != like[1]:
        raise ValueError(f"{name} must be {str(like[1]).removeprefix('torch.')} like {like[0]}, got {t.dtype}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be on the cpu, got {t.device}")
    return t


def _rows(
    name: str, t: object, cols: int | None = None, written: bool = False, like: tuple[str, torch.dtype] | None = None
) -> torch.Tensor:
    """A `[T, cols]` cpu tensor with contiguous columns; a written one's rows must not overlap."""
    t = _float_cpu(name, t, like)
    if t.dim() != 2 or (cols is not None and t.shape[1] != cols):
        want = f"[T, {cols}]" if cols is not None else "2-d [T, H]"
        raise ValueError(f"{name} must be {want}, got shape {tuple(t.shape)}")
    if t.shape[1] > 1 and t.stride(1) != 1:
        raise ValueError(f"{name} must have contiguous columns (stride 1), got strides {t.stride()}")
    if written and t.shape[0] > 1 and t.stride(0) < t.shape[1]:
        raise ValueError(f"{name} rows overlap (row stride {t.stride(0)} < {t.shape[1]} columns)")
    return t


def _weight(weight: object, hidden: int, x: torch.Tensor) -> torch.Tensor:
    weight = _float_cpu("weight", weight, ("x", x.dtype))
    if weight.dim() != 1 or weight.shape[0] != hidden:
        raise ValueError(f"weight must be [{hidden}], got shape {tuple(weight.shape)}")
    return weight.contiguous()


def _eps(eps: object) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"eps must be a number >= 0, got {eps!r}")
    return float(eps)


@cache
def entry_point(op: str, dtype: torch.dtype):  # noqa: ANN201 - a ctypes function
    """The library's entry point of `op` for `dtype` (`rms_norm` and float32: `rms_norm_cpu`), looked up once."""
    return getattr(_lib(), op + _SUFFIX[dtype])


def run(op: str, dtype: torch.dtype, *args: object) -> None:
    """Calls the entry point of `op` for `dtype` on raw arguments; raises on a refusal."""
    _cpu.check_status(op + _SUFFIX[dtype], entry_point(op, dtype)(*args))


def _out(out: torch.Tensor | None, num_rows: int, cols: int, x: torch.Tensor, may_be_x: bool) -> torch.Tensor:
    """`out`, checked, or a new contiguous `[num_rows, cols]` tensor."""
    if out is None:
        return torch.empty(num_rows, cols, dtype=x.dtype)
    out = _rows("out", out, cols, written=True, like=("x", x.dtype))
    if out.shape[0] != num_rows:
        raise ValueError(f"out must be [{num_rows}, {cols}], got shape {tuple(out.shape)}")
    if not (may_be_x and out.data_ptr() == x.data_ptr() and out.stride() == x.stride()):
        check_disjoint(("out", out), ("x", x))
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """`weight * F.rms_norm(x, (H,), eps=eps)` for x `[T, H]`, into `out` (`[T, H]` with contiguous
    columns: a reused buffer saves a large tensor's page faults; it may be `x` itself) or a new
    contiguous tensor; returns it."""
    x = _rows("x", x)
    eps = _eps(eps)
    weight = _weight(weight, x.shape[1], x)
    out = _out(out, x.shape[0], x.shape[1], x, may_be_x=True)
    if x.numel() == 0:
        return out
    run("rms_norm", x.dtype, out.data_ptr(), out.stride(0), x.data_ptr(), x.stride(0), weight.data_ptr(),
        x.shape[0], x.shape[1], eps, torch.get_num_threads())
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """In one pass per row: `residual += x` in place, then `x = weight * rms_norm(residual)` in
    place; returns `x`. Equals `residual = residual + x; weight * F.rms_norm(residual, ...)`."""
    x = _rows("x", x, written=True)
    residual = _rows("residual", residual, x.shape[1], written=True, like=("x", x.dtype))
    if residual.shape[0] != x.shape[0]:
        raise ValueError(f"residual must be [{x.shape[0]}, {x.shape[1]}] like x, got shape {tuple(residual.shape)}")
    eps = _eps(eps)
    weight = _weight(weight, x.shape[1], x)
    if x.numel() == 0:
        return x
    check_disjoint(("x", x), ("residual", residual), ("weight", weight))
    run("add_rms_norm", x.dtype, x.data_ptr(), x.stride(0), residual.data_ptr(), residual.stride(0),
        weight.data_ptr(), x.shape[0], x.shape[1], eps, torch.get_num_threads())
    return x


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """`F.silu(x[:, :I]) * x[:, I:]` for x `[T, 2I]` (the fused gate/up output), into `out`
    (`[T, I]` with contiguous columns, not overlapping x) or a new contiguous tensor; returns it."""
    x = _rows("x", x)
    if x.shape[1] % 2 or x.shape[1] == 0:
        raise ValueError(f"x must be [T, 2 * intermediate], got shape {tuple(x.shape)} (odd or zero width)")
    inter = x.shape[1] // 2
    out = _out(out, x.shape[0], inter, x, may_be_x=False)
    if x.shape[0] == 0:
        return out
    run("silu_and_mul", x.dtype, out.data_ptr(), out.stride(0), x.data_ptr(), x.stride(0), x.shape[0], inter,
        *silu_lanes(x.dtype), torch.get_num_threads())
    return out


def rotary_embedding(
    qk: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, head_dim: int
) -> None:
    """Rotates in place the first `num_heads` heads of `head_dim` of every row of `qk`, HF's
    rotate_half layout (dimension i pairs with i + head_dim / 2): `x * cos + rotate_half(x) * sin`
    with the `[P, head_dim]` tables' rows at `positions` (int64 `[T]`, each in `[0, P)`).

    `qk` is `[T, >= num_heads * head_dim]` with contiguous columns and any row stride (a view of
    the first columns of the fused qkv output), or `[T, >= num_heads, head_dim]` with contiguous
    heads. Non-contiguous tables are copied."""
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads <= 0:
        raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
        raise ValueError(f"head_dim must be a positive even int, got {head_dim!r}")
    qk = _float_cpu("qk", qk)
    width = num_heads * head_dim
    if qk.dim() == 3:
        if qk.shape[1] < num_heads or qk.shape[2] != head_dim or (qk.stride(2) != 1 or qk.stride(1) != head_dim):
            raise ValueError(f"a 3-d qk must be [T, >= {num_heads}, {head_dim}] with strides (*, {head_dim}, 1), "
                             f"got shape {tuple(qk.shape)} strides {qk.stride()}")
    elif qk.dim() == 2:
        if qk.shape[1] < width or (qk.shape[1] > 1 and qk.stride(1) != 1):
            raise ValueError(f"qk must be [T, >= {width}] with contiguous columns, got shape {tuple(qk.shape)} "
                             f"strides {qk.stride()}")
    else:
        raise ValueError(f"qk must be 2-d [T, >= {width}] (or [T, heads, {head_dim}]), got shape {tuple(qk.shape)}")
    num_rows = qk.shape[0]
    if num_rows > 1 and qk.stride(0) < width:
        raise ValueError(f"qk rows overlap (row stride {qk.stride(0)} < {width} rotated columns)")
    if not isinstance(positions, torch.Tensor) or positions.dtype != torch.int64 or positions.dim() != 1:
        got = f"{positions.dim()}-d {positions.dtype}" if isinstance(positions, torch.Tensor) else type(positions)
        raise ValueError(f"positions must be a 1-d int64 tensor, got {got}")
    if positions.shape[0] != num_rows or positions.device.type != "cpu":
        raise ValueError(f"positions must be [{num_rows}] on the cpu, got {tuple(positions.shape)} on "
                         f"{positions.device}")
    cos, sin = _float_cpu("cos", cos, ("qk", qk.dtype)), _float_cpu("sin", sin, ("qk", qk.dtype))
    if cos.dim() != 2 or cos.shape[1] != head_dim:
        raise ValueError(f"cos must be [P, {head_dim}], got shape {tuple(cos.shape)}")
    if sin.shape != cos.shape:
        raise ValueError(f"sin must be {list(cos.shape)} like cos, got shape {tuple(sin.shape)}")
    if num_rows == 0:
        return
    tables = cos.contiguous(), sin.contiguous()
    check_disjoint(("qk", qk), ("cos", tables[0]), ("sin", tables[1]), ("positions", positions))
    positions = positions.contiguous()
    run("rotary_embedding", qk.dtype, qk.data_ptr(), qk.stride(0), positions.data_ptr(), tables[0].data_ptr(),
        tables[1].data_ptr(), num_rows, tables[0].shape[0], num_heads, head_dim, torch.get_num_threads())
