"""The server over a Ray fleet (issue 48): two tiny-random replicas as Ray actors behind a round-robin
router stream greedy outputs equal to `LLM.generate`'s token by token, and a client that leaves aborts
its request on its actor (`Fleet.abort` -> `EngineActor.abort`), whose blocks are freed there.

Ray and two replicas take seconds to start: one test, on a local Ray of two CPUs (as
tests/test_ray_fleet.py starts it)."""

from __future__ import annotations

import logging
import re
import time

import httpx
import openai
import pytest
import ray

from paged import LLM, SamplingParams
from paged.api.options import EngineArgs, llm_config
from paged.cluster.fleet_builder import build_fleet
from paged.cluster.ray_fleet import RayFleet
from paged.serve.server import BackgroundServer, limits_for

pytestmark = pytest.mark.subprocess

MODEL = "tiny-random"
ARGS = {"max_model_len": 256, "max_num_seqs": 8}
FLEET = ["cluster.num_replicas=2", "cluster.backend=ray", "router=round-robin"]
PROMPTS = ["The capital of France is", "Hello", "Once upon a time, in a land far away,", "One two three"]


def _metric(url: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", httpx.get(f"{url}/metrics").text, re.MULTILINE)
    assert match is not None, f"{name} not in /metrics"
    return float(match.group(1))


def test_a_ray_fleet_streams_greedy_tokens_and_frees_a_leaving_clients_blocks() -> None:
    expected = LLM(MODEL, **ARGS).generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                                           use_tqdm=False)
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level=logging.WARNING,
             object_store_memory=128 * 2**20)
    args = EngineArgs.from_kwargs(dict(ARGS), own=())
    fleet = build_fleet(llm_config(MODEL, overrides=FLEET, engine_args=args))
    assert isinstance(fleet, RayFleet)
    server = BackgroundServer(fleet, limits_for(llm_config(MODEL, engine_args=args), fleet)).start()
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        greedy = {"temperature": 0.0, "max_tokens": 12, "extra_body": {"ignore_eos": True}}
        whole = client.completions.create(model=MODEL, prompt=PROMPTS, **greedy)
        assert [c.text for c in whole.choices] == [o.text for o in expected]
        chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[2], stream=True, **greedy))
        assert "".join(c.choices[0].text for c in chunks) == expected[2].text
        assert len(chunks) > 2  # the actor's tokens reach the stream step by step, not all at the end

        body = {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 200, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()  # kept: an iterator dropped closes the response
            assert next(line for line in lines if line.startswith("data: "))
        request = server.engine_loop.requests[-1]
        deadline = time.monotonic() + 60
        while request.finish_time is None or _metric(server.url, "paged_kv_blocks_in_use") != 0:
            assert time.monotonic() < deadline, "the aborted request's blocks were not freed"
            time.sleep(0.05)
        assert request.abort_reason == "client disconnected" and len(request.outputs()[0].token_ids) < 200
        assert all(not r.held for r in fleet.replicas)
        assert all(r.kv_stats().num_allocated_blocks == 0 for r in fleet.replicas)  # the actors' own word
        assert sum(row["num_aborted"] for row in fleet.replica_rows()) == 1
        assert httpx.get(f"{server.url}/health").status_code == 200
    finally:
        server.stop()
        fleet.shutdown()
        ray.shutdown()
