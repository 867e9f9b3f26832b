"""The decoder class for a checkpoint's architecture."""

from __future__ import annotations

import torch

from paged.model.arch import LlamaArch
from paged.model.bloom import BloomModel
from paged.model.llama import LlamaModel


def takes_gemm_and_layer_ops(arch: LlamaArch) -> bool:
    """Only the Llama decoder runs `model.gemm`'s kernel and swappable layer ops; BLOOM keeps
    F.linear and its own norms."""
    return arch.architecture != "bloom"


def build_model(
    arch: LlamaArch, state: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device, gemm: str = "torch"
) -> LlamaModel | BloomModel:
    """The inference model for `arch`, its weights from the HF-named `state`; `gemm` is the linear
    layers' resolved kernel (`paged.model.linear.resolve_gemm`)."""
    if not takes_gemm_and_layer_ops(arch):
        return BloomModel(arch, state, dtype, device)
    return LlamaModel(arch, state, dtype, device, gemm)
