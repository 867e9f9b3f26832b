"""The host side of the CUDA path, executed against a recording fake libcuda.so.1 (`tests/fake_driver`):
NVRTC's cubins loaded by cuda.core, kernels resolved by their lowered names, the launch geometry,
shared memory and every argument's bytes as the driver receives them, the stream, the current
context, and the errors a user sees for a missing or too old driver (a swap's copies are checked in
test_kernels_swap.py). Runs on machines without a GPU; `pytest -k driver` selects it.
"""

from __future__ import annotations

import ctypes
import math
import struct
from pathlib import Path
from typing import Any

import pytest

from paged.kernels.split_plan import plan_splits
from paged.kernels.testing import attention_grid, default_partition_grid
from paged.kernels.toolchain.specs import group_tile
from paged.kernels.v3_layout import DeviceLimits, hardware, v3_shared_memory, v3_stages
from tests import fake_driver
from tests.fake_driver.scenario import LONG_V3_CASES, PREFILL_CASES, SMEM_CASE, V3_CASES

pytestmark = pytest.mark.compiles

NUM_THREADS = 128
# What fake_libcuda.c reports: an H100's SMs, shared memory, threads and registers per SM.
FAKE_LIMITS = DeviceLimits(132, 228 * 1024, 2048, 65536)
DEFAULT_SMEM = 48 * 1024
ELEMENT_SIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


@pytest.fixture(scope="module")
def driver_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fake_driver.build_or_skip(tmp_path_factory.mktemp("fake_driver"))


@pytest.fixture(scope="module")
def launches(driver_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> fake_driver.Run:
    """Every case of scenario.py's `launches`, run once in one subprocess with two fake devices."""
    return fake_driver.run_scenario("launches", tmp_path_factory.mktemp("launches"), driver_dir, devices="2")


def _case(run: fake_driver.Run, case: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    result = run.results[case]
    assert "error" not in result, result["error"]
    return result, run.calls[case]


def _launched(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [c for c in calls if c["call"] == "cuLaunchKernel"]


def _decode(launch: dict[str, Any]) -> list[tuple[int, int | float]]:
    """(size, value) of each argument as the driver read it with the cubin's parameter sizes;
    4-byte values are returned both ways by the expectation helpers below."""
    out = []
    for hexed in launch["args"]:
        raw = bytes.fromhex(hexed)
        out.append((len(raw), int.from_bytes(raw, "little", signed=len(raw) == 4)))
    return out


def _f32(value: float) -> int:
    return struct.unpack("<i", struct.pack("<f", value))[0]


def _ptr(value: int) -> tuple[int, int]:
    return (8, value)


def _i32(value: int) -> tuple[int, int]:
    return (4, value)


def _check_common_launch(launch: dict[str, Any], name: str, grid: tuple[int, int, int], block: int, smem: int,
                         stream: int, device: int = 0) -> None:
    assert launch["status"] == 0, launch
    assert launch["name"] == name
    assert tuple(launch["grid"]) == grid
    assert tuple(launch["block"]) == (block, 1, 1)
    assert launch["smem"] == smem
    assert launch["stream"] == stream and launch["special_stream"] == -1
    assert launch["device"] == device


ATTENTION = [(c, v) for c in attention_grid() + default_partition_grid() for v in ("v1", "v2")]


@pytest.mark.parametrize(("case", "version"), ATTENTION, ids=[f"{v}-{c.id}" for c, v in ATTENTION])
def test_driver_receives_the_attention_launch_plan(launches: fake_driver.Run, case: Any, version: str) -> None:
    r, calls = _case(launches, f"attention-{version}-{case.id}")
    _check_attention(case, version, r, calls, q_ptr=r["query"], q_stride=r["q_stride"])


def _check_attention(case: Any, version: str, r: dict[str, Any], calls: list[dict[str, Any]], *, q_ptr: int,
                     q_stride: int) -> None:
    if version == "v3":
        _check_v3(case, r, calls)
        return
    lookups = [c for c in calls if c["call"] == "cuLibraryGetKernel"]
    assert all(c["found"] for c in lookups) and {c["name"] for c in lookups} <= set(r["names"])
    launched = _launched(calls)
    assert [c["name"] for c in launched] == r["names"]
    num_seqs, head, block = len(case.seq_lens), case.head_size, case.block_size
    max_seq_len, window = r["max_seq_len"], r["sliding_window"]
    # The cross-warp output buffer reuses the logits' shared memory: NUM_WARPS / 2 rows of fp32.
    outputs_smem = NUM_THREADS // 32 // 2 * head * 4
    kv_block_stride, kv_head_stride = case.num_kv_heads * head * block, head * block
    common = [_ptr(q_ptr), _ptr(r["key_cache"]), _ptr(r["value_cache"]), _i32(case.num_kv_heads),
              _i32(_f32(r["scale"])), _ptr(r["block_tables"]), _ptr(r["seq_lens"]), _i32(r["max_blocks"]),
              _i32(q_stride), _i32(kv_block_stride), _i32(kv_head_stride), _i32(window),
              *map(_ptr, r["features"]), *map(_i32, r["sparse"])]
    if version == "v1":
        (launch,) = launched
        smem = max(math.ceil(_span(max_seq_len, window, block) / block) * block * 4, outputs_smem)
        _check_common_launch(launch, r["names"][0], (case.num_heads, num_seqs, 1), NUM_THREADS, smem, r["stream"])
        assert _decode(launch) == [_ptr(r["out"]), *common]
        return
    main, reduce = launched
    partitions = math.ceil(_span(max_seq_len, window, case.partition_size) / case.partition_size)
    _check_common_launch(main, r["names"][0], (case.num_heads, num_seqs, partitions), NUM_THREADS,
                         max(case.partition_size * 4, outputs_smem), r["stream"])
    _check_common_launch(reduce, r["names"][1], (case.num_heads, num_seqs, 1), NUM_THREADS, partitions * 4,
                         r["stream"])
    main_args, reduce_args = _decode(main), _decode(reduce)
    scratch = main_args[:3]  # exp_sums, max_logits, tmp_out: allocated by the plan
    assert all(size == 8 and ptr for size, ptr in scratch) and len({p for _, p in scratch}) == 3
    assert main_args[3:] == common
    assert reduce_args == [_ptr(r["out"]), *scratch, _ptr(r["seq_lens"]), _i32(partitions), _i32(window)]


@pytest.mark.parametrize("case", V3_CASES, ids=[c.id for c in V3_CASES])
def test_driver_receives_the_v3_launch_plan(launches: fake_driver.Run, case: Any) -> None:
    r, calls = _case(launches, f"attention-v3-{case.id}")
    smem = _check_v3(case, r, calls)
    # each case's kernel is launched here for the first time: it opts in past 48 KB
    opt_ins = [(c["attr"], c["value"]) for c in calls if c["call"] == "cuKernelSetAttribute"]
    assert opt_ins == ([(8, smem)] if smem > DEFAULT_SMEM else [])


def test_v3_rows_that_leave_the_device_idle_are_split_and_merged(launches: fake_driver.Run) -> None:
    """The long rows of the partition grid (4 sequences x 2 KV heads, 1100 tokens) fill 8 CTAs
    without splits; the plan splits them, and a merge launch follows the main one."""
    case = default_partition_grid()[0]
    _, calls = _case(launches, f"attention-v3-{case.id}")
    main, merge = _launched(calls)
    assert main["grid"][2] > 1 and tuple(merge["grid"]) == (case.num_heads, len(case.seq_lens), 1)


@pytest.mark.parametrize(("case", "splits"), list(zip(LONG_V3_CASES, (64, 64))), ids=["1x16384", "1x4096"])
def test_one_long_sequence_is_split_over_every_sm_of_an_h200_shaped_device(launches: fake_driver.Run, case: Any,
                                                                          splits: int) -> None:
    """1x16384 and 1x4096 of a GQA-8 model: 8 KV heads x 64 splits = 512 CTAs, of the 528 that 132
    SMs hold at 4 each (53.75 KB of shared memory, 110 registers a thread), so every SM runs 3 or
    4 (1x4096's splits are 64 tokens, 32 KB of K/V: a 256-token floor gave 128 CTAs); the merge
    then reads 64 partials per (head, sequence)."""
    r, calls = _case(launches, f"attention-v3-1x{case.seq_lens[0]}-{case.id}")
    _check_v3(case, r, calls)
    main, merge = _launched(calls)
    assert tuple(main["grid"]) == (8, 1, splits) and tuple(merge["grid"]) == (64, 1, 1)
    split_blocks = _decode(main)[16][1]  # after the 16 pointers, sizes and strides up to the window
    assert split_blocks * splits * 16 == case.seq_lens[0]
    slots = hardware(FAKE_LIMITS, v3_shared_memory(2, 128, 8, 3))
    assert (slots.processors, slots.slots) == (132, 4) and 132 * 3 <= 8 * splits <= 132 * 4


def _check_v3(case: Any, r: dict[str, Any], calls: list[dict[str, Any]]) -> int:
    """One CTA per (KV head x head chunk, sequence, split) with the plan's arguments; the merge only
    with splits. Returns the main kernel's dynamic shared memory."""
    launched = _launched(calls)
    num_seqs, head, block = len(case.seq_lens), case.head_size, case.block_size
    group = case.num_heads // case.num_kv_heads
    tile = group_tile(group)
    ctas = case.num_kv_heads * -(-group // tile)
    window = r["sliding_window"]
    element = 1 if "fp8" in r["kernels"][0] else ELEMENT_SIZE[str(case.dtype).removeprefix("torch.")]
    smem = v3_shared_memory(element, head, tile, v3_stages(FAKE_LIMITS, element, head, tile))
    # the plan reads the cache's bytes: its splits' K/V and its tiles' shared memory
    plan = plan_splits(num_seqs, ctas, r["max_seq_len"], block, hardware(FAKE_LIMITS, smem),
                       sliding_window=window or None, kv_bytes_per_token=2 * head * element)
    main = launched[0]
    _check_common_launch(main, r["names"][0], (ctas, num_seqs, plan.num_splits), NUM_THREADS, smem, r["stream"])
    args = _decode(main)
    scratch = args[1:3]
    kv_block_stride, kv_head_stride = case.num_kv_heads * head * block, head * block
    assert args[0] == _ptr(r["out"])
    assert args[3:] == [
        _ptr(r["query"]), _ptr(r["key_cache"]), _ptr(r["value_cache"]), _i32(case.num_heads),
        _i32(case.num_kv_heads), _i32(_f32(r["scale"])), _ptr(r["block_tables"]), _ptr(r["seq_lens"]),
        _i32(r["max_blocks"]), _i32(r["q_stride"]), _i32(kv_block_stride), _i32(kv_head_stride), _i32(window),
        _i32(plan.split_blocks), _i32(plan.num_splits), *map(_ptr, r["features"]), *map(_i32, r["sparse"]),
    ]
    if plan.num_splits == 1:
        assert len(launched) == 1 and scratch == [_ptr(0), _ptr(0)]
        return smem
    assert all(ptr for _, ptr in scratch) and scratch[0] != scratch[1]
    (merge,) = launched[1:]
    _check_common_launch(merge, r["names"][1], (case.num_heads, num_seqs, 1), NUM_THREADS, 0, r["stream"])
    assert _decode(merge) == [_ptr(r["out"]), *scratch, _ptr(r["seq_lens"]), _i32(block), _i32(plan.split_blocks),
                              _i32(plan.num_splits), _i32(window)]
    return smem


def _span(max_seq_len: int, window: int, align: int) -> int:
    """Positions the kernels cover: a window's start lies at most `align - 1` past the `align`
    boundary they start from."""
    return min(max_seq_len, window + align - 1) if window else max_seq_len


@pytest.mark.parametrize("version", ["v1", "v2", "v3"])
def test_driver_gets_the_window_and_a_grid_that_covers_only_it(launches: fake_driver.Run, version: str) -> None:
    case = attention_grid()[0]
    r, calls = _case(launches, f"window-{version}-{case.id}")
    assert 0 < r["sliding_window"] < r["max_seq_len"]
    _check_attention(case, version, r, calls, q_ptr=r["query"], q_stride=r["q_stride"])
    if version == "v2":
        partitions = _launched(calls)[0]["grid"][2]
        assert partitions < math.ceil(r["max_seq_len"] / case.partition_size)


@pytest.mark.parametrize("version", ["v1", "v2", "v3"])
def test_driver_gets_fp8_scales_alibi_slopes_and_the_sparse_pattern(launches: fake_driver.Run, version: str) -> None:
    case = attention_grid()[0]
    r, calls = _case(launches, f"features-{version}-{case.id}")
    assert all(r["features"]) and r["sparse"][2] == 3 and "__nv_fp8_e4m3" in r["kernels"][0]
    _check_attention(case, version, r, calls, q_ptr=r["query"], q_stride=r["q_stride"])


def test_driver_gets_an_fp8_cache_write_with_its_scales(launches: fake_driver.Run) -> None:
    r, calls = _case(launches, "cache-fp8")
    assert all(r["scales"]) and r["x"] == 16
    assert r["kernels"] == ["paged::reshape_and_cache_kernel<__half, __nv_fp8_e5m2>",
                            "paged::copy_blocks_kernel<__nv_fp8_e5m2>", "paged::move_slots_kernel<__nv_fp8_e5m2>"]
    _check_cache_ops(r, calls)


def test_driver_gets_a_fused_qkv_query_as_it_is(launches: fake_driver.Run) -> None:
    case = attention_grid()[0]
    r, calls = _case(launches, f"query-fused-{case.id}")
    width = (case.num_heads + 2 * case.num_kv_heads) * case.head_size
    assert r["q_stride"] == width
    _check_attention(case, "v2", r, calls, q_ptr=r["query"], q_stride=width)


def test_driver_gets_an_aligned_copy_of_a_misaligned_query(launches: fake_driver.Run) -> None:
    case = attention_grid()[0]
    r, calls = _case(launches, f"query-misaligned-{case.id}")
    assert r["query"] % 16, "the scenario should have produced a misaligned query"
    (size, q_ptr) = _decode(_launched(calls)[0])[3]
    assert size == 8 and q_ptr != r["query"] and q_ptr % 16 == 0
    _check_attention(case, "v2", r, calls, q_ptr=q_ptr, q_stride=case.num_heads * case.head_size)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_driver_receives_the_cache_op_launch_plans(launches: fake_driver.Run, dtype: str) -> None:
    r, calls = _case(launches, f"cache-{dtype}")
    _check_cache_ops(r, calls)


def _check_cache_ops(r: dict[str, Any], calls: list[dict[str, Any]], device: int = 0) -> None:
    write, copy = _launched(calls)
    heads, head = r["heads"], r["head"]
    _check_common_launch(write, r["names"][0], (r["num_tokens"], 1, 1), min(heads * head, 512), 0, r["stream"], device)
    assert _decode(write) == [
        _ptr(r["key"]), _ptr(r["value"]), _ptr(r["key_cache"]), _ptr(r["value_cache"]), _ptr(r["slots"]),
        _i32(r["key_stride"]), _i32(r["value_stride"]), _i32(heads), _i32(head), _i32(r["block"]), _i32(r["x"]),
        *map(_ptr, r["scales"]),
    ]
    assert r["key_stride"] == r["value_stride"] == 4 * heads * head  # rows of the fused QKV, not copies
    numel = r["numel_per_block"]
    _check_common_launch(copy, r["names"][1], (r["layers"], r["pairs"], 1), min(numel, 1024), 0, r["stream"], device)
    pointers = _decode(copy)
    assert [size for size, _ in pointers] == [8, 8, 8, 4] and pointers[3] == _i32(numel)


@pytest.mark.parametrize("regime", ["default-below", "default-above", "optin-below", "optin-above"])
def test_driver_sees_shared_memory_opted_in_exactly_when_needed(launches: fake_driver.Run, regime: str) -> None:
    """Cases run in this order on one kernel, whose opt-in limit only rises."""
    (case_id,) = [c for c in launches.results if c.startswith(f"smem-{regime}-")]
    r, calls = launches.results[case_id], launches.calls[case_id]
    dynamic = int(case_id.rsplit("-", 1)[1])
    opt_ins = [(c["attr"], c["value"], c["status"]) for c in calls if c["call"] == "cuKernelSetAttribute"]
    if regime == "optin-above":
        assert "ValueError" in r["error"] and str(dynamic) in r["error"] and "version='v2'" in r["error"]
        assert not _launched(calls) and not opt_ins
        return
    assert r["static_smem"] > 0, "ptxas reports static shared memory for this kernel"
    _check_attention(SMEM_CASE, "v1", r, calls, q_ptr=r["query"], q_stride=r["q_stride"])
    needs_opt_in = dynamic + r["static_smem"] > DEFAULT_SMEM
    assert needs_opt_in == (regime != "default-below")
    assert opt_ins == ([(8, dynamic, 0)] if needs_opt_in else [])


def _prefill_tiles(element: int, cache: int, head: int) -> tuple[int, int, int]:
    """(rows per CTA, keys per K/V tile, K/V buffers) of prefill.cuh's `PrefillTiles` for activations
    and cache elements of these sizes, written out independently of the launch plan: 16-bit types up
    to head 128 hold two m16 row tiles per warp (64 keys a tile up to head 64), the rest one (32
    keys); two buffers where they fit in 96 KB."""
    wide = element == 2 and head <= 128
    rows, keys = (128, 64 if head <= 64 else 32) if wide else (64, 32)
    return rows, keys, 2 if _prefill_smem(element, cache, head, rows, keys, 2) <= 96 * 1024 else 1


def _prefill_smem(element: int, cache: int, head: int, rows: int, keys: int, stages: int) -> int:
    """The Q tile, then per stage a K and a Vᵀ tile in cache elements, rows padded by 16 bytes."""
    kv_pad = 16 // cache
    stage = (keys * (head + kv_pad) + head * (keys + kv_pad)) * cache
    return rows * (head + 16 // element) * element + stages * stage


@pytest.mark.parametrize("features", [False, True], ids=["plain", "features"])
@pytest.mark.parametrize(("case", "q_lens"), PREFILL_CASES, ids=[c.id for c, _ in PREFILL_CASES])
def test_driver_receives_the_prefill_launch_plan(launches: fake_driver.Run, case: Any, q_lens: tuple[int, ...],
                                                 features: bool) -> None:
    """One launch for the batch: a CTA per 64 or 128 (query, head) rows of a sequence and KV head."""
    if features and case is not PREFILL_CASES[0][0]:
        pytest.skip("the features run on the first case")
    r, calls = _case(launches, f"prefill-{'features-' * features}{case.id}")
    (launch,) = _launched(calls)
    dtype = str(case.dtype).removeprefix("torch.")
    head, block, group = case.head_size, case.block_size, case.num_heads // case.num_kv_heads
    element = ELEMENT_SIZE[dtype]
    cache = 1 if features else element  # the features run with an fp8 cache
    rows, keys, stages = _prefill_tiles(element, cache, head)
    smem = _prefill_smem(element, cache, head, rows, keys, stages)
    grid = (math.ceil(max(q_lens) * group / rows), case.num_kv_heads, len(q_lens))
    _check_common_launch(launch, r["names"][0], grid, NUM_THREADS, smem, r["stream"])
    assert _decode(launch) == [
        _ptr(r["out"]), _ptr(r["query"]), _ptr(r["key_cache"]), _ptr(r["value_cache"]), _i32(case.num_heads),
        _i32(case.num_kv_heads), _i32(_f32(r["scale"])), _ptr(r["block_tables"]), _ptr(r["seq_lens"]),
        _ptr(r["query_start_loc"]), _i32(r["max_blocks"]), _i32(case.num_heads * head),
        _i32(case.num_kv_heads * head * block), _i32(head * block), _i32(r["sliding_window"]),
        *map(_ptr, r["features"]), *map(_i32, r["sparse"]),
    ]
    opt_ins = [(c["attr"], c["value"]) for c in calls if c["call"] == "cuKernelSetAttribute"]
    assert opt_ins == ([(8, smem)] if smem > DEFAULT_SMEM else [])


def test_driver_rejects_bad_caches_before_any_launch(launches: fake_driver.Run) -> None:
    expected = {
        "strided_cache": "key_cache must be contiguous",
        "misaligned_cache": "not 16-byte aligned",
        "overlapping_caches": "key_cache and value_cache overlap in memory",
    }
    for kind, message in expected.items():
        result, calls = launches.results[f"bad-{kind}"], launches.calls[f"bad-{kind}"]
        assert result["error"].startswith("ValueError") and message in result["error"], result
        assert not _launched(calls)


def test_a_plan_whose_arguments_do_not_fit_the_kernel_is_refused_before_the_driver(launches: fake_driver.Run) -> None:
    """The first launch of a kernel checks the plan's argument sizes against the cubin's (later ones
    reuse its packed parameter block); a refused plan leaves the kernel to launch rightly after."""
    r, calls = _case(launches, "mistyped-plan")
    assert r["error_message"] is not None and "passes arguments of (4, 8, 8, 4) bytes" in r["error_message"]
    assert "the kernel takes (8, 8, 8, 4)" in r["error_message"]
    (launch,) = _launched(calls)
    assert [size for size, _ in _decode(launch)] == [8, 8, 8, 4]


def test_driver_launches_on_the_stream_the_source_names(launches: fake_driver.Run) -> None:
    r, calls = _case(launches, "streams-follow-the-source")
    first, second = r["streams"]
    assert first != second
    assert [c["stream"] for c in _launched(calls)] == [first, first, second, second]


def test_driver_launch_on_another_device_restores_the_current_context(launches: fake_driver.Run) -> None:
    r, calls = _case(launches, "device-1-from-device-0")
    _check_cache_ops(r, calls, device=1)
    assert r["current_before"] == 0 and r["current_after"] == 0


def test_driver_scenario_raised_no_deprecation(launches: fake_driver.Run) -> None:
    # scenario.py turns DeprecationWarning into errors: launching on an unwrapped foreign stream
    # (what torch's stream is to cuda.core) would have failed every case above.
    assert "DeprecationWarning" not in launches.stderr


def test_driver_too_old_for_the_cubins_gets_a_clear_error(driver_dir: Path, tmp_path: Path) -> None:
    run = fake_driver.run_scenario("init", tmp_path, driver_dir, driver_version="12080")
    error = run.results["start"]["error"]
    assert error.startswith("CudaDriverError") and "supports CUDA 12.8" in error
    assert "R580" in error and "nvidia-cuda-nvrtc" in error and "cuda-python" in error
    assert not [c for c in run.calls[""] + run.calls["start"] if c["call"] == "cuLibraryLoadData"]


def test_driver_for_a_device_nvrtc_cannot_target_gets_a_clear_error(driver_dir: Path, tmp_path: Path) -> None:
    run = fake_driver.run_scenario("init", tmp_path, driver_dir, cc="52")
    error = run.results["start"]["error"]
    assert "sm_52" in error and "nvidia-cuda-nvrtc" in error


def test_driver_that_is_current_enough_starts_a_runner(driver_dir: Path, tmp_path: Path) -> None:
    run = fake_driver.run_scenario("init", tmp_path, driver_dir, cc="80", smem_optin="166912")
    assert run.results["start"] == {"arch": "sm_80", "max_shared_memory": 166912}


def test_no_driver_at_all_gets_a_clear_error(tmp_path: Path) -> None:
    try:
        ctypes.CDLL("libcuda.so.1")
        pytest.skip("this machine has an NVIDIA driver")
    except OSError:
        pass
    if fake_driver.nvrtc_missing():
        pytest.skip("NVRTC is not installed")
    run = fake_driver.run_scenario("init", tmp_path, None)
    error = run.results["start"]["error"]
    assert error.startswith("CudaDriverError") and "libcuda.so.1" in error and "cuda-python" in error

