"""The KV cache's share of a CUDA device's memory, measured as vLLM measures it.

`allocator.gpu_memory_utilization` of the device's memory is what this process may fill. What is in
use with the weights loaded is taken off (`torch.cuda.mem_get_info` sees all of it: the weights,
the CUDA context, cuBLAS workspaces, other processes; read after the dummy step below, so that what
its first kernels create outside torch's allocator counts too), then the activation peak of the
largest step the scheduler can hand over; the KV cache gets the rest (`kv_cache_bytes`).

The largest step is `max_num_batched_tokens` prompt tokens split evenly into `max_num_seqs`
sequences, through every layer, then the logits (and their softmax, which sampling takes) of each
sequence's last token: the most tokens through the layers and the most rows through the vocabulary
at once. Its attention allocates a zero tensor shaped like q and nothing else. That is what the
paged kernels allocate (they write K/V into the preallocated cache and return a q-shaped output);
torch SDPA would add score or workspace memory they never take (its math path materialises
[heads, L, L]), and so overstate the peak.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass
from typing import Protocol

import torch

from paged.config import ConfigError
from paged.model.llama import AttentionFn

log = logging.getLogger(__name__)

GiB = 2**30


class ForwardModel(Protocol):
    """What the dummy step runs: `paged.model`'s Llama and BLOOM models."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionFn) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class DeviceMemory:
    """Bytes of one CUDA device: its `total`, what is `used_after_load` (weights, context, other
    processes) and the `activation_peak` of the largest step."""

    total: int
    used_after_load: int
    activation_peak: int

    def describe(self, utilization: float, kv_cache: int) -> str:
        """One line for the log, `kv_cache` being what `kv_cache_bytes` left."""
        return (
            f"{utilization:g} x {self.total / GiB:.2f} GiB, less {self.used_after_load / GiB:.2f} GiB in use after "
            f"loading (weights, CUDA context) and {self.activation_peak / GiB:.2f} GiB of activations, leaves "
            f"{kv_cache / GiB:.2f} GiB for the KV cache"
        )


def kv_cache_bytes(total: int, utilization: float, used_after_load: int, activation_peak: int) -> int:
    """`utilization` of `total` bytes less `used_after_load` and `activation_peak`: the KV cache's
    bytes; a ConfigError naming the numbers when nothing is left."""
    usable = int(total * utilization)
    free = usable - used_after_load - activation_peak
    if free <= 0:
        raise ConfigError(
            f"allocator.gpu_memory_utilization={utilization} leaves no memory for the KV cache: {utilization:g} x "
            f"{total / GiB:.2f} GiB = {usable / GiB:.2f} GiB, but {used_after_load / GiB:.2f} GiB is in use after "
            f"loading the weights and a step's activations take {activation_peak / GiB:.2f} GiB; raise "
            "allocator.gpu_memory_utilization, lower scheduler.max_num_batched_tokens, or set allocator.num_blocks "
            "or allocator.kv_cache_memory"
        )
    return free


def measure(
    model: ForwardModel, device: torch.device, max_num_batched_tokens: int, max_num_seqs: int, max_positions: int
) -> DeviceMemory:
    """The device's memory with `model` loaded, and the peak of a dummy largest step (module docstring);
    `max_positions` bounds the positions it runs at (the model's rotary table)."""
    # tensors nothing refers to any more (an earlier engine's cache) and the blocks torch keeps
    # cached for reuse are not in use: give them back before asking the driver
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    _dummy_step(model, device, max_num_batched_tokens, max_num_seqs, max_positions)
    torch.cuda.synchronize(device)
    # the step's tensors are freed by now: what it left allocated (a cuBLAS workspace) stays in use
    # and is counted below, the rest of its peak is what every step needs on top
    activation_peak = torch.cuda.max_memory_allocated(device) - torch.cuda.memory_allocated(device)
    # its activations go back to the driver before it is asked what is in use
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return DeviceMemory(total=total, used_after_load=total - free, activation_peak=activation_peak)


def kv_budget(model: ForwardModel, device: torch.device, utilization: float, max_num_batched_tokens: int,
              max_num_seqs: int, max_positions: int) -> int:
    """The KV cache's bytes on a CUDA device: `measure`, then `kv_cache_bytes`, logged."""
    memory = measure(model, device, max_num_batched_tokens, max_num_seqs, max_positions)
    budget = kv_cache_bytes(memory.total, utilization, memory.used_after_load, memory.activation_peak)
    log.info("memory: %s", memory.describe(utilization, budget))
    return budget


def _dummy_step(model: ForwardModel, device: torch.device, num_tokens: int, num_seqs: int, max_positions: int) -> None:
    num_seqs = min(num_seqs, num_tokens)
    lengths = [num_tokens // num_seqs + (i < num_tokens % num_seqs) for i in range(num_seqs)]
    positions = torch.cat([torch.arange(n, device=device) for n in lengths]) % max_positions
    last_rows = torch.tensor(lengths, device=device).cumsum(0) - 1
    input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    with torch.inference_mode():
        hidden = model.forward(input_ids, positions, lambda layer, q, k, v: torch.zeros_like(q))
        torch.softmax(model.compute_logits(hidden[last_rows]), dim=-1)
