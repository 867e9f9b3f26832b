"""A finished sequence's chain of block hashes leaves the prefix index with its blocks: finished
requests keep their sequences, and a fleet hour's chains held that way were 400 MB."""

from __future__ import annotations

from paged.config import compose_config
from paged.engine.builder import build_engine
from paged.engine.runner import drive
from paged.experiment.run import held_requests, workload_for

SIM = ["executor=sim", "model=llama-3-8b", "hardware=h100-sxm", "logger=none", "progress=false",
       "allocator=prefix", "workload.num_requests=24"]


def test_finished_and_aborted_sequences_leave_no_chain() -> None:
    cfg = compose_config(SIM)
    engine = build_engine(cfg)
    requests = held_requests(workload_for(cfg, engine))
    index = engine.scheduler.block_manager.prefix_index
    engine.clock.reset()
    drive(engine, requests[:12], compact=True)
    assert all(r.finish_time is not None for r in requests[:12])
    assert len(index._chains) == 0  # the requests (and their sequences) are alive here
    engine.add_request(requests[12])
    engine.step()  # admitted: its chain is cached while it may be scheduled again
    assert len(index._chains) == 1
    engine.abort(requests[12], "test")
    assert len(index._chains) == 0
