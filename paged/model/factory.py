"""The decoder class for a checkpoint's architecture."""

from __future__ import annotations

import torch

from paged.model.arch import LlamaArch
from paged.model.bloom import BloomModel
from paged.model.gemma import GemmaModel
from paged.model.llama import LlamaModel


def takes_gemm_and_layer_ops(arch: LlamaArch) -> bool:
    """Only the Llama decoder runs `model.gemm`'s kernel and swappable layer ops; BLOOM keeps
    F.linear and its own norms, Gemma takes the gemm kernel but keeps its own norms."""
    return arch.architecture == "llama"


def build_model(
    arch: LlamaArch, state: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device, gemm: str = "torch"
) -> LlamaModel | GemmaModel | BloomModel:
    """The inference model for `arch`, its weights from the HF-named `state`; `gemm` is the linear
    layers' resolved kernel (`paged.model.linear.resolve_gemm`)."""
    if arch.architecture == "bloom":
        return BloomModel(arch, state, dtype, device)
    if arch.architecture == "gemma":
        return GemmaModel(arch, state, dtype, device, gemm)
    return LlamaModel(arch, state, dtype, device, gemm)
