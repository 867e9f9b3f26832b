"""What a model executor says it runs: the one line naming model, device, dtypes, attention kernel and
prefill path, layer ops, CUDA graphs, async scheduling, ranks and threads (summary.json, the console),
and the kernel each kind of rows runs on, logged once."""

from __future__ import annotations

import logging
from typing import Any, Protocol

import torch

from paged.model.linear import describe_gemm
from paged.model.llama import LlamaModel

log = logging.getLogger(__name__)


class Described(Protocol):
    """What `describe` reads of a model executor."""

    model_name: str
    model: Any
    device: torch.device
    dtype: torch.dtype
    dtype_note: str
    cache_dtype: torch.dtype
    kv_cache_dtype_name: str
    kernel_description: str | None
    prefill_path: str | None
    gemm: str
    native_decode: bool
    version: str
    backend: Any
    graphs: Any
    async_scheduling: bool
    threads: Any
    num_devices: int


def describe(ex: Described) -> str:
    """`ModelExecutor.description`."""
    dtype = str(ex.dtype).removeprefix("torch.") + ex.dtype_note
    kv = f", KV cache {ex.kv_cache_dtype_name}" if ex.cache_dtype != ex.dtype else ""
    # BLOOM keeps F.linear and its own norms: only a Llama model has these choices
    layers = (f"; gemm {describe_gemm(ex.gemm, ex.dtype)}, {ex.model.ops.name} norms/RoPE/SwiGLU"
              if isinstance(ex.model, LlamaModel) else "")
    if (isinstance(ex.model, LlamaModel) and ex.native_decode and ex.backend.name == "cpu"
            and ex.version in ("auto", "v3") and ex.cache_dtype == ex.dtype and ex.model.decode_layers() is not None):
        layers += ", decode steps' layers in one native call (those without a window or feature)"
    graphs = "; steps from CUDA graphs" if ex.graphs is not None else ""
    graphs += "; async scheduling" if ex.async_scheduling else ""
    cpu = f"; {ex.threads.count}" + " per rank" * (ex.num_devices > 1) if ex.device.type == "cpu" else ""
    tp = f"; tensor parallel over {ex.num_devices} ranks" if ex.num_devices > 1 else ""
    prefill = f"; prefill on {ex.prefill_path}" if ex.prefill_path else ""
    return (f"{ex.model_name} on {ex.device} ({dtype}{kv}); attention {ex.kernel_description}{prefill}"
            f"{layers}{graphs}{tp}{cpu}")


def announce_once(announced: set[str], what: str) -> None:
    """Log, once per executor, which kernel runs a kind of rows."""
    if what not in announced:
        announced.add(what)
        log.info("running %s", what)
