"""Drive an engine: submit requests when its clock reaches their arrival times, step until all are
done, show progress. `drive` is the one loop behind `LLM.generate`, `run.py` (through
paged/experiment.py) and the experiments; `to_request` is the one way a prompt becomes a `Request`."""

from __future__ import annotations

from collections.abc import Sequence

from tqdm import tqdm

from paged.engine import Engine
from paged.interrupt import Interrupt
from paged.request import Request, SamplingParams
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
        prompt=item.prompt, priority=item.priority, client_id=item.client_id,
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
) -> bool:
    """Submit each of `requests` once the engine's clock reaches its arrival time, idling until the
    next arrival while nothing runs, and step until every request is done: these and any submitted
    before. The clock is not reset here, so arrival times are read on it as it stands.

    `stop` is checked between steps, never inside one: once it is requested, no more requests are
    submitted and every unfinished one is aborted with reason "interrupted" (those already finished
    keep their outputs). Returns True when it stopped so, with work left; False when all was done."""
    pending = sorted(requests, key=lambda r: r.arrival_time)
    clock = engine.clock
    # a wall-clock idle wait in slices, so that a stop is seen while waiting for a far arrival
    # (a signal does not cut a sleep short); simulated time waits at no cost
    slice_s = STOP_POLL_S if stop is not None and not clock.simulated else float("inf")
    i = 0
    with tqdm(total=len(pending), desc=label, unit="req", disable=not progress, leave=False) as bar:
        while i < len(pending) or engine.has_unfinished:
            if stop is not None and stop.requested:
                bar.update(len(engine.abort_all(INTERRUPTED)))
                return True
            now = clock.now()
            while i < len(pending) and pending[i].arrival_time <= now:
                engine.add_request(pending[i])
                i += 1
            if not engine.has_unfinished:
                clock.wait_until(min(pending[i].arrival_time, now + slice_s))
                continue
            bar.update(len(engine.step()))
    return False


def run_workload(engine: Engine, items: list[WorkloadItem], *, progress: bool = True) -> list[Request]:
    """Run a workload from its start: the engine's clock is reset, so that the items' arrival times
    (seconds from the start) are on it. Returns the requests in item order."""
    requests = [to_request(item) for item in items]
    engine.clock.reset()
    drive(engine, requests, progress=progress)
    return requests
