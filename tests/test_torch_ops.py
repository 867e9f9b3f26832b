"""Our kernels as torch ops (issue 43): `torch.ops.paged.*` defined once with their schemas and a CPU, a
CUDA and a Meta kernel each; the kernel-level ops compute what `paged.kernels` computes; the layer-level
op runs the step's attention from the forward context, writing into its `out`; the meta device,
FakeTensorMode and torch.compile trace through them, and a traced forward splits at attention; the
model's layers call the op."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.split_module import split_module
from torch.utils._python_dispatch import TorchDispatchMode

from paged import kernels
from paged.executor.attention import PagedAttention
from paged.executor.step_plan import HostBatch, HostRows, InputBuffers
from paged.kernels import torch_ops
from paged.kernels.features import alibi_slopes
from paged.kernels.forward_context import forward_context
from paged.kernels.planned import AttentionSettings
from paged.kernels.testing import AttentionCase, attention_inputs, prefill_inputs
from paged.kernels.toolchain import host_compiler
from paged.kernels.torch_ops import layer_attention
from paged.model.llama import LlamaModel
from paged.model.tiny import random_state, tiny_arch

_NO_COMPILER = host_compiler.unavailable_reason()
needs_compiler = pytest.mark.skipif(_NO_COMPILER is not None, reason=f"cpu backend not buildable: {_NO_COMPILER}")

CASE = AttentionCase(torch.float32, 64, 16, 4, 2, 32, (1, 17, 40))  # 8 query heads over 2 KV heads


def test_the_ops_have_their_schemas_and_a_cpu_cuda_and_meta_kernel() -> None:
    schemas = {name: str(getattr(torch.ops.paged, name).default._schema) for name in torch_ops.SCHEMAS}
    assert schemas["attention"] == "paged::attention(Tensor q, Tensor k, Tensor v, Tensor(a!) out, int layer) -> ()"
    assert schemas["reshape_and_cache"].startswith(
        "paged::reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
        "Tensor slot_mapping, Tensor? k_scale=None")
    assert schemas["paged_attention"].startswith(
        "paged::paged_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
        'Tensor block_tables, Tensor seq_lens, float scale, int max_seq_len, str version="v1", int partition_size=512')
    assert schemas["prefill_attention"].startswith(
        "paged::prefill_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
        "Tensor block_tables, Tensor query_start_loc, Tensor seq_lens, float scale, int max_query_len, int max_seq_len")
    for name in torch_ops.SCHEMAS:
        for key in ("CPU", "CUDA", "Meta"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(f"paged::{name}", key), (name, key)
    assert torch_ops.REGISTRATION_MS > 0


def test_importing_the_module_again_defines_nothing_twice() -> None:
    library = torch_ops._LIBRARY
    reloaded = importlib.reload(torch_ops)
    assert reloaded._LIBRARY is library  # still held: the registrations last
    q = torch.zeros(2, 4, 8)
    with forward_context(lambda layer, q, k, v, out: out.fill_(layer)):
        assert torch.equal(layer_attention(3, q, q, q), torch.full_like(q, 3))


@needs_compiler
@pytest.mark.compiles
@pytest.mark.parametrize("version", ["v1", "v2", "v3"])
def test_paged_attention_on_cpu_is_the_native_backends(version: str) -> None:
    x = attention_inputs(CASE)
    slopes = alibi_slopes(CASE.num_heads)
    out = torch.full_like(x.query, float("nan"))
    torch.ops.paged.paged_attention(out, x.query, x.key_cache, x.value_cache, x.block_tables, x.seq_lens, x.scale,
                                    max(CASE.seq_lens), version, 32, 20, slopes)
    expected = kernels.paged_attention(x.query, x.key_cache, x.value_cache, x.block_tables, x.seq_lens, x.scale,
                                       version=version, backend="cpu", partition_size=32, sliding_window=20,
                                       alibi_slopes=slopes)
    assert torch.equal(out, expected)


@needs_compiler
@pytest.mark.compiles
def test_prefill_attention_and_the_cache_write_on_cpu_are_the_native_backends() -> None:
    x = prefill_inputs(CASE, (1, 5, 40))
    p = x.paged
    out = torch.empty_like(x.query)
    torch.ops.paged.prefill_attention(out, *x.args, 40, max(CASE.seq_lens))
    assert torch.equal(out, kernels.prefill_attention(*x.args, backend="cpu"))

    key = torch.randn(3, CASE.num_kv_heads, CASE.head_size)
    slots = torch.tensor([0, -1, 17])
    ours = p.clean_key_cache.clone(), p.clean_value_cache.clone()
    theirs = p.clean_key_cache.clone(), p.clean_value_cache.clone()
    torch.ops.paged.reshape_and_cache(key, -key, *ours, slots)
    kernels.reshape_and_cache(key, -key, *theirs, slots, backend="cpu")
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    assert not torch.equal(ours[0], p.clean_key_cache)  # it wrote


def test_the_meta_kernels_check_shapes_and_trace_under_fake_tensors() -> None:
    x = attention_inputs(CASE)
    args = (x.query, x.key_cache, x.value_cache, x.block_tables, x.seq_lens)
    with torch.device("meta"):
        meta = [torch.empty_like(t, device="meta") for t in args]
        torch.ops.paged.paged_attention(torch.empty_like(meta[0]), *meta, x.scale, 40)
        torch.ops.paged.attention(meta[0], meta[1], meta[1], torch.empty_like(meta[0]), 0)
        with pytest.raises(ValueError, match=r"paged::attention: out must be torch.float32 \(3, 8, 64\)"):
            torch.ops.paged.attention(meta[0], meta[1], meta[1], meta[0][:1], 0)
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in args]
        out = torch.empty_like(fake[0])
        torch.ops.paged.prefill_attention(out, fake[0], fake[1], fake[2], fake[3], torch.arange(4, dtype=torch.int32),
                                          fake[4], x.scale, 1, 40)
        torch.ops.paged.attention(fake[0], fake[0], fake[0], out, 1)  # no forward context needed to trace
        assert out.shape == x.query.shape and out.dtype == x.query.dtype


def _batch(host: HostBatch) -> object:
    return InputBuffers(torch.device("cpu")).upload(host)


def _mixed_step() -> tuple[HostBatch, int]:
    """Two decode rows (contexts 17 and 40) and one prefill row of 5 new tokens (context 9), block 16."""
    tables = np.array([[0, 1, 0], [2, 3, 4], [5, 0, 0]], dtype=np.int32)
    lens = np.array([17, 40, 9], dtype=np.int32)
    positions = np.array([16, 39, 4, 5, 6, 7, 8], dtype=np.int64)
    owner = np.array([0, 1, 2, 2, 2, 2, 2])
    slots = tables[owner, positions // 16].astype(np.int64) * 16 + positions % 16
    decode = HostRows(np.array([0, 1]), tables[:2], lens[:2], np.arange(3, dtype=np.int32), 40, 1)
    prefill = HostRows(np.arange(2, 7), tables[2:], lens[2:], np.array([0, 5], dtype=np.int32), 9, 5)
    host = HostBatch(np.zeros(7, dtype=np.int64), positions, slots, np.array([0, 1, 6]), decode, prefill)
    return host, 6


@pytest.mark.parametrize("backend", ["torch", pytest.param("cpu", marks=[needs_compiler, pytest.mark.compiles])])
def test_the_layer_op_writes_the_steps_attention_into_out(backend: str) -> None:
    host, num_blocks = _mixed_step()
    gen = torch.Generator().manual_seed(0)
    caches = [torch.randn(num_blocks, 2, 64 // 4, 16, 4, generator=gen),
              torch.randn(num_blocks, 2, 64, 16, generator=gen)]
    q, k, v = (torch.randn(7, heads, 64, generator=gen) for heads in (8, 2, 2))
    settings = AttentionSettings(kernels.get_backend(backend), 0.125, 32)

    def step(caches: list[torch.Tensor]) -> PagedAttention:
        return PagedAttention(_batch(host), [caches[0]], [caches[1]], settings, decode_version="v2", num_heads=8)

    expected = step([c.clone() for c in caches])(0, q, k, v)
    ours = step(caches)
    out = torch.full_like(q, float("nan"))
    with forward_context(ours):
        torch.ops.paged.attention(q, k, v, out, 0)
    assert torch.equal(out, expected)


def test_the_layer_op_needs_a_forward_context_and_restores_the_outer_one() -> None:
    q = torch.zeros(1, 2, 8)
    with pytest.raises(RuntimeError, match="outside a forward context"):
        layer_attention(0, q, q, q)
    with forward_context(lambda layer, q, k, v, out: out.fill_(1)):
        with forward_context(lambda layer, q, k, v, out: out.fill_(2)):
            assert layer_attention(0, q, q, q).eq(2).all()
        assert layer_attention(0, q, q, q).eq(1).all()
    with pytest.raises(ValueError, match=r"out must be torch.float32 \(1, 2, 8\)"):
        torch.ops.paged.attention(q, q, q, torch.empty(1, 16), 0)


def _layer(x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    return layer_attention(0, x * 2, k, k) + 1


def test_torch_compile_sees_the_layer_op_and_a_traced_graph_splits_at_it() -> None:
    graphs: list[torch.fx.GraphModule] = []

    def record(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> torch.fx.GraphModule:
        graphs.append(gm)
        return gm

    x, k = torch.randn(3, 4, 8), torch.randn(3, 2, 8)
    with forward_context(lambda layer, q, k, v, out: out.copy_(q.flip(0))):
        eager = _layer(x, k)
        assert torch.equal(torch.compile(_layer, backend=record, fullgraph=True)(x, k), eager)
        assert torch.equal(torch.compile(_layer, backend="aot_eager", fullgraph=False)(x, k), eager)
    (gm,) = graphs
    attention = [n for n in gm.graph.nodes if n.target is torch.ops.paged.attention.default]
    assert len(attention) == 1
    # vLLM's piecewise split: the op alone in its piece, the computation before and after it in theirs
    after = False

    def which(node: torch.fx.Node) -> int:
        nonlocal after
        if node.target is torch.ops.paged.attention.default:
            after = True
            return 1
        return 2 if after else 0

    split = split_module(gm, None, which, keep_original_order=True)  # as vLLM: the op mutates `out`
    assert sorted(name for name, _ in split.named_children()) == ["submod_0", "submod_1", "submod_2"]
    assert [n.target for n in split.submod_1.graph.nodes if n.op == "call_function"] == [
        torch.ops.paged.attention.default]
    with forward_context(lambda layer, q, k, v, out: out.copy_(q.flip(0))):
        assert torch.equal(split(x, k)[0], eager)  # a dynamo graph returns its outputs as a tuple


class _Calls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's protocol
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_the_model_calls_attention_through_the_torch_op() -> None:
    arch = tiny_arch()
    model = LlamaModel(arch, random_state(arch))
    seen: list[tuple[int, tuple[int, ...]]] = []

    def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
        seen.append((layer, tuple(q.shape)))
        out.copy_(q)

    ids = torch.tensor([1, 2, 3])
    with forward_context(attention), _Calls() as calls:
        hidden = model.forward(ids, torch.arange(3))
    assert calls.ops.count("paged.attention.default") == arch.num_layers
    assert seen == [(i, (3, arch.num_heads, arch.head_dim)) for i in range(arch.num_layers)]
    assert torch.equal(hidden, model.forward(ids, torch.arange(3), lambda layer, q, k, v: q.contiguous()))
