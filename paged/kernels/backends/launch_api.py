"""What a launch plan hands a runner: `Launch`es of kernels_cu/ kernels with their argument values,
host/device `Copy`s, and the `Runner` protocol that executes them (the cuda backend through the
driver, the emu backend on the CPU). Plans live in `launch.py` (attention, cache ops) and
`layer_plans.py` (the fused layer ops); both build on these types.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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


# A launch to bind (`Runner.bind`): its unit, the launch as planned, and the pointer arguments a
# call changes, as (argument i, index j of the address it takes).
BoundPart = tuple[Unit, Launch, Sequence[tuple[int, int]]]


def pointer_slots(launches: Sequence[Launch], addresses: Sequence[int | None]) -> list[list[tuple[int, int]]] | None:
    """For each launch, its (argument i, j) pairs where argument i is the pointer `addresses[j]` (None: an
    absent tensor): the slots a later call with other tensors laid out alike rewrites. None where two
    addresses are one, one is 0, or one is among no launch's arguments (the plan copied that tensor)."""
    where = {a: j for j, a in enumerate(addresses) if a is not None}
    if len(where) != sum(a is not None for a in addresses) or 0 in where:
        return None
    slots = [[(i, where[int(a)]) for i, a in enumerate(item.args) if isinstance(a, Ptr) and int(a) in where]
             for item in launches]
    if {j for launch_slots in slots for _, j in launch_slots} != set(where.values()):
        return None
    return slots


class Runner(Protocol):
    # Copies run asynchronously, so host memory in them must be page-locked.
    needs_pinned_host: bool

    def dynamic_shared_memory_limit(self, unit: Unit, kernel: str) -> int:
        """The most dynamic shared memory one block of `kernel` may use on this device."""
        ...

    def run(self, unit: Unit, launches: Sequence[Launch]) -> None: ...

    def bind(self, parts: Sequence[BoundPart]) -> Callable[[Sequence[int]], None]:
        """Launches made ready to run again with some pointers changed: a call with `addresses`
        runs each part's launch with its argument i set to `addresses[j]` for each (i, j) of the
        part's slots (a model's later layers, whose launches differ from the first's only there)."""
        ...

    def copy(self, copies: Sequence[Copy]) -> None:
        """Runs the copies in order."""
        ...


@dataclass(frozen=True)
class Relaunches:
    """`Runner.bind` for a runner with nothing to prepare ahead: each call makes the `Launch`es anew."""

    runner: Runner
    parts: Sequence[BoundPart]

    def __call__(self, addresses: Sequence[int]) -> None:
        for unit, item, slots in self.parts:
            args = list(item.args)
            for i, j in slots:
                args[i] = Ptr(addresses[j])
            self.runner.run(unit, [Launch(item.kernel, item.grid, item.block, item.shared_memory, tuple(args))])
