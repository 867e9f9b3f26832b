"""What the model allows, checked by the model executor: its settings before any weights load
(`check_before_load`), and each step's positions against the model's RoPE table (`check_positions`)."""

from __future__ import annotations

from typing import Any

import torch

from paged.config import ConfigError, KernelConfig, ModelConfig
from paged.executor.layer_types import check_backend_serves
from paged.executor.step_plan import HostBatch
from paged.model.tensor_parallel import check_tensor_parallel_size
from paged.model.weights import load_arch


def check_before_load(model_cfg: ModelConfig, kernel_cfg: KernelConfig, cuda_graphs: bool | None, size: int,
                      device: torch.device) -> None:
    """Rank 0's checks before the weights load: CUDA graphs need a CUDA device and one rank; the
    size must split the model and the kernels serve its layers (a GGUF's llama / qwen2 layers they
    always do, so only `hf` and `random` models, and any split one, read their arch here)."""
    if cuda_graphs and device.type != "cuda":
        raise ConfigError(
            f"executor.cuda_graphs=true needs a CUDA device, but the model runs on {device} "
            f"(model.device={model_cfg.device}); use executor.cuda_graphs=false or null"
        )
    if size != 1 or model_cfg.source in ("hf", "random"):
        arch = load_arch(model_cfg)[0]
        check_tensor_parallel_size(size, arch, model_cfg.name, device)
        check_backend_serves(kernel_cfg.backend, arch, model_cfg.name)
    if cuda_graphs and size != 1:
        raise ConfigError(f"executor.cuda_graphs=true does not run with executor.tensor_parallel_size={size}: "
                          "a graph would not capture the all-reduces; use executor.cuda_graphs=false or null")


def check_positions(host: HostBatch, arch: Any) -> None:
    """Positions have RoPE rows only up to the model's table: the torch formulas would raise an
    IndexError past it, the fused kernels (which look rows up on the device) read past it."""
    if arch.architecture != "bloom" and host.num_tokens:
        last = int(host.positions.max())
        if last >= arch.max_position_embeddings:
            raise ValueError(f"position {last} is past the model's max_position_embeddings="
                             f"{arch.max_position_embeddings}; keep scheduler.max_model_len at most that")
