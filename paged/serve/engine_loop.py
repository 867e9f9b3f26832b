"""The engine in its own thread, stepping while requests are in flight, fed by the HTTP handlers.

The engine is not thread-safe, so only this thread touches it: handlers put commands (submit,
abort, stop) on a thread-safe queue, and this thread hands each step's output back to the asyncio
loop in one `loop.call_soon_threadsafe` per step, as `Update`s on each submission's asyncio queue.
While the engine holds work the thread takes the commands that came in between two steps; idle,
it blocks on the queue.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from paged.cluster.fleet import Fleet
from paged.engine.engine import Engine
from paged.request import Request
from paged.serve.deltas import ChoiceStream, Update, final_deltas
from paged.serve.prometheus import EngineState, ServerMetrics

log = logging.getLogger(__name__)

# the abort reasons of a client that went away and of a server that was stopped (run.py's word)
DISCONNECTED = "client disconnected"
INTERRUPTED = "interrupted"


class ServerClosed(RuntimeError):
    """The server stopped admitting requests (a signal), or its engine failed."""


class Rejected(ValueError):
    """The engine refused a prompt at intake (it can never run under this configuration)."""


@dataclass(eq=False)
class Submission:
    """One HTTP call's requests (a completions call may send several prompts) and the asyncio queue
    their updates arrive on, first an admission (None, or the reason the engine refused one)."""

    requests: list[Request]
    stream: bool
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)

    async def admitted(self) -> None:
        """Wait for the engine to queue the requests; Rejected names why it refused one."""
        reason = await self.queue.get()
        if isinstance(reason, BaseException):
            raise reason
        if reason is not None:
            raise Rejected(reason)

    async def updates(self) -> AsyncIterator[Update]:
        """The requests' updates until every one is done; ServerClosed if the engine failed."""
        pending = len(self.requests)
        while pending:
            update = await self.queue.get()
            if isinstance(update, BaseException):
                raise update
            pending -= update.done
            yield update


@dataclass(eq=False)
class _Tracked:
    submission: Submission
    prompt_index: int
    streams: dict[int, ChoiceStream] = field(default_factory=dict)


class EngineLoop:
    """Runs `engine` (one engine, or a `Fleet`, local or on Ray: it steps and aborts as one) in a
    thread once `start`ed. `requests` lists every request submitted, in order
    (the run's requests.jsonl); `metrics` is what /metrics shows."""

    def __init__(self, engine: Engine | Fleet) -> None:
        self.engine = engine
        self.tokenizer = engine.executor.tokenizer
        self.decode = self.tokenizer.decode if self.tokenizer is not None else None
        self.metrics = ServerMetrics()
        engine.metrics.step_listeners.append(self.metrics.on_step)
        self.requests: list[Request] = []
        self.accepting = True
        self.error: BaseException | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._active: dict[Request, _Tracked] = {}
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    # -- the HTTP side (the asyncio thread) ------------------------------------------------------

    def start(self) -> None:
        self.engine.clock.reset()  # the run's times are seconds since the server started
        self._publish_state()
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def submit(self, requests: list[Request], stream: bool) -> Submission:
        """Hand `requests` to the engine; ServerClosed once the server stopped admitting."""
        if not self.accepting or not self.alive:
            raise ServerClosed("the server is shutting down" if self.error is None else f"the engine failed: "
                               f"{self.error}")
        submission = Submission(requests, stream, asyncio.get_running_loop())
        self._commands.put(("submit", submission))
        return submission

    def abort(self, submission: Submission, reason: str = DISCONNECTED) -> None:
        """Abort what of `submission` still runs (a finished request is left as it is)."""
        self._commands.put(("abort", submission, reason))

    def stop(self, reason: str = INTERRUPTED) -> None:
        """Stop admitting, abort every request in flight with `reason`; the thread ends once they ended."""
        self.accepting = False
        self._commands.put(("stop", reason))

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    # -- the engine thread -----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            stopping = False
            while not (stopping and not self.engine.has_unfinished):
                for command in self._take(block=not self.engine.has_unfinished):
                    stopping |= self._apply(command)
                if self.engine.has_unfinished:
                    self._publish(self.engine.step())
                    self._publish_state()
            self._publish_state()
            # a call that passed the `accepting` check as the stop came: answered, not left waiting
            closed = ServerClosed("the server is shutting down")
            self._deliver([(command[1], closed) for command in self._take(block=False) if command[0] == "submit"])
        except BaseException as err:  # the server answers 503 from now on; each waiting handler hears why
            log.exception("the engine loop failed")
            self.error = err
            self.accepting = False
            failed = ServerClosed(f"the engine failed: {type(err).__name__}: {err}")
            self._deliver([(t.submission, failed) for t in self._active.values()])

    def _take(self, block: bool) -> list[tuple]:
        commands = [self._commands.get()] if block else []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _apply(self, command: tuple) -> bool:
        """Carry out one command; True for stop."""
        kind, *args = command
        if kind == "submit":
            self._submit(args[0])
        elif kind == "abort":
            submission, reason = args
            for request in submission.requests:
                if request in self._active and request.abort_reason is None:
                    self.engine.abort(request, reason)
        else:
            for request in list(self._active):
                if request.abort_reason is None:
                    self.engine.abort(request, args[0])
            return True
        return False

    def _submit(self, submission: Submission) -> None:
        refused = None
        now = self.engine.clock.now()
        for i, request in enumerate(submission.requests):
            request.arrival_time = now
            self.engine.add_request(request)
            self.requests.append(request)
            self.metrics.on_received(request)
            self._active[request] = _Tracked(submission, i)
            refused = refused or request.abort_reason
        if refused is not None:  # the call fails as a whole: its other prompts need not run
            for request in submission.requests:
                if request.abort_reason is None:
                    self.engine.abort(request, f"another prompt of the call was refused: {refused}")
        self._deliver([(submission, refused)])

    def _publish(self, finished: list[Request]) -> None:
        """Each finished request's last update, each streamed one's new output."""
        out: list[tuple[Submission, Update]] = []
        for request in finished:
            tracked = self._active.pop(request, None)
            if tracked is None:
                continue
            self.metrics.on_finished(request)
            deltas = final_deltas(request, self.decode, tracked.streams if tracked.submission.stream else None)
            out.append((tracked.submission, Update(tracked.prompt_index, deltas, done=True)))
        for request, tracked in self._active.items():
            if not tracked.submission.stream or request.abort_reason is not None:
                continue
            deltas = []
            for seq in request.seqs:
                stream = tracked.streams.get(seq.index)
                if stream is None:
                    stream = tracked.streams[seq.index] = ChoiceStream(request, self.tokenizer)
                if (delta := stream.advance(seq, seq.index)) is not None:
                    deltas.append(delta)
            if deltas:
                out.append((tracked.submission, Update(tracked.prompt_index, deltas)))
        self._deliver(out)

    def _publish_state(self) -> None:
        running, waiting = self.engine.request_counts()
        self.metrics.set_state(EngineState(
            running, waiting, self.engine.kv_stats(), self.engine.counters.num_preemptions,
        ))

    def _deliver(self, items: list[tuple[Submission, object]]) -> None:
        """Put each item on its submission's queue, in the asyncio loop's thread."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Submission, object]]] = {}
        for submission, item in items:
            by_loop.setdefault(submission.loop, []).append((submission, item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # the loop closed: no handler is left to hear
                pass


def _put_all(batch: list[tuple[Submission, object]]) -> None:
    for submission, item in batch:
        submission.queue.put_nowait(item)
