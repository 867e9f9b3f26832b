"""Bad input to the native backends fails before any launch, with errors that say what is supported."""

from __future__ import annotations

import pytest
import torch

from paged import kernels
from paged.kernels.backends.emu import EmuRunner
from paged.kernels.testing import AttentionCase, attention_inputs, random_cache
from paged.kernels.toolchain import host_compiler

pytestmark = pytest.mark.compiles

NATIVE = ["emu", "cuda"]


@pytest.fixture(autouse=True)
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every case here must be refused before the emulator (or a GPU) runs anything."""

    def refuse(*_: object) -> None:
        raise AssertionError("a kernel was launched")

    monkeypatch.setattr(EmuRunner, "run", refuse)


def _inputs(dtype: torch.dtype = torch.float16, head: int = 64, block: int = 16):  # noqa: ANN202
    return attention_inputs(AttentionCase(dtype, head, block, 2, 2, 32, (5, 20)))


@pytest.mark.parametrize("backend", NATIVE)
@pytest.mark.parametrize(
    ("head", "block", "match"),
    [(32, 16, "head_size=32 .*supported: 64, 80, 96, 112, 128, 256"), (64, 4, "block_size=4 .*supported: 8, 16, 32")],
)
def test_unsupported_shapes_list_what_is_supported(backend: str, head: int, block: int, match: str) -> None:
    x = _inputs(head=head, block=block)
    with pytest.raises(ValueError, match=match):
        kernels.paged_attention(x.query, x.key_cache, x.value_cache, x.block_tables, x.seq_lens, x.scale,
                                backend=backend)
    key = torch.zeros(2, 2, head, dtype=torch.float16)
    with pytest.raises(ValueError, match=match):
        kernels.reshape_and_cache(key, key, x.key_cache, x.value_cache, torch.zeros(2, dtype=torch.int64),
                                  backend=backend)


@pytest.mark.parametrize("backend", NATIVE)
def test_unsupported_partition_size_lists_what_is_supported(backend: str) -> None:
    x = _inputs()
    with pytest.raises(ValueError, match="partition_size=48 .*supported: 32, 64, 128, 256, 512, 1024"):
        kernels.paged_attention(x.query, x.key_cache, x.value_cache, x.block_tables, x.seq_lens, x.scale,
                                backend=backend, version="v2", partition_size=48)


def test_unsupported_dtype_lists_what_is_supported() -> None:
    x = _inputs()
    with pytest.raises(TypeError, match="float64; supported: float32, float16, bfloat16"):
        kernels.paged_attention(x.query.double(), x.key_cache.double(), x.value_cache.double(), x.block_tables,
                                x.seq_lens, x.scale, backend="emu")


def test_mismatched_shapes_and_dtypes_fail_before_launch() -> None:
    x = _inputs()
    with pytest.raises(ValueError, match="query must be"):
        kernels.paged_attention(x.query[..., :32], x.key_cache, x.value_cache, x.block_tables, x.seq_lens,
                                x.scale, backend="emu")
    with pytest.raises(ValueError, match="kv cache dtype=float16 with dtype=bfloat16 is not supported by backend="):
        kernels.paged_attention(x.query.bfloat16(), x.key_cache, x.value_cache, x.block_tables, x.seq_lens,
                                x.scale, backend="emu")
    with pytest.raises(ValueError, match="query has 2 sequences but block_tables has 1"):
        kernels.paged_attention(x.query, x.key_cache, x.value_cache, x.block_tables[:1], x.seq_lens, x.scale,
                                backend="emu")
    with pytest.raises(TypeError, match="seq_lens must be a 1-d torch.int32"):
        kernels.paged_attention(x.query, x.key_cache, x.value_cache, x.block_tables, x.seq_lens.long(),
                                x.scale, backend="emu")
    k, v = random_cache(x.key_cache.shape[0] + 1, 2, 64, 16, torch.float16)
    with pytest.raises(ValueError, match="same shape"):
        kernels.copy_blocks([x.key_cache, k], [x.value_cache, v], [(0, 1)], backend="emu")


def test_wrong_devices_fail_before_launch() -> None:
    x = _inputs()
    with pytest.raises(ValueError, match="backend='emu' needs cpu tensors, got tensors on meta"):
        kernels.paged_attention(x.query.to("meta"), x.key_cache.to("meta"), x.value_cache.to("meta"),
                                x.block_tables.to("meta"), x.seq_lens.to("meta"), x.scale, backend="emu",
                                max_seq_len=20)
    with pytest.raises(ValueError, match="tensors must share one device"):
        kernels.paged_attention(x.query, x.key_cache, x.value_cache, x.block_tables.to("meta"), x.seq_lens,
                                x.scale, backend="emu", max_seq_len=20)
    with pytest.raises(ValueError, match="backend='cuda' needs cuda tensors, got tensors on cpu"):
        kernels.paged_attention(x.query, x.key_cache, x.value_cache, x.block_tables, x.seq_lens, x.scale,
                                backend="cuda")


def test_non_contiguous_cache_is_refused_by_native_backends() -> None:
    x = _inputs()
    wide = torch.zeros(*x.value_cache.shape[:-1], 32, dtype=x.value_cache.dtype)
    value_view = wide[..., :16]
    with pytest.raises(ValueError, match="value_cache must be contiguous"):
        kernels.paged_attention(x.query, x.key_cache, value_view, x.block_tables, x.seq_lens, x.scale,
                                backend="emu")


def test_v1_context_beyond_shared_memory_points_to_v2() -> None:
    case = AttentionCase(torch.float16, 64, 32, 1, 1, 512, (60_000,))
    x = attention_inputs(case)
    with pytest.raises(ValueError, match="shared memory.*use version='v2'"):
        kernels.paged_attention(x.query, x.key_cache, x.value_cache, x.block_tables, x.seq_lens, x.scale,
                                backend="emu", version="v1")


def test_missing_compiler_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    host_compiler.find_compiler.cache_clear()
    monkeypatch.setenv("CXX", "g++-that-does-not-exist")
    try:
        with pytest.raises(host_compiler.CompilerNotFoundError, match="looked for 'g\\+\\+-that-does-not-exist'"):
            host_compiler.find_compiler()
    finally:
        host_compiler.find_compiler.cache_clear()


def test_too_old_compiler_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # noqa: ANN001
    fake = tmp_path / "old-g++"
    fake.write_text("#!/bin/sh\necho 11.4.0\n")
    fake.chmod(0o755)
    host_compiler.find_compiler.cache_clear()
    monkeypatch.setenv("CXX", str(fake))
    try:
        with pytest.raises(host_compiler.CompilerNotFoundError, match="g\\+\\+ >= 12.*'11.4.0'"):
            host_compiler.find_compiler()
    finally:
        host_compiler.find_compiler.cache_clear()
