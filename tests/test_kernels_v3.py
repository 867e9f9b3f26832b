"""kernels_cu/decode_v3.cuh on the emulator against the float64 reference of the prefill tests
(a decode row is a one-query prefill): GQA groups 1-16 (head chunks past 8), every head size,
block sizes 8-32, contexts 1-16K, fp8 caches with per-head scales, ALiBi, sliding windows and
block-sparse patterns; forced split counts; stale table entries before the window; and the split
planner's refusals.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from paged import kernels
from paged.kernels.backends import cpu as cpu_backend
from paged.kernels.backends.emu import BACKEND as EMU
from paged.kernels.backends.interface import CacheView
from paged.kernels.backends.v3_plans import V3Workspace, check_workspace, v3_unit, v3_workspace
from paged.kernels.features import AttentionFeatures, alibi_slopes
from paged.kernels.ops import narrower_window
from paged.kernels.split_plan import MAX_SPLITS, MIN_SPLIT_BYTES, Hardware, SplitPlan, plan_splits
from paged.kernels.testing import tolerance
from paged.kernels.toolchain import host_compiler
from paged.kernels.v3_layout import (
    H100,
    MAX_STAGES,
    MIN_STAGES,
    DeviceLimits,
    base_stages,
    hardware,
    v3_shared_memory,
    v3_stages,
)
from tests.test_prefill_kernel import E4M3, E5M2, SPARSE, SPARSE_PER_KV_HEAD, Setting, feature_inputs, reference64

pytestmark = [
    pytest.mark.compiles,
    pytest.mark.skipif(host_compiler.unavailable_reason() is not None, reason="no host compiler"),
]

# (setting, context lengths): every head size and block size, GQA 1, 2, 3, 4, 5, 8 and 16.
SETTINGS = (
    (Setting("fp32-mha-h64", torch.float32, head=64, group=1), (1, 15, 17, 300)),
    (Setting("fp16-gqa8-h128", torch.float16, head=128, group=8), (1, 33, 1000, 4097)),
    (Setting("bf16-gqa4-h256-b32", torch.bfloat16, head=256, block=32, group=4), (5, 700)),
    (Setting("fp16-gqa3-h80-b8", torch.float16, head=80, block=8, group=3), (9, 250, 2049)),
    (Setting("fp16-gqa16-h96", torch.float16, head=96, group=16), (40, 600)),
    (Setting("fp32-gqa2-h112-b8-window", torch.float32, head=112, block=8, group=2, window=100), (50, 130, 999)),
    (Setting("bf16-gqa5-alibi", torch.bfloat16, group=5, alibi=True), (3, 77, 1500)),
    (Setting("fp16-sparse", torch.float16, sparse=SPARSE, group=2), (1, 90, 700)),
    (Setting("fp32-sparse-per-kv-head-b8", torch.float32, sparse=SPARSE_PER_KV_HEAD, block=8), (20, 333)),
    (Setting("fp16-e4m3-gqa8-h128", torch.float16, head=128, group=8, cache=E4M3), (7, 1200)),
    (Setting("bf16-e5m2-window", torch.bfloat16, cache=E5M2, window=300, group=2), (100, 301, 2000)),
    (Setting("fp32-e4m3-everything", torch.float32, cache=E4M3, window=200, alibi=True, sparse=SPARSE), (64, 900)),
    (Setting("fp16-gqa8-16k", torch.float16, group=8), (16384,)),
    # tensor cores (fp16 / bf16, head tiles 4 and 8) under every feature
    (Setting("fp16-gqa4-window-alibi-sparse", torch.float16, group=4, window=150, alibi=True, sparse=SPARSE),
     (1, 64, 151, 700)),
    (Setting("bf16-gqa8-e4m3-window-h96-b8", torch.bfloat16, head=96, block=8, group=8, cache=E4M3, window=90),
     (5, 91, 500)),
    (Setting("fp16-gqa6-e5m2-sparse-per-kv-head-h112", torch.float16, head=112, group=6, cache=E5M2,
             sparse=SPARSE_PER_KV_HEAD), (20, 333)),
    (Setting("bf16-gqa4-e4m3-everything-h256-b32", torch.bfloat16, head=256, block=32, group=4, cache=E4M3,
             window=200, alibi=True, sparse=SPARSE), (64, 900)),
    (Setting("fp16-gqa7-e4m3-alibi-h80", torch.float16, head=80, group=7, cache=E4M3, alibi=True), (3, 333)),
)


def _decode(x: dict) -> dict:
    """The prefill tests' arguments as `paged_attention`'s."""
    args = dict(x["args"])
    args.pop("query_start_loc")
    return args


def _reference(x: dict) -> torch.Tensor:
    return reference64(x["args"], x["options"], x["clean"])


@pytest.mark.parametrize(("setting", "seq_lens"), SETTINGS, ids=[s.name for s, _ in SETTINGS])
def test_v3_matches_a_float64_reference(setting: Setting, seq_lens: tuple[int, ...]) -> None:
    x = feature_inputs(setting, seq_lens=seq_lens, q_lens=(1,) * len(seq_lens))
    out = kernels.paged_attention(**_decode(x), version="v3", backend="emu", **x["options"])
    assert out.dtype == setting.dtype and not out.isnan().any()
    torch.testing.assert_close(out.double(), _reference(x), **tolerance(setting.dtype))


def _run_with_splits(x: dict, num_splits: int | None,
                     num_stages: int | None = None) -> tuple[torch.Tensor, V3Workspace]:
    """v3 on the emulator with `num_splits` and `num_stages` forced (None: planned for an H100-shaped
    device at the cache's element size), with the setting's fp8 scales and features."""
    args, options = _decode(x), x["options"]
    query, key_cache = args["query"], args["key_cache"]
    max_seq_len = int(args["seq_lens"].max())
    window = narrower_window(options["sliding_window"], max_seq_len)
    workspace = v3_workspace(H100, query.shape[0], query.shape[1], key_cache.shape[1], query.shape[2],
                             args["value_cache"].shape[3], max_seq_len, window, query.device, num_splits=num_splits,
                             cache_element_size=key_cache.element_size(), num_stages=num_stages)
    cache = CacheView(key_cache, args["value_cache"], args["block_tables"], args["seq_lens"], options.get("k_scale"),
                      options.get("v_scale"))
    features = AttentionFeatures(options.get("alibi_slopes"), options["blocksparse"])
    out = EMU.paged_attention(query, cache, args["scale"], "v3", 512, max_seq_len, window, features, workspace)
    return out, workspace


@pytest.mark.parametrize("num_splits", [1, 2, 7, 40])
def test_every_split_count_gives_the_same_attention(num_splits: int) -> None:
    """Forced split counts, down to one tile a split (40 > the 16 tiles of the longest row), each
    split whole tiles: sequences shorter than the plan have empty trailing splits, which the merge
    leaves out."""
    setting = Setting("splits", torch.float16, group=4, block=16)
    x = feature_inputs(setting, seq_lens=(1, 31, 100, 500), q_lens=(1,) * 4)
    out, workspace = _run_with_splits(x, num_splits)
    tiles_per_split = -(-16 // num_splits)
    assert workspace.plan.num_splits == -(-16 // tiles_per_split)
    torch.testing.assert_close(out.double(), _reference(x), **tolerance(torch.float16))


# (setting, context lengths, forced splits): 128+ splits of one to three tiles, GQA on tensor cores
# and CUDA cores, fp8 caches, a window, rows far shorter than the plan (their trailing splits empty).
MANY_SPLITS = (
    (Setting("fp16-gqa8-h128", torch.float16, head=128, group=8), (8192, 3000, 1), MAX_SPLITS),
    (Setting("bf16-gqa4-e4m3-window", torch.bfloat16, group=4, cache=E4M3, window=5000), (8192, 5001, 40), 160),
    (Setting("fp32-gqa2-e5m2-h64-b8", torch.float32, block=8, group=2, cache=E5M2), (4096, 77), 128),
)


@pytest.mark.parametrize(("setting", "seq_lens", "num_splits"), MANY_SPLITS, ids=[s.name for s, _, _ in MANY_SPLITS])
def test_128_and_more_splits_merge_to_the_float64_reference(setting: Setting, seq_lens: tuple[int, ...],
                                                            num_splits: int) -> None:
    x = feature_inputs(setting, seq_lens=seq_lens, q_lens=(1,) * len(seq_lens))
    out, workspace = _run_with_splits(x, num_splits)
    assert workspace.plan.num_splits >= 128 and not out.isnan().any()
    torch.testing.assert_close(out.double(), _reference(x), **tolerance(setting.dtype))


def test_the_planner_gives_one_long_sequence_the_most_splits_the_scratch_holds() -> None:
    """One sequence of 2 KV heads over 16K tokens on an H100-shaped device (528 slots): 256 splits of
    two tiles, planned (not forced), merged to the reference."""
    x = feature_inputs(Setting("one-long", torch.float16, head=128, group=8), seq_lens=(16384,), q_lens=(1,))
    out, workspace = _run_with_splits(x, None)
    assert workspace.plan.num_splits == MAX_SPLITS and workspace.plan.split_tokens == 64
    torch.testing.assert_close(out.double(), _reference(x), **tolerance(torch.float16))


@pytest.mark.parametrize(("dtype", "group"), [(torch.float32, 2), (torch.float16, 2), (torch.float16, 4),
                                            (torch.bfloat16, 4)], ids=str)
def test_blocks_before_the_window_and_slots_past_the_context_are_never_read(dtype: torch.dtype, group: int) -> None:
    """Table entries of blocks wholly before each row's window name a block of NaN; with several
    splits too, and on tensor cores (group 4), nothing NaN reaches the output."""
    setting = Setting("stale", dtype, block=8, window=60, group=group)
    x = feature_inputs(setting, seq_lens=(70, 200, 333), q_lens=(1, 1, 1))
    reference = _reference(x)
    args = x["args"]
    poisoned = args["key_cache"].shape[0]
    for name in ("key_cache", "value_cache"):
        args[name] = torch.cat([args[name], torch.full_like(args[name][:1], float("nan"))])
    tables = args["block_tables"].clone()
    for s, seq_len in enumerate(args["seq_lens"].tolist()):
        tables[s, : (seq_len - setting.window) // setting.block] = poisoned
    args["block_tables"] = tables
    for num_splits in (1, 3):
        out, _ = _run_with_splits(x, num_splits)
        assert not out.isnan().any()
        torch.testing.assert_close(out.double(), reference, **tolerance(dtype))


def test_the_planner_splits_only_what_leaves_the_device_idle() -> None:
    h100 = Hardware(132, 2)
    assert plan_splits(256, 8, 1024, 16, h100).num_splits == 1  # 2048 CTAs already fill it
    one_long = plan_splits(1, 8, 16384, 16, h100)
    # 264 slots / 8 KV heads: 33 splits wanted, of whole tiles: 16 tiles (512 tokens) each, so 32
    assert one_long.num_splits == 32 and one_long.split_tokens == 512
    assert one_long.num_splits * one_long.split_tokens >= 16384
    window = plan_splits(1, 8, 16384, 16, h100, sliding_window=1000)
    assert window.num_splits * window.split_blocks >= -(-(1000 + 15) // 16)
    # A plan depends on the longest context only, so a graph captured with it replays it.
    assert plan_splits(4, 2, 5000, 16, h100) == plan_splits(4, 2, 5000, 16, h100)


# An H200 (or H100) at v3's fp16 head-128 GQA-8 occupancy: 132 SMs x 4 CTAs.
H200_SLOTS = Hardware(132, 4)


@pytest.mark.parametrize(("num_seqs", "context", "splits", "split_tokens"), [
    (1, 16384, 64, 256),  # 512 of 528 slots, 128 KB of K/V a split
    (1, 4096, 64, 64),    # a 256-token floor left 16 splits: 128 CTAs on 132 SMs
    (16, 1024, 4, 256),
    (64, 4096, 1, 4096),  # 512 CTAs fill the slots once; 2 splits (before) made 1.94 waves of halves
    (256, 1024, 1, 1024),
])
def test_one_long_sequence_fills_every_sm_and_a_full_batch_is_not_split(
        num_seqs: int, context: int, splits: int, split_tokens: int) -> None:
    plan = plan_splits(num_seqs, 8, context, 16, H200_SLOTS)
    assert (plan.num_splits, plan.split_tokens) == (splits, split_tokens)
    ctas = num_seqs * 8 * plan.num_splits
    assert ctas <= max(num_seqs * 8, 132 * 4) and (num_seqs > 1 or ctas >= 132 * 3)


def test_splits_are_bounded_by_the_bytes_they_read_not_by_tokens() -> None:
    """The floor is MIN_SPLIT_BYTES of K and V: 64 tokens at 16-bit head 128, twice that at fp8 or
    head 64, half at fp32; one KV head of a long sequence takes up to MAX_SPLITS splits."""
    def tokens(kv_bytes_per_token: int) -> int:
        return plan_splits(1, 8, 4096, 16, H200_SLOTS, kv_bytes_per_token=kv_bytes_per_token).split_tokens

    assert tokens(2 * 128 * 2) == 64 and 2 * 128 * 2 * 64 == MIN_SPLIT_BYTES
    assert tokens(2 * 128 * 1) == tokens(2 * 64 * 2) == 128
    assert tokens(2 * 128 * 4) == 64  # 2 tiles wanted by the slots, whole tiles of 32 tokens
    assert plan_splits(1, 8, 200, 16, H200_SLOTS).num_splits == 3  # 7 tiles: splits of 2, 2, 2, 1 -> 3 of 3
    single = plan_splits(1, 1, 16384, 16, H200_SLOTS)
    assert single.num_splits == MAX_SPLITS and single.split_tokens == 64
    with pytest.raises(ValueError, match=r"kv_bytes_per_token=0 is not a K and V size; allowed: > 0"):
        plan_splits(1, 8, 4096, 16, H200_SLOTS, kv_bytes_per_token=0)


def test_a_plan_with_more_splits_than_the_scratch_holds_is_refused() -> None:
    refusal = rf"num_splits={MAX_SPLITS + 1} is outside the scratch's capacity; allowed: 1..{MAX_SPLITS}"
    with pytest.raises(ValueError, match=refusal):
        plan_splits(1, 1, 100000, 16, Hardware(132), num_splits=MAX_SPLITS + 1)
    x = feature_inputs(Setting("scratch", torch.float16, group=2), seq_lens=(900,), q_lens=(1,))
    _, workspace = _run_with_splits(x, 4)
    assert workspace.lse is not None
    grown = replace(workspace, plan=SplitPlan(8, workspace.plan.split_blocks // 2, 16))
    with pytest.raises(ValueError, match="the split plan has 8 splits but the scratch holds 4; allowed: 1..4"):
        check_workspace(grown, 900, None, 16)
    short = replace(workspace, plan=SplitPlan(2, 4, 16))
    with pytest.raises(ValueError, match=r"covers 2 x 4 blocks of 16 tokens, but rows of max_seq_len=900 need 57"):
        check_workspace(short, 900, None, 16)


def test_an_unsupported_head_size_is_refused_before_launch_and_auto_picks_no_v3_there() -> None:
    setting = Setting("head32", torch.float16, head=32, group=2)
    x = feature_inputs(setting, seq_lens=(5,), q_lens=(1,))
    with pytest.raises(ValueError, match=r"head_size=32 is not supported by backend='emu'; supported: 64, 80, 96"):
        kernels.paged_attention(**_decode(x), version="v3", backend="emu")
    # on a GPU, auto would take cuda, which has no head 32: the torch reference runs, and v3 is not
    # its pick there
    backend, _ = kernels.resolve_backend("auto", device=torch.device("cuda"), dtype=torch.float16, head_size=32,
                                         block_size=16, partition_size=None)
    assert backend.name == "torch" and kernels.choose_version(5, 1, 4, backend=backend.name) in ("v1", "v2")


def test_shared_memory_follows_the_layout_of_decode_v3() -> None:
    """The query, a table chunk, the warps' probabilities and states, then the K/V stages."""
    assert v3_shared_memory(2, 128, 8, 3) == 8 * 128 * 4 + 512 + 4 * 8 * 8 * 4 + 2 * 4 * 8 * 4 + 3 * 2 * 32 * 128 * 2
    assert v3_shared_memory(4, 256, 8, 2) == 8 * 256 * 4 + 512 + 1024 + 256 + 2 * 2 * 32 * 256 * 4
    assert v3_shared_memory(1, 64, 4, 8) - v3_shared_memory(1, 64, 4, 2) == 6 * 2 * 32 * 64


# (cache element size, head, head tile) -> an H100's depth: 16-bit head-128 stages are 16 KB, so 3
# fill the 57 KB of each of the 4 CTAs registers allow, as before; fp8 and small heads take as many
# of their smaller stages (the same bytes in flight; 3 before); fp32 keeps its 2 (a CTA lost at head
# 256, as before), fp8 at head 256 its 3 (16 KB stages: one more than the 4 CTAs' share).
H100_DEPTHS = {(2, 128, 8): 3, (2, 128, 1): 3, (1, 128, 8): 6, (2, 64, 4): 6, (2, 96, 8): 4, (1, 256, 8): 3,
               (4, 128, 8): 2, (4, 256, 8): 2, (1, 64, 1): 8}


@pytest.mark.parametrize(("shape", "depth"), H100_DEPTHS.items(), ids=str)
def test_the_pipeline_is_as_deep_as_the_shared_memory_allows_without_costing_a_cta(shape: tuple[int, int, int],
                                                                                   depth: int) -> None:
    """Deeper than the former fixed depth only while every SM keeps the CTAs its registers allow;
    never shallower than it."""
    element, head, tile = shape
    assert v3_stages(H100, element, head, tile) == depth >= base_stages(element, head)
    by_registers = hardware(H100, 0).slots
    if depth > base_stages(element, head):
        assert hardware(H100, v3_shared_memory(element, head, tile, depth)).slots == by_registers
    if depth < MAX_STAGES:  # one stage more would cost an SM a CTA
        assert hardware(H100, v3_shared_memory(element, head, tile, depth + 1)).slots < by_registers


def test_a_device_with_less_shared_memory_gets_shallower_pipelines() -> None:
    """An sm_86-like SM (100 KB, 1,536 threads) at the same 4 CTAs has 25 KB each: fp8 head-64
    stages (4 KB) fit 5 deep, where an H100 takes 6 or 8; 16-bit head 128 keeps the former 3."""
    ampere = DeviceLimits(multiprocessors=84, shared_memory_per_multiprocessor=100 * 1024,
                          threads_per_multiprocessor=1536)
    assert v3_stages(ampere, 2, 128, 8) == 3 and v3_stages(ampere, 4, 128, 8) == MIN_STAGES
    assert v3_stages(ampere, 1, 64, 4) == 5 < v3_stages(H100, 1, 64, 4)
    assert v3_stages(ampere, 1, 64, 1) == 5 < v3_stages(H100, 1, 64, 1) == MAX_STAGES


def test_the_steps_workspace_carries_the_devices_depth_to_the_kernel() -> None:
    """The emulator plans for an H100: a 16-bit head-128 cache gets 3 stages, an e4m3 one 6; the
    depth is the unit's template argument and sets its shared memory."""
    cpu = torch.device("cpu")
    for cache_dtype, depth in ((None, 3), (E4M3, 6)):
        workspace = EMU.decode_workspace(2, 8, 1, 128, 16, "v3", 512, 3000, None, cpu, cache_dtype)
        assert isinstance(workspace, V3Workspace) and workspace.stages == depth
    x = feature_inputs(Setting("depth", torch.float16, head=128, group=8, cache=E4M3), seq_lens=(300,), q_lens=(1,))
    args = _decode(x)
    cache = CacheView(args["key_cache"], args["value_cache"], args["block_tables"], args["seq_lens"])
    unit, smem = v3_unit(args["query"], cache, True, 6)
    assert unit.stages == 6 and ", 8, 6, false>" in unit.kernels[0] and smem == v3_shared_memory(1, 128, 8, 6)


# (setting, context lengths, forced splits, depths): tensor cores over a 16-bit cache through every
# depth, merged from 3 splits; fp8 with a window and ALiBi on tensor cores; fp32 on CUDA cores.
DEPTHS = (
    (Setting("fp16-gqa8-h128", torch.float16, head=128, group=8), (1, 700, 2500), 3, range(MIN_STAGES, MAX_STAGES + 1)),
    (Setting("bf16-gqa4-e4m3-window-alibi-b8", torch.bfloat16, block=8, group=4, cache=E4M3, window=500, alibi=True),
     (40, 1300), 2, (2, 8)),
    (Setting("fp32-gqa2-h64", torch.float32, head=64, group=2), (9, 900), 1, (2, 8)),
)


@pytest.mark.parametrize(("setting", "seq_lens", "num_splits", "depths"), DEPTHS, ids=[d[0].name for d in DEPTHS])
def test_every_pipeline_depth_gives_the_same_attention_to_the_bit(setting: Setting, seq_lens: tuple[int, ...],
                                                                 num_splits: int, depths: range) -> None:
    """The depth changes only when a tile's loads are issued, never the arithmetic: each forced
    depth's output equals the planned depth's bit for bit, and the float64 reference."""
    x = feature_inputs(setting, seq_lens=seq_lens, q_lens=(1,) * len(seq_lens))
    planned, workspace = _run_with_splits(x, num_splits)
    torch.testing.assert_close(planned.double(), _reference(x), **tolerance(setting.dtype))
    for depth in depths:
        out, forced = _run_with_splits(x, num_splits, depth)
        assert forced.stages == depth and forced.plan.num_splits == workspace.plan.num_splits
        assert torch.equal(out, planned), depth


def test_a_depth_the_kernel_is_not_built_for_or_the_device_cannot_hold_is_refused() -> None:
    cpu = torch.device("cpu")
    for depth in (1, MAX_STAGES + 1):
        with pytest.raises(ValueError, match=rf"num_stages={depth} is not a v3 pipeline depth; allowed: 2\.\.8"):
            EMU.decode_workspace(1, 8, 1, 128, 16, "v3", 512, 300, None, cpu, num_stages=depth)
    with pytest.raises(ValueError, match=r"num_stages=3 forces a CUDA v3 pipeline.*allowed: None"):
        cpu_backend.BACKEND.decode_workspace(1, 8, 1, 128, 16, "v3", 512, 300, None, cpu, num_stages=3)
    # fp32 at head 256, 8 stages: 522 KB of shared memory, past the 227 KB a CTA may have
    x = feature_inputs(Setting("too-deep", torch.float32, head=256, group=2), seq_lens=(40,), q_lens=(1,))
    with pytest.raises(ValueError, match=r"shared memory"):
        _run_with_splits(x, 1, MAX_STAGES)


def test_planned_v3_runs_alibi_once_planned_for_the_step() -> None:
    """Through `DecodeAttention`: the plan is made at construction from the host rows; each layer's
    call reuses it."""
    from paged.kernels.planned import AttentionSettings, DecodeAttention, Rows

    setting = Setting("planned", torch.bfloat16, group=4, alibi=True)
    x = feature_inputs(setting, seq_lens=(3, 800), q_lens=(1, 1))
    args = _decode(x)
    tables, lens = args["block_tables"], args["seq_lens"]
    rows = Rows(tables, lens, torch.arange(3, dtype=torch.int32), tables.numpy(), lens.numpy(),
                torch.arange(3, dtype=torch.int32).numpy(), max_seq_len=800, max_query_len=1)
    settings = AttentionSettings(EMU, args["scale"], 512, alibi_slopes=alibi_slopes(8))
    num_blocks, num_kv_heads, head_size, block_size = args["value_cache"].shape
    decode = DecodeAttention(rows, settings, "v3", 8, num_kv_heads, head_size, num_blocks, block_size)
    assert isinstance(decode.workspace, V3Workspace)
    for _ in range(2):
        out = decode(args["query"], args["key_cache"], args["value_cache"])
        torch.testing.assert_close(out.double(), _reference(x), **tolerance(torch.bfloat16))


def test_the_steps_plan_sizes_splits_by_the_cache_dtype() -> None:
    """The step's plan reads the cache's element size (`AttentionSettings.cache_dtype`): an e4m3 split
    holds twice a 16-bit split's tokens, on the launch backends and the cpu planner alike, and the
    planned op then runs it to the reference."""
    from paged.kernels.planned import AttentionSettings, DecodeAttention, Rows

    cpu = torch.device("cpu")
    for backend in (EMU, cpu_backend.BACKEND):  # one sequence of 256 tokens: the byte floor sets the splits
        half, fp8 = (backend.decode_workspace(1, 8, 1, 128, 16, "v3", 512, 256, None, cpu, dtype)
                     for dtype in (None, E4M3))
        half, fp8 = (getattr(w, "plan", w) for w in (half, fp8))
        assert fp8.split_tokens >= 2 * half.split_tokens and fp8.num_splits < half.num_splits
    setting = Setting("planned-e4m3", torch.float16, group=8, cache=E4M3)
    x = feature_inputs(setting, seq_lens=(4000,), q_lens=(1,))
    args = _decode(x)
    tables, lens = args["block_tables"], args["seq_lens"]
    rows = Rows(tables, lens, torch.arange(2, dtype=torch.int32), tables.numpy(), lens.numpy(),
                torch.arange(2, dtype=torch.int32).numpy(), max_seq_len=4000, max_query_len=1)
    num_blocks, num_kv_heads, head_size, block_size = args["value_cache"].shape
    num_heads = args["query"].shape[1]
    planned = {dtype: DecodeAttention(rows, AttentionSettings(EMU, args["scale"], 512, cache_dtype=dtype), "v3",
                                      num_heads, num_kv_heads, head_size, num_blocks, block_size)
               for dtype in (None, E4M3)}
    assert planned[E4M3].workspace.plan == EMU.decode_workspace(1, num_heads, num_kv_heads, head_size, block_size, "v3",
                                                                512, 4000, None, cpu, E4M3).plan
    assert planned[E4M3].workspace.plan != planned[None].workspace.plan
    options = x["options"]
    out = planned[E4M3](args["query"], args["key_cache"], args["value_cache"], options["k_scale"], options["v_scale"])
    torch.testing.assert_close(out.double(), _reference(x), **tolerance(torch.float16))


def test_a_scratch_planned_for_other_heads_is_refused() -> None:
    """A step's workspace planned for fewer query heads than the query has would be written past its
    end: refused in one line naming both shapes."""
    x = feature_inputs(Setting("scratch", torch.float16, group=8), seq_lens=(4000,), q_lens=(1,))
    args = _decode(x)
    query, key_cache, value_cache = args["query"], args["key_cache"], args["value_cache"]
    workspace = v3_workspace(H100, 1, query.shape[1] // 2, key_cache.shape[1], query.shape[2], value_cache.shape[3],
                             4000, None, query.device)
    assert workspace.tmp_out is not None
    cache = CacheView(key_cache, value_cache, args["block_tables"], args["seq_lens"])
    with pytest.raises(ValueError, match=r"the v3 scratch \(1, 8, .* was planned for other rows than the query's"):
        EMU.paged_attention(query, cache, args["scale"], "v3", 512, 4000, None, AttentionFeatures(), workspace)
