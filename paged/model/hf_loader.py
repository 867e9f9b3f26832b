"""Load a local HF checkpoint directory (config.json + *.safetensors)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from paged.model.arch import LlamaArch


def read_hf_arch(path: str | Path) -> LlamaArch:
    config = Path(path) / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"{path} is not an HF checkpoint directory: no config.json")
    return LlamaArch.from_hf_config(json.loads(config.read_text()))


def load_hf(path: str | Path) -> tuple[LlamaArch, dict[str, torch.Tensor]]:
    """Architecture and weights of a Llama / SmolLM / Mistral / Qwen2 / BLOOM checkpoint, HF names kept."""
    root = Path(path)
    arch = read_hf_arch(root)
    shards = sorted(root.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"{root} holds no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        state.update(load_file(shard))
    return arch, state
