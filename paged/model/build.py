"""The decoder class for a checkpoint's architecture."""

from __future__ import annotations

import torch

from paged.model.config import LlamaArch
from paged.model.llama import LlamaModel


def build_model(arch: LlamaArch, state: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device) -> LlamaModel:
    """The inference model for `arch`, its weights from the HF-named `state`."""
    return LlamaModel(arch, state, dtype, device)
