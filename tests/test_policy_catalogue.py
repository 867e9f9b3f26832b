"""The policy catalogue (LPM, priority preemption, VTC fair sharing, skip-join MLFQ, SJF with
output-length predictors), tested against the policies directly, plus every scheduler YAML
composing and building its policy."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from paged.config import CONF_DIR, ConfigError, compose_config
from paged.engine.builder import check_config
from paged.memory import BlockManager, PrefixCachingAllocator
from paged.request import Request, SamplingParams, SeqStatus, Sequence
from paged.scheduler.fair import DEFAULT_CLIENT, VTCPolicy
from paged.scheduler.length_predictor import (
    BucketMeanPredictor,
    NoPredictor,
    OraclePredictor,
    make_predictor,
)
from paged.scheduler.lpm import LPMPolicy
from paged.scheduler.mlfq import MLFQPolicy
from paged.scheduler.policy import SchedulingPolicy
from paged.scheduler.priority import PriorityPolicy
from paged.scheduler.sjf import SJFPolicy
from paged.step import ScheduledSeq, SchedulerOutput


def make_request(
    rid: str,
    prompt: int | list[int] = 8,
    *,
    arrival: float = 0.0,
    priority: int = 0,
    client: str | None = None,
    max_tokens: int = 16,
    ignore_eos: bool = True,
    n: int = 1,
) -> Request:
    tokens = list(range(1000, 1000 + prompt)) if isinstance(prompt, int) else prompt
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, temperature=0.0, n=n)
    return Request(rid, tokens, params, arrival_time=arrival, priority=priority, client_id=client)


def seq(rid: str, prompt: int | list[int] = 8, **kwargs: Any) -> Sequence:
    return make_request(rid, prompt, **kwargs).seqs[0]


def generate(s: Sequence, num_tokens: int) -> None:
    """`s` has produced `num_tokens` more output tokens, all computed but the last."""
    s.token_ids.extend(range(7, 7 + num_tokens))
    s.num_computed_tokens = s.num_tokens - 1


def step(*rows: tuple[Sequence, int]) -> SchedulerOutput:
    return SchedulerOutput(scheduled=[ScheduledSeq(s, num_new, []) for s, num_new in rows])


def ids(seqs: list[Sequence]) -> list[str]:
    return [s.request.request_id for s in seqs]


# -- LPM -------------------------------------------------------------------------------------------


def cached_manager(prefix: list[int]) -> BlockManager:
    """A prefix-caching manager whose cache holds `prefix` (computed, published, then freed)."""
    bm = BlockManager(PrefixCachingAllocator(64, 4))
    s = seq("cached", prefix)
    s.num_computed_tokens = bm.allocate(s)
    s.num_computed_tokens = s.num_tokens
    bm.mark_computed(s)
    bm.free(s)
    return bm


SHARED = list(range(1, 17))  # four blocks of 4


def lpm_queue() -> list[Sequence]:
    return [
        seq("none", list(range(100, 120)), arrival=0.0),
        seq("two-blocks-early", [*SHARED[:8], *range(200, 210)], arrival=1.0),
        seq("three-blocks", [*SHARED[:12], *range(300, 310)], arrival=2.0),
        seq("two-blocks-late", [*SHARED[:8], *range(400, 410)], arrival=3.0),
    ]


def test_lpm_admits_longest_cached_prefix_first_ties_by_arrival():
    bm = cached_manager(SHARED)
    policy = LPMPolicy()
    policy.bind(bm)
    queue = lpm_queue()
    assert [bm.num_cached_tokens(s) for s in queue] == [0, 8, 12, 8]
    assert ids(policy.order(queue, now=5.0)) == ["three-blocks", "two-blocks-early", "two-blocks-late", "none"]


def test_lpm_falls_back_to_fcfs_above_the_threshold():
    policy = LPMPolicy(fcfs_above=3)
    policy.bind(cached_manager(SHARED))
    queue = lpm_queue()
    assert ids(policy.order(queue, now=5.0)) == ["none", "two-blocks-early", "three-blocks", "two-blocks-late"]
    assert ids(policy.order(queue[1:], now=5.0)) == ["three-blocks", "two-blocks-early", "two-blocks-late"]


def test_lpm_serves_running_sequences_first_come_first_served_and_preempts_the_newest():
    policy = LPMPolicy()
    policy.bind(cached_manager(SHARED))
    running = lpm_queue()
    for s in running:
        s.status = SeqStatus.RUNNING
    assert ids(policy.order(running, now=5.0)) == ["none", "two-blocks-early", "three-blocks", "two-blocks-late"]
    assert policy.choose_victim(running, now=5.0).request.request_id == "two-blocks-late"
    assert not policy.preemptive


def test_lpm_rejects_a_negative_threshold():
    with pytest.raises(ValueError, match="fcfs_above must be an integer >= 0"):
        LPMPolicy(fcfs_above=-1)


# -- priority ---------------------------------------------------------------------------------------


def test_priority_outranks_only_on_a_strictly_lower_priority_value():
    policy = PriorityPolicy()
    assert policy.preemptive
    running = seq("running", priority=1, arrival=5.0)
    assert policy.outranks(seq("urgent", priority=0, arrival=9.0), running, now=10.0)
    # earlier arrival at equal priority (vLLM V0 would preempt) does not
    assert not policy.outranks(seq("same", priority=1, arrival=0.0), running, now=10.0)
    assert not policy.outranks(seq("lower", priority=2, arrival=0.0), running, now=10.0)


def test_priority_orders_by_priority_then_arrival_and_preempts_the_least_important():
    policy = PriorityPolicy(preempt=False)
    assert not policy.preemptive
    queue = [seq("p1-late", priority=1, arrival=2.0), seq("p0", priority=0, arrival=3.0),
             seq("p1-early", priority=1, arrival=1.0), seq("p2", priority=2, arrival=0.0)]
    assert ids(policy.order(queue, now=4.0)) == ["p0", "p1-early", "p1-late", "p2"]
    assert policy.choose_victim(queue, now=4.0).request.request_id == "p2"


def test_priority_rejects_a_non_boolean_preempt():
    with pytest.raises(ValueError, match="preempt must be true or false"):
        PriorityPolicy(preempt="no")  # type: ignore[arg-type]


# -- VTC fair sharing -------------------------------------------------------------------------------


def add(policy: SchedulingPolicy, s: Sequence, now: float = 0.0) -> Sequence:
    policy.on_add(s.request, now)
    return s


def test_vtc_counts_weighted_prefill_and_decode_service_per_client():
    policy = VTCPolicy()
    a, b = add(policy, seq("a", 10, client="a")), add(policy, seq("b", 4, client="b"))
    policy.on_scheduled(step((a, 10), (b, 4)), now=1.0)
    assert policy.counters == {"a": 10.0, "b": 4.0}
    generate(a, 1)
    policy.on_scheduled(step((a, 1)), now=2.0)  # a decode row: output_weight 2
    assert policy.counters["a"] == 12.0
    # a recompute after preemption is prefill service, though the sequence has output
    a.num_computed_tokens = 0
    policy.on_scheduled(step((a, a.num_tokens)), now=3.0)
    assert policy.counters["a"] == 12.0 + 11


def test_vtc_admits_the_least_served_client_first_interleaving_backlogs():
    policy = VTCPolicy(input_weight=1.0, output_weight=2.0)
    heavy = [add(policy, seq(f"heavy-{i}", 8, client="heavy", arrival=float(i))) for i in range(3)]
    light = add(policy, seq("light", 8, client="light", arrival=5.0))
    # equal counters: heavy-0 arrived first; its prompt then counts against heavy before the next pick
    assert ids(policy.order([*heavy, light], now=6.0)) == ["heavy-0", "light", "heavy-1", "heavy-2"]
    policy.on_scheduled(step((heavy[0], 8)), now=6.0)
    assert ids(policy.order([*heavy[1:], light], now=7.0)) == ["light", "heavy-1", "heavy-2"]


def test_vtc_lifts_a_returning_clients_counter_to_the_least_active_one():
    policy = VTCPolicy()
    a, b = add(policy, seq("a", 100, client="a")), add(policy, seq("b", 50, client="b"))
    idle = add(policy, seq("idle", 10, client="idle"))
    policy.on_scheduled(step((a, 100), (b, 50), (idle, 10)), now=1.0)
    policy.on_finished(idle.request, now=2.0)
    # a newcomer starts at the least active counter, not at 0
    add(policy, seq("new", 4, client="new"), now=3.0)
    assert policy.counters["new"] == 50.0
    # a client back from idle cannot bank the service it skipped...
    add(policy, seq("idle-again", 4, client="idle"), now=4.0)
    assert policy.counters["idle"] == 50.0
    # ...and one that stays active keeps its own counter, even above the floor
    add(policy, seq("a-2", 4, client="a"), now=5.0)
    assert policy.counters["a"] == 100.0


def test_vtc_lifts_to_the_last_client_to_leave_when_none_is_active():
    policy = VTCPolicy()
    a = add(policy, seq("a", 30, client="a"))
    policy.on_scheduled(step((a, 30)), now=1.0)
    policy.on_add(a.request, now=1.5)  # re-queued after preemption: still one active request
    policy.on_finished(a.request, now=2.0)
    policy.on_finished(a.request, now=2.0)  # reported twice: counted once
    assert not policy.active
    add(policy, seq("b", 4, client="b"), now=3.0)
    assert policy.counters["b"] == 30.0


def test_vtc_preempts_the_newest_sequence_of_the_most_served_client():
    policy = VTCPolicy()
    a1, a2 = add(policy, seq("a1", 8, client="a", arrival=0.0)), add(policy, seq("a2", 8, client="a", arrival=1.0))
    b = add(policy, seq("b", 8, client="b", arrival=2.0))
    policy.on_scheduled(step((a1, 8), (a2, 8), (b, 8)), now=3.0)
    assert policy.choose_victim([a1, a2, b], now=4.0) is a2
    assert not policy.preemptive


def test_vtc_warns_once_when_requests_name_no_client(caplog: pytest.LogCaptureFixture):
    policy = VTCPolicy()
    with caplog.at_level(logging.WARNING, logger="paged.scheduler.fair"):
        add(policy, seq("x"))
        add(policy, seq("y"))
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "workload.num_clients" in warnings[0].getMessage()
    assert policy.active[DEFAULT_CLIENT] == 2


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"input_weight": -1.0}, "input_weight must be >= 0"),
        ({"output_weight": float("nan")}, "output_weight must be >= 0"),
        ({"input_weight": 0.0, "output_weight": 0.0}, "must not both be 0"),
    ],
)
def test_vtc_rejects_bad_weights(settings: dict[str, float], message: str):
    with pytest.raises(ValueError, match=message):
        VTCPolicy(**settings)


# -- MLFQ -------------------------------------------------------------------------------------------


def test_mlfq_skip_join_picks_the_highest_level_whose_quantum_covers_the_prefill():
    policy = MLFQPolicy(num_levels=4, base_quantum=8, quantum_ratio=2.0, prefill_tokens_per_quantum=64)
    assert policy.quanta == [8, 16, 32, 64]
    # prefill estimate = prompt / 64 iterations
    levels = {p: policy.join_level(make_request("r", p)) for p in (100, 512, 600, 2048, 3000, 10000)}
    assert levels == {100: 0, 512: 0, 600: 1, 2048: 2, 3000: 3, 10000: 3}


def test_mlfq_demotes_after_the_quantum_counting_a_request_once_per_step():
    policy = MLFQPolicy(num_levels=3, base_quantum=2, quantum_ratio=2.0, starvation_s=100.0)
    request = make_request("r", 8, n=2)
    first = request.seqs[0]
    second = first.fork(1)
    request.seqs.append(second)
    policy.on_add(request, now=0.0)
    assert policy.level(request, 0.0) == 0
    policy.on_scheduled(step((first, 1), (second, 1)), now=1.0)  # two rows, one iteration
    assert policy.level(request, 1.0) == 0
    policy.on_scheduled(step((first, 1), (second, 1)), now=2.0)
    assert policy.level(request, 2.0) == 1
    for t in range(3, 7):  # quantum 4 at level 1
        policy.on_scheduled(step((first, 1)), now=float(t))
    assert policy.level(request, 6.0) == 2
    policy.on_add(request, now=6.5)  # re-queued after preemption: keeps its level
    assert policy.level(request, 6.5) == 2
    for t in range(7, 40):  # the bottom level is FCFS: no further demotion
        policy.on_scheduled(step((first, 1)), now=float(t))
    assert policy.level(request, 40.0) == 2


def test_mlfq_promotes_a_starving_request_to_the_top_level():
    policy = MLFQPolicy(prefill_tokens_per_quantum=1, starvation_s=5.0)
    request = make_request("long", 1000, arrival=0.0)
    policy.on_add(request, now=0.0)
    assert policy.level(request, 4.9) == 3
    assert policy.level(request, 5.0) == 0
    # promotion sticks; it is then demoted by service again
    assert policy.level(request, 5.1) == 0
    for t in range(8):
        policy.on_scheduled(step((request.seqs[0], 1)), now=6.0 + t)
    assert policy.level(request, 14.0) == 1


def test_mlfq_preempts_lower_levels_and_picks_the_newest_of_the_lowest_level():
    policy = MLFQPolicy(prefill_tokens_per_quantum=64)
    short = add(policy, seq("short", 64, arrival=3.0))
    long_old = add(policy, seq("long-old", 4000, arrival=0.0))
    long_new = add(policy, seq("long-new", 4000, arrival=1.0))
    mid = add(policy, seq("mid", 1000, arrival=2.0))
    assert policy.preemptive
    assert policy.outranks(short, mid, now=3.0)
    assert not policy.outranks(mid, short, now=3.0)
    assert not policy.outranks(long_old, long_new, now=3.0)  # same level: no preemption
    assert ids(policy.order([long_new, mid, short, long_old], now=3.0)) == ["short", "mid", "long-old", "long-new"]
    assert policy.choose_victim([short, mid, long_old, long_new], now=3.0) is long_new


def test_mlfq_forgets_finished_requests():
    policy = MLFQPolicy()
    s = add(policy, seq("r"))
    policy.on_finished(s.request, now=1.0)
    with pytest.raises(KeyError):
        policy.level(s.request, 2.0)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"num_levels": 0}, "num_levels must be an integer >= 1"),
        ({"base_quantum": 0}, "base_quantum must be an integer >= 1"),
        ({"prefill_tokens_per_quantum": 0}, "prefill_tokens_per_quantum must be an integer >= 1"),
        ({"quantum_ratio": 0.5}, "quantum_ratio must be >= 1"),
        ({"starvation_s": 0.0}, "starvation_s must be > 0"),
    ],
)
def test_mlfq_rejects_bad_settings(settings: dict[str, Any], message: str):
    with pytest.raises(ValueError, match=message):
        MLFQPolicy(**settings)


# -- output-length predictors -----------------------------------------------------------------------


def finished(rid: str, prompt: int, output: int, *, aborted: bool = False) -> Request:
    request = make_request(rid, prompt, max_tokens=max(output, 1))
    request.seqs[0].token_ids.extend(range(output))
    if aborted:
        request.abort_reason = "test"
    return request


def test_oracle_predicts_max_tokens_and_warns_when_eos_may_end_early(caplog: pytest.LogCaptureFixture):
    oracle = OraclePredictor(prior=1.0)
    with caplog.at_level(logging.WARNING, logger="paged.scheduler.length_predictor"):
        assert oracle.predict(make_request("r", max_tokens=321)) == 321
        assert not caplog.records
        assert oracle.predict(make_request("e", max_tokens=50, ignore_eos=False)) == 50
        oracle.predict(make_request("e2", max_tokens=50, ignore_eos=False))
    assert len(caplog.records) == 1 and "upper bound" in caplog.records[0].getMessage()


def test_bucket_mean_learns_per_prompt_length_bucket():
    predictor = BucketMeanPredictor(prior=77.0)
    probe = make_request("probe", 20)  # bucket [16, 32)
    assert predictor.predict(probe) == 77.0
    predictor.observe(finished("a", 100, 40))  # bucket [64, 128)
    predictor.observe(finished("b", 70, 20))
    predictor.observe(finished("aborted", 100, 1000, aborted=True))  # cut short: ignored
    assert predictor.predict(make_request("same-bucket", 127)) == 30.0
    assert predictor.predict(probe) == 30.0  # no finished request in its bucket: the global mean
    predictor.observe(finished("c", 16, 10))
    assert predictor.predict(probe) == 10.0
    assert predictor.predict(make_request("other", 2000)) == (40 + 20 + 10) / 3


def test_bucket_mean_takes_the_longest_completion():
    predictor = BucketMeanPredictor(prior=0.0)
    request = make_request("n2", 8, n=2)
    request.seqs.append(request.seqs[0].fork(1))
    request.seqs[0].token_ids.extend(range(3))
    request.seqs[1].token_ids.extend(range(9))
    predictor.observe(request)
    assert predictor.predict(make_request("probe", 8)) == 9.0


def test_none_predicts_no_output_and_unknown_names_list_the_registry():
    assert NoPredictor(prior=50.0).predict(make_request("r", max_tokens=500)) == 0.0
    assert isinstance(make_predictor("bucket-mean", 1.0), BucketMeanPredictor)
    with pytest.raises(ValueError, match="predictor must be one of 'bucket-mean', 'none', 'oracle', got 'gpt'"):
        make_predictor("gpt", 1.0)


# -- SJF --------------------------------------------------------------------------------------------


def sjf_queue() -> list[Sequence]:
    return [seq("short-prompt-long-output", 10, max_tokens=100), seq("long-prompt-short-output", 50, max_tokens=5)]


def test_sjf_ranks_by_prompt_plus_predicted_output():
    queue = sjf_queue()
    oracle = SJFPolicy(predictor="oracle", aging_tokens_per_s=0.0)
    assert [oracle.remaining(s) for s in queue] == [110, 55]
    assert ids(oracle.order(queue, now=0.0)) == ["long-prompt-short-output", "short-prompt-long-output"]
    none = SJFPolicy(predictor="none", aging_tokens_per_s=0.0)
    assert ids(none.order(queue, now=0.0)) == ["short-prompt-long-output", "long-prompt-short-output"]


def test_sjf_with_bucket_mean_learns_from_finished_requests():
    policy = SJFPolicy(predictor="bucket-mean", aging_tokens_per_s=0.0, prior=10.0)
    queue = sjf_queue()
    assert [policy.remaining(s) for s in queue] == [20, 60]
    # short prompts turn out to produce long outputs, long prompts short ones
    policy.on_finished(finished("a", 9, 200), now=1.0)  # bucket of 10
    policy.on_finished(finished("b", 40, 2), now=1.0)  # bucket of 50
    assert [policy.remaining(s) for s in queue] == [210, 52]
    assert ids(policy.order(queue, now=2.0)) == ["long-prompt-short-output", "short-prompt-long-output"]


def test_sjf_preempts_the_longest_predicted_remaining_job_and_ages_waiting_ones():
    policy = SJFPolicy(predictor="oracle", aging_tokens_per_s=10.0)
    nearly_done, barely_started = seq("nearly-done", 8, max_tokens=20), seq("barely-started", 8, max_tokens=20)
    generate(nearly_done, 18)
    generate(barely_started, 2)
    assert [policy.remaining(s) for s in (nearly_done, barely_started)] == [1 + 2, 1 + 18]
    assert policy.choose_victim([nearly_done, barely_started], now=0.0) is barely_started
    # a job that outran its prediction counts no output left
    generate(nearly_done, 5)
    assert policy.remaining(nearly_done) == 1
    # aging: a long job waiting 10 s at 10 tokens/s ranks ahead of a fresh job 90 tokens shorter
    old, fresh = seq("old", 100, max_tokens=10, arrival=0.0), seq("fresh", 10, max_tokens=10, arrival=10.0)
    assert ids(policy.order([fresh, old], now=10.0)) == ["old", "fresh"]


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"predictor": "magic"}, "predictor must be one of 'bucket-mean', 'none', 'oracle', got 'magic'"),
        ({"aging_tokens_per_s": -1.0}, "aging_tokens_per_s must be >= 0"),
        ({"prior": -5.0}, "prior must be >= 0"),
    ],
)
def test_sjf_rejects_bad_settings(settings: dict[str, Any], message: str):
    with pytest.raises(ValueError, match=message):
        SJFPolicy(**settings)


# -- every scheduler YAML -------------------------------------------------------------------------


SCHEDULERS = sorted(p.stem for p in (CONF_DIR / "scheduler").glob("*.yaml"))


def compose_scheduler(name: str, *overrides: str) -> Any:
    return compose_config([f"scheduler={name}", "executor=sim", "model=llama-2-7b", "logger=none", *overrides])


def test_the_catalogue_is_in_conf():
    assert {"fcfs", "priority", "sjf", "sjf-oracle", "lpm", "fair", "mlfq"} <= set(SCHEDULERS)


@pytest.mark.parametrize("name", SCHEDULERS)
def test_every_scheduler_yaml_composes_and_builds_its_policy(name: str):
    cfg = compose_scheduler(name)
    assert cfg.scheduler.name == name
    policy = check_config(cfg).policy.build()
    assert isinstance(policy, SchedulingPolicy)


def test_yaml_settings_reach_the_policies():
    assert isinstance(check_config(compose_scheduler("sjf-oracle")).policy.build().predictor, OraclePredictor)
    assert isinstance(check_config(compose_scheduler("sjf")).policy.build().predictor, BucketMeanPredictor)
    assert check_config(compose_scheduler("priority")).policy.build().preemptive
    mlfq = check_config(compose_scheduler("mlfq", "scheduler.policy.num_levels=2")).policy.build()
    assert mlfq.quanta == [8, 16]


@pytest.mark.parametrize(
    ("name", "override", "message"),
    [
        ("mlfq", "scheduler.policy.quantum_ratio=0.5", "quantum_ratio must be >= 1"),
        ("sjf", "scheduler.policy.predictor=magic", "predictor must be one of"),
        ("lpm", "scheduler.policy.fcfs_above=-1", "fcfs_above must be an integer >= 0"),
        ("fair", "scheduler.policy.output_weight=-2", "output_weight must be >= 0"),
    ],
)
def test_a_bad_yaml_setting_is_a_config_error_naming_it(name: str, override: str, message: str):
    plugin = check_config(compose_scheduler(name, override)).policy
    with pytest.raises(ConfigError, match=message):
        plugin.build()
