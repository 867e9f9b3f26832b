"""Drive an engine through a workload on its clock: submit requests at their arrival times, step
until all are done, and show progress."""

from __future__ import annotations

from tqdm import tqdm

from paged.engine import Engine
from paged.request import Request, SamplingParams
from paged.workload import WorkloadItem


def to_request(item: WorkloadItem) -> Request:
    request = Request(
        item.request_id, item.prompt_token_ids, item.params or SamplingParams(), arrival_time=item.arrival_time,
        prompt=item.prompt, priority=item.priority, client_id=item.client_id,
    )
    request.abort_reason = item.error
    return request


def run_workload(engine: Engine, items: list[WorkloadItem], *, progress: bool = True) -> list[Request]:
    """Returns the requests in submission order. The engine clock starts at the first arrival."""
    pending = sorted(items, key=lambda it: it.arrival_time)
    requests: dict[str, Request] = {}
    bar = tqdm(total=len(items), desc="requests", unit="req", disable=not progress, leave=False)
    clock = engine.clock
    clock.reset()
    i = 0
    while i < len(pending) or engine.has_unfinished:
        now = clock.now()
        while i < len(pending) and pending[i].arrival_time <= now:
            request = to_request(pending[i])
            requests[request.request_id] = request
            engine.add_request(request)
            i += 1
        if not engine.has_unfinished:
            clock.wait_until(pending[i].arrival_time)
            continue
        bar.update(len(engine.step()))
    bar.close()
    return [requests[it.request_id] for it in items]
