"""Drive an engine through a workload in real time: submit requests at their arrival times, step
until all are done, and show progress."""

from __future__ import annotations

import time
from collections.abc import Callable

from tqdm import tqdm

from paged.engine import Engine
from paged.request import Request
from paged.workload import WorkloadItem

_IDLE_SLEEP_MAX_S = 0.05


def to_request(item: WorkloadItem) -> Request:
    params = item.params
    if params is None:
        from paged.request import SamplingParams

        params = SamplingParams()
    request = Request(
        item.request_id, item.prompt_token_ids, params, arrival_time=item.arrival_time,
        prompt=item.prompt, priority=item.priority,
    )
    request.abort_reason = item.error
    return request


def run_workload(
    engine: Engine,
    items: list[WorkloadItem],
    *,
    progress: bool = True,
    sleep: Callable[[float], None] = time.sleep,
) -> list[Request]:
    """Returns the requests in submission order. The engine clock starts at the first arrival."""
    pending = sorted(items, key=lambda it: it.arrival_time)
    requests: dict[str, Request] = {}
    bar = tqdm(total=len(items), desc="requests", unit="req", disable=not progress, leave=False)
    engine.reset_clock()
    i = 0
    while i < len(pending) or engine.has_unfinished:
        now = engine.now()
        while i < len(pending) and pending[i].arrival_time <= now:
            request = to_request(pending[i])
            requests[request.request_id] = request
            engine.add_request(request)
            i += 1
        if not engine.has_unfinished:
            sleep(min(_IDLE_SLEEP_MAX_S, pending[i].arrival_time - now))
            continue
        finished = engine.step()
        bar.update(len(finished))
    bar.close()
    return [requests[it.request_id] for it in items]
