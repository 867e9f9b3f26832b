"""What a launch plan hands a runner: `Launch`es of kernels_cu/ kernels with their argument values,
host/device `Copy`s, and the `Runner` protocol that executes them (the cuda backend through the
driver, the emu backend on the CPU). Plans live in `launch.py` (attention, cache ops) and
`layer_plans.py` (the fused layer ops); both build on these types.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from paged.kernels.toolchain.specs import Unit


class Ptr(int):
    """A device (or host, for the emulator) address passed as a pointer argument."""


Arg = Ptr | np.int32 | np.float32

# The kernels load rows in vectors of up to 16 bytes.
VECTOR_BYTES = 16


@dataclass(frozen=True)
class Launch:
    kernel: str
    grid: tuple[int, int, int]
    block: int
    shared_memory: int
    args: tuple[Arg, ...]


@dataclass(frozen=True)
class Copy:
    """`nbytes` from address `src` to address `dst`, each on the host or the device."""

    dst: Ptr
    src: Ptr
    nbytes: int


class Runner(Protocol):
    # Copies run asynchronously, so host memory in them must be page-locked.
    needs_pinned_host: bool

    def dynamic_shared_memory_limit(self, unit: Unit, kernel: str) -> int:
        """The most dynamic shared memory one block of `kernel` may use on this device."""
        ...

    def run(self, unit: Unit, launches: Sequence[Launch]) -> None: ...

    def copy(self, copies: Sequence[Copy]) -> None:
        """Runs the copies in order."""
        ...
