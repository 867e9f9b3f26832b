"""Kernel settings that are checked where the config is (no torch here): fp8 scales and the
block-sparse pattern's settings (their meaning: `paged.kernels.features`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields


def check_scale(name: str, value: float | None) -> None:
    """A given fp8 scale must be a finite number > 0 (it divides every stored value)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a finite number > 0")


@dataclass(frozen=True)
class BlockSparseSpec:
    """vLLM's blocksparse_local_blocks / _vert_stride / _block_size / _head_sliding_step: the settings
    and their checks. The kernels' `BlockSparse` adds the pattern itself."""

    local_blocks: int
    vert_stride: int
    block_size: int
    head_sliding_step: int = 0

    @classmethod
    def from_config(cls, values: Mapping[str, int]) -> BlockSparseSpec:
        if not isinstance(values, Mapping):
            raise ValueError(f"kernel.blocksparse={values!r} must be null or a mapping of local_blocks, vert_stride, "
                             "block_size and optionally head_sliding_step")
        allowed = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - allowed)
        if unknown:
            raise ValueError(f"kernel.blocksparse has unknown keys {unknown}; allowed: {', '.join(sorted(allowed))}")
        missing = sorted({"local_blocks", "vert_stride", "block_size"} - set(values))
        if missing:
            raise ValueError(f"kernel.blocksparse needs {', '.join(missing)}")
        for key, value in values.items():
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"kernel.blocksparse.{key}={value!r} must be an integer")
        return cls(**values)

    def check(self, cache_block_size: int) -> None:
        """The kernels skip whole cache blocks, so a cache block must lie inside one sparse block."""
        for name in ("local_blocks", "vert_stride", "block_size"):
            value = getattr(self, name)
            if value <= 0:
                raise ValueError(f"blocksparse {name}={value} must be > 0")
        if self.block_size % cache_block_size:
            raise ValueError(
                f"blocksparse block_size={self.block_size} must be a multiple of the KV cache block size "
                f"{cache_block_size} (the kernels keep or skip whole cache blocks)"
            )
