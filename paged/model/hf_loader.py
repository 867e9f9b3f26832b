"""Load a local HF checkpoint directory (config.json + *.safetensors), checked before any weight loads.

config.json is parsed with each problem named (invalid JSON, a missing or non-integer shape key), the
shards are found (through model.safetensors.index.json where there is one) and their headers checked
against the config (`paged.model.checkpoint_check`); only then are the tensors read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from paged.model.arch import LlamaArch
from paged.model.checkpoint_check import CheckpointError, check_checkpoint, listed, read_headers
from paged.model.checkpoint_layout import SHAPE_FIELDS, config_key

INDEX = "model.safetensors.index.json"


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """The parsed config.json of an HF checkpoint directory."""
    config = Path(path) / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"{path} is not an HF checkpoint directory: no config.json")
    try:
        parsed = json.loads(config.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{config} is not valid JSON: {e}") from e
    if not isinstance(parsed, dict):
        raise CheckpointError(f"{config} holds a JSON {type(parsed).__name__}, not an object of config keys")
    quantization = parsed.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else quantization
        raise CheckpointError(f"{config} describes a quantized checkpoint (quant_method={method!r}); "
                              "only floating-point HF checkpoints are supported")
    return parsed


def arch_of(path: str | Path, config: dict[str, Any]) -> LlamaArch:
    """The architecture `config` (path/config.json, parsed) describes; a missing key, a value of the
    wrong type or an unsupported feature is a one-line CheckpointError naming it."""
    where = Path(path) / "config.json"
    try:
        arch = LlamaArch.from_hf_config(config)
    except KeyError as e:
        raise CheckpointError(f"{where} lacks {e.args[0]!r}, which a {config.get('model_type')} config needs") from e
    except (ValueError, TypeError, AttributeError, NotImplementedError) as e:
        raise CheckpointError(f"{where}: {e}") from e
    for field in SHAPE_FIELDS:
        value = getattr(arch, field)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            key = config_key(config, arch.architecture, field)
            raise CheckpointError(f"{where}: {key}={config.get(key)!r} must be a positive integer")
    return arch


def read_hf_arch(path: str | Path) -> LlamaArch:
    return arch_of(path, read_hf_config(path))


def weight_files(path: str | Path) -> list[Path]:
    """The safetensors shards: those model.safetensors.index.json lists (each must exist), else every
    *.safetensors in the directory."""
    root = Path(path)
    index = root / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index} is not a safetensors index (JSON with a weight_map): {e!r}") from e
        absent = [name for name in names if not (root / name).is_file()]
        if absent:
            raise CheckpointError(f"{index} lists shards missing from {root}: {listed(absent)}")
        return [root / name for name in names]
    shards = sorted(root.glob("*.safetensors"))
    if not shards:
        others = [p.name for p in root.glob("*.bin")] + [p.name for p in root.glob("*.pt")]
        hint = f" ({listed(others)}: only safetensors weights are read)" if others else ""
        raise FileNotFoundError(f"{root} holds no *.safetensors weights{hint}")
    return shards


def open_hf(path: str | Path) -> tuple[LlamaArch, list[Path]]:
    """The architecture and weight files of a checkpoint whose config and weights agree; nothing
    but config.json and the safetensors headers is read."""
    config = read_hf_config(path)
    arch = arch_of(path, config)
    shards = weight_files(path)
    check_checkpoint(Path(path), arch, config, read_headers(shards))
    return arch, shards


def read_weights(shards: list[Path]) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        try:
            state.update(load_file(shard))
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{shard} could not be read: {e}") from e
    return state


def load_hf(path: str | Path) -> tuple[LlamaArch, dict[str, torch.Tensor]]:
    """Architecture and weights of a Llama / SmolLM / Mistral / Qwen2 / BLOOM checkpoint, HF names kept."""
    arch, shards = open_hf(path)
    return arch, read_weights(shards)
