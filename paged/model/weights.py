"""The `model` config group's sources: a GGUF file, a local HF checkpoint, or seeded random weights."""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from paged.config import ModelConfig
from paged.model.arch import LlamaArch
from paged.model.checkpoint_check import check_tokenizer_files
from paged.model.gguf_header import read_arch
from paged.model.gguf_loader import load_gguf
from paged.model.hf_loader import open_hf, read_hf_arch, read_weights
from paged.model.locate import locate_smollm2, shipped_tokenizer
from paged.model.tiny import random_state, tiny_arch
from paged.model.weight_cache import load_gguf_cached

log = logging.getLogger(__name__)


def _arch_keys(model_cfg: ModelConfig) -> dict[str, Any]:
    arch = model_cfg.arch
    return OmegaConf.to_container(arch) if isinstance(arch, DictConfig) else dict(arch)  # type: ignore[return-value]


def _window_override(model_cfg: ModelConfig) -> dict[str, Any]:
    window = model_cfg.sliding_window
    return {} if window is None else {"sliding_window": window}


def arch_overrides(model_cfg: ModelConfig) -> dict[str, Any]:
    """`model.arch` as a plain dict, with `model.sliding_window` when set: the keys a random or
    spec-only model is built from."""
    return {**_arch_keys(model_cfg), **_window_override(model_cfg)}


def _checkpoint_arch(arch: LlamaArch, model_cfg: ModelConfig) -> LlamaArch:
    """A checkpoint's own architecture, its window replaced by `model.sliding_window` when set: on
    every layer, a model whose layers differ included."""
    override = _window_override(model_cfg)
    return dataclasses.replace(arch, **override, layer_windows=None) if override else arch


def load_arch(model_cfg: ModelConfig) -> tuple[LlamaArch, Path]:
    """(architecture, tokenizer source) for a model with weights, without reading the weights."""
    _check_source(model_cfg)
    if model_cfg.source == "gguf":
        path = Path(model_cfg.path) if model_cfg.path else locate_smollm2()
        return _checkpoint_arch(read_arch(path), model_cfg), path
    if model_cfg.source == "hf":
        return _checkpoint_arch(read_hf_arch(model_cfg.path), model_cfg), Path(model_cfg.path)
    return _checkpoint_arch(tiny_arch(_arch_keys(model_cfg)), model_cfg), shipped_tokenizer()


def _check_source(model_cfg: ModelConfig) -> None:
    if model_cfg.source == "spec":
        raise ValueError(
            f"model={model_cfg.name} is a spec-only model (no weights): it runs only with executor=sim"
        )
    if model_cfg.source not in ("gguf", "hf", "random"):
        raise ValueError(f"model.source={model_cfg.source!r} is not supported; allowed: gguf, hf, random, spec")
    if _arch_keys(model_cfg) and model_cfg.source != "random":
        raise ValueError(f"model.arch only applies to model.source=random or spec, not {model_cfg.source!r}")
    if model_cfg.source == "hf" and not model_cfg.path:
        raise ValueError("model.source=hf needs model.path=/path/to/a/local/hf/checkpoint")


def load_weights(
    model_cfg: ModelConfig, device: torch.device | None = None, dtype: torch.dtype = torch.float32
) -> tuple[LlamaArch, dict[str, torch.Tensor], Path]:
    """(architecture, HF-named weights, tokenizer source) for `model.source` gguf / hf / random.
    Random weights are drawn on a GPU `device` in `dtype` (on the host in fp32 otherwise, which
    keeps `tiny-random` the same model on every CPU)."""
    _check_source(model_cfg)
    if model_cfg.source == "gguf":
        path = Path(model_cfg.path) if model_cfg.path else locate_smollm2()
        arch, state = _load_gguf_timed(path, model_cfg.weight_cache)
        return _checkpoint_arch(arch, model_cfg), state, path
    if model_cfg.source == "hf":
        # config.json, the safetensors headers and the tokenizer's presence are checked first, so a
        # broken checkpoint fails in milliseconds rather than after its weights load
        path = Path(model_cfg.path)
        arch, shards = open_hf(path)
        check_tokenizer_files(path)
        return _checkpoint_arch(arch, model_cfg), read_weights(shards), path
    arch = _checkpoint_arch(tiny_arch(_arch_keys(model_cfg)), model_cfg)
    # A fixed weight seed: `tiny-random` is one model whatever the experiment's sampling seed.
    on_gpu = device is not None and device.type != "cpu"
    state = random_state(arch, seed=0, device=device, dtype=dtype) if on_gpu else random_state(arch, seed=0)
    return arch, state, shipped_tokenizer()


def _load_gguf_timed(path: Path, use_cache: bool) -> tuple[LlamaArch, dict[str, torch.Tensor]]:
    """The GGUF's weights, from the on-disk cache (`paged.model.weight_cache`) unless `use_cache` is
    false; logs where they came from and the seconds it took, apart from any serving time."""
    start = time.perf_counter()
    if use_cache:
        arch, state, how = load_gguf_cached(path)
    else:
        arch, state = load_gguf(path)
        how = f"dequantized {path.name} (model.weight_cache=false)"
    log.info("weights: %s in %.2f s", how, time.perf_counter() - start)
    return arch, state
