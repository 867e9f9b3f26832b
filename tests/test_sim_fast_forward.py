"""executor.fast_forward: summary.json and requests.jsonl byte-identical to stepping one iteration
at a time, over a reference set small enough for CI: every scheduler policy, chunked prefill on and
off, prefix caching, beams, swap, eviction policies and a CPU tier, KV groups, fleets behind each
router, disaggregation. And the bad input: fast-forward on a real executor."""

from __future__ import annotations

import pytest

from paged.config import ConfigError, compose_config
from paged.engine.builder import check_config
from paged.engine.fast_forward import FastForward
from paged.experiment.run import run_experiment

# the summary keys that time the host: the only ones two runs of one config may differ in
HOST_KEYS = ('"host_time_s"', '"load_time_s"', '"sim_seconds_per_host_second"')

BASE = ["executor=sim", "model=llama-3-8b", "hardware=h100-sxm", "kernel=vllm", "workload=sharegpt",
        "workload.num_requests=24", "workload.arrival_rate=8", "workload.output_len_max=160",
        "scheduler.max_model_len=2048", "logger=none", "progress=false"]
TIGHT = ["allocator.num_blocks=120"]  # preemptions and admission waits
FLEET = ["cluster.num_replicas=3", "workload.num_requests=36", "workload.arrival_rate=12"]
PREFIX_FLEET = ["router=prefix-aware", "allocator=prefix", "workload.shared_prefix_len=64", "workload.num_prefixes=12",
                "allocator.num_blocks=160"]

CASES = {
    **{f"policy-{p}": [f"scheduler={p}"] for p in
       ("fcfs", "fair", "lpm", "mlfq", "prefill-first", "priority", "sjf", "sjf-oracle")},
    "unchunked": ["scheduler.chunked_prefill=false"],
    "chunked-tight": ["scheduler.chunked_prefill=true", "scheduler.max_num_batched_tokens=512", *TIGHT],
    "prefix": ["allocator=prefix", "workload.shared_prefix_len=64", "workload.num_prefixes=3"],
    "beam": ["workload.use_beam_search=true", "workload.n=3", "workload.best_of=3"],
    "parallel-samples": ["workload.n=2"],
    "swap": ["scheduler.preemption_mode=swap", *TIGHT],
    "recompute": TIGHT,
    "orca-max": ["allocator=orca-max"],
    "eviction-lfu": ["allocator=prefix", "allocator/eviction=lfu", "workload.shared_prefix_len=64",
                     "workload.num_prefixes=6", *TIGHT],
    "eviction-s3fifo": ["allocator=prefix", "allocator/eviction=s3fifo", "workload.shared_prefix_len=64",
                        "workload.num_prefixes=6", *TIGHT],
    "cpu-tier": ["allocator=prefix", "allocator.offload.cpu_bytes=1GiB", "workload.shared_prefix_len=64",
                 "workload.num_prefixes=6", *TIGHT],
    "kv-groups": ["model=gemma-3-27b", "workload.num_requests=12"],
    **{f"fleet-{r}": [*FLEET, f"router={r}"] for r in ("round-robin", "least-loaded", "prefix-aware", "session")},
    "disaggregated": ["+deploy=1p3d", "workload.num_requests=24"],
    # block edges at every step, and every fourth: the block manager's calls inside a bulk of steps
    "block-size-1": ["allocator=prefix", "allocator.block_size=1", "workload.shared_prefix_len=64",
                     "workload.num_prefixes=3"],
    "block-size-4": ["allocator=prefix", "allocator.block_size=4", "workload.shared_prefix_len=64",
                     "workload.num_prefixes=3"],
    "follow-ups": ["workload=multiturn", "workload.num_requests=24"],  # the horizon is a follow-up's due time
    # a replica's finishing step releases a follow-up due almost at once, routed by the others' load:
    # while follow-ups are held a replica runs only up to the next busy replica's clock
    # a lagging replica answers the router's prefix reads without running its window where they cannot
    # change, and runs it first where an eviction or a publish could
    "fleet-prefix-shared": [*FLEET, *PREFIX_FLEET],
    "fleet-follow-ups": ["cluster.num_replicas=3", "router=least-loaded", "workload=multiturn",
                         "workload.num_requests=48", "workload.think_time_s=0.001", "workload.num_sessions=12",
                         "workload.arrival_rate=4"],
}


def _outputs(overrides: list[str], path) -> dict[str, str]:
    run_experiment(compose_config(overrides), path)
    summary = "".join(line for line in (path / "summary.json").read_text().splitlines(keepends=True)
                      if not line.lstrip().startswith(HOST_KEYS))
    return {"summary.json": summary, "requests.jsonl": (path / "requests.jsonl").read_text()}


@pytest.mark.parametrize("case", list(CASES))
def test_fast_forward_is_byte_identical(case: str, tmp_path) -> None:
    overrides = [*BASE, *CASES[case]]
    on = _outputs([*overrides, "executor.fast_forward=true"], tmp_path / "on")
    off = _outputs([*overrides, "executor.fast_forward=false"], tmp_path / "off")
    assert on["requests.jsonl"] == off["requests.jsonl"]
    assert on["summary.json"] == off["summary.json"]


def test_fast_forward_skips_steps() -> None:
    """It does fast-forward: on a decode-heavy load most steps are windows' steps."""
    from paged.engine.builder import build_engine
    from paged.engine.runner import run_workload
    from paged.experiment.run import workload_for

    cfg = compose_config([*BASE, "executor.fast_forward=true"])
    engine = build_engine(cfg)
    ff = engine.fast_forward
    assert isinstance(ff, FastForward)
    engine.metrics.keep_steps = False  # as run_experiment's: a run that keeps records runs a step a call
    run_workload(engine, workload_for(cfg, engine), progress=False)
    assert ff.num_steps > engine.metrics.step_stats.num_steps / 2
    # drive's horizon (the next arrival) lets a call run many of a window's steps
    assert ff.num_calls < ff.num_steps / 4


def _stop_run(fast_forward: bool, stops: dict[int, int]) -> tuple[list, dict]:
    """The BASE workload with request i stopping at token stops[i]: each request's tokens, times and
    finish reason, and the step statistics."""
    import dataclasses

    from paged.engine.builder import build_engine
    from paged.engine.runner import drive, to_request
    from paged.experiment.run import workload_for

    cfg = compose_config([*BASE, f"executor.fast_forward={str(fast_forward).lower()}"])
    engine = build_engine(cfg)
    engine.metrics.keep_steps = False
    items = workload_for(cfg, engine)
    requests = [to_request(dataclasses.replace(item, params=dataclasses.replace(
        item.params, stop_token_ids=[stops[i]] if i in stops else []))) for i, item in enumerate(items)]
    engine.clock.reset()
    drive(engine, requests)
    outcome = [(r.outputs()[0].token_ids, list(r.token_times), r.finish_reason) for r in requests]
    return outcome, engine.metrics.step_stats.summary(None)


def test_a_stop_token_ends_a_bulk_of_steps_where_stepping_ends_it() -> None:
    """A stop token sampled inside a window ends it before that step (the finishing step is
    stepped): tokens, times and statistics as stepping has them."""
    plain, _ = _stop_run(False, {})
    # a token from the middle of some outputs: the request stops at its first occurrence
    stops = {i: plain[i][0][len(plain[i][0]) // 2] for i in range(0, len(plain), 3) if len(plain[i][0]) > 8}
    on, on_stats = _stop_run(True, stops)
    off, off_stats = _stop_run(False, stops)
    assert on == off and on_stats == off_stats
    stopped = [i for i in stops if on[i][2].value == "stop"]
    assert stopped and all(len(on[i][0]) < len(plain[i][0]) for i in stopped)


def test_fast_forward_on_a_real_executor_is_a_config_error() -> None:
    cfg = compose_config(["executor=model", "model=tiny-random", "executor.fast_forward=true"])
    with pytest.raises(ConfigError, match="executor=sim"):
        check_config(cfg)


def test_fleet_replicas_lag_behind_arrivals_routed_elsewhere() -> None:
    """A replica inside its window lags: an arrival its router sends elsewhere (round-robin reads
    nothing) does not run its steps; they run later, many per call."""
    from paged.cluster.fleet_builder import build_fleet
    from paged.engine.runner import run_workload
    from paged.experiment.run import workload_for

    cfg = compose_config([*BASE, *FLEET, "router=round-robin", "executor.fast_forward=true"])
    fleet = build_fleet(cfg)
    forwards = [replica.engine.fast_forward for replica in fleet.replicas]
    assert all(isinstance(ff, FastForward) for ff in forwards)
    route = fleet.router.route
    behind = 0  # (arrival, replica not chosen) where the replica's clock was behind the arrival

    def spy(request, replicas):
        nonlocal behind
        chosen = route(request, replicas)
        behind += sum(r is not chosen and r.clock.now() < request.arrival_time for r in replicas)
        return chosen

    fleet.router.route = spy  # type: ignore[method-assign]
    fleet.metrics.keep_steps = False  # as run_experiment's: no step record, so the replicas may lag
    assert fleet.lags
    items = workload_for(cfg, fleet)
    run_workload(fleet, items, progress=False)
    assert behind > 0
    calls, steps = sum(ff.num_calls for ff in forwards), sum(ff.num_steps for ff in forwards)
    # running every replica to every arrival took a call per replica and arrival at least
    assert calls < steps / 4 and calls < len(items) * len(forwards)


def test_a_lagging_replica_answers_a_prefix_read_as_its_steps_would() -> None:
    """Where a lagging replica answers the prefix-aware router's read without running its window
    (`window_horizon.prefix_unchanged`), running the window up to the arrival first gives the same
    answer: over a fleet with shared prefixes and a pool small enough to evict them."""
    from paged.cluster.fleet_builder import build_fleet
    from paged.engine.runner import run_workload
    from paged.experiment.run import workload_for
    from paged.memory.hashing import prompt_block_hashes

    cfg = compose_config([*BASE, *FLEET, *PREFIX_FLEET, "executor.fast_forward=true"])
    fleet = build_fleet(cfg)
    fleet.metrics.keep_steps = False
    route = fleet.router.route
    lazy = ran = 0

    def check(request, replicas):
        nonlocal lazy, ran
        chain = prompt_block_hashes(request.prompt_token_ids, replicas[0].block_size, request.cache_salt)
        for replica in replicas:
            before = replica.clock.now()
            answer = replica.cached_prefix_blocks(chain)
            if replica.clock.now() != before:
                ran += 1  # the replica could not tell: it ran its steps up to the arrival
                continue
            if before < replica.reads_at and replica.engine.scheduler.running:
                lazy += 1
                replica.run_window_to(replica.reads_at)
                assert replica.cached_prefix_blocks(chain) == answer
        return route(request, replicas)

    fleet.router.route = check  # type: ignore[method-assign]
    run_workload(fleet, workload_for(cfg, fleet), progress=False)
    assert lazy > 0 and ran > 0


def test_a_window_call_leaves_its_last_steps_cost() -> None:
    """After a call of many window steps the executor's `last_cost` (built when read) is the cost
    of the call's last step, as stepping leaves it."""
    from paged.engine.builder import build_engine
    from paged.engine.runner import to_request
    from paged.experiment.run import workload_for

    cfg = compose_config([*BASE, "executor.fast_forward=true"])
    engine = build_engine(cfg)
    engine.metrics.keep_steps = False
    ff = engine.fast_forward
    assert isinstance(ff, FastForward)
    for item in workload_for(cfg, engine)[:4]:
        engine.add_request(to_request(item))
    checked = 0
    while engine.has_unfinished and checked < 5:
        before = ff.num_steps
        engine.step(engine.clock.now() + 0.2)
        ran = ff.num_steps - before
        window = ff._window
        if ran > 1 and window is not None:
            last = engine.executor.decode_cost([c - 1 for c in window.contexts])
            assert engine.executor.last_cost == last and repr(engine.executor.last_cost) == repr(last)
            checked += 1
    assert checked == 5
