"""kernels_cu/prefill.cuh on the emulator against a float64 reference written here from the
definition (per query: the visible keys, ALiBi bias, softmax, weighted values), on varlen batches
of whole prompts, prefix hits, chunks and decode rows: GQA, sliding windows, ALiBi, block-sparse
patterns and fp8 caches, in fp32 (CUDA cores) and fp16 / bf16 (tensor cores, emulated). Plus what
the kernel must never do (read a block before the window) and the refusals before any launch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest
import torch

from paged import kernels
from paged.config import KernelConfig, ModelConfig
from paged.executor.model_executor import ModelExecutor
from paged.kernels.backends.emu import EmuBackend
from paged.kernels.backends.launch import RunnerBackend
from paged.kernels.backends.prefill_plans import prefill_shared_memory
from paged.kernels.features import FP8_MAX, BlockSparse, alibi_slopes
from paged.kernels.registry import resolve_backend
from paged.kernels.testing import AttentionCase, prefill_inputs, tolerance
from paged.kernels.toolchain import host_compiler
from paged.kernels.v3_layout import H100, DeviceLimits

pytestmark = [
    pytest.mark.compiles,
    pytest.mark.skipif(host_compiler.unavailable_reason() is not None, reason="no host compiler"),
]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SPARSE = BlockSparse(local_blocks=2, vert_stride=3, block_size=32, head_sliding_step=1)
SPARSE_PER_KV_HEAD = BlockSparse(local_blocks=1, vert_stride=2, block_size=16, head_sliding_step=-1)
# Per sequence (queries, context): a whole prompt past one 64-row tile (with GQA, rows are queries
# times heads), a prefix hit, a chunk, a decode row, a one-token prompt.
Q_LENS = (45, 6, 20, 1, 1)
SEQ_LENS = (45, 53, 90, 37, 1)


@dataclass(frozen=True)
class Setting:
    name: str
    dtype: torch.dtype
    head: int = 64
    block: int = 16
    group: int = 4  # query heads per KV head
    cache: torch.dtype | None = None
    window: int | None = None
    alibi: bool = False
    sparse: BlockSparse | None = None


SETTINGS = (
    Setting("fp32", torch.float32),
    Setting("fp16-mha-b8", torch.float16, head=80, block=8, group=1),
    Setting("bf16-b32-head128", torch.bfloat16, head=128, block=32, group=2),
    Setting("fp16-window", torch.float16, window=19),
    Setting("fp32-window-b8", torch.float32, block=8, window=40),
    Setting("bf16-alibi", torch.bfloat16, alibi=True, group=3),
    Setting("fp16-sparse", torch.float16, sparse=SPARSE, block=16, group=2),
    Setting("fp32-sparse-per-kv-head", torch.float32, sparse=SPARSE_PER_KV_HEAD, block=8),
    Setting("fp16-e4m3", torch.float16, cache=E4M3),
    Setting("bf16-e5m2-window", torch.bfloat16, cache=E5M2, window=25, group=2),
    Setting("fp32-e4m3-everything", torch.float32, cache=E4M3, window=33, alibi=True, sparse=SPARSE),
    # one row tile per warp and one K/V buffer (head 256), the widest GQA group over 8-token blocks
    Setting("fp16-head256-gqa8-b32", torch.float16, head=256, block=32, group=8),
    Setting("bf16-gqa16-head96-b8-window", torch.bfloat16, head=96, block=8, group=16, window=30),
    # fp8 V tiles of an 8-token block are 8-byte copies
    Setting("bf16-e4m3-b8-head128-alibi", torch.bfloat16, head=128, block=8, cache=E4M3, alibi=True),
)


def _fp8_layout(cache: torch.Tensor) -> torch.Tensor:
    """A key cache `[n, h, d/x, b, x]` repacked with fp8's x = 16 (a value cache is unchanged)."""
    if cache.dim() == 4:
        return cache
    n, h, _, b, _ = cache.shape
    rows = cache.permute(0, 1, 3, 2, 4).reshape(n, h, b, -1)  # [n, h, b, d]
    return rows.view(n, h, b, -1, 16).permute(0, 1, 3, 2, 4).contiguous()


def _quantize(cache: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    limit = FP8_MAX[dtype]
    return (cache.float() / scale.view(1, -1, *[1] * (cache.dim() - 2))).clamp(-limit, limit).to(dtype)


def feature_inputs(s: Setting, seed: int = 0, seq_lens: tuple[int, ...] = SEQ_LENS,
                   q_lens: tuple[int, ...] = Q_LENS) -> dict:
    """The arguments, feature options and NaN-free (dequantised) caches of setting `s`: the
    decode tests (q_lens all 1) share them."""
    num_kv_heads = 2
    case = AttentionCase(s.dtype, s.head, s.block, s.group, num_kv_heads, 512, seq_lens)
    x = prefill_inputs(case, q_lens, seed=seed)
    p = x.paged
    args = {"query": x.query, "key_cache": p.key_cache, "value_cache": p.value_cache, "block_tables": p.block_tables,
            "query_start_loc": x.query_start_loc, "seq_lens": p.seq_lens, "scale": p.scale}
    options: dict = {"sliding_window": s.window, "blocksparse": s.sparse}
    if s.alibi:
        options["alibi_slopes"] = alibi_slopes(case.num_heads)
    clean = (p.clean_key_cache, p.clean_value_cache)
    if s.cache is not None:
        k_scale = torch.linspace(0.002, 0.004, num_kv_heads)
        v_scale = torch.linspace(0.003, 0.001, num_kv_heads)
        stored = [_fp8_layout(c) for c in (p.key_cache, p.value_cache)]
        args["key_cache"], args["value_cache"] = (_quantize(c, scale, s.cache)
                                                  for c, scale in zip(stored, (k_scale, v_scale)))
        clean = tuple(_fp8_layout(c) for c in clean)
        clean = tuple(_quantize(c, scale, s.cache).double() * scale.double().view(1, -1, *[1] * (c.dim() - 2))
                      for c, scale in zip(clean, (k_scale, v_scale)))
        options |= {"k_scale": k_scale, "v_scale": v_scale}
    return {"args": args, "options": options, "clean": clean}


def reference64(args: dict, options: dict, clean: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Query by query in float64, from the NaN-free (dequantised) caches."""
    query, tables = args["query"].double(), args["block_tables"]
    key_cache, value_cache = (c.double() for c in clean)
    num_heads, num_kv_heads = query.shape[1], key_cache.shape[1]
    group, block = num_heads // num_kv_heads, key_cache.shape[3]
    window, sparse, slopes = options["sliding_window"], options["blocksparse"], options.get("alibi_slopes")
    offsets = sparse.offsets(num_heads, num_kv_heads, torch.device("cpu")) if sparse else None
    out = torch.empty_like(query)
    starts = args["query_start_loc"].tolist()
    for s, seq_len in enumerate(args["seq_lens"].tolist()):
        blocks = tables[s, : -(-seq_len // block)].long()
        k = key_cache[blocks].permute(0, 3, 1, 2, 4).reshape(-1, num_kv_heads, query.shape[2])[:seq_len]
        v = value_cache[blocks].permute(0, 3, 1, 2).reshape(-1, num_kv_heads, query.shape[2])[:seq_len]
        q_len = starts[s + 1] - starts[s]
        keys = torch.arange(seq_len)
        for j in range(q_len):
            pos = seq_len - q_len + j
            for h in range(num_heads):
                visible = keys <= pos
                if window is not None:
                    visible &= keys > pos - window
                if sparse is not None:
                    visible &= sparse.allowed(torch.tensor(pos), keys, offsets[h])
                logits = k[:, h // group] @ query[starts[s] + j, h] * args["scale"]
                if slopes is not None:
                    logits = logits + slopes[h].double() * (keys - pos).double()
                weights = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=0)
                out[starts[s] + j, h] = weights @ v[:, h // group]
    return out


@pytest.mark.parametrize("setting", SETTINGS, ids=[s.name for s in SETTINGS])
def test_prefill_kernel_matches_a_float64_reference(setting: Setting) -> None:
    x = feature_inputs(setting)
    out = kernels.prefill_attention(**x["args"], backend="emu", **x["options"])
    assert out.dtype == setting.dtype and not out.isnan().any()
    torch.testing.assert_close(out.double(), reference64(x["args"], x["options"], x["clean"]),
                               **tolerance(setting.dtype))


LONG = (
    Setting("fp16-head128-gqa8", torch.float16, head=128, block=16, group=8),
    Setting("bf16-head64-mha-b32-alibi", torch.bfloat16, head=64, block=32, group=1, alibi=True),
    Setting("fp16-head112-e5m2-sparse", torch.float16, head=112, block=16, group=2, cache=E5M2,
            sparse=SPARSE_PER_KV_HEAD),
)


@pytest.mark.parametrize("setting", LONG, ids=[s.name for s in LONG])
def test_long_prompts_on_tensor_cores_match_a_float64_reference(setting: Setting) -> None:
    """Many K/V tiles through the double-buffered pipeline and several row tiles per sequence: a
    whole prompt, a prefix hit with a long cached context, a decode row."""
    x = feature_inputs(setting, seq_lens=(300, 400, 150), q_lens=(300, 130, 1))
    out = kernels.prefill_attention(**x["args"], backend="emu", **x["options"])
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), reference64(x["args"], x["options"], x["clean"]),
                               **tolerance(setting.dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_blocks_before_the_window_and_slots_past_the_context_are_never_read(dtype: torch.dtype) -> None:
    """Table entries of blocks wholly before a sequence's first query's window name a block full of
    NaN (the block manager may have given them away), as do the caches' slots past each context
    (prefill_inputs); nothing NaN reaches the output."""
    setting = Setting("stale", dtype, block=8, window=12)
    x = feature_inputs(setting)
    args, block = x["args"], setting.block
    poisoned = args["key_cache"].shape[0]  # a block past those the tables use, all NaN
    for name in ("key_cache", "value_cache"):
        args[name] = torch.cat([args[name], torch.full_like(args[name][:1], float("nan"))])
    tables = args["block_tables"].clone()
    starts = args["query_start_loc"].tolist()
    stale = 0
    for s, seq_len in enumerate(args["seq_lens"].tolist()):
        first_query = seq_len - (starts[s + 1] - starts[s])
        for b in range(max(0, first_query + 1 - setting.window) // block):
            tables[s, b] = poisoned
            stale += 1
    assert stale >= 5
    reference = reference64(args, x["options"], x["clean"])
    args["block_tables"] = tables
    out = kernels.prefill_attention(**args, backend="emu", **x["options"])
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), reference, **tolerance(dtype))


def test_an_unsupported_head_size_is_refused_before_launch_with_what_is_supported() -> None:
    case = AttentionCase(torch.float16, 32, 16, 2, 2, 512, (5,))
    x = prefill_inputs(case, (5,))
    with pytest.raises(ValueError, match=r"head_size=32 is not supported by backend='emu'; supported: 64, 80, 96"):
        kernels.prefill_attention(*x.args, backend="emu")


class _SmallSharedMemory:
    """A runner for a device with 64 KB of shared memory that records what it is asked to run."""

    needs_pinned_host = False

    def __init__(self) -> None:
        self.launches: list = []

    def dynamic_shared_memory_limit(self, unit: object, kernel: str) -> int:
        return 64 * 1024

    def run(self, unit: object, launches: list) -> None:
        self.launches += launches


class _SmallDevice(RunnerBackend):
    name = "small-device"
    description = "a runner backend on a device with little shared memory"
    device_type = "cpu"

    def __init__(self) -> None:
        self.recorder = _SmallSharedMemory()

    def runner(self, tensor: torch.Tensor) -> _SmallSharedMemory:
        return self.recorder

    def device_limits(self, device: torch.device) -> DeviceLimits:
        return H100


def test_tiles_larger_than_the_devices_shared_memory_are_refused_before_launch() -> None:
    backend = _SmallDevice()
    case = AttentionCase(torch.float32, 256, 16, 1, 2, 512, (9,))
    x = prefill_inputs(case, (9,))
    needed = prefill_shared_memory(torch.float32, 256)
    with pytest.raises(ValueError, match=f"torch.float32 prefill attention with head size 256 needs {needed} bytes "
                                         "of shared memory but the device allows 65536; use kernel.backend=torch"):
        kernels.prefill_attention(*x.args, backend=backend)
    assert backend.recorder.launches == []
    half = prefill_inputs(AttentionCase(torch.float16, 64, 16, 1, 2, 512, (9,)), (9,))
    kernels.prefill_attention(*half.args, backend=backend)
    assert len(backend.recorder.launches) == 1


def test_auto_takes_the_torch_reference_for_a_head_size_the_kernels_lack_and_says_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """On a GPU, `auto` would pick cuda; a head size without kernels sends it to the torch
    reference, logged once (the executor resolves its backend once)."""
    with caplog.at_level(logging.INFO, logger="paged.kernels.registry"):
        backend, reason = resolve_backend("auto", device=torch.device("cuda"), dtype=torch.float16, head_size=32,
                                          block_size=16, partition_size=None)
    assert backend.name == "torch"
    assert "head_size=32 is not supported by backend='cuda'; supported: 64, 80, 96, 112, 128, 256" in reason
    assert [r.getMessage() for r in caplog.records].count(f"kernel backend: {reason}") == 1


class _PreAmpere(EmuBackend):
    """The emulator standing in for a GPU without mma.sync (sm_75)."""

    def has_mma(self, device: torch.device) -> bool:
        return False


def test_the_executor_names_the_prefill_path_its_tiles_and_why_it_takes_cuda_cores() -> None:
    cpu = torch.device("cpu")
    assert EmuBackend().prefill_path(torch.bfloat16, 128, cpu) == (
        "tensor cores (mma.sync m16n8k16), 128 rows x 32 keys, 2 K/V buffers")
    assert EmuBackend().prefill_path(torch.float16, 256, cpu) == (
        "tensor cores (mma.sync m16n8k16), 64 rows x 32 keys, 1 K/V buffer")
    # fp8 tiles are half the bytes: head 256 keeps two buffers
    assert EmuBackend().prefill_path(torch.float16, 256, cpu, E5M2) == (
        "tensor cores (mma.sync m16n8k16, fp8 K/V converted in registers), 64 rows x 32 keys, 2 K/V buffers")
    assert _PreAmpere().prefill_path(torch.float16, 64, cpu) == (
        "CUDA cores (mma.sync needs sm_80), 128 rows x 64 keys, 2 K/V buffers")
    ex = ModelExecutor(ModelConfig(name="tiny-random", source="random", device="cpu"),
                       KernelConfig(name="t", backend="emu"))
    assert ex.dtype == torch.float32 and "; prefill on CUDA cores (float32 has no tensor-core path), 64 rows x 32 " \
        "keys, 2 K/V buffers;" in ex.description
    cpu_ex = ModelExecutor(ModelConfig(name="tiny-random", source="random", device="cpu"),
                           KernelConfig(name="t", backend="torch"))
    assert cpu_ex.prefill_path is None and "prefill on" not in cpu_ex.description
