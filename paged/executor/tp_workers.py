"""Tensor-parallel worker processes: ranks 1..size-1 of a `ModelExecutor`, driven by rank 0.

Rank 0 is the executor the engine talks to, in the engine's process: it keeps the scheduler-facing
role (planning, sampling) and its own shard. Every other rank is a process started with spawn that
builds the same executor for its rank from the same config, then serves calls: each engine step's
swaps, copies and planned batch (`RankStep`: numpy arrays, never `Sequence` objects), and
`configure_kernel` / `init_kv_cache` / `kv_cache_budget`. Calls go over one pipe per worker; the
model's all-reduces over a torch.distributed process group (gloo on a CPU, NCCL on CUDA) built
without the default group, so one process may hold several executors in turn (tests, reused LLMs).

A failure is one error in the driver, never a hang: a worker that raises sends its error on its
pipe and exits; a worker that dies closes its sockets, so a collective waiting on it fails at once
(gloo), and any collective fails after `TIMEOUT`; the driver then raises `TensorParallelError`
naming the rank and its error. Workers exit with the driver: end-of-file on their pipe (the driver
closed it in `WorkerGroup.close`, which also runs when the group is collected and at interpreter
exit, or the driver died) ends their loop. They ignore Ctrl-C, which the driver handles between
steps (`paged.utils.interrupt`), and stop with it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from paged.executor.step_plan import HostBatch

# Longest a rank waits at a collective or the rendezvous: past it, a peer is stuck.
TIMEOUT = timedelta(minutes=5)
# The ranks run on this machine; their group's store listens here.
HOST = "127.0.0.1"
# How often a driver waiting for a reply looks whether the worker is still alive.
_POLL_S = 0.1
# How long a closing driver waits for idle workers to exit before terminating them.
_JOIN_S = 10.0
# What a worker may be asked to run: the executor's methods that every rank runs.
CALLS = frozenset({"configure_kernel", "init_kv_cache", "kv_cache_budget", "run_rank_step"})


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank failed or died; its executor runs no further step."""


@dataclass(frozen=True)
class RankStep:
    """What every rank runs for one engine step, as rank 0 planned it."""

    blocks_to_swap_out: list[tuple[int, int]]
    blocks_to_swap_in: list[tuple[int, int]]
    blocks_to_copy: list[tuple[int, int]]
    batch: HostBatch | None  # None: a step of swaps only
    decode_version: str | None  # the decode kernel rank 0 chose for the batch's decode rows
    # KV compression's (src, dst) token-slot copies (`SchedulerOutput.slots_to_compact`); None: none
    slots_to_compact: np.ndarray | None = None


def process_group(backend: str, store: dist.Store, rank: int, size: int) -> dist.ProcessGroup:
    """This rank's group of `size` ranks, met through `store`; blocks until all have joined."""
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = TIMEOUT
        return dist.ProcessGroupNCCL(store, rank, size, options)
    return dist.ProcessGroupGloo(store, rank, size, TIMEOUT)


def _one_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {' '.join(str(error).split())}"


def _serve(
    rank: int, size: int, backend: str, port: int, conn: Connection, build: Callable[..., Any], args: tuple[Any, ...]
) -> None:
    """A worker's life: join the group, build rank `rank`'s executor, run calls until the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        store = dist.TCPStore(HOST, port, size, False, timeout=TIMEOUT)
        conn.send(("ok", None))  # started: the driver may now wait in the rendezvous
        executor = build(rank, process_group(backend, store, rank, size), *args)
        conn.send(("ok", None))  # built
        while True:
            try:
                method, call_args, call_kwargs, reply = conn.recv()
            except EOFError:  # the driver closed the pipe or died
                return
            if method not in CALLS:
                raise ValueError(f"tensor-parallel worker cannot run {method!r}; it runs {', '.join(sorted(CALLS))}")
            result = getattr(executor, method)(*call_args, **call_kwargs)
            if reply:
                conn.send(("ok", result))
    except Exception as e:  # noqa: BLE001 - every error goes to the driver, which raises it
        with contextlib.suppress(OSError):
            conn.send(("error", _one_line(e)))
        # skips the group's teardown, which could wait on peers that are gone
        os._exit(1)


def _close(processes: list[BaseProcess], conns: list[Connection], wait_s: float) -> None:
    """Closes the pipes (idle workers then exit) and terminates any worker still there after `wait_s`."""
    for conn in conns:
        conn.close()
    for process in processes:
        process.join(wait_s)
        if process.is_alive():
            process.terminate()
            process.join()


Method = TypeVar("Method", bound=Callable[..., Any])


def on_every_rank(
    combine: Callable[[Any, Any, list[Any]], Any] | None = None, *, wait: bool = True
) -> Callable[[Method], Method]:
    """An executor method that every rank runs: its workers (`executor.workers`) start it before
    rank 0 does, and rank 0 then waits for their answers, unless not `wait` (a step: its
    all-reduces keep the ranks in step, and a worker's failure shows at rank 0's next call);
    `combine(executor, mine, theirs)` makes rank 0's answer from all of them (default: its own).
    An error on rank 0 stops the workers: they may wait in a collective it never reached."""

    def wrap(method: Method) -> Method:
        @functools.wraps(method)
        def run(executor: Any, *args: Any, **kwargs: Any) -> Any:
            workers: WorkerGroup | None = executor.workers
            if workers is None:
                return method(executor, *args, **kwargs)
            workers.send(method.__name__, args, kwargs, reply=wait)
            try:
                mine = method(executor, *args, **kwargs)
                theirs = workers.replies() if wait else []
            except TensorParallelError:  # a worker failed: the group is stopped already
                raise
            except BaseException as e:  # Ctrl-C too: the workers may be mid-call
                error = workers.failure(e)
                if error is e:
                    raise
                raise error from e
            return mine if combine is None else combine(executor, mine, theirs)

        return run  # type: ignore[return-value]

    return wrap


class WorkerGroup:
    """Ranks 1..size-1 as `processes`, each building its executor with `build(rank, group, *args)`;
    `group` is rank 0's process group (the driver's shard reduces over it); `failed` says why the
    workers were stopped, once they were."""

    def __init__(self, size: int, device_type: str, build: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.size = size
        self.backend = "nccl" if device_type == "cuda" else "gloo"
        self.failed: str | None = None
        store = dist.TCPStore(HOST, 0, size, True, timeout=TIMEOUT, wait_for_workers=False)
        context = mp.get_context("spawn")
        self._conns: list[Connection] = []
        self.processes: list[BaseProcess] = []
        for rank in range(1, size):
            ours, theirs = context.Pipe()
            process = context.Process(
                target=_serve, args=(rank, size, self.backend, store.port, theirs, build, args),
                name=f"paged-tp-rank{rank}", daemon=True,
            )
            process.start()
            theirs.close()
            self._conns.append(ours)
            self.processes.append(process)
        self._finalizer = weakref.finalize(self, _close, self.processes, self._conns, _JOIN_S)
        self._started = False
        self.replies()
        self._started = True
        self.group = process_group(self.backend, store, 0, size)

    def send(self, method: str, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None, *,
             reply: bool = False) -> None:
        """Asks every worker to run `method(*args, **kwargs)`; with `reply`, `replies` then collects
        the results."""
        self.check()
        for rank, conn in enumerate(self._conns, start=1):
            try:
                conn.send((method, args, kwargs or {}, reply))
            except OSError as e:
                raise self._stop(self._error(rank) or f"rank {rank} is gone ({_one_line(e)})") from None

    def replies(self) -> list[Any]:
        """Each worker's answer to the last call sent with `reply`, rank by rank."""
        return [self._reply(rank) for rank in range(1, self.size)]

    def _reply(self, rank: int) -> Any:
        conn, process = self._conns[rank - 1], self.processes[rank - 1]
        while not conn.poll(_POLL_S):
            if not process.is_alive() and not conn.poll():
                raise self._stop(self._exited(rank))
        try:
            kind, value = conn.recv()
        except EOFError:
            raise self._stop(self._exited(rank)) from None
        if kind == "error":
            raise self._stop(f"rank {rank} failed: {value}")
        return value

    def _exited(self, rank: int) -> str:
        process = self.processes[rank - 1]
        process.join(_JOIN_S)
        if self._started:
            return f"rank {rank} exited with code {process.exitcode}"
        # a spawned process imports the parent's main module first: unguarded, that starts workers itself
        return (f"rank {rank} exited with code {process.exitcode} before it started; a script that starts "
                "tensor-parallel workers must run its code under `if __name__ == \"__main__\":`")

    def check(self) -> None:
        """Raises `TensorParallelError` if a worker reported an error or died since the last call, or
        the workers were stopped after one."""
        if self.failed:
            raise TensorParallelError(f"the tensor-parallel workers were stopped after an error: {self.failed}")
        for rank in range(1, self.size):
            error = self._error(rank, wait_s=0.0)
            if error:
                raise self._stop(error)

    def failure(self, error: BaseException) -> BaseException:
        """What to raise after rank 0's part of a step raised `error`: a worker's own error when one
        failed (a collective with a dead peer fails too), else `error`. Either way the workers stop:
        they may be waiting in a collective that rank 0 never reached."""
        # a collective fails with a RuntimeError when a peer is gone: give that peer's report time to arrive
        wait_s = 1.0 if isinstance(error, RuntimeError) else 0.0
        for rank in range(1, self.size):
            reason = self._error(rank, wait_s)
            if reason:
                return self._stop(reason)
        self._stop(f"rank 0 failed: {_one_line(error)}")
        return error

    def _error(self, rank: int, wait_s: float) -> str | None:
        """Rank `rank`'s error report, or how it exited, if it failed; waits up to `wait_s` for it."""
        conn, process = self._conns[rank - 1], self.processes[rank - 1]
        try:
            if conn.poll(wait_s):
                kind, value = conn.recv()
                return f"rank {rank} failed: {value}" if kind == "error" else f"rank {rank} sent {kind!r} unasked"
        except EOFError:
            # its end of the pipe closed: the worker is exiting, though it may not be reaped yet (a killed
            # one under load), and the caller's own error is only the collective it broke
            return self._exited(rank)
        except OSError:
            pass
        return None if process.is_alive() else self._exited(rank)

    def _stop(self, reason: str) -> TensorParallelError:
        self.failed = reason
        self.close(wait_s=0.0)
        return TensorParallelError(f"tensor parallelism: {reason}")

    def close(self, wait_s: float = _JOIN_S) -> None:
        """Stops the workers: idle ones exit within `wait_s`, the rest are terminated. Idempotent."""
        if self._finalizer.alive:
            self._finalizer.detach()
            _close(self.processes, self._conns, wait_s)
