"""CPU threads for torch and the native kernels, set up so that a busy neighbour costs about its share.

One OpenMP runtime serves every parallel loop of a CPU run: the wheel's torch ships libgomp (SONAME
libgomp.so.1), and oneDNN, MKL's GNU threading layer and the `-fopenmp` library of kernels_cu/cpu all
bind to that one copy, so one team of `torch.get_num_threads()` threads runs them all.

libgomp's default wait is a spin: a thread that reaches the end of a parallel loop busy-waits for
GOMP_SPINCOUNT=300000 pause instructions (milliseconds on a recent x86) before it sleeps. On a quiet
machine that saves a wake-up per loop; beside a process that keeps a core busy, the spinning workers
take the cores the main thread (which runs the Python between loops) and the straggling worker need,
and a run kept 18-29% of its quiet speed (issue 30). Sleeping at once (`OMP_WAIT_POLICY=PASSIVE`,
paged's default until issue 47) is the fairest, but then every parallel loop of a step wakes the
worker again (tens of µs on a VM; a decode step runs hundreds of loops). So paged asks for a short
spin, `GOMP_SPINCOUNT=500` (`DEFAULT_SPIN_COUNT`: ~12 µs where a pause takes 25 ns, as on the
AVX512-BF16 EPYC it was measured on; about twice that where it takes ~45 ns, as on recent Intel
CPUs, not measured): long enough to bridge the gaps between a step's loops, short against the gaps
between steps and against a neighbour's time slice.
Measured there (experiments/cpu/neighbour_bench.py, docs/speed.md#shared-machines): +9-10% output
tok/s quiet, and 0.63-0.66 of the quiet speed kept beside a busy core (0.75-0.80 sleeping at once;
issue 47's floor is 0.5). `OMP_WAIT_POLICY=PASSIVE` stays the setting for a shared machine. libgomp
reads these once, when torch loads it, so `paged/__init__.py` calls `set_wait_policy_env` before
anything imports torch, and a wait setting already in the environment (the user's) is left alone.

The thread count is `model.num_threads`, else the user's OMP_NUM_THREADS, else the cores this process
may run on (`os.sched_getaffinity`): torch's own defaults, now chosen in one place and logged. Under
tensor parallelism every rank is a process with its own team, so by default each takes its share of
the cores (`ranks`); `model.num_threads` and OMP_NUM_THREADS count per process.
"""

from __future__ import annotations

import logging
import os
import platform
import sys
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

# The variables that choose how an idle OpenMP thread waits: the standard one, libgomp's spin count
# (which overrides the policy) and Intel OpenMP's block time. Any of them set means someone chose.
WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
# Pause instructions an idle worker spins before it sleeps (see the top of this module).
DEFAULT_SPIN_COUNT = 500

# Whether `set_wait_policy_env` ran before torch was imported (so before libgomp read the
# environment), and whether it set the policy itself: a policy it set after torch loaded is not this
# process's, only its children's.
_env_before_torch: bool | None = None
_set_by_paged = False


def set_wait_policy_env(environ: MutableMapping[str, str] | None = None) -> bool:
    """Sets `GOMP_SPINCOUNT=DEFAULT_SPIN_COUNT` unless one of `WAIT_VARIABLES` is already set; returns
    whether it set it. Takes effect only where torch is not yet imported (libgomp reads it on load); child
    processes inherit it either way."""
    global _env_before_torch, _set_by_paged
    env = os.environ if environ is None else environ
    if any(name in env for name in WAIT_VARIABLES):
        return False
    env["GOMP_SPINCOUNT"] = str(DEFAULT_SPIN_COUNT)
    if environ is None and _env_before_torch is None:
        _env_before_torch, _set_by_paged = "torch" not in sys.modules, True
    return True


def user_environment() -> dict[str, str]:
    """This process's environment less the wait setting `set_wait_policy_env` added: what a child that
    is not paged should inherit (a peer benchmark's vLLM waits as it would without paged: libgomp's
    default spin, or the user's own setting)."""
    env = dict(os.environ)
    if _set_by_paged:
        env.pop("GOMP_SPINCOUNT", None)
    return env


def wait_policy(environ: Mapping[str, str] | None = None) -> str:
    """How this process's OpenMP threads wait, in words, as the environment set it at torch's load."""
    env = os.environ if environ is None else environ
    if environ is None and _set_by_paged and not _env_before_torch:
        return "libgomp's default spin (torch was imported before paged)"
    chosen = [f"{name}={env[name]}" for name in WAIT_VARIABLES if name in env]
    return ", ".join(chosen) if chosen else "libgomp's default spin"


def available_cores() -> int:
    """The cores this process may run on: its CPU affinity (a cpuset or `taskset` narrows it)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no sched_getaffinity (macOS)
        return os.cpu_count() or 1


def choose_num_threads(
    requested: int | None, cores: int, environ: Mapping[str, str] | None = None, ranks: int = 1
) -> int:
    """`model.num_threads` when set, else OMP_NUM_THREADS when it is a positive count (its first
    entry: libgomp takes a list per nesting level), else one thread per available core, shared out
    among the `ranks` processes that compute side by side (at least one each)."""
    if requested is not None:
        return requested
    first = (os.environ if environ is None else environ).get("OMP_NUM_THREADS", "").split(",")[0].strip()
    return int(first) if first.isdigit() and int(first) > 0 else max(1, cores // ranks)


@dataclass(frozen=True)
class ThreadChoice:
    """What `configure` chose: the thread count, how waiting threads wait and the cores available."""

    num_threads: int
    wait_policy: str
    cores: int

    @property
    def count(self) -> str:
        return f"{self.num_threads} CPU thread{'' if self.num_threads == 1 else 's'}"

    def __str__(self) -> str:
        return f"{self.count} ({self.wait_policy}; {self.cores} cores available)"


def configure(requested: int | None, ranks: int = 1) -> ThreadChoice:
    """Sets torch's (and so the native kernels') thread count from `model.num_threads` and logs it;
    `ranks`: the tensor-parallel processes this one computes beside (itself included)."""
    import torch  # lazily: this module sits below the model layers and is imported before torch

    cores = available_cores()
    choice = ThreadChoice(choose_num_threads(requested, cores, ranks=ranks), wait_policy(), cores)
    if torch.get_num_threads() != choice.num_threads:
        torch.set_num_threads(choice.num_threads)
    log.info("%s", choice)
    return choice


def cpu_name() -> str:
    """This machine's CPU model as /proc/cpuinfo names it (what a measured number came from)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
