"""Token ids held compactly (`Request.compact`, `drive(compact=True)`, which `run_experiment` uses
with its requests held compactly until submitted, `held_requests`): the same outputs, prompts,
follow-ups and times as lists give, in 4 bytes a token."""

from __future__ import annotations

from array import array

import pytest

from paged.cluster.fleet_builder import build_fleet, uses_fleet
from paged.config import compose_config
from paged.engine.builder import build_engine
from paged.engine.runner import FollowUps, drive, to_request
from paged.experiment.run import held_requests, workload_for
from paged.request import FollowUp, Request, SamplingParams

SIM = ["executor=sim", "model=llama-3-8b", "hardware=h100-sxm", "logger=none", "progress=false"]


def _run(overrides: list[str], compact: bool, held: bool = False) -> list[Request]:
    cfg = compose_config(overrides)
    engine = build_fleet(cfg) if uses_fleet(cfg) else build_engine(cfg)
    items = workload_for(cfg, engine)
    requests = held_requests(items) if held else [to_request(item) for item in items]
    assert not held or (not items and all(isinstance(r.prompt_token_ids, array) for r in requests))
    engine.clock.reset()
    drive(engine, requests, compact=compact)
    return requests


def _view(requests: list[Request]) -> list[tuple]:
    return [(r.request_id, list(r.prompt_token_ids), [(c.token_ids, c.finish_reason) for c in r.outputs()],
             r.arrival_time, r.finish_time, r.token_times.tolist()) for r in requests]


@pytest.mark.parametrize("overrides", [
    ["workload=multiturn"],  # follow-ups: the next turn's prompt holds the reply
    ["workload=agent", "cluster.num_replicas=2", "router=session"],
    ["workload.num_requests=12"],
    ["workload.num_requests=8", "workload.use_beam_search=true", "workload.n=2", "workload.best_of=2"],
    ["workload.num_requests=8", "workload.n=2", "workload.best_of=3"],  # the best two of three samples
])
def test_compacted_requests_read_as_lists_do(overrides):
    plain = _run([*SIM, *overrides], compact=False)
    for held in (False, True):
        compacted = _run([*SIM, *overrides], compact=True, held=held)
        assert _view(compacted) == _view(plain)
        finished = [r for r in compacted if r.finish_time is not None]
        assert finished
        assert all(isinstance(s.token_ids, array) and s.token_ids.itemsize == 4 for r in finished for s in r.seqs)
        # each token held once: the prompt and the (plain-sampled) completions are views of the sequence's array
        assert all(r.prompt_token_ids.obj is r.seqs[0].token_ids for r in finished)
        sampled = [r for r in finished if not r.params.use_beam_search]
        assert all(r.completions and c.token_ids.obj in [s.token_ids for s in r.seqs] for r in sampled
                   for c in r.completions)
        assert all(type(c.token_ids) is list for r in finished for c in r.outputs())


def test_released_follow_up_waits_compacted_and_compacting_again_changes_nothing():
    requests = _run([*SIM, "workload=multiturn"], compact=True)
    parent = next(r for r in requests if any(c.follows is not None and c.follows.parent == r.request_id
                                             for c in requests))
    child = next(r for r in requests if r.follows is not None and r.follows.parent == parent.request_id)
    follow_ups = FollowUps([parent, child], compact=True)
    follow_ups.release([parent])
    # the conversation so far, waiting for its arrival in 4 bytes a token: the prompt is the sequence's array
    assert isinstance(child.seqs[0].token_ids, array) and child.prompt_token_ids is child.seqs[0].token_ids
    child.expand()
    assert type(child.prompt_token_ids) is list and type(child.seqs[0].token_ids) is list
    before = _view([parent])
    held = [c.token_ids for c in parent.completions]
    parent.compact()
    assert _view([parent]) == before and [c.token_ids for c in parent.completions] == held


def test_the_packed_prompt_goes_with_the_prompt_it_packs():
    """`expand` keeps the prompt's array (`packed_prompt`) for the next `compact` to copy; a follow-up's
    new prompt (`follow`) drops it."""
    request = Request("r", [1, 2, 3], SamplingParams())
    request.compact()
    request.expand()
    packed = request.packed_prompt
    assert packed is not None and packed.tolist() == [1, 2, 3] and request.prompt_token_ids == [1, 2, 3]
    request.seqs[0].token_ids += [7, 8]
    request.finish_time = 1.0
    request.compact()  # the packed prompt copied, the outputs converted
    assert request.packed_prompt is None and packed.tolist() == [1, 2, 3]
    assert request.seqs[0].token_ids.tolist() == [1, 2, 3, 7, 8] and request.prompt_token_ids.tolist() == [1, 2, 3]
    child = Request("c", [9], SamplingParams(), follows=FollowUp("r"))
    child.compact()
    child.expand()
    child.follow(request)
    assert child.packed_prompt is None and child.prompt_token_ids == [1, 2, 3, 7, 8, 9]
    child.seqs[0].token_ids.append(4)
    child.compact()
    assert child.seqs[0].token_ids.tolist() == [1, 2, 3, 7, 8, 9, 4]
