"""The emu backend arrives with the CUDA kernel issue; until then it refuses clearly."""

from __future__ import annotations

from typing import Any


def _unavailable(*_: Any, **__: Any) -> None:
    raise NotImplementedError("kernel.backend=emu is not available yet: use kernel.backend=torch")


paged_attention = reshape_and_cache = copy_blocks = _unavailable
