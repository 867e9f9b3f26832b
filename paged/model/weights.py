"""The `model` config group's sources: a GGUF file, a local HF checkpoint, or seeded random weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from paged.config import ModelConfig
from paged.model.config import LlamaArch
from paged.model.gguf_loader import load_gguf
from paged.model.hf_loader import load_hf
from paged.model.locate import locate_smollm2
from paged.model.tiny import random_state, tiny_arch


def load_weights(model_cfg: ModelConfig) -> tuple[LlamaArch, dict[str, torch.Tensor], Path]:
    """(architecture, HF-named weights, tokenizer source) for `model.source` gguf / hf / random."""
    overrides: dict[str, Any] = (
        OmegaConf.to_container(model_cfg.arch) if isinstance(model_cfg.arch, DictConfig) else dict(model_cfg.arch)
    )
    if overrides and model_cfg.source != "random":
        raise ValueError(f"model.arch only applies to model.source=random, not {model_cfg.source!r}")
    if model_cfg.source == "gguf":
        path = Path(model_cfg.path) if model_cfg.path else locate_smollm2()
        arch, state = load_gguf(path)
        return arch, state, path
    if model_cfg.source == "hf":
        if not model_cfg.path:
            raise ValueError("model.source=hf needs model.path=/path/to/a/local/hf/checkpoint")
        arch, state = load_hf(model_cfg.path)
        return arch, state, Path(model_cfg.path)
    if model_cfg.source == "random":
        arch = tiny_arch(overrides)
        # A fixed weight seed: `tiny-random` is one model whatever the experiment's sampling seed.
        return arch, random_state(arch, seed=0), locate_smollm2()
    raise ValueError(f"model.source={model_cfg.source!r} is not supported; allowed: gguf, hf, random")
