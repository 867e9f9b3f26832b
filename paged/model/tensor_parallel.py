"""Megatron-style tensor parallelism for the Llama decoder: what each of `size` ranks holds.

A rank holds `num_heads / size` query heads, the KV heads they read, and `intermediate_size / size`
columns of the MLP. q/k/v and gate/up are column-parallel (a rank computes its own heads and
columns, no communication); o_proj and down_proj are row-parallel (a rank multiplies its heads' and
columns' slice of their input), so their outputs are partial sums that one all-reduce adds up: one
after attention, one after the MLP. Embeddings, norms and the LM head are replicated, so every rank
holds the whole hidden state after each all-reduce; only rank 0 computes logits and samples.

KV heads follow vLLM's rule: `size` divides `num_heads`, and either divides `num_kv_heads` (each
rank its own KV heads) or is a multiple of it (each KV head replicated on the `size / num_kv_heads`
ranks whose query heads read it). A rank's KV cache holds only its KV heads, under the block ids of
the one block table the driver keeps.

A rank's shard is itself a Llama: `shard_arch` has its head counts and MLP width, `shard_state` the
matching rows and columns of the HF-named weights, so `LlamaModel` builds it unchanged and only
adds the all-reduce (`AllReduce`) after its row-parallel layers.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from paged.config import ConfigError
from paged.model.arch import LlamaArch
from paged.model.llama import LlamaModel


def _splits_heads(size: int, arch: LlamaArch) -> bool:
    return arch.num_heads % size == 0 and (arch.num_kv_heads % size == 0 or size % arch.num_kv_heads == 0)


def _splits(size: int, arch: LlamaArch) -> bool:
    return _splits_heads(size, arch) and arch.intermediate_size % size == 0


def tensor_parallel_sizes(arch: LlamaArch) -> list[int]:
    """The sizes whose ranks split `arch`'s heads and MLP columns evenly."""
    return [size for size in range(1, arch.num_heads + 1) if _splits(size, arch)]


def check_tensor_parallel_size(size: int, arch: LlamaArch, model_name: str, device: torch.device) -> None:
    """A ConfigError naming the sizes that work, unless `size` ranks can split `arch` (on a CUDA
    `device`, one GPU each)."""
    key = f"executor.tensor_parallel_size={size}"
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ConfigError(f"{key} must be a positive integer (1: no tensor parallelism)")
    if size == 1:
        return
    if device.type == "cuda" and (count := torch.cuda.device_count()) < size:
        raise ConfigError(f"{key} needs {size} CUDA devices, one per rank; this machine has {count}")
    if arch.architecture != "llama":
        raise ConfigError(f"{key}: tensor parallelism runs Llama-family models, and {model_name} is a "
                          f"{arch.architecture} model; use executor.tensor_parallel_size=1")
    if _splits(size, arch):
        return
    allowed = ", ".join(map(str, tensor_parallel_sizes(arch)))
    if not _splits_heads(size, arch):
        what = f"{arch.num_heads} attention heads ({arch.num_kv_heads} KV head{'s' * (arch.num_kv_heads > 1)})"
    else:
        what = f"MLP width of {arch.intermediate_size}"
    raise ConfigError(f"{key} does not divide {model_name}'s {what}; allowed: {allowed}")


def shard_arch(arch: LlamaArch, size: int) -> LlamaArch:
    """One rank's architecture: its query and KV heads and its MLP columns."""
    return dataclasses.replace(
        arch, num_heads=arch.num_heads // size, num_kv_heads=max(1, arch.num_kv_heads // size),
        intermediate_size=arch.intermediate_size // size,
    )


def _kv_heads(arch: LlamaArch, rank: int, size: int) -> slice:
    """The KV heads rank `rank` holds: its own share, or the one its query heads read."""
    if arch.num_kv_heads >= size:
        per_rank = arch.num_kv_heads // size
        return slice(rank * per_rank, (rank + 1) * per_rank)
    head = rank * arch.num_kv_heads // size
    return slice(head, head + 1)


def shard_state(arch: LlamaArch, state: dict[str, torch.Tensor], rank: int, size: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s slices of the HF-named Llama weights; the tensors not named here are replicated."""
    d, local = arch.head_dim, shard_arch(arch, size)
    q = slice(rank * local.num_heads * d, (rank + 1) * local.num_heads * d)
    kv_heads = _kv_heads(arch, rank, size)
    kv = slice(kv_heads.start * d, kv_heads.stop * d)
    mlp = slice(rank * local.intermediate_size, (rank + 1) * local.intermediate_size)
    out = dict(state)
    for i in range(arch.num_layers):
        attn, ffn = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        rows = {f"{attn}q_proj": q, f"{attn}k_proj": kv, f"{attn}v_proj": kv, f"{ffn}gate_proj": mlp,
                f"{ffn}up_proj": mlp}
        for name, part in rows.items():
            out[f"{name}.weight"] = state[f"{name}.weight"][part]
            if f"{name}.bias" in state:
                out[f"{name}.bias"] = state[f"{name}.bias"][part]
        out[f"{attn}o_proj.weight"] = state[f"{attn}o_proj.weight"][:, q]
        out[f"{ffn}down_proj.weight"] = state[f"{ffn}down_proj.weight"][:, mlp]
    return out


def shard_model(
    arch: LlamaArch, state: dict[str, torch.Tensor], rank: int, size: int, group: dist.ProcessGroup,
    dtype: torch.dtype, device: torch.device, gemm: str,
) -> LlamaModel:
    """Rank `rank`'s shard of the Llama whose whole weights are `state`, reducing over `group`."""
    return LlamaModel(shard_arch(arch, size), shard_state(arch, state, rank, size), dtype, device, gemm,
                      all_reduce=AllReduce(group))


class AllReduce:
    """Sums a row-parallel layer's partial outputs over the ranks of `group`, in place."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.group.allreduce([x]).wait()
        return x
