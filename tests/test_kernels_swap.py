"""swap_blocks: KV blocks move bit-exactly between two pools of different sizes (device <-> CPU swap
space) on every backend; bad pools and mappings are refused by name; the cuda backend's plan is one
cuMemcpyAsync per cache and pair on the current stream (against the recording fake driver, and on a
real GPU where there is one)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from paged import kernels
from paged.kernels.backends.interface import DTYPES
from paged.kernels.limits import BLOCK_SIZES
from paged.kernels.testing import random_cache
from paged.kernels.toolchain import host_compiler
from tests import fake_driver

pytestmark = pytest.mark.compiles

_NO_COMPILER = host_compiler.unavailable_reason()
_needs_compiler = pytest.mark.skipif(_NO_COMPILER is not None, reason=f"no host compiler: {_NO_COMPILER}")
_needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
HOST_BACKENDS = ["torch", pytest.param("cpu", marks=_needs_compiler), pytest.param("emu", marks=_needs_compiler)]
DEVICE_BLOCKS, HOST_BLOCKS = 10, 7
OUT = [(3, 0), (9, 6), (0, 2)]  # (device block, host block)
IN = [(0, 5), (6, 1), (2, 3)]  # (host block, device block): back into blocks other than they left


def _pool(num_blocks: int, dtype: torch.dtype, block_size: int, gen: torch.Generator, layers: int = 2,
          device: str = "cpu") -> list[torch.Tensor]:
    """`layers` layers' caches in the executor's order: every key cache, then every value cache."""
    caches = [random_cache(num_blocks, 2, 64, block_size, dtype, generator=gen) for _ in range(layers)]
    return [k.to(device) for k, _ in caches] + [v.to(device) for _, v in caches]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes, so equality is bit-exact (signed zeros, NaN payloads)."""
    return t.contiguous().view(torch.uint8)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(_bits(a.cpu()), _bits(b.cpu()))


def _round_trip(backend: str, device: list[torch.Tensor], host: list[torch.Tensor]) -> None:
    """Swaps OUT, poisons the vacated device blocks as a new owner might, swaps IN; checks both."""
    original_device, original_host = [c.clone() for c in device], [c.clone() for c in host]
    kernels.swap_blocks(device, host, OUT, backend=backend)
    if device[0].is_cuda:
        torch.cuda.synchronize()
    for before, after, orig_dev in zip(original_host, host, original_device):
        for src, dst in OUT:
            assert _same_bits(after[dst], orig_dev[src])
        untouched = [b for b in range(HOST_BLOCKS) if b not in {d for _, d in OUT}]
        assert _same_bits(after[untouched], before[untouched])
    for cache in device:
        cache[[src for src, _ in OUT]] = float("nan")
    kernels.swap_blocks(host, device, torch.tensor(IN), backend=backend)
    if device[0].is_cuda:
        torch.cuda.synchronize()
    moved = {dst: OUT[i][0] for i, (_, dst) in enumerate(IN)}  # device block -> where its data started
    for orig, after in zip(original_device, device):
        for dst, src in moved.items():
            assert _same_bits(after[dst], orig[src])
        untouched = [b for b in range(DEVICE_BLOCKS) if b not in moved and b not in {s for s, _ in OUT}]
        assert _same_bits(after[untouched], orig[untouched])


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_swap_out_and_back_in_is_bit_exact(backend: str, dtype: torch.dtype, block_size: int) -> None:
    gen = torch.Generator().manual_seed(block_size)
    device, host = _pool(DEVICE_BLOCKS, dtype, block_size, gen), _pool(HOST_BLOCKS, dtype, block_size, gen)
    _round_trip(backend, device, host)


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_an_empty_mapping_copies_nothing(backend: str) -> None:
    gen = torch.Generator().manual_seed(0)
    device, host = _pool(4, torch.float16, 16, gen), _pool(3, torch.float16, 16, gen)
    before = [c.clone() for c in host]
    kernels.swap_blocks(device, host, [], backend=backend)
    kernels.swap_blocks(device, host, torch.empty((0, 2), dtype=torch.int64), backend=backend)
    assert all(_same_bits(a, b) for a, b in zip(host, before))


def _bad_args(kind: str) -> tuple[list[torch.Tensor], list[torch.Tensor], Any]:
    """Two pools and a mapping with the defect `kind` names; "valid" has none."""
    gen = torch.Generator().manual_seed(0)
    src, dst = _pool(5, torch.float16, 16, gen), _pool(3, torch.float16, 16, gen)
    pairs: Any = {"mapping_dtype": torch.tensor([[0, 1]], dtype=torch.int32), "mapping_shape": [(0, 1, 2)],
                  "src_range": [(5, 0)], "dst_negative": [(0, -1)], "dst_range": [(0, 3)],
                  "dst_repeated": [(0, 1), (2, 1), (3, 0)]}.get(kind, [(0, 1)])
    if kind == "lengths":
        dst = dst[:3]
    elif kind == "empty":
        src, dst = [], []
    elif kind == "dtype":
        dst[1] = dst[1].float()
    elif kind == "block_shape":
        dst[2] = random_cache(3, 2, 64, 8, torch.float16)[1]
    elif kind == "layout":
        src[0], dst[0] = src[0].flatten(2), dst[0].flatten(2)
    elif kind == "pool":
        dst[3] = random_cache(4, 2, 64, 16, torch.float16)[1]
    elif kind == "overlap":
        dst = src
    return src, dst, pairs


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("lengths", "need one destination cache per source cache, and at least one, got 4 source and 3 destination"),
        ("empty", "got 0 source and 0 destination caches"),
        ("dtype", r"dst_caches\[1\] holds torch.float32 blocks of shape \(2, 8, 16, 8\) but src_caches\[1\] "
                  r"torch.float16"),
        ("block_shape", r"dst_caches\[2\] holds torch.float16 blocks of shape \(2, 64, 8\) but src_caches\[2\] "
                        r"torch.float16 blocks of shape \(2, 64, 16\)"),
        ("layout", r"src_caches\[0\] must be a key cache .* or a value cache .*, got shape \(5, 2, 1024\)"),
        ("pool", r"dst_caches form one pool and must hold the same number of blocks, got \[3, 3, 3, 4\]"),
        ("overlap", "overlap in memory"),
        ("mapping_dtype", r"block_mapping must be an int64 \[num_pairs, 2\] tensor .* got a torch.int32 tensor"),
        ("mapping_shape", r"block_mapping must be an int64 \[num_pairs, 2\] tensor .* of shape \(1, 3\)"),
        ("src_range", r"block_mapping source ids must be in \[0, 5\), got \[5\]"),
        ("dst_negative", r"block_mapping destination ids must be in \[0, 3\), got \[-1\]"),
        ("dst_range", r"block_mapping destination ids must be in \[0, 3\), got \[3\]"),
        ("dst_repeated", r"block_mapping writes destination block\(s\) \[1\] more than once"),
    ],
)
def test_bad_pools_and_mappings_are_refused_by_name(kind: str, message: str) -> None:
    src, dst, pairs = _bad_args(kind)
    before = [c.clone() for c in dst]
    with pytest.raises(ValueError, match=message):
        kernels.swap_blocks(src, dst, pairs)
    assert all(torch.equal(a, b) for a, b in zip(dst, before))


def test_a_mapping_off_the_cpu_is_refused() -> None:
    src, dst, _ = _bad_args("valid")
    with pytest.raises(ValueError, match="block_mapping must be on the CPU .* got it on meta"):
        kernels.swap_blocks(src, dst, torch.tensor([[0, 1]], device="meta"))


def test_backends_refuse_pools_they_cannot_serve() -> None:
    src, dst, pairs = _bad_args("valid")
    with pytest.raises(ValueError, match="backend='cuda' needs cuda tensors, got tensors on cpu"):
        kernels.swap_blocks(src, dst, pairs, backend="cuda")
    with pytest.raises(ValueError, match="block_size=12 is not supported by backend='emu'"):
        kernels.swap_blocks([random_cache(4, 2, 64, 12, torch.float16)[0]],
                            [random_cache(4, 2, 64, 12, torch.float16)[0]], pairs, backend="emu")


@pytest.mark.parametrize("backend", [pytest.param("cpu", marks=_needs_compiler),
                                     pytest.param("emu", marks=_needs_compiler)])
def test_native_backends_refuse_a_strided_pool(backend: str) -> None:
    """They copy whole blocks where they lie; the torch backend takes any layout."""
    src, dst, pairs = _bad_args("valid")
    wide = random_cache(3, 4, 64, 16, torch.float16)[1]
    dst[2] = wide[:, :2]
    with pytest.raises(ValueError, match=r"dst_caches\[2\] must be contiguous"):
        kernels.swap_blocks(src, dst, pairs, backend=backend)
    kernels.swap_blocks(src, dst, pairs)
    assert torch.equal(dst[2][1], src[2][0])


# ---- the cuda backend against the recording fake driver (see tests/test_cuda_driver.py)


@pytest.fixture(scope="module")
def swaps(tmp_path_factory: pytest.TempPathFactory) -> fake_driver.Run:
    """scenario.py's `swaps` cases, run in one subprocess on the fake driver."""
    driver_dir = fake_driver.build_or_skip(tmp_path_factory.mktemp("fake_driver"))
    return fake_driver.run_scenario("swaps", tmp_path_factory.mktemp("swaps"), driver_dir)


def _memcpys(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [c for c in calls if c["call"] == "cuMemcpyAsync"]


@pytest.mark.parametrize(("dtype", "element_size"), [("float32", 4), ("float16", 2), ("bfloat16", 2)])
def test_driver_gets_one_async_copy_per_cache_and_pair(swaps: fake_driver.Run, dtype: str, element_size: int) -> None:
    r, calls = swaps.results[f"swap-{dtype}"], swaps.calls[f"swap-{dtype}"]
    assert "error" not in r, r["error"]
    block_bytes = 2 * 64 * 16 * element_size  # kv heads * head size * block size
    assert r["block_bytes"] == [block_bytes] * 4  # two layers' K, then their V
    expected = [(dst + d * block_bytes, src + s * block_bytes, block_bytes)
                for src, dst in zip(r["src"], r["dst"]) for s, d in r["pairs"]]
    copies = _memcpys(calls)
    assert len(copies) == len(r["src"]) * len(r["pairs"])
    assert [(c["dst"], c["src"], c["bytes"]) for c in copies] == expected
    for copy in copies:
        assert (copy["stream"], copy["special_stream"], copy["device"], copy["status"]) == (r["stream"], -1, 0, 0)
    assert not [c for c in calls if c["call"].startswith("cuLaunch")]
    assert r["copied"], "the fake driver's copies moved other bytes than swap_blocks names"


def test_driver_sees_no_copy_from_a_pageable_host_pool(swaps: fake_driver.Run) -> None:
    result, calls = swaps.results["swap-pageable"], swaps.calls["swap-pageable"]
    assert result["error"].startswith("ValueError: dst_caches[0] is in pageable host memory"), result
    assert "pin_memory=True" in result["error"]
    assert not _memcpys(calls)


# ---- a real GPU


@_needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "torch"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_swap_to_pinned_host_and_back_is_bit_exact(backend: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    device = _pool(DEVICE_BLOCKS, dtype, 16, gen, device="cuda")
    host = [c.pin_memory() for c in _pool(HOST_BLOCKS, dtype, 16, gen)]
    _round_trip(backend, device, host)


@_needs_gpu
@pytest.mark.gpu
def test_gpu_swap_within_the_device_is_bit_exact() -> None:
    gen = torch.Generator().manual_seed(2)
    device = _pool(DEVICE_BLOCKS, torch.float16, 16, gen, device="cuda")
    other = _pool(HOST_BLOCKS, torch.float16, 16, gen, device="cuda")
    _round_trip("cuda", device, other)


@_needs_gpu
@pytest.mark.gpu
def test_gpu_swap_refuses_a_pageable_host_pool() -> None:
    gen = torch.Generator().manual_seed(3)
    device, host = _pool(4, torch.float16, 16, gen, device="cuda"), _pool(3, torch.float16, 16, gen)
    with pytest.raises(ValueError, match=r"dst_caches\[0\] is in pageable host memory.*pin_memory=True"):
        kernels.swap_blocks(device, host, [(0, 1)], backend="cuda")
