"""The steady decode step (`paged.scheduler.steady`) and the executor's persistent batch
(`paged.executor.persistent_batch`): a decode step in which nothing changed reuses the last step's
rows and plans its inputs from arrays kept across steps, and schedules, plans and outputs exactly
what the general path does, through arrivals, finishes, stop tokens, block growth, prefix hits and
preemption."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from paged.executor.persistent_batch import PersistentBatch
from paged.executor.step_plan import HostBatch, plan_batch
from paged.request import Request, SamplingParams
from paged.step import ExecutorOutput
from tests.engine_helpers import make_engine, outputs

TIGHT = ("allocator.num_blocks=16", "allocator.block_size=8", "scheduler.max_model_len=96",
         "scheduler.max_num_batched_tokens=96")


def _requests(seed: int, n: int = 16) -> list[Request]:
    """Prompts sharing prefixes (prefix hits), lengths that end in different steps, some ending on a
    stop token (a token the executor samples often enough) and some at max_model_len."""
    rng = random.Random(seed)
    shared = [rng.randrange(900) for _ in range(8)]
    requests = []
    for i in range(n):
        prompt = (shared if i % 2 else []) + [rng.randrange(900) for _ in range(rng.randint(1, 20))]
        stops = [rng.randrange(998) for _ in range(40)] if i % 3 == 0 else None
        params = SamplingParams(max_tokens=rng.randint(2, 60), temperature=0.0, stop_token_ids=stops,
                                min_tokens=2 if i % 5 == 0 else 0)
        requests.append(Request(f"r{i}", prompt, params, arrival_time=0.0))
    return requests


def _run(steady: bool, overrides: tuple[str, ...], seed: int) -> tuple[list[tuple], list[list[list[int]]], int]:
    """Every step's rows, block tables, copies and preemptions, the outputs, and how many steps the
    scheduler took as steady ones. Requests arrive a few at a time between steps."""
    engine = make_engine(*overrides)
    scheduler = engine.scheduler
    if not steady:
        scheduler._init_steady(False)  # the general path only: the reference
    requests = _requests(seed)
    pending = list(requests)
    steps = []
    while pending or engine.has_unfinished:
        for _ in range(min(len(pending), 2 if len(steps) % 7 == 0 else 0)):
            engine.add_request(pending.pop(0))
        if not engine.has_unfinished:
            engine.add_request(pending.pop(0))
        sched = scheduler.schedule(engine.clock.now())
        steps.append((
            [(it.seq.request.request_id, it.num_new_tokens, it.num_samples, list(it.block_table))
             for it in sched.scheduled],
            sched.num_decode_rows, sched.is_prefill, list(sched.blocks_to_copy), list(sched.blocks_to_swap_out),
            [s.request.request_id for s in sched.preempted], scheduler.stats().kv,
        ))
        busy = sched.scheduled or sched.blocks_to_swap_out or sched.blocks_to_swap_in
        output = engine.executor.execute(sched) if busy else ExecutorOutput([])
        finished = scheduler.update_from_output(sched, output, engine.clock.now())
        steps[-1] += ([r.request_id for r in finished], scheduler.stats().kv)
    return steps, outputs(requests), scheduler.num_steady_steps


@pytest.mark.parametrize("allocator", ["naive", "prefix"])
@pytest.mark.parametrize("overrides", [(), TIGHT], ids=["roomy", "tight"])
def test_steady_steps_schedule_and_apply_what_the_general_path_does(allocator, overrides):
    config = (f"allocator={allocator}", *overrides)
    general, general_outputs, none = _run(False, config, seed=3)
    steady, steady_outputs, num_steady = _run(True, config, seed=3)
    assert none == 0 and 10 <= num_steady < len(steady), (num_steady, len(steady))  # both paths ran
    assert steady == general
    assert steady_outputs == general_outputs


@pytest.mark.parametrize("allocator", ["naive", "prefix"])
def test_arrivals_and_finishes_keep_the_steady_step(allocator):
    """With room, only a batch's first step and the steps whose rows are all new prompts take the
    general path: requests waiting (admitted after the rows), rows that finished (dropped) and
    sequences that joined (decoding after the rows) keep the rest steady."""
    steps, _, num_steady = _run(True, (f"allocator={allocator}",), seed=3)
    rows = [step[0] for step in steps]
    all_new = sum(1 for r in rows if all(n > 1 for _, n, _, _ in r))
    assert num_steady == len(steps) - all_new, (num_steady, len(steps), all_new)


def _same(a: HostBatch, b: HostBatch) -> None:
    for field in dataclasses.fields(HostBatch):
        x, y = getattr(a, field.name), getattr(b, field.name)
        if field.name in ("decode", "prefill"):
            assert (x is None) == (y is None), field.name
            if x is None:
                continue
            for rows_field in dataclasses.fields(x):
                u, v = getattr(x, rows_field.name), getattr(y, rows_field.name)
                if isinstance(u, np.ndarray):
                    assert u.dtype == v.dtype and np.array_equal(u, v), rows_field.name
                else:
                    assert u == v, rows_field.name
        elif isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and np.array_equal(x, y), field.name
        else:
            assert x == y, field.name


# an up-front reservation's tables are whole from admission: at a block's edge a row's table has
# not grown (`PersistentBatch._extend_tables` must not take it for one block more)
POW2 = ("+allocator.reservation.max_model_len=128",
        "allocator.reservation._target_=paged.memory.reservation.Pow2Reservation")


@pytest.mark.parametrize("overrides", [(), TIGHT, POW2], ids=["roomy", "tight", "pow2"])
def test_the_persistent_batch_plans_what_plan_batch_plans(overrides):
    engine = make_engine("allocator=prefix", *overrides)
    scheduler, bs = engine.scheduler, engine.block_size
    batch = PersistentBatch(bs)
    requests = _requests(seed=5, n=24)
    for r in requests[:12]:
        engine.add_request(r)
    step = 0
    while engine.has_unfinished or step < 40:
        if step == 40:  # arrivals into a steady batch
            for r in requests[12:]:
                engine.add_request(r)
        sched = scheduler.schedule(engine.clock.now())
        output = ExecutorOutput([])
        if sched.scheduled:
            expected = plan_batch(sched, bs)
            planned = batch.plan(sched)
            if planned is None:
                batch.keep(sched, expected)
            else:
                _same(planned, expected)
            output = engine.executor.execute(sched)
        scheduler.update_from_output(sched, output, engine.clock.now())
        step += 1
    assert 10 <= batch.num_planned < step, (batch.num_planned, step)  # both paths ran


def test_a_decode_step_samples_every_row_without_a_copy_of_the_hidden_states():
    """A decode step whose rows all sample reads the logits of the hidden states as they are."""
    import torch

    from paged.executor.step_plan import InputBuffers
    from paged.executor.step_sampling import sampled_logits

    class Logits:
        def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
            self.seen = hidden
            return hidden

    host = HostBatch(np.zeros(3, np.int64), np.zeros(3, np.int64), np.zeros(3, np.int64), np.arange(3), None, None)
    hidden = torch.arange(6.0).view(3, 2)
    model = Logits()
    sampled_logits(model, hidden, InputBuffers(torch.device("cpu")).upload(host))
    assert model.seen is hidden
    fewer = dataclasses.replace(host, sample_rows=np.array([0, 2]))
    assert torch.equal(sampled_logits(model, hidden, InputBuffers(torch.device("cpu")).upload(fewer)), hidden[[0, 2]])
