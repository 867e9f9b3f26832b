"""`model.native_decode`: a CPU decode step's layers in one native call (paged.model.decode_layers)
against the Python forward it replaces, which steps take it, and how a refusal reads.

Every decode step of these runs is computed twice, the Python forward first and then the native call
over the same cache contents, and both the hidden states and the caches they leave must agree bit for
bit: the native call makes the Python forward's kernel calls with its arguments."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from paged.api.llm import LLM
from paged.config import ConfigError, compose_config
from paged.kernels.forward_context import current_stack
from paged.kernels.toolchain import host_compiler
from paged.model.decode_layers import DecodeLayers
from paged.model.layer_ops import TORCH_OPS
from paged.model.linear import packed_unsupported_reason
from paged.request import SamplingParams

_NO_COMPILER = host_compiler.unavailable_reason()
pytestmark = [
    pytest.mark.compiles,
    pytest.mark.skipif(_NO_COMPILER is not None, reason=f"cpu backend not buildable: {_NO_COMPILER}"),
]
CPU = torch.device("cpu")
DTYPES = [torch.float32, torch.bfloat16]

# prompts crossing 16-token blocks at different steps, one long enough for v3 to split its context
PROMPTS = [[(31 * n + 7 * i) % 40000 + 3 for i in range(n)] for n in (15, 16, 40, 300, 1)]


def _needs_loop(dtype: torch.dtype) -> None:
    reason = packed_unsupported_reason(dtype, CPU)
    if reason is not None:
        pytest.skip(f"the native decode layers run the packed loop: {reason}")


def _llm(dtype: torch.dtype, *overrides: str) -> LLM:
    llm = LLM("tiny-random", overrides=["model.device=cpu", f"model.dtype={str(dtype).removeprefix('torch.')}",
                                        *overrides])
    # random norm weights (the shipped ones are ones): a norm read from the wrong layer changes the output
    gen = torch.Generator().manual_seed(3)
    model = llm.engine.executor.model
    for weight in [model.final_norm, *(w for layer in model.layers for w in (layer.attn_norm, layer.mlp_norm))]:
        weight.copy_(1 + 0.3 * torch.randn(weight.shape, generator=gen))
    return llm


class _Runs:
    """Counts `DecodeLayers.run` calls (each a decode step's native call)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        run = DecodeLayers.run

        def counted(layers: DecodeLayers, *args: object) -> None:
            self.calls += 1
            run(layers, *args)

        monkeypatch.setattr(DecodeLayers, "run", counted)


def _generate(llm: LLM, max_tokens: int = 24) -> list[list[int]]:
    greedy = [SamplingParams(max_tokens=max_tokens + i, ignore_eos=True, temperature=0.0) for i in range(len(PROMPTS))]
    return [o.token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]


def _twice(llm: LLM, checked: list[int]) -> Callable[..., torch.Tensor]:
    """The executor's `_forward`, every step run by the Python forward and then (over the caches as they
    were) by whatever the executor now offers, both results and both caches compared bit for bit."""
    ex = llm.engine.executor
    forward = ex._forward

    def both(batch: object, version: str | None) -> torch.Tensor:
        caches = [*ex.key_caches, *ex.value_caches]
        before = [c.clone() for c in caches]
        ex.native_decode = False
        python = forward(batch, version).clone()
        python_caches = [c.clone() for c in caches]
        for cache, saved in zip(caches, before, strict=True):
            cache.copy_(saved)
        ex.native_decode = True
        native = forward(batch, version)
        assert torch.equal(native.view(torch.uint8), python.view(torch.uint8))
        assert all(torch.equal(c.view(torch.uint8), p.view(torch.uint8))
                   for c, p in zip(caches, python_caches, strict=True))
        checked.append(batch.input_ids.shape[0])
        return native

    return both


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_every_step_matches_the_python_forward_to_the_bit(dtype: torch.dtype, monkeypatch) -> None:
    _needs_loop(dtype)
    llm = _llm(dtype)
    runs, checked = _Runs(monkeypatch), []
    monkeypatch.setattr(llm.engine.executor, "_forward", _twice(llm, checked))
    _generate(llm)
    # the prompts' steps took the Python forward (the native call only runs decode rows), every decode step it
    assert checked and 0 < runs.calls < len(checked)
    assert "decode steps' layers in one native call" in llm.engine.executor.description


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_greedy_outputs_equal_those_of_the_python_forward(dtype: torch.dtype, monkeypatch) -> None:
    _needs_loop(dtype)
    runs = _Runs(monkeypatch)
    native = _generate(_llm(dtype))
    assert runs.calls
    calls = runs.calls
    assert _generate(_llm(dtype, "model.native_decode=false")) == native
    assert runs.calls == calls  # off: the Python forward for every step


@pytest.mark.parametrize(
    ("dtype", "overrides"),
    [
        (torch.float32, ["kernel.version=v2"]),  # only v3's calls are made natively
        (torch.float32, ["kernel.kv_cache_dtype=fp8_e4m3"]),  # scales, and a cache in another dtype
        (torch.bfloat16, ["kernel.kv_cache_dtype=float32"]),  # converted on its write
        # a window narrower than every decode step's longest context (one wider than all of a step's
        # contexts is no window: that step runs natively, as the Python forward runs it without one)
        (torch.float32, ["model.sliding_window=4"]),
        (torch.float32, ["kernel.backend=torch"]),  # torch attention and layer ops
        (torch.float32, ["model.gemm=onednn"]),  # linears the loop does not run
    ],
    ids=["v2", "fp8", "bf16-over-fp32-cache", "window", "torch-backend", "onednn"],
)
def test_steps_it_cannot_run_take_the_python_forward(dtype: torch.dtype, overrides: list[str], monkeypatch) -> None:
    _needs_loop(dtype)
    runs = _Runs(monkeypatch)
    llm = _llm(dtype, *overrides)
    reference = _generate(_llm(dtype, *overrides, "model.native_decode=false"))
    assert _generate(llm) == reference
    assert runs.calls == 0
    # a model with a window still runs natively a step whose contexts all fit in it: the line says so
    described = "window" in overrides[0]
    assert ("in one native call (those without a window or feature)" in llm.engine.executor.description) == described


def test_decode_layers_of_a_model_it_cannot_run_is_none() -> None:
    _needs_loop(torch.float32)
    model = _llm(torch.float32).engine.executor.model
    layers = model.decode_layers()
    assert layers is not None
    model.ops = TORCH_OPS  # the torch formulas are not the native ops' calls
    assert model.decode_layers() is None
    assert DecodeLayers.of(model) is None


def test_a_refused_call_names_its_layer_and_call(monkeypatch) -> None:
    """A position past the RoPE table: the kernel's refusal, with the layer and the call."""
    _needs_loop(torch.float32)
    llm = _llm(torch.float32)
    ex, seen = llm.engine.executor, []
    forward = ex.model.forward

    def keep(input_ids: torch.Tensor, positions: torch.Tensor, *args: object) -> torch.Tensor:
        stack = current_stack()
        if stack is not None:
            seen.append((input_ids.shape[0], stack))
        return forward(input_ids, positions, *args)

    monkeypatch.setattr(ex.model, "forward", keep)
    _generate(llm, max_tokens=2)
    rows, stack = seen[-1]
    layers = ex.model.decode_layers()
    x, residual = torch.zeros(rows, 128), torch.zeros(rows, 128)
    beyond = torch.full((rows,), ex.model.cos.shape[0], dtype=torch.int64)
    with pytest.raises(ValueError, match=r"decode_layers_cpu \(layer 0, rope\) refused its arguments: positions "
                                         r"holds a position outside the cos/sin tables"):
        layers.run(x, residual, beyond, ex.model.cos, ex.model.sin, stack, 1e-5)
    # its own sizes: no layer ran
    layers.dims = (layers.dims[0], 0, *layers.dims[2:])
    with pytest.raises(ValueError, match=r"^cpu decode_layers_cpu refused its arguments: sizes must be positive"):
        layers.run(x, residual, beyond, ex.model.cos, ex.model.sin, stack, 1e-5)


def test_native_decode_takes_a_bool() -> None:
    assert compose_config(["model=tiny-random", "model.native_decode=false"]).model.native_decode is False
    with pytest.raises(ConfigError, match="model.native_decode"):
        compose_config(["model=tiny-random", "model.native_decode=sometimes"])

