"""The run's progress bar (paged/engine/progress.py): requests finished out of the total, and in its
postfix the requests running and waiting and the input and output tokens per second so far, on
`drive` (run.py's runs, a fleet's) and `LLM.generate`; nothing at all with it off."""

from __future__ import annotations

import io
import re
from dataclasses import dataclass

import pytest

from paged import LLM, SamplingParams
from paged.cluster.fleet import Fleet
from paged.cluster.fleet_builder import build_fleet
from paged.config import compose_config
from paged.engine import progress
from paged.engine.builder import build_engine
from paged.engine.progress import RunProgress
from paged.engine.runner import drive, run_workload
from paged.experiment.run import run_experiment, workload_for
from paged.request import Request
from tests.engine_helpers import make_engine

# a batch of 4 seats for 12 requests: some wait while others run (a model whose spec is in its yaml:
# the default one's is read from its weights file, seconds)
SIM = [
    "executor=sim", "model=llama-3-8b", "hardware=h100-sxm", "logger=none", "workload.num_requests=12",
    "scheduler.max_num_seqs=4",
]
BAR = re.compile(
    r"(?P<label>[^\r]*?): +\d+%\|[^|]*\| (?P<n>\d+)/(?P<total>\d+) \[[^\]]*?running: (?P<running>\d+), "
    r"waiting: (?P<waiting>\d+), (?P<speed>simulated speed|est\. speed) input: (?P<input>[\d.]+) toks/s, "
    r"output: (?P<output>[\d.]+) toks/s\]"
)


@dataclass
class Draw:
    label: str
    n: int
    total: int
    running: int
    waiting: int
    speed: str
    input: float
    output: float


def draws(text: str) -> list[Draw]:
    """Each drawing of the bar with a postfix, in order (tqdm redraws the line after a carriage return)."""
    found = []
    for line in text.split("\r"):
        if m := BAR.search(line):
            g = m.groupdict()
            found.append(Draw(g["label"].strip(), int(g["n"]), int(g["total"]), int(g["running"]),
                              int(g["waiting"]), g["speed"], float(g["input"]), float(g["output"])))
    return found


@pytest.fixture
def every_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Draw on every step: the bars `drive` opens read the module's interval when they open."""
    monkeypatch.setattr(progress, "MININTERVAL_S", 0.0)


def _sim_run(*overrides: str, progress_on: bool = True) -> None:
    cfg = compose_config([*SIM, *overrides])
    engine = build_engine(cfg)
    run_workload(engine, workload_for(cfg, engine), progress=progress_on)


def test_the_postfix_moves_mid_run_with_running_waiting_and_token_speeds(every_step, capsys) -> None:
    _sim_run()
    out, err = capsys.readouterr()
    seen = draws(err)
    assert seen and not draws(out)  # stderr only: stdout stays the caller's
    assert {d.label for d in seen} == {"requests"} and {d.total for d in seen} == {12}
    # before any request finished, the postfix already shows the batch, the queue and both speeds
    mid = [d for d in seen if d.n == 0 and d.running and d.input > 0 and d.output > 0]
    assert mid, "nothing moved before the first request finished"
    assert max(d.running for d in seen) == 4 and max(d.waiting for d in seen) == 8
    assert all(d.running + d.waiting + d.n <= 12 for d in seen)
    # on the simulator the speeds are in simulated seconds, and say so
    assert {d.speed for d in seen} == {"simulated speed"}
    # the count only grows, and reaches the total with the last step
    assert [d.n for d in seen] == sorted(d.n for d in seen)
    last = seen[-1]
    assert (last.n, last.running, last.waiting) == (12, 0, 0)


def test_the_speeds_are_the_tokens_of_the_run_over_its_clock(every_step, capsys) -> None:
    cfg = compose_config(SIM)
    engine = build_engine(cfg)
    requests = run_workload(engine, workload_for(cfg, engine), progress=True)
    last = draws(capsys.readouterr().err)[-1]
    elapsed = engine.clock.now()  # run_workload reset it when the run began
    prompt = sum(r.num_prompt_tokens for r in requests)
    generated = sum(len(c.token_ids) for r in requests for c in r.outputs())
    # no prefix is shared and nothing was preempted: every prompt token computed once
    assert last.input == pytest.approx(prompt / elapsed, rel=1e-3)
    assert last.output == pytest.approx(generated / elapsed, rel=1e-3)


def test_progress_false_draws_nothing(every_step, capsys) -> None:
    _sim_run(progress_on=False)
    out, err = capsys.readouterr()
    assert "requests" not in err and "toks/s" not in err + out


def test_draws_are_throttled_to_the_interval(capsys) -> None:
    cfg = compose_config(SIM)
    engine = build_engine(cfg)
    requests = [Request(str(i), [1] * 20, SamplingParams(max_tokens=20, ignore_eos=True)) for i in range(8)]
    for request in requests:
        engine.add_request(request)
    stream = io.StringIO()
    with RunProgress(engine, len(requests), mininterval=3600.0, file=stream) as bar:
        while engine.has_unfinished:
            bar.step(len(engine.step()))
    # an hour between draws: only the bar's opening line, without a postfix, in a run of 20+ steps
    assert len(engine.metrics.steps) >= 20 and not draws(stream.getvalue())
    assert "0/8" in stream.getvalue()


def test_a_fleet_reports_its_replicas_requests_together(every_step, capsys) -> None:
    cfg = compose_config([*SIM, "progress=true", "cluster.num_replicas=2"])
    fleet = build_fleet(cfg)
    assert isinstance(fleet, Fleet)
    run_workload(fleet, workload_for(cfg, fleet), progress=True)
    seen = draws(capsys.readouterr().err)
    # round robin gives each replica 6; after the first step (one replica's) 4 run there, 8 wait
    assert (seen[0].running, seen[0].waiting) == (4, 8)
    # both replicas' seats: up to 8 running, all of the 12 held
    assert max(d.running for d in seen) == 8 and all(d.running + d.waiting + d.n == 12 for d in seen)
    assert any(d.n == 0 and d.input > 0 and d.output > 0 for d in seen)
    last = seen[-1]
    assert (last.n, last.running, last.waiting) == (12, 0, 0)
    # over the simulated seconds its replicas ran, though the fleet's clock reads its idle time once all are done
    end = max(record.time_s for record in fleet.metrics.steps)
    generated = sum(record.num_sampled_tokens for record in fleet.metrics.steps)
    assert last.output == pytest.approx(generated / end, rel=1e-3) and last.output > 0


def test_request_counts_count_requests_not_their_sequences() -> None:
    engine = make_engine("scheduler.max_num_seqs=8")
    params = SamplingParams(n=3, max_tokens=6, ignore_eos=True, temperature=1.0, seed=0)
    requests = [Request(str(i), [1, 2, 3, 4], params) for i in range(4)]
    for request in requests:
        engine.add_request(request)
    assert engine.request_counts() == (0, 4)
    engine.step()
    # a request of n=3 takes 3 of the 8 seats: 2 run (6 sequences), 2 wait
    assert engine.request_counts() == (2, 2) and len(engine.scheduler.running) == 6
    drive(engine)
    assert engine.request_counts() == (0, 0)


def test_run_experiment_shows_the_bar_on_stderr_and_progress_false_hides_it(every_step, capsys, tmp_path) -> None:
    run_experiment(compose_config([*SIM, "progress=true"]), tmp_path / "on", progress_label="job 2/3")
    out, err = capsys.readouterr()
    assert {d.label for d in draws(err)} == {"job 2/3"} and not draws(out)
    run_experiment(compose_config([*SIM, "progress=false"]), tmp_path / "off")
    out, err = capsys.readouterr()
    assert "toks/s" not in err + out


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny-random")


def test_llm_generate_shows_the_bar_on_the_wall_clock_and_use_tqdm_false_hides_it(llm, every_step, capsys) -> None:
    prompts = ["The capital of France is", "Hello", "Once upon a time, in a land far away,"]
    params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0)
    llm.generate(prompts, params)
    seen = draws(capsys.readouterr().err)
    assert {d.label for d in seen} == {"Processed prompts"} and {d.speed for d in seen} == {"est. speed"}
    assert any(d.n == 0 and d.running == 3 and d.output > 0 for d in seen)
    assert seen[-1].n == 3
    llm.generate(prompts, params, use_tqdm=False)
    assert "Processed prompts" not in capsys.readouterr().err
