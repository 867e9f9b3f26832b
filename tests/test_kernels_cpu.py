"""The native cpu backend's decode attention (kernels_cu/cpu/) against the torch reference."""

from __future__ import annotations

import platform
import subprocess

import pytest
import torch

from paged import kernels
from paged.kernels.backends import cpu as cpu_backend
from paged.kernels.backends.interface import DTYPES
from paged.kernels.testing import AttentionCase, attention_inputs, edge_seq_lens, tolerance
from paged.kernels.toolchain import host_compiler

pytestmark = pytest.mark.compiles

_NO_COMPILER = host_compiler.unavailable_reason()
needs_compiler = pytest.mark.skipif(_NO_COMPILER is not None, reason=f"cpu backend not buildable: {_NO_COMPILER}")

BLOCKS = (8, 16, 32)
HEADS = (64, 128)
GROUPS = ((1, 2), (3, 3), (8, 1))  # (query heads per kv head, kv heads): MHA, SmolLM2's GQA, MQA


def _cases() -> list[AttentionCase]:
    """Every (dtype, block) pair, with head size, GQA ratio and partition size rotating through
    their values, so every pair of values of any two of them appears."""
    cases = []
    for i, dtype in enumerate(DTYPES):
        for j, block in enumerate(BLOCKS):
            head = HEADS[(i + j) % len(HEADS)]
            group, kv = GROUPS[(i + 2 * j) % len(GROUPS)]
            partition = (32, 64)[(i + j) % 2]
            lens = (*edge_seq_lens(block, partition), 3 * partition)
            cases.append(AttentionCase(dtype, head, block, group, kv, partition, lens))
    return cases


def _reference(x, version: str, partition: int) -> torch.Tensor:  # noqa: ANN001
    return kernels.paged_attention(x.query, x.clean_key_cache, x.clean_value_cache, x.block_tables, x.seq_lens,
                                   x.scale, version=version, backend="torch", partition_size=partition)


@needs_compiler
@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize("case", _cases(), ids=lambda c: c.id)
def test_matches_torch_reference(case: AttentionCase, version: str) -> None:
    x = attention_inputs(case, seed=hash(case.id) % 1000)
    out = kernels.paged_attention(x.query, x.key_cache, x.value_cache, x.block_tables, x.seq_lens, x.scale,
                                  version=version, backend="cpu", partition_size=case.partition_size)
    ref = _reference(x, version, case.partition_size)
    assert out.dtype == case.dtype and out.shape == ref.shape
    assert not out.isnan().any(), "read a cache slot past seq_len"
    torch.testing.assert_close(out.float(), ref.float(), **tolerance(case.dtype))


@needs_compiler
@pytest.mark.parametrize("version", ["v1", "v2"])
def test_default_partition_multi_partition(version: str) -> None:
    case = AttentionCase(torch.float32, 64, 16, 3, 3, 512, (1, 511, 512, 513, 1300))
    x = attention_inputs(case)
    out = kernels.paged_attention(x.query, x.key_cache, x.value_cache, x.block_tables, x.seq_lens, x.scale,
                                  version=version, backend="cpu", partition_size=512)
    torch.testing.assert_close(out, _reference(x, version, 512), **tolerance(torch.float32))


@needs_compiler
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_query_view_of_fused_qkv(dtype: torch.dtype) -> None:
    """The executor's query is a strided slice of the qkv projection, not a contiguous tensor."""
    case = AttentionCase(dtype, 64, 16, 3, 3, 32, (1, 17, 40, 70))
    x = attention_inputs(case)
    num_seqs, num_heads, head = x.query.shape
    fused = torch.randn(num_seqs, (num_heads + 2 * 3) * head, dtype=dtype)
    query = fused[:, : num_heads * head].view(num_seqs, num_heads, head)
    query.copy_(x.query)
    assert not query.is_contiguous()
    for version in ("v1", "v2"):
        out = kernels.paged_attention(query, x.key_cache, x.value_cache, x.block_tables, x.seq_lens, x.scale,
                                      version=version, backend="cpu", partition_size=32)
        torch.testing.assert_close(out.float(), _reference(x, version, 32).float(), **tolerance(dtype))


@needs_compiler
def test_v1_and_v2_take_different_paths() -> None:
    """Same answer, different rounding: v2's rescaled reduce is not an alias of v1."""
    case = AttentionCase(torch.float32, 64, 16, 3, 3, 32, (300,) * 4)
    x = attention_inputs(case)
    args = (x.query, x.key_cache, x.value_cache, x.block_tables, x.seq_lens, x.scale)
    v1 = kernels.paged_attention(*args, version="v1", backend="cpu", partition_size=32)
    v2 = kernels.paged_attention(*args, version="v2", backend="cpu", partition_size=32)
    torch.testing.assert_close(v1, v2, atol=1e-5, rtol=1e-5)
    assert not torch.equal(v1, v2)


def test_missing_compiler_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    x = attention_inputs(AttentionCase(torch.float32, 64, 16, 1, 1, 32, (5,)))
    monkeypatch.setenv("CXX", "no-such-cxx-compiler")
    monkeypatch.setattr(cpu_backend, "_library", None)
    host_compiler.find_compiler.cache_clear()
    try:
        with pytest.raises(host_compiler.CompilerNotFoundError, match="'no-such-cxx-compiler'"):
            kernels.paged_attention(x.query, x.key_cache, x.value_cache, x.block_tables, x.seq_lens, x.scale,
                                    backend="cpu")
    finally:
        host_compiler.find_compiler.cache_clear()


def test_partition_must_be_whole_blocks() -> None:
    x = attention_inputs(AttentionCase(torch.float32, 64, 16, 1, 1, 32, (5,)))
    with pytest.raises(ValueError, match="partition_size=24 must be a positive multiple of block_size=16"):
        kernels.paged_attention(x.query, x.key_cache, x.value_cache, x.block_tables, x.seq_lens, x.scale,
                                backend="cpu", version="v2", partition_size=24)


def test_bad_march_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    x = attention_inputs(AttentionCase(torch.float32, 64, 16, 1, 1, 32, (5,)))
    monkeypatch.setenv("PAGED_CPU_MARCH", "x86-64 -O0")
    monkeypatch.setattr(cpu_backend, "_library", None)
    cpu_backend._load_failure.cache_clear()
    try:
        with pytest.raises(ValueError, match=r"PAGED_CPU_MARCH='x86-64 -O0' is not a -march value"):
            kernels.paged_attention(x.query, x.key_cache, x.value_cache, x.block_tables, x.seq_lens, x.scale,
                                    backend="cpu")
    finally:
        # the failure seen under the bad value must not outlive it: the process's later calls build again
        cpu_backend._load_failure.cache_clear()


@pytest.mark.skipif(host_compiler.unavailable_reason() is not None, reason="no host C++ compiler")
@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64-v4", "sapphirerapids"])
def test_the_library_compiles_for_every_x86_level_it_picks_paths_for(march: str) -> None:
    """The library is built for the CPU it runs on, so this machine's build never sees another
    level's `#if` branches: AVX2 (no AVX-512: the portable paths, no packed linear), AVX-512 without
    bf16 (the fp32 packed linear only) and AVX512-BF16 with AMX must each compile. A syntax-only pass
    of the same flags (a second or less each)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 -march levels")
    flags = [f for f in cpu_backend.FLAGS if f not in ("-shared", "-O3")]
    result = subprocess.run(
        [host_compiler.find_compiler().path, *flags, f"-march={march}", "-fsyntax-only",
         "-I", str(cpu_backend.source_dir()), str(cpu_backend.source_dir() / cpu_backend.MAIN)],
        capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stderr[-3000:]
