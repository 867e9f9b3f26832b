"""The emu backend: the CUDA kernels of kernels_cu/ executed on the CPU (see emulator.py)."""

from __future__ import annotations

from collections.abc import Sequence

from paged.kernels import emulator, launch
from paged.kernels.specs import Unit


class _EmuRunner:
    max_shared_memory = emulator.MAX_SHARED_MEMORY

    def run(self, unit: Unit, launches: Sequence[launch.Launch]) -> None:
        emulator.run(unit, launches)


_RUNNER = _EmuRunner()
BACKEND = launch.RunnerBackend(lambda tensor: _RUNNER)
