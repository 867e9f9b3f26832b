"""Backends by name, and the choice `kernel.backend=auto` makes for a model's configuration."""

from __future__ import annotations

import importlib
import logging

import torch

from paged.config.choices import BACKENDS as BACKEND_NAMES
from paged.kernels.backends.interface import KernelBackend, listing
from paged.kernels.features import NONE, AttentionFeatures

log = logging.getLogger(__name__)

# Imported on first use: cuda needs cuda-python at run time, emu and cpu a host compiler.
_MODULES = {
    "torch": "paged.kernels.backends.torch_ref",
    "cpu": "paged.kernels.backends.cpu",
    "cuda": "paged.kernels.backends.cuda",
    "emu": "paged.kernels.backends.emu",
}
BACKENDS = tuple(_MODULES)
assert BACKENDS == BACKEND_NAMES, "paged.config.choices.BACKENDS lists the backends a config may name"
# emu is never chosen: it runs the CUDA sources slowly, to test them.
AUTO_ORDER = ("cuda", "cpu", "torch")


def get_backend(backend: str | KernelBackend) -> KernelBackend:
    """The backend named `backend` (one of `BACKENDS`); a backend object is returned as it is."""
    if isinstance(backend, KernelBackend):
        return backend
    if backend not in _MODULES:
        raise ValueError(f"backend={backend!r} is not supported; allowed: {listing(BACKENDS)}")
    return importlib.import_module(_MODULES[backend]).BACKEND


def backends_serving(features: AttentionFeatures) -> tuple[str, ...]:
    """The backends that implement every feature in `features` (whatever else they need): what a
    model whose layers need them may name as `kernel.backend`."""
    return tuple(name for name in BACKENDS if set(features.names) <= set(get_backend(name).features))


def resolve_backend(
    requested: str,
    *,
    device: torch.device,
    dtype: torch.dtype,
    head_size: int,
    block_size: int | None,
    partition_size: int | None,
    cache_dtype: torch.dtype | None = None,
    features: AttentionFeatures = NONE,
) -> tuple[KernelBackend, str]:
    """The backend that runs a model's attention, and why, e.g. `"cpu (native C++/OpenMP; auto:
    backend='cuda' needs cuda tensors, got tensors on cpu)"`. `block_size` is `None` where it is not
    known yet (the ops check it on every call), `partition_size` where v2 never runs.

    `auto` takes the first of cuda, cpu, torch that supports the configuration and runs here; a
    named backend that cannot serve it raises `ValueError` naming the value and what is supported.
    """

    def problem(backend: KernelBackend) -> str | None:
        unsupported = backend.unsupported_reason(device, dtype, head_size, block_size, partition_size, cache_dtype,
                                                 features)
        if unsupported:
            return unsupported
        unavailable = backend.unavailable_reason()
        return f"backend={backend.name!r} cannot run here: {unavailable}" if unavailable else None

    if requested != "auto":
        backend = get_backend(requested)
        refused = problem(backend)
        if refused:
            raise ValueError(refused)
        return backend, f"{backend.name} ({backend.description})"
    skipped = []
    for name in AUTO_ORDER:
        backend = get_backend(name)
        refused = problem(backend)
        if refused is None:
            why = f": {'; '.join(skipped)}" if skipped else ""
            reason = f"{name} ({backend.description}; auto{why})"
            log.info("kernel backend: %s", reason)
            return backend, reason
        skipped.append(refused)
    raise AssertionError(f"the torch backend serves every valid configuration, yet: {skipped}")
