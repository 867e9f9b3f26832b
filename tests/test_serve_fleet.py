"""The server over a fleet in this process (issue 48): two tiny-random replicas behind a round-robin
router, greedy outputs over HTTP equal to `LLM.generate`'s, a client that leaves frees its blocks on
its replica, /metrics adds the replicas up; and the fleet the server refuses (disaggregated)."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from paged import LLM, SamplingParams
from paged.api.options import EngineArgs, llm_config
from paged.cluster.fleet import Fleet
from paged.cluster.fleet_builder import build_fleet
from paged.config import ConfigError, compose_config
from paged.serve.server import BackgroundServer, check_server_config, limits_for

MODEL = "tiny-random"
ARGS = {"max_model_len": 256, "max_num_seqs": 8}
FLEET = ["cluster.num_replicas=2", "cluster.backend=local", "router=round-robin"]
PROMPTS = ["The capital of France is", "Hello", "Once upon a time, in a land far away,", "One two three"]


@pytest.fixture(scope="module")
def fleet() -> Fleet:
    built = build_fleet(llm_config(MODEL, overrides=FLEET, engine_args=_engine_args()))
    assert isinstance(built, Fleet) and len(built.replicas) == 2
    return built


def _engine_args() -> EngineArgs:
    return EngineArgs.from_kwargs(dict(ARGS), own=())


@pytest.fixture(scope="module")
def server(fleet: Fleet) -> Iterator[BackgroundServer]:
    running = BackgroundServer(fleet, limits_for(llm_config(MODEL, engine_args=_engine_args()), fleet)).start()
    yield running
    running.stop()


def _metric(server: BackgroundServer, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", httpx.get(f"{server.url}/metrics").text, re.MULTILINE)
    assert match is not None, f"{name} not in /metrics"
    return float(match.group(1))


def test_fleet_greedy_outputs_over_http_equal_llm_generate(server: BackgroundServer) -> None:
    expected = LLM(MODEL, **ARGS).generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                                           use_tqdm=False)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    greedy = {"temperature": 0.0, "max_tokens": 12, "extra_body": {"ignore_eos": True}}
    whole = client.completions.create(model=MODEL, prompt=PROMPTS, **greedy)
    assert [c.text for c in whole.choices] == [o.text for o in expected]
    streamed = client.completions.create(model=MODEL, prompt=PROMPTS[2], stream=True, **greedy)
    assert "".join(c.choices[0].text for c in streamed) == expected[2].text
    # round robin: both replicas served
    assert all(row["num_finished"] >= 2 for row in server.engine.replica_rows())


def test_a_client_that_leaves_frees_its_blocks_on_its_replica(server: BackgroundServer) -> None:
    fleet = server.engine
    body = {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 200, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()  # kept: an iterator dropped closes the response
        assert next(line for line in lines if line.startswith("data: "))
        # /metrics is the fleet's: the sum of the replicas' pools
        in_use = _metric(server, "paged_kv_blocks_in_use")
        assert in_use > 0
        assert _metric(server, "paged_kv_cache_usage_ratio") > 0
    request = server.engine_loop.requests[-1]
    deadline = time.monotonic() + 30
    while request.finish_time is None or _metric(server, "paged_kv_blocks_in_use") != 0:
        assert time.monotonic() < deadline, "the aborted request's blocks were not freed"
        time.sleep(0.05)
    assert request.abort_reason == "client disconnected" and len(request.outputs()[0].token_ids) < 200
    assert all(not replica.held and replica.engine.kv_stats().num_allocated_blocks == 0 for replica in fleet.replicas)
    assert sum(row["num_aborted"] for row in fleet.replica_rows()) == 1
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_metrics_sum_the_replicas(server: BackgroundServer) -> None:
    total = sum(r.engine.kv_stats().num_total_blocks for r in server.engine.replicas)
    one = server.engine.replicas[0].engine.kv_stats().num_total_blocks
    assert total == 2 * one
    assert _metric(server, "paged_kv_blocks_total") == total


def test_the_server_refuses_fleets_that_cannot_abort_one_request() -> None:
    check_server_config(compose_config([f"model={MODEL}", "server.port=0", *FLEET]))
    # Ray replicas abort one request too (tests/test_serve_ray.py)
    check_server_config(compose_config([f"model={MODEL}", "server.port=0", "cluster.num_replicas=2"]))
    sim = ["executor=sim", "model=llama-3-8b", "hardware=h100-sxm", "cluster.prefill_replicas=1",
           "cluster.decode_replicas=1"]
    with pytest.raises(ConfigError, match="cluster.prefill_replicas=1: the server cannot run a disaggregated fleet"):
        check_server_config(compose_config(sim))
