"""The decoder class for a checkpoint's architecture."""

from __future__ import annotations

import torch

from paged.model.arch import LlamaArch
from paged.model.bloom import BloomModel
from paged.model.llama import LlamaModel


def build_model(
    arch: LlamaArch, state: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device, gemm: str = "torch"
) -> LlamaModel | BloomModel:
    """The inference model for `arch`, its weights from the HF-named `state`; `gemm` is the linear
    layers' resolved kernel (`paged.model.linear.resolve_gemm`)."""
    if arch.architecture == "bloom":
        return BloomModel(arch, state, dtype, device)
    return LlamaModel(arch, state, dtype, device, gemm)
