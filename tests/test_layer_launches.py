"""A step's decode attention and cache write on a backend that runs `Launch`es (emu here, cuda alike): the first
layer's launches serve the later layers with their own query, caches and output swapped in
(`paged.kernels.planned._LayerLaunches`, and both ops in one call: `WriteThenAttend`), and every layer's output
is what the op computes for it alone; a layer whose query is laid out otherwise plans its own launches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from paged import kernels
from paged.executor.attention import PagedAttention
from paged.executor.step_plan import HostBatch, HostRows, InputBuffers
from paged.kernels.backends.emu import BACKEND as EMU
from paged.kernels.planned import AttentionSettings, CacheWrite, DecodeAttention, Rows
from paged.kernels.testing import AttentionCase, attention_inputs, random_cache
from paged.kernels.toolchain import host_compiler

pytestmark = [
    pytest.mark.compiles,
    pytest.mark.skipif(host_compiler.unavailable_reason() is not None, reason="no host compiler"),
]

LAYERS = 3


def _step(version: str, dtype: torch.dtype) -> tuple[DecodeAttention, list[tuple[torch.Tensor, ...]], object]:
    case = AttentionCase(dtype, 64, 16, 4, 2, 32, (5, 40, 77))  # 8 query heads over 2 KV heads
    x = attention_inputs(case)
    layers = []
    for layer in range(LAYERS):
        gen = torch.Generator().manual_seed(layer + 1)
        key, value = random_cache(x.key_cache.shape[0], case.num_kv_heads, 64, 16, dtype, generator=gen)
        query = torch.randn(x.query.shape, generator=gen).to(dtype)
        layers.append((query, key, value))
    starts = torch.arange(len(case.seq_lens) + 1, dtype=torch.int32)
    rows = Rows(x.block_tables, x.seq_lens, starts, x.block_tables.numpy(), x.seq_lens.numpy(), starts.numpy(),
                max_seq_len=max(case.seq_lens), max_query_len=1)
    decode = DecodeAttention(rows, AttentionSettings(EMU, x.scale, 32), version, case.num_heads, case.num_kv_heads, 64,
                             x.key_cache.shape[0], 16)
    return decode, layers, x


@pytest.mark.parametrize("version", ["v1", "v2", "v3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_every_layer_from_the_first_layers_launches_equals_the_op(version: str, dtype: torch.dtype) -> None:
    decode, layers, x = _step(version, dtype)
    outputs = [decode(*layer) for layer in layers]
    assert decode.layer_launches is not None  # the later layers ran from the first's launches
    for (query, key, value), out in zip(layers, outputs):
        alone = kernels.paged_attention(query, key, value, x.block_tables, x.seq_lens, x.scale, version=version,
                                        backend=EMU, partition_size=32)
        assert torch.equal(out, alone)
    assert len({out.data_ptr() for out in outputs}) == LAYERS  # each layer its own output


def test_a_layer_whose_query_is_laid_out_otherwise_plans_its_own_launches() -> None:
    decode, layers, x = _step("v2", torch.float16)
    decode(*layers[0])
    query, key, value = layers[1]
    # a slice of a fused QKV projection: another row stride than the first layer's packed query
    fused = torch.zeros(query.shape[0], 3 * query.shape[1] * query.shape[2], dtype=query.dtype)
    fused[:, : query.shape[1] * query.shape[2]] = query.reshape(query.shape[0], -1)
    sliced = fused[:, : query.shape[1] * query.shape[2]].view(query.shape)
    assert decode.layer_launches.attend(sliced, key, value, None, None) is None
    out = decode(sliced, key, value)
    alone = kernels.paged_attention(query, key, value, x.block_tables, x.seq_lens, x.scale, version="v2",
                                    backend=EMU, partition_size=32)
    assert torch.equal(out, alone)


def test_a_layer_given_its_output_tensor_writes_the_attention_there() -> None:
    """As the layer-level torch op passes it: the first layer's output is copied in, the later layers'
    launches write it in place."""
    decode, layers, x = _step("v2", torch.float16)
    first = torch.empty_like(layers[0][0])
    assert decode(*layers[0], out=first) is first
    query, key, value = layers[1]
    second = torch.empty_like(query)
    assert decode.layer_launches.attend(query, key, value, None, None, second) is second
    assert decode.layer_launches.attend(query, key, value, None, None, second[:, :1]) is None  # not laid out as planned
    for (query, key, value), out in zip(layers, (first, second)):
        alone = kernels.paged_attention(query, key, value, x.block_tables, x.seq_lens, x.scale, version="v2",
                                        backend=EMU, partition_size=32)
        assert torch.equal(out, alone)


def test_every_layers_cache_write_from_the_first_layers_launch_equals_the_op() -> None:
    """The cache write's launch is made once a step too: each later layer's new K/V (a slice of a
    fused projection, as the model passes them) land where the op alone puts them, -1 slots nowhere."""
    num_blocks, heads, block = 6, 2, 16
    slots = torch.tensor([3, -1, 17, 40, 95], dtype=torch.long)
    write = CacheWrite(slots, slots.numpy(), EMU, num_blocks * block)
    for layer in range(LAYERS):
        gen = torch.Generator().manual_seed(layer)
        fused = torch.randn(len(slots), 3 * heads * 64, generator=gen).half()
        key, value = (fused[:, i * heads * 64 : (i + 1) * heads * 64].view(len(slots), heads, 64) for i in (1, 2))
        caches = random_cache(num_blocks, heads, 64, block, torch.float16, generator=gen)
        expected = [c.clone() for c in caches]
        write(key, value, *caches)
        kernels.reshape_and_cache(key, value, *expected, slots, backend=EMU)
        assert all(torch.equal(c, e) for c, e in zip(caches, expected))
    # the later layers run from the first's launch; tensors laid out otherwise plan their own
    assert write.layer_launches is not None and write.layer_launches.run((key, value, *caches, None, None))
    assert not write.layer_launches.run((key.contiguous(), value, *caches, None, None))


@pytest.mark.parametrize("version", ["v1", "v2", "v3", "prefill"])
def test_a_steps_later_layers_write_and_attend_in_one_call_as_the_ops_do(version: str) -> None:
    """The executor's attention (`PagedAttention`): after the first layer, a step whose rows all
    decode (`version` v1/v2/v3) or all prefill (after cached tokens) runs each layer's cache write
    and attention from the first layer's launches in one call (`WriteThenAttend`); every layer's
    cache and output are what the two ops alone give, also for a layer whose key is laid out
    otherwise (which runs the ops one by one)."""
    case = AttentionCase(torch.float16, 64, 16, 4, 2, 32, (5, 40, 77))
    x = attention_inputs(case)
    tables, lens = x.block_tables.numpy(), x.seq_lens.numpy()
    q_lens = np.array([1, 1, 1] if version != "prefill" else [5, 17, 30])
    starts = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    seq_rows = np.repeat(np.arange(len(lens)), q_lens)
    positions = np.concatenate([np.arange(n - q, n) for n, q in zip(lens, q_lens, strict=True)]).astype(np.int64)
    slots = tables[seq_rows, positions // 16].astype(np.int64) * 16 + positions % 16
    rows = HostRows(None, tables, lens, starts, max(case.seq_lens), int(q_lens.max()))
    decode, prefill = (rows, None) if version != "prefill" else (None, rows)
    host = HostBatch(np.zeros(len(slots), dtype=np.int64), positions, slots, starts[1:] - 1, decode, prefill)
    caches = [random_cache(x.key_cache.shape[0], 2, 64, 16, torch.float16, generator=torch.Generator().manual_seed(i))
              for i in range(LAYERS)]
    step = PagedAttention(InputBuffers(torch.device("cpu")).upload(host), [c[0] for c in caches],
                          [c[1] for c in caches], AttentionSettings(EMU, x.scale, 32),
                          decode_version=None if version == "prefill" else version, num_heads=8)
    for layer in range(LAYERS):
        gen = torch.Generator().manual_seed(10 + layer)
        # q, k and v as the model passes them: slices of one fused projection
        fused = torch.randn(len(slots), (8 + 2 + 2) * 64, generator=gen).half()
        q, k, v = (fused[:, a * 64 : b * 64].view(len(slots), -1, 64) for a, b in ((0, 8), (8, 10), (10, 12)))
        if layer == LAYERS - 1:
            k = k.contiguous()
        expected = [c.clone() for c in caches[layer]]
        kernels.reshape_and_cache(k, v, *expected, torch.from_numpy(slots), backend=EMU)
        if version == "prefill":
            alone = kernels.prefill_attention(q, *expected, x.block_tables, torch.from_numpy(starts), x.seq_lens,
                                              x.scale, backend=EMU)
        else:
            alone = kernels.paged_attention(q, *expected, x.block_tables, x.seq_lens, x.scale, version=version,
                                            backend=EMU, partition_size=32)
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        assert step(layer, q, k, v, out) is out
        joined = step.layers[layer][0].joined
        assert joined is not None
        # run again (the same values): a layer laid out as the first runs in one call, one laid out otherwise not
        assert joined((k, v, *caches[layer], None, None, out, q)) == (layer < LAYERS - 1)
        assert torch.equal(out, alone)
        assert all(torch.equal(c, e) for c, e in zip(caches[layer], expected, strict=True))
