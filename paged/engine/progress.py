"""The progress bar of a run (`drive`): requests finished out of the total, and in its postfix the
requests running and waiting and the input and output tokens per second so far, as vLLM's
`LLM.generate` bar shows them:

    Processed prompts:   0%|          | 0/48 [00:01<?, ?req/s, running: 48, waiting: 0, est. speed
    input: 836.88 toks/s, output: 1827.33 toks/s]

Most requests of a batch finish near its end, so the count alone would sit at 0 for most of a run;
the postfix moves with every step. Input tokens are the prompt tokens computed (prefix-cache hits are
not computed; a preempted sequence's recomputed tokens are, again); output tokens are those sampled.
Speeds are on the engine's clock since the bar opened: simulated seconds on a simulated clock (the
postfix then says "simulated speed"), while the bar's own times and req/s are the host's.

Nothing is computed per step but a clock read: the postfix is built when the bar is drawn, at most
every `mininterval` seconds of wall time (`MININTERVAL_S` unless given), from the step records added
since the last draw. With the bar off, a step costs one attribute test. tqdm writes to stderr unless
`file` says otherwise, so it never mixes into stdout that callers parse.
"""

from __future__ import annotations

import time
from typing import Protocol, TextIO

from tqdm import tqdm

from paged.engine.metrics import MetricsRecorder
from paged.utils.clock import Clock

# tqdm's own default: seconds of wall time between two draws
MININTERVAL_S = 0.1


class Driven(Protocol):
    """What the bar reads of an `Engine` or a `Fleet`."""

    clock: Clock
    metrics: MetricsRecorder

    def request_counts(self) -> tuple[int, int]: ...


class RunProgress:
    """A run's bar; `drive` calls `step` after every engine step and `close` at the end (or uses it
    as a context manager). `enabled=False` draws nothing and costs nothing."""

    def __init__(
        self,
        engine: Driven,
        total: int,
        *,
        label: str = "requests",
        enabled: bool = True,
        mininterval: float | None = None,
        file: TextIO | None = None,
    ) -> None:
        self.enabled = enabled
        self._engine = engine
        # read when the bar opens, so that a test can set the module's to 0 for the bars `drive` opens
        self._mininterval = MININTERVAL_S if mininterval is None else mininterval
        # the totals before this run (an LLM's earlier calls) are not its own
        self._stats = engine.metrics.step_stats
        self._input_base, self._output_base = self._stats.input_tokens, self._stats.sampled_tokens
        self._start = engine.clock.now()
        self._speed = "simulated speed" if engine.clock.simulated else "est. speed"
        self._finished = 0  # finished since the last draw: the bar's count moves when it is drawn
        self._last_draw = time.monotonic()
        # miniters=0, mininterval=0: tqdm draws on every update, which `step` makes only when due
        self._bar = tqdm(
            total=total, desc=label, unit="req", disable=not enabled, leave=False, file=file,
            dynamic_ncols=True, mininterval=0, miniters=0,
        )

    def step(self, num_finished: int) -> None:
        """One engine step finished `num_finished` requests; draw if `mininterval` has passed."""
        if not self.enabled:
            return
        self._finished += num_finished
        now = time.monotonic()
        if now - self._last_draw >= self._mininterval:
            self._last_draw = now
            self._draw()

    def _draw(self) -> None:
        """Redraw the bar with the count and the speeds of the steps' running totals now."""
        stats = self._stats
        input_tokens = stats.input_tokens - self._input_base
        output_tokens = stats.sampled_tokens - self._output_base
        running, waiting = self._engine.request_counts()
        # a simulated fleet's clock is its next event's time: once no replica is busy it falls back
        # to the last idle time, behind the steps it ran, so the steps' own times count too
        elapsed = max(self._engine.clock.now(), stats.latest_time_s) - self._start
        input_speed = input_tokens / elapsed if elapsed > 0 else 0.0
        output_speed = output_tokens / elapsed if elapsed > 0 else 0.0
        self._bar.set_postfix_str(
            f"running: {running}, waiting: {waiting}, {self._speed} input: {input_speed:.2f} toks/s, "
            f"output: {output_speed:.2f} toks/s",
            refresh=False,
        )
        self._bar.update(self._finished)  # draws: mininterval=0
        self._finished = 0

    def close(self) -> None:
        self._bar.close()

    def __enter__(self) -> RunProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
