"""The cpu backend: native C++/OpenMP decode attention (kernels_cu/cpu/paged_attention_cpu.cpp).

`paged_attention` reads K/V straight from the paged cache through the block tables, so unlike the
torch reference it makes no gathered or permuted copies. The library is built with the host
compiler (`$CXX`, else `g++`) into the on-disk kernel cache, keyed by the source's hash, the
compiler and the flags, and loaded once per process through ctypes. `reshape_and_cache` and
`copy_blocks` are cheap and use the torch reference.
"""

from __future__ import annotations

import ctypes
import hashlib
import platform
import subprocess
import threading
import time
from pathlib import Path

import torch

from paged.kernels import torch_ref
from paged.kernels.cache_dir import ArtifactCache, make_key
from paged.kernels.host_compiler import find_compiler
from paged.kernels.source import source_dir

SOURCE = Path("cpu") / "paged_attention_cpu.cpp"
FLAGS = ("-std=c++17", "-O3", "-march=native", "-fopenmp", "-fPIC", "-shared")
_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_STATUS = {
    1: "block_size must be 1..64",
    2: "num_heads must be a multiple of num_kv_heads",
    3: "head_size must be a positive multiple of x = 16 // element_size",
    4: "partition_size must be a positive multiple of block_size",
    6: "the thread count must be positive",
    7: "unsupported dtype",
}

_CACHE = ArtifactCache("cpu", ".so")
_LOCK = threading.Lock()
_library: ctypes.CDLL | None = None


class CpuBuildError(RuntimeError):
    """The host compiler rejected the cpu backend's source; the message holds its output."""


def _host_id() -> str:
    """-march=native output depends on the CPU, so a shared cache directory keys on its features."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        flags = next((line for line in text.splitlines() if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return f"{platform.machine()}:{hashlib.sha256(flags.encode()).hexdigest()[:16]}"


def build() -> Path:
    """Builds (or finds in the cache) the shared library; raises with the reason on failure."""
    compiler = find_compiler()
    src = source_dir() / SOURCE
    text = src.read_bytes()
    key = make_key("cpu", hashlib.sha256(text).hexdigest(), compiler.path, compiler.version, list(FLAGS), _host_id())
    hit = _CACHE.get(key)
    if hit is not None:
        return hit[0]
    out = _CACHE.temp_path()
    cmd = [compiler.path, *FLAGS, str(src), "-o", str(out)]
    start = time.perf_counter()
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        out.unlink(missing_ok=True)
        raise CpuBuildError(f"{' '.join(cmd)} failed:\n{result.stderr}")
    return _CACHE.put_file(key, out, {"compile_s": time.perf_counter() - start, "command": cmd})


_ARGTYPES = [
    ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
    ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_float,
    ctypes.c_int, ctypes.c_int, ctypes.c_int,
]


def load() -> ctypes.CDLL:
    """The loaded library, built on first use and cached for the process."""
    global _library
    with _LOCK:
        if _library is None:
            library = ctypes.CDLL(str(build()))
            for name in ("paged_attention_v1_cpu", "paged_attention_v2_cpu"):
                fn = getattr(library, name)
                fn.argtypes = _ARGTYPES
                fn.restype = ctypes.c_int
            _library = library
        return _library


class CpuBackend(torch_ref.TorchBackend):
    """Native decode attention; the cache ops are the torch reference's."""

    def paged_attention(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        version: str,
        partition_size: int,
        max_seq_len: int,
    ) -> torch.Tensor:
        library = load()
        num_seqs, num_heads, head_size = query.shape
        _, num_kv_heads, _, block_size, _ = key_cache.shape
        # no-ops for the executor's tensors: the caches are allocated contiguous, tables are fresh
        key_cache, value_cache = key_cache.contiguous(), value_cache.contiguous()
        seq_lens = seq_lens.contiguous()
        if block_tables.stride(1) != 1:
            block_tables = block_tables.contiguous()
        if block_tables.shape[1] * block_size < max_seq_len:
            raise ValueError(
                f"block_tables has {block_tables.shape[1]} columns of {block_size} tokens, fewer than "
                f"max_seq_len={max_seq_len} needs"
            )
        out = torch.empty((num_seqs, num_heads, head_size), dtype=query.dtype)
        fn = library.paged_attention_v1_cpu if version == "v1" else library.paged_attention_v2_cpu
        status = fn(
            _DTYPES[query.dtype], out.data_ptr(), query.data_ptr(), *query.stride(),
            key_cache.data_ptr(), value_cache.data_ptr(), block_tables.data_ptr(), block_tables.stride(0),
            seq_lens.data_ptr(), num_seqs, num_heads, num_kv_heads, head_size, block_size, float(scale),
            partition_size, max_seq_len, torch.get_num_threads(),
        )
        if status:
            raise ValueError(f"cpu paged_attention_{version} refused its arguments: {_STATUS.get(status, status)}")
        return out


BACKEND = CpuBackend()
