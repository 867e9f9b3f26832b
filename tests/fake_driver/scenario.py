"""What runs in the subprocess whose libcuda.so.1 is the recording fake: every launch plan and the
swap copies of the cuda backend, through `paged.kernels` ops, the real `CudaRunner` and cuda.core.

    python -m tests.fake_driver.scenario {launches|swaps|layer|init} OUT.json

Device memory is host memory under the fake driver, so the tensors are CPU tensors and the backend
is `RunnerBackend` with the real runner; only the tensor -> runner choice (`CudaBackend.runner`
reads torch's CUDA device index) is replaced. Before each case a `{"case": id}` line is appended to
the driver's log, so the test can split the log by case; OUT.json maps case ids to what the test
needs to know about the tensors (addresses, strides) or to the error raised.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from paged import kernels
from paged.kernels.backends.launch import RunnerBackend
from paged.kernels.features import BlockSparse, alibi_slopes
from paged.kernels.testing import (
    AttentionCase,
    attention_grid,
    attention_inputs,
    default_partition_grid,
    prefill_inputs,
    random_cache,
)
from paged.kernels.toolchain import nvrtc
from paged.kernels.toolchain.specs import Unit, attention_unit, cache_unit, prefill_unit

# Shorter than the longest sequence of `attention_grid()[0]`, not a multiple of its block or partition.
WINDOW = 20
# One case per v1 shared-memory regime of this configuration (see `smem_cases`).
# v3 on every dtype and block size, MHA to MQA, and the long rows that split.
V3_CASES = attention_grid()[:4] + default_partition_grid()
# One long sequence of a GQA-8 model (64 query / 8 KV heads, head 128): the fake device has an H200's
# (and H100's) 132 SMs, 228 KB of shared memory, 2048 threads and 64K registers per SM.
LONG_V3_CASES = [AttentionCase(torch.float16, 128, 16, 8, 8, 512, (context,)) for context in (16384, 4096)]
SMEM_CASE = AttentionCase(torch.float16, 128, 16, 4, 2, 512, (5, 40))
DEVICE_LIMIT = int(os.environ.get("FAKE_CUDA_SMEM_OPTIN", 232448))


@dataclass(frozen=True)
class Case:
    id: str
    run: Callable[[], dict[str, Any]]


class HostMemoryCuda(RunnerBackend):
    """The cuda backend's launch plans and runner over host tensors."""

    name = "cuda-on-fake-driver"
    description = "CUDA launch plans on the recording fake driver"
    device_type = "cpu"

    def __init__(self, runner: Any) -> None:
        self._runner = runner

    def runner(self, tensor: torch.Tensor) -> Any:
        return self._runner

    def device_limits(self, device: torch.device) -> Any:
        return self._runner.limits


def _stream_id(stream: Any) -> int:
    from cuda.bindings import driver

    _, stream_id = driver.cuStreamGetId(stream.handle)
    return int(stream_id)


def _current_device() -> int:
    from cuda.bindings import driver

    _, device = driver.cuCtxGetDevice()
    return int(device)


def _lowered(unit: Unit, arch: str) -> dict[str, Any]:
    """Lowered names in launch order, and the static shared memory ptxas reported for each."""
    compiled = nvrtc.compile_unit(unit, arch)
    static = {info.kernel: info.static_smem for info in compiled.infos}
    return {"names": [compiled.symbol_mapping[k].decode() for k in unit.kernels],
            "static_smem": [static[k] for k in unit.kernels], "kernels": list(unit.kernels)}


def _query(case: AttentionCase, layout: str, gen: torch.Generator) -> torch.Tensor:
    """The query in one of the layouts a caller may pass."""
    shape = (len(case.seq_lens), case.num_heads, case.head_size)
    if layout == "fused":  # a slice of a fused QKV projection, as the model passes it
        width = (case.num_heads + 2 * case.num_kv_heads) * case.head_size
        qkv = torch.randn(shape[0], width, generator=gen).to(case.dtype)
        return qkv[:, : case.num_heads * case.head_size].view(shape)
    if layout == "misaligned":  # packed, but one element past an aligned address
        flat = torch.randn(1 + shape[0] * shape[1] * shape[2], generator=gen).to(case.dtype)
        return flat[1:].view(shape)
    return torch.randn(shape, generator=gen).to(case.dtype)


def _fp8_features(case: AttentionCase, x: Any) -> dict[str, Any]:
    """fp8 e4m3 caches of the inputs' shape, per-head scales, ALiBi slopes and a block-sparse
    pattern: what the features' launch arguments carry."""
    key_cache = torch.zeros(x.key_cache.shape[:2] + (case.head_size // 16, case.block_size, 16),
                            dtype=torch.float8_e4m3fn)
    value_cache = torch.zeros(x.value_cache.shape, dtype=torch.float8_e4m3fn)
    return {"key_cache": key_cache, "value_cache": value_cache,
            "k_scale": torch.linspace(0.5, 1.0, case.num_kv_heads), "v_scale": torch.full((case.num_kv_heads,), 0.25),
            "alibi_slopes": alibi_slopes(case.num_heads),
            "blocksparse": BlockSparse(local_blocks=2, vert_stride=3, block_size=2 * case.block_size,
                                       head_sliding_step=-1)}


def attention_case(case: AttentionCase, version: str, backend: HostMemoryCuda, stream: Any, arch: str,
                   layout: str = "packed", max_seq_len: int | None = None,
                   sliding_window: int | None = None, features: bool = False) -> dict[str, Any]:
    x = attention_inputs(case)
    extra = _fp8_features(case, x) if features else {}
    key_cache, value_cache = extra.pop("key_cache", x.key_cache), extra.pop("value_cache", x.value_cache)
    query = _query(case, layout, torch.Generator().manual_seed(1))
    max_seq_len = max_seq_len or max(case.seq_lens)
    tables = x.block_tables
    if tables.shape[1] * case.block_size < max_seq_len:  # room for an overstated max_seq_len
        tables = torch.nn.functional.pad(tables, (0, -(-max_seq_len // case.block_size) - tables.shape[1]))
    sparse = extra.get("blocksparse")
    result = {"query": query.data_ptr(), "q_stride": query.stride(0), "key_cache": key_cache.data_ptr(),
              "value_cache": value_cache.data_ptr(), "block_tables": tables.data_ptr(),
              "max_blocks": tables.shape[1], "seq_lens": x.seq_lens.data_ptr(), "scale": x.scale,
              "stream": _stream_id(stream), "max_seq_len": max_seq_len, "sliding_window": sliding_window or 0,
              "features": [extra[k].data_ptr() if k in extra else 0 for k in ("k_scale", "v_scale", "alibi_slopes")],
              "sparse": [sparse.block_size, sparse.local_blocks, sparse.vert_stride, sparse.head_sliding_step]
              if sparse else [0, 0, 0, 0],
              **_lowered(attention_unit(case.dtype, case.head_size, case.block_size, version, case.partition_size,
                                        key_cache.dtype, features, case.group), arch)}
    out = kernels.paged_attention(query, key_cache, value_cache, tables, x.seq_lens, x.scale, version=version,
                                  backend=backend, partition_size=case.partition_size, max_seq_len=max_seq_len,
                                  sliding_window=sliding_window, **extra)
    return {**result, "out": out.data_ptr()}


# (case, queries per sequence): fp16 GQA over two row tiles with a prefix hit and a decode row; fp32
# head 256, whose tiles need more than the 48 KB default of shared memory.
PREFILL_CASES = (
    (AttentionCase(torch.float16, 64, 16, 4, 2, 512, (40, 70, 9)), (20, 70, 1)),
    (AttentionCase(torch.float32, 256, 8, 1, 2, 512, (33, 5)), (33, 2)),
)


def prefill_case(case: AttentionCase, q_lens: tuple[int, ...], backend: HostMemoryCuda, stream: Any, arch: str,
                 features: bool = False) -> dict[str, Any]:
    x = prefill_inputs(case, q_lens)
    extra = _fp8_features(case, x.paged) if features else {}
    key_cache, value_cache = extra.pop("key_cache", x.paged.key_cache), extra.pop("value_cache", x.paged.value_cache)
    p, sparse = x.paged, extra.get("blocksparse")
    result = {"query": x.query.data_ptr(), "key_cache": key_cache.data_ptr(), "value_cache": value_cache.data_ptr(),
              "block_tables": p.block_tables.data_ptr(), "max_blocks": p.block_tables.shape[1],
              "seq_lens": p.seq_lens.data_ptr(), "query_start_loc": x.query_start_loc.data_ptr(), "scale": p.scale,
              "stream": _stream_id(stream), "sliding_window": WINDOW if features else 0,
              "features": [extra[k].data_ptr() if k in extra else 0 for k in ("k_scale", "v_scale", "alibi_slopes")],
              "sparse": [sparse.block_size, sparse.local_blocks, sparse.vert_stride, sparse.head_sliding_step]
              if sparse else [0, 0, 0, 0],
              **_lowered(prefill_unit(case.dtype, case.head_size, case.block_size, key_cache.dtype, features), arch)}
    out = kernels.prefill_attention(x.query, key_cache, value_cache, p.block_tables, x.query_start_loc, p.seq_lens,
                                    p.scale, backend=backend, sliding_window=WINDOW if features else None, **extra)
    return {**result, "out": out.data_ptr()}


def cache_case(dtype: torch.dtype, backend: HostMemoryCuda, stream: Any, arch: str,
               cache_dtype: torch.dtype | None = None) -> dict[str, Any]:
    """reshape_and_cache from key/value slices of a fused QKV (strided rows), then copy_blocks over
    two layers; `cache_dtype` fp8 stores them with per-head scales."""
    num_tokens, heads, head, block, num_blocks = 5, 2, 64, 16, 6
    cache_dtype = cache_dtype or dtype
    qkv = torch.randn(num_tokens, 4 * heads * head).to(dtype)
    key = qkv[:, 2 * heads * head: 3 * heads * head].view(num_tokens, heads, head)
    value = qkv[:, 3 * heads * head:].view(num_tokens, heads, head)
    caches = [random_cache(num_blocks, heads, head, block, dtype) for _ in range(2)]
    scales = {}
    if cache_dtype != dtype:
        caches = [(torch.zeros(num_blocks, heads, head // 16, block, 16, dtype=cache_dtype),
                   torch.zeros(num_blocks, heads, head, block, dtype=cache_dtype)) for _ in range(2)]
        scales = {"k_scale": torch.tensor([0.5, 2.0]), "v_scale": torch.tensor([1.5, 0.25])}
    slots = torch.tensor([3, -1, 17, 40, 95], dtype=torch.int64)
    kernels.reshape_and_cache(key, value, *caches[0], slots, backend=backend, **scales)
    mapping = torch.tensor([[0, 4], [1, 5], [2, 3]], dtype=torch.int64)
    kernels.copy_blocks([c[0] for c in caches], [c[1] for c in caches], mapping, backend=backend)
    return {"key": key.data_ptr(), "value": value.data_ptr(), "key_stride": key.stride(0),
            "value_stride": value.stride(0), "key_cache": caches[0][0].data_ptr(),
            "value_cache": caches[0][1].data_ptr(), "slots": slots.data_ptr(), "num_tokens": num_tokens,
            "heads": heads, "head": head, "block": block, "x": 16 // caches[0][0].element_size(),
            "layers": len(caches), "pairs": mapping.shape[0], "numel_per_block": heads * head * block,
            "stream": _stream_id(stream),
            "scales": [scales[k].data_ptr() if scales else 0 for k in ("k_scale", "v_scale")],
            **_lowered(cache_unit(dtype, cache_dtype), arch)}


class PinnedHost(torch.Tensor):
    """Host memory that reports itself page-locked: torch without CUDA cannot pin memory, and under
    the fake driver every tensor is host memory anyway."""

    def is_pinned(self, device: Any = None) -> bool:
        return True


SWAP_PAIRS = [(5, 0), (0, 3), (2, 1)]


def swap_case(dtype: torch.dtype, backend: HostMemoryCuda, stream: Any, pinned: bool = True) -> dict[str, Any]:
    """swap_blocks of two layers' K and V caches, `[*keys, *values]` as the executor passes them, from
    a pool of 6 blocks to one of 4; `pinned=False` leaves the destination pool pageable."""
    gen = torch.Generator().manual_seed(3)
    src_layers = [random_cache(6, 2, 64, 16, dtype, generator=gen) for _ in range(2)]
    dst_layers = [random_cache(4, 2, 64, 16, dtype, generator=gen) for _ in range(2)]
    src = [k for k, _ in src_layers] + [v for _, v in src_layers]
    dst = [k for k, _ in dst_layers] + [v for _, v in dst_layers]
    expected = [d.clone() for d in dst]
    for s, d in SWAP_PAIRS:
        for want, cache in zip(expected, src):
            want[d] = cache[s]
    src = [c.as_subclass(PinnedHost) for c in src]
    dst = [c.as_subclass(PinnedHost) if pinned else c for c in dst]
    kernels.swap_blocks(src, dst, SWAP_PAIRS, backend=backend)
    return {"src": [c.data_ptr() for c in src], "dst": [c.data_ptr() for c in dst],
            "block_bytes": [c[0].numel() * c.element_size() for c in src], "pairs": SWAP_PAIRS,
            "stream": _stream_id(stream), "copied": all(torch.equal(d, e) for d, e in zip(dst, expected))}


def bad_cache_case(kind: str, backend: HostMemoryCuda) -> dict[str, Any]:
    key_cache, value_cache = random_cache(4, 2, 64, 16, torch.float16)
    key = torch.randn(3, 2, 64).half()
    slots = torch.tensor([0, 1, 2])
    if kind == "strided_cache":
        key_cache = random_cache(4, 4, 64, 16, torch.float16)[0][:, :2]
    elif kind == "misaligned_cache":
        flat = torch.empty(key_cache.numel() + 1, dtype=torch.float16)
        key_cache = flat[1:].view(key_cache.shape)
    elif kind == "overlapping_caches":
        value_cache = key_cache.view(value_cache.shape)
    kernels.reshape_and_cache(key, key, key_cache, value_cache, slots, backend=backend)
    return {}


def mistyped_plan_case(stream: Any) -> dict[str, Any]:
    """A plan that passes a 4-byte int where `copy_blocks` takes a pointer, on a runner that has not
    launched the kernel yet: refused before the driver sees it; the right plan then launches."""
    from paged.kernels.backends.cuda import CudaRunner
    from paged.kernels.backends.launch_api import Launch, Ptr

    runner = CudaRunner(0, stream_source=lambda index: int(stream.handle))
    unit = cache_unit(torch.float16)
    kernel = unit.kernels[1]  # copy_blocks: key caches, value caches, block mapping, numel per block
    buffers = torch.zeros(4, dtype=torch.int64)
    right = (Ptr(buffers.data_ptr()), Ptr(buffers.data_ptr()), Ptr(buffers.data_ptr()), np.int32(16))
    error = None
    try:
        runner.run(unit, [Launch(kernel, (1, 1, 1), 32, 0, (np.int32(0), *right[1:]))])
    except RuntimeError as e:
        error = str(e)
    runner.run(unit, [Launch(kernel, (1, 1, 1), 32, 0, right)])
    return {"error_message": error}


def smem_cases(stream: Any, backend: HostMemoryCuda, arch: str) -> list[Case]:
    """v1 at max_seq_len values around the two shared-memory limits of its kernel: 48 KB less its
    static shared memory (beyond it the launch needs the opt-in attribute) and the device's opt-in
    maximum less it (beyond it the launch is refused before it reaches the driver)."""
    unit = attention_unit(SMEM_CASE.dtype, SMEM_CASE.head_size, SMEM_CASE.block_size, "v1", 512)
    static = _lowered(unit, arch)["static_smem"][0]
    granule = SMEM_CASE.block_size * 4  # v1's logits cover whole blocks of fp32
    cases = []
    for label, limit in (("default", 48 * 1024 - static), ("optin", DEVICE_LIMIT - static)):
        below, above = limit // granule * granule, (limit // granule + 1) * granule
        for side, smem in (("below", below), ("above", above)):
            cases.append(Case(f"smem-{label}-{side}-{smem}", lambda smem=smem: {
                **attention_case(SMEM_CASE, "v1", backend, stream, arch, max_seq_len=smem // 4),
                "static_smem": static}))
    return cases


def launch_cases(arch: str) -> list[Case]:
    from cuda.core import Device

    from paged.kernels.backends.cuda import CudaRunner

    streams = []
    for index in (0, 1):
        device = Device(index)
        device.set_current()
        streams.append(device.create_stream())
    Device(0).set_current()
    active = {"stream": streams[0]}
    runner = CudaRunner(0, stream_source=lambda index: int(active["stream"].handle))
    backend = HostMemoryCuda(runner)
    cases = []
    for case in attention_grid() + default_partition_grid():
        for version in ("v1", "v2"):
            cases.append(Case(f"attention-{version}-{case.id}",
                              lambda c=case, v=version: attention_case(c, v, backend, active["stream"], arch)))
    for case in V3_CASES:
        cases.append(Case(f"attention-v3-{case.id}",
                          lambda c=case: attention_case(c, "v3", backend, active["stream"], arch)))
    for case in LONG_V3_CASES:
        cases.append(Case(f"attention-v3-1x{case.seq_lens[0]}-{case.id}",
                          lambda c=case: attention_case(c, "v3", backend, active["stream"], arch)))
    for layout in ("fused", "misaligned"):
        case = attention_grid()[0]
        cases.append(Case(f"query-{layout}-{case.id}",
                          lambda c=case, lay=layout: attention_case(c, "v2", backend, active["stream"], arch, lay)))
    window_case = attention_grid()[0]
    for version in ("v1", "v2", "v3"):
        cases.append(Case(f"window-{version}-{window_case.id}", lambda v=version: attention_case(
            window_case, v, backend, active["stream"], arch, sliding_window=WINDOW)))
    for version in ("v1", "v2", "v3"):
        cases.append(Case(f"features-{version}-{window_case.id}", lambda v=version: attention_case(
            window_case, v, backend, active["stream"], arch, features=True)))
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        cases.append(Case(f"cache-{str(dtype).removeprefix('torch.')}",
                          lambda d=dtype: cache_case(d, backend, active["stream"], arch)))
    cases.append(Case("cache-fp8", lambda: cache_case(torch.float16, backend, active["stream"], arch,
                                                      torch.float8_e5m2)))
    cases += smem_cases(active["stream"], backend, arch)
    for case, q_lens in PREFILL_CASES:
        cases.append(Case(f"prefill-{case.id}", lambda c=case, q=q_lens: prefill_case(
            c, q, backend, active["stream"], arch)))
    case, q_lens = PREFILL_CASES[0]
    cases.append(Case(f"prefill-features-{case.id}", lambda: prefill_case(
        case, q_lens, backend, active["stream"], arch, features=True)))
    for kind in ("strided_cache", "misaligned_cache", "overlapping_caches"):
        cases.append(Case(f"bad-{kind}", lambda k=kind: bad_cache_case(k, backend)))

    def second_stream() -> dict[str, Any]:
        active["stream"] = streams[0]
        first = cache_case(torch.float16, backend, streams[0], arch)
        active["stream"] = Device(0).create_stream()
        second = cache_case(torch.float16, backend, active["stream"], arch)
        return {"streams": [first["stream"], second["stream"]]}

    def other_device() -> dict[str, Any]:
        on_one = CudaRunner(1, stream_source=lambda index: int(streams[1].handle))
        before = _current_device()
        result = cache_case(torch.float16, HostMemoryCuda(on_one), streams[1], arch)
        return {**result, "current_before": before, "current_after": _current_device()}

    cases += [Case("streams-follow-the-source", second_stream), Case("device-1-from-device-0", other_device),
              Case("mistyped-plan", lambda: mistyped_plan_case(streams[0]))]
    return cases


def swap_cases() -> list[Case]:
    from cuda.core import Device

    from paged.kernels.backends.cuda import CudaRunner

    stream = Device(0).create_stream()
    backend = HostMemoryCuda(CudaRunner(0, stream_source=lambda index: int(stream.handle)))
    cases = [Case(f"swap-{str(dtype).removeprefix('torch.')}", lambda d=dtype: swap_case(d, backend, stream))
             for dtype in (torch.float32, torch.float16, torch.bfloat16)]
    return [*cases, Case("swap-pageable", lambda: swap_case(torch.float16, backend, stream, pinned=False))]


def init_cases() -> list[Case]:
    """Bringing a runner up: with the driver configured by the environment it either works or
    raises the error a user should see."""
    from paged.kernels.backends.cuda import CudaRunner

    def start() -> dict[str, Any]:
        runner = CudaRunner(0)
        return {"arch": runner.arch, "max_shared_memory": runner.max_shared_memory}

    return [Case("start", start)]


def main() -> None:
    scenario, out_path = sys.argv[1], sys.argv[2]
    log = os.environ.get("FAKE_CUDA_LOG")
    # cuda.core deprecates launching on a foreign stream object; the runner must wrap it first.
    warnings.simplefilter("error", DeprecationWarning)
    if scenario in ("launches", "swaps", "layer", "press"):
        from cuda.core import Device

        Device(0).set_current()
        major, minor = Device(0).compute_capability
        arch = f"sm_{major}{minor}"
        if scenario == "layer":  # one decode step of a model (layer_scenario.py)
            from tests.fake_driver.layer_scenario import layer_cases

            cases = layer_cases(arch)
        elif scenario == "press":  # the KV presses' kernels (press_scenario.py)
            from tests.fake_driver.press_scenario import press_cases

            cases = press_cases(arch)
        else:
            cases = launch_cases(arch) if scenario == "launches" else swap_cases()
    else:
        cases = init_cases()
    results = {}
    for case in cases:
        if log:
            with open(log, "a") as f:
                f.write(json.dumps({"case": case.id}) + "\n")
        try:
            results[case.id] = case.run()
        except (ValueError, RuntimeError) as e:
            results[case.id] = {"error": f"{type(e).__name__}: {e}"}
    with open(out_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
