"""The emu backend: the CUDA kernels of kernels_cu/ executed on the CPU (see emulator.py)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from paged.kernels import emulator, launch
from paged.kernels.specs import Unit


class _EmuRunner:
    max_shared_memory = emulator.MAX_SHARED_MEMORY

    def run(self, unit: Unit, launches: Sequence[launch.Launch]) -> None:
        emulator.run(unit, launches)


_RUNNER = _EmuRunner()


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    version: str,
    partition_size: int,
    max_seq_len: int,
) -> torch.Tensor:
    return launch.paged_attention(
        _RUNNER, query, key_cache, value_cache, block_tables, seq_lens, scale, version, partition_size, max_seq_len
    )


def reshape_and_cache(
    key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    launch.reshape_and_cache(_RUNNER, key, value, key_cache, value_cache, slot_mapping)


def copy_blocks(key_caches: list[torch.Tensor], value_caches: list[torch.Tensor], block_mapping: torch.Tensor) -> None:
    launch.copy_blocks(_RUNNER, key_caches, value_caches, block_mapping)
