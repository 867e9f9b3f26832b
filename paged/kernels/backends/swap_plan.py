"""vLLM's swap_blocks as copies the cuda and emu backends run: whole blocks, cache by cache, between
device memory and page-locked host memory."""

from __future__ import annotations

import math

import torch

from paged.kernels.backends.interface import require_contiguous
from paged.kernels.backends.launch_api import Copy, Ptr


def require_pinned(**caches: torch.Tensor) -> None:
    """Host caches must be page-locked: the copies are asynchronous."""
    for name, cache in caches.items():
        if cache.device.type == "cpu" and not cache.is_pinned():
            raise ValueError(f"{name} is in pageable host memory; the cuda backend swaps blocks with asynchronous "
                             "copies (cuMemcpyAsync), which need page-locked memory: allocate it with pin_memory=True")


def copy_plan(
    src_caches: list[torch.Tensor], dst_caches: list[torch.Tensor], block_mapping: torch.Tensor
) -> list[Copy]:
    """vLLM's swap_blocks: one copy of a whole block per cache and `(src, dst)` row, cache by cache."""
    for i, (src, dst) in enumerate(zip(src_caches, dst_caches)):
        require_contiguous(**{f"src_caches[{i}]": src, f"dst_caches[{i}]": dst})
    pairs = block_mapping.tolist()
    plan = []
    for src, dst in zip(src_caches, dst_caches):
        nbytes = math.prod(src.shape[1:]) * src.element_size()
        src_base, dst_base = src.data_ptr(), dst.data_ptr()
        plan += [Copy(Ptr(dst_base + d * nbytes), Ptr(src_base + s * nbytes), nbytes) for s, d in pairs]
    return plan
