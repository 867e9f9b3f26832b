"""Ctrl-C (SIGINT) and a cluster's time limit (SIGTERM) as a request to stop a run, not a crash.

The handler only sets a flag; the runner's loop checks it between engine steps (a step cut in half
would leave the scheduler's state inconsistent), stops, and the run writes what it has. A second
signal quits at once, writing nothing more.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupt:
    """A request to stop: set by a signal while `catching`, or by `request` in code."""

    def __init__(self) -> None:
        self.signum: int | None = None

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def request(self, signum: int = signal.SIGINT) -> None:
        self.signum = signum

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else "none"

    @property
    def exit_code(self) -> int:
        """The shell's convention for a process that a signal ended: 128 + its number (130, 143)."""
        return 128 + self.signum if self.signum is not None else 0

    @contextmanager
    def catching(self, signals: tuple[int, ...] = STOP_SIGNALS) -> Iterator[Interrupt]:
        """Within the block, `signals` set this flag instead of ending the process; the previous
        handlers come back after it. Only the main thread may install handlers: elsewhere the
        block runs with the process's handlers as they are."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {s: signal.getsignal(s) for s in signals}
        for s in signals:
            signal.signal(s, self._handle)
        try:
            yield self
        finally:
            for s, handler in previous.items():
                # None: a handler installed outside Python, which cannot be put back; the default is closest
                signal.signal(s, handler if handler is not None else signal.SIG_DFL)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        # os.write, not print: a handler that interrupts a print to the same stream cannot print
        if self.requested:
            os.write(2, f"\n{name} again: quitting now, without writing the partial results\n".encode())
            os._exit(128 + signum)
        self.signum = signum
        os.write(2, f"\n{name}: stopping; unfinished requests are aborted and the partial results written "
                    f"(send {name} again to quit at once)\n".encode())
