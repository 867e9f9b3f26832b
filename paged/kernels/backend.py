"""What every kernel backend provides: the three ops, on arguments the front end already checked."""

from __future__ import annotations

from typing import Protocol

import torch


class KernelBackend(Protocol):
    def paged_attention(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        version: str,
        partition_size: int,
        max_seq_len: int,
    ) -> torch.Tensor: ...

    def reshape_and_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None: ...

    def copy_blocks(
        self, key_caches: list[torch.Tensor], value_caches: list[torch.Tensor], block_mapping: torch.Tensor
    ) -> None: ...
