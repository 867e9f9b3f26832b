"""Drive an engine: submit requests when its clock reaches their arrival times, step until all are
done, show progress (`RunProgress`). `drive` is the one loop behind `LLM.generate`, `run.py` (through
paged/experiment/run.py) and the experiments; `to_request` is the one way a prompt becomes a `Request`.

Follow-ups (`Request.follows`: a chat's next turn, an agent's next step) are closed-loop: they are
held until the request they follow finishes, then sent at its finish time plus their think time,
its prompt and reply before their own tokens (`FollowUps`). The same loop drives one engine or a
`Fleet` of them."""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Sequence

from paged.engine.engine import Engine
from paged.engine.progress import RunProgress
from paged.request import Request, SamplingParams
from paged.utils.interrupt import Interrupt
from paged.workload import WorkloadItem

# the abort reason of the requests a stopped run leaves unfinished
INTERRUPTED = "interrupted"
# seconds between looks at the stop flag while idle until the next arrival (wall clock)
STOP_POLL_S = 0.1


def to_request(item: WorkloadItem) -> Request:
    """The request `item` describes: its tokens, params (vLLM's defaults when None), arrival time on
    the engine's clock, priority and client. An item with an `error` (a prompt-file line that failed
    to load) becomes a request that the scheduler aborts with that reason when it is submitted."""
    request = Request(
        item.request_id, item.prompt_token_ids, item.params or SamplingParams(), arrival_time=item.arrival_time,
        prompt=item.prompt, priority=item.priority, client_id=item.client_id, follows=item.follows,
    )
    request.abort_reason = item.error
    return request


def drive(
    engine: Engine,
    requests: Sequence[Request] = (),
    *,
    progress: bool = False,
    label: str = "requests",
    stop: Interrupt | None = None,
    compact: bool = False,
) -> bool:
    """Submit each of `requests` once the engine's clock reaches its arrival time, idling until the
    next arrival while nothing runs, and step until every request is done: these and any submitted
    before. The clock is not reset here, so arrival times are read on it as it stands. A follow-up
    is held until the request it follows (earlier in `requests`) finishes, then sent as `FollowUps`
    says; one whose parent was aborted is aborted too, with a reason naming the parent.

    `stop` is checked between steps, never inside one: once it is requested, no more requests are
    submitted and every unfinished one is aborted with reason "interrupted" (those already finished
    keep their outputs), and so are the follow-ups of those. Returns True when it stopped so, with
    work left; False when all was done. `progress` draws a bar labelled `label` (`RunProgress`).
    `compact` holds each finished request's token ids compactly (`Request.compact`), once its
    follow-ups have read them: for runs read afterwards only through `outputs()` and lengths; the
    requests may then be passed compacted too, each `expand`ed as it is submitted."""
    follow_ups = FollowUps(requests, compact=compact)
    pending = sorted((r for r in requests if r.follows is None), key=lambda r: r.arrival_time)
    clock = engine.clock
    # a wall-clock idle wait in slices, so that a stop is seen while waiting for a far arrival
    # (a signal does not cut a sleep short); simulated time waits at no cost
    slice_s = STOP_POLL_S if stop is not None and not clock.simulated else float("inf")
    i = 0

    def submit(request: Request) -> None:
        if compact:
            request.expand()
        engine.add_request(request)

    with RunProgress(engine, len(requests), label=label, enabled=progress) as bar:
        while i < len(pending) or follow_ups.has_due or engine.has_unfinished:
            if stop is not None and stop.requested:
                bar.step(_abort_all(engine, follow_ups))
                return True
            # each arrival in time order, once the engine's clock reaches it; the clock is read again
            # after each, since taking a request can move it back: a fleet's idle replica joins at
            # the arrival's time, and its first step comes before a later arrival
            now = clock.now()
            while True:
                next_arrival = min(pending[i].arrival_time if i < len(pending) else math.inf, follow_ups.next_due)
                if next_arrival > now:
                    break
                if i < len(pending) and pending[i].arrival_time == next_arrival:
                    submit(pending[i])
                    i += 1
                else:
                    submit(follow_ups.pop_due())
                now = clock.now()
            if not engine.has_unfinished:
                clock.wait_until(min(next_arrival, now + slice_s))
                continue
            # nothing reaches the engine before the next arrival but what its finishing steps
            # release: a fast-forward window runs up to it
            finished = engine.step(next_arrival, follow_ups.holding)
            bar.step(len(finished))
            for request in follow_ups.release(finished):
                submit(request)
            if compact:
                for request in finished:
                    request.compact()
    return False


def _abort_all(engine: Engine, follow_ups: FollowUps) -> int:
    """Abort everything unfinished, then the follow-ups of what was aborted, theirs in turn, and so
    on; returns how many requests ended so."""
    ended = engine.abort_all(INTERRUPTED)
    count = len(ended)
    # with the follow-ups aborted before: one submitted just before the stop ended inside abort_all
    ended += follow_ups.aborted
    while orphans := follow_ups.release(ended):
        for request in orphans:
            engine.add_request(request)
        ended = []
        while engine.has_unfinished:
            ended += engine.step()
        count += len(ended)
    return count


class FollowUps:
    """The follow-ups of a run: held until their parent finishes, then due at its finish time plus
    their think time, the parent's prompt and reply before their own tokens (`Request.follow`). A
    follow-up of an aborted parent is released at once, aborted with a reason naming the parent, so
    that it is recorded (requests.jsonl) rather than lost; its own follow-ups follow it so. With
    `compact`, a released follow-up waits for its arrival compacted (`Request.compact`): it holds
    the whole conversation so far as its prompt."""

    def __init__(self, requests: Sequence[Request], compact: bool = False) -> None:
        self.compact = compact
        self._waiting: dict[str, list[Request]] = {}  # parent id -> its follow-ups, in request order
        self._due: list[tuple[float, int, Request]] = []  # (arrival, order, request): a heap
        self._order = 0
        self.aborted: list[Request] = []  # the follow-ups released aborted so far
        if all(request.follows is None for request in requests):
            return  # no set of every request id for a run without follow-ups (millions at paper scale)
        seen: set[str] = set()
        for request in requests:
            if request.follows is not None:
                if request.follows.parent not in seen:
                    raise ValueError(
                        f"request {request.request_id!r} follows {request.follows.parent!r}, which is not among "
                        "the requests before it"
                    )
                self._waiting.setdefault(request.follows.parent, []).append(request)
            seen.add(request.request_id)

    @property
    def has_due(self) -> bool:
        """Whether a released follow-up waits for its arrival time."""
        return bool(self._due)

    @property
    def holding(self) -> bool:
        """Whether a follow-up waits for its parent to finish (a finishing step may release it)."""
        return bool(self._waiting)

    @property
    def next_due(self) -> float:
        """The arrival time of the next released follow-up; inf when none waits."""
        return self._due[0][0] if self._due else math.inf

    def pop_due(self) -> Request:
        """The released follow-up that arrives next (`next_due`)."""
        return heapq.heappop(self._due)[2]

    def release(self, finished: Iterable[Request]) -> list[Request]:
        """Release the follow-ups of the `finished` requests: those of a finished parent become due
        later; those of an aborted one are returned, aborted, to be submitted now."""
        aborted = []
        for parent in finished:
            for request in self._waiting.pop(parent.request_id, ()):
                if parent.abort_reason is not None:
                    request.abort_reason = f"follows {parent.request_id}, which was aborted ({parent.abort_reason})"
                    aborted.append(request)
                    continue
                request.follow(parent)
                if self.compact:
                    request.compact()
                heapq.heappush(self._due, (request.arrival_time, self._order, request))
                self._order += 1
        self.aborted += aborted
        return aborted


def run_workload(engine: Engine, items: list[WorkloadItem], *, progress: bool = True) -> list[Request]:
    """Run a workload from its start: the engine's clock is reset, so that the items' arrival times
    (seconds from the start) are on it. Returns the requests in item order."""
    requests = [to_request(item) for item in items]
    engine.clock.reset()
    drive(engine, requests, progress=progress)
    return requests
