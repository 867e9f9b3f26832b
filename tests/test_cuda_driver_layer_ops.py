"""A decode step of a small Llama model with the fused CUDA layer ops, on the recording fake
libcuda.so.1 (`tests/fake_driver/layer_scenario.py`): the kernels each layer launches, in order,
with their grids and blocks, and every layer-op launch's arguments as the driver receives them,
derived here from the tensors the ops were given rather than from the launch plan.

Per decode layer, besides the GEMMs (cuBLAS, never seen by the driver): RoPE, the cache write,
attention (v1: one kernel, v2: two), add + RMSNorm, SiLU-and-mul, add + RMSNorm: 6 launches with
v1, 7 with v2, plus one RMSNorm per step before the first layer.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from paged.kernels.toolchain.specs import NUM_THREADS, layer_kernel
from tests import fake_driver
from tests.fake_driver.layer_scenario import ARCH, PARTITION, SEQ_LENS
from tests.test_cuda_driver import _check_common_launch, _decode, _f32, _i32, _launched, _ptr

pytestmark = pytest.mark.compiles

CXX = {"float16": "__half", "float32": "float"}
ELEMENT_SIZE = {"float16": 2, "float32": 4}
CASES = [(version, dtype) for version in ("v1", "v2") for dtype in ("float16", "float32")]
LAUNCHES_PER_LAYER = {"v1": 6, "v2": 7}


@pytest.fixture(scope="module")
def layer_run(tmp_path_factory: pytest.TempPathFactory) -> fake_driver.Run:
    driver_dir = fake_driver.build_or_skip(tmp_path_factory.mktemp("fake_driver"))
    return fake_driver.run_scenario("layer", tmp_path_factory.mktemp("layer"), driver_dir)


def _warps(threads: int, limit: int) -> int:
    return min(math.ceil(threads / 32) * 32, limit)


def _row_block(width: int, dtype: str) -> int:
    """A thread per 16-byte vector of a row (the model's rows are aligned), whole warps, at most 1024."""
    return _warps(width * ELEMENT_SIZE[dtype] // 16, 1024)


def _expected_layer(version: str, dtype: str) -> list[tuple[str, tuple[int, int, int], int]]:
    """(kernel, grid, block) of one decode layer's launches."""
    t, rows = CXX[dtype], len(SEQ_LENS)
    heads, kv_heads, head = ARCH["num_heads"], ARCH["num_kv_heads"], ARCH["head_dim"]
    row = (rows, 1, 1)
    if version == "v1":
        attention = [(f"paged::paged_attention_v1_kernel<{t}, {t}, {head}, 16, {NUM_THREADS}, false>",
                      (heads, rows, 1), NUM_THREADS)]
    else:
        partitions = math.ceil(max(SEQ_LENS) / PARTITION)
        attention = [
            (f"paged::paged_attention_v2_kernel<{t}, {t}, {head}, 16, {NUM_THREADS}, {PARTITION}, false>",
             (heads, rows, partitions), NUM_THREADS),
            (f"paged::paged_attention_v2_reduce_kernel<{t}, {head}, {NUM_THREADS}, {PARTITION}>", (heads, rows, 1),
             NUM_THREADS),
        ]
    norm = (layer_kernel(t, "add_rms_norm", True), row, _row_block(ARCH["hidden_size"], dtype))
    return [
        (layer_kernel(t, "rotary_embedding"), row, _warps((heads + kv_heads) * head // 2, 512)),
        (f"paged::reshape_and_cache_kernel<{t}, {t}>", row, min(kv_heads * head, 512)),
        *attention,
        norm,
        (layer_kernel(t, "silu_and_mul", True), row, _row_block(ARCH["intermediate_size"], dtype)),
        norm,
    ]


def _case(run: fake_driver.Run, version: str, dtype: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    result = run.results[f"decode-{version}-{dtype}"]
    assert "error" not in result, result["error"]
    return result, _launched(run.calls[f"decode-{version}-{dtype}"])


@pytest.mark.parametrize(("version", "dtype"), CASES)
def test_each_decode_layer_launches_the_fused_ops_around_attention(layer_run: fake_driver.Run, version: str,
                                                                   dtype: str) -> None:
    r, launched = _case(layer_run, version, dtype)
    per_layer = _expected_layer(version, dtype)
    assert len(per_layer) == LAUNCHES_PER_LAYER[version]
    first = (layer_kernel(CXX[dtype], "rms_norm", True), (len(SEQ_LENS), 1, 1),
             _row_block(ARCH["hidden_size"], dtype))
    expected = [first, *per_layer * r["layers"]]
    assert [(c["name"], tuple(c["grid"]), c["block"][0]) for c in launched] == [
        (r["names"][kernel], grid, block) for kernel, grid, block in expected]
    assert all(c["status"] == 0 and c["stream"] == r["stream"] for c in launched)


def _expected_args(call: dict[str, Any]) -> list[tuple[int, int]]:
    """The kernel's parameters (kernels_cu/layer_ops.cuh) from what the op was given."""
    op = call["op"]
    if op == "rms_norm":
        return [_ptr(call["out"]), _ptr(call["x"]), _ptr(call["weight"]), _i32(call["out_stride"]),
                _i32(call["x_stride"]), _i32(call["width"]), _i32(_f32(call["eps"]))]
    if op == "add_rms_norm":
        return [_ptr(call["x"]), _ptr(call["residual"]), _ptr(call["weight"]), _i32(call["x_stride"]),
                _i32(call["residual_stride"]), _i32(call["width"]), _i32(_f32(call["eps"]))]
    if op == "silu_and_mul":
        return [_ptr(call["out"]), _ptr(call["x"]), _i32(call["out_stride"]), _i32(call["x_stride"]),
                _i32(call["width"])]
    return [_ptr(call["qk"]), _ptr(call["positions"]), _ptr(call["cos"]), _ptr(call["sin"]),
            _i32(call["row_stride"]), _i32(call["num_heads"]), _i32(call["head_dim"])]


@pytest.mark.parametrize(("version", "dtype"), CASES)
def test_layer_op_launches_get_the_arguments_of_their_tensors(layer_run: fake_driver.Run, version: str,
                                                              dtype: str) -> None:
    r, launched = _case(layer_run, version, dtype)
    layer_ops = {r["names"][k]: k for k in r["names"] if "attention" not in k and "cache" not in k}
    op_launches = [c for c in launched if c["name"] in layer_ops]
    calls = r["calls"]
    assert [c["op"] for c in calls] == ["rms_norm"] + ["rotary_embedding", "add_rms_norm", "silu_and_mul",
                                                       "add_rms_norm"] * r["layers"]
    assert len(op_launches) == len(calls)
    for launch, call in zip(op_launches, calls, strict=True):
        kernel = layer_ops[launch["name"]]
        assert f"paged::{call['op']}_kernel<" in kernel
        _check_common_launch(launch, launch["name"], (call["rows"], 1, 1), launch["block"][0], 0, r["stream"])
        assert _decode(launch) == _expected_args(call)
    # the fused qkv output, rotated where it lies: rows of q, k and v heads
    rope = next(c for c in calls if c["op"] == "rotary_embedding")
    assert rope["row_stride"] == (ARCH["num_heads"] + 2 * ARCH["num_kv_heads"]) * ARCH["head_dim"]


@pytest.mark.parametrize(("version", "dtype"), CASES)
def test_later_layers_write_and_attend_with_their_own_tensors(layer_run: fake_driver.Run, version: str,
                                                              dtype: str) -> None:
    """The later layers run the first layer's cache write and attention launches, packed once, in one
    bound call (`paged.kernels.planned.WriteThenAttend`): each launch's arguments as the driver reads
    them are the first layer's with that layer's addresses in place of the first's, nothing else."""
    r, launched = _case(layer_run, version, dtype)
    assert r["joined"]
    kernels = {lowered for kernel, lowered in r["names"].items() if "attention" in kernel or "cache" in kernel}
    attention = [c for c in launched if c["name"] in kernels]
    per_layer = len(attention) // r["layers"]
    assert per_layer == LAUNCHES_PER_LAYER[version] - 4  # the cache write and attention's kernels
    first, tensors = attention[:per_layer], r["tensors"]
    for layer in range(1, r["layers"]):
        ours = tensors[layer]
        assert ours["key_cache"] != tensors[0]["key_cache"] and ours["value_cache"] != tensors[0]["value_cache"]
        swapped = {tensors[0][role]: address for role, address in ours.items()}
        launches = attention[layer * per_layer : (layer + 1) * per_layer]
        for launch, planned in zip(launches, first, strict=True):
            assert launch["name"] == planned["name"] and launch["grid"] == planned["grid"]
            assert _decode(launch) == [(size, swapped.get(value, value) if size == 8 else value)
                                       for size, value in _decode(planned)]
        pointers = {value for launch in launches for size, value in _decode(launch) if size == 8}
        assert set(ours.values()) <= pointers
