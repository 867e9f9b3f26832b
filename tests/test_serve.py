"""`python -m paged.serve` (issue 48): OpenAI's client and raw HTTP against the server on
127.0.0.1, streaming and not, greedy outputs equal to `LLM.generate` / `LLM.chat`, usage chunks only
when asked, a client that leaves frees its blocks, bad input is a 400 naming the field and the next
request is served, /health and /metrics; one run of the module entry point, stopped by SIGINT.

The server runs in a thread of the test process over the module's one tiny-random `LLM` (its engine
idles between calls, so the reference outputs come from the same engine)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from paged import LLM, SamplingParams
from paged.config import ConfigError, compose_config, validate
from paged.serve.server import BackgroundServer, check_server_config, limits_for

REPO = Path(__file__).resolve().parents[1]
MODEL = "tiny-random"
MAX_MODEL_LEN = 256
PROMPTS = ["The capital of France is", "Hello", "Once upon a time, in a land far away,"]
GREEDY = {"temperature": 0.0, "max_tokens": 12, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(MODEL, max_model_len=MAX_MODEL_LEN, max_num_seqs=8)


@pytest.fixture(scope="module")
def server(llm: LLM) -> Iterator[BackgroundServer]:
    running = BackgroundServer(llm.engine, limits_for(llm.config, llm.engine)).start()
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server: BackgroundServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _greedy(max_tokens: int = 12) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _sse(response: httpx.Response) -> list[str]:
    return [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]


def test_binds_127_0_0_1_by_default_and_lists_the_model(server: BackgroundServer, client: openai.OpenAI) -> None:
    assert compose_config([]).server.host == "127.0.0.1" and compose_config([]).server.port == 8000
    assert server.url.startswith("http://127.0.0.1:")
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}


def test_completions_greedy_equal_llm_generate_with_usage(llm: LLM, client: openai.OpenAI) -> None:
    expected = llm.generate(PROMPTS, _greedy(), use_tqdm=False)
    response = client.completions.create(model=MODEL, prompt=PROMPTS, **GREEDY)
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert [c.text for c in response.choices] == [o.text for o in expected]
    assert [c.finish_reason for c in response.choices] == ["length"] * 3
    prompt_tokens = sum(len(o.prompt_token_ids) for o in expected)
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (prompt_tokens, 36)
    # token ids as the prompt: the same tokens, the same output
    by_ids = client.completions.create(model=MODEL, prompt=expected[0].prompt_token_ids, **GREEDY)
    assert by_ids.choices[0].text == expected[0].text


def test_streamed_completion_joins_to_the_generate_text(llm: LLM, client: openai.OpenAI) -> None:
    (expected,) = llm.generate(PROMPTS[2], _greedy(20), use_tqdm=False)
    greedy_20 = {**GREEDY, "max_tokens": 20}
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[2], stream=True, **greedy_20))
    assert len(chunks) > 1 and all(len(c.choices) == 1 for c in chunks)
    assert "".join(c.choices[0].text for c in chunks) == expected.text
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.usage is None for c in chunks)


def test_a_usage_only_chunk_comes_last_only_when_asked(server: BackgroundServer) -> None:
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 5, "temperature": 0, "ignore_eos": True, "stream": True}
    for include_usage in (False, True):
        options = {"stream_options": {"include_usage": True}} if include_usage else {}
        with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, **options}, timeout=60) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            events = _sse(response)
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        empty = [c for c in chunks if not c["choices"]]
        if include_usage:
            assert empty == [chunks[-1]] and chunks[-1]["usage"]["completion_tokens"] == 5
        else:
            assert empty == [] and all("usage" not in c for c in chunks)


def test_chat_streamed_and_not_equal_llm_chat(llm: LLM, client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    (expected,) = llm.chat(messages, _greedy(), use_tqdm=False)
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=12,
                                           temperature=0, extra_body={"ignore_eos": True})
    assert whole.choices[0].message.content == expected.text and whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens == len(expected.prompt_token_ids) and whole.usage.completion_tokens == 12
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, stream=True, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text


def test_n_and_logprobs_over_http(client: openai.OpenAI) -> None:
    response = client.completions.create(model=MODEL, prompt="Hello", n=2, temperature=1.0, seed=3, max_tokens=4,
                                         logprobs=2, extra_body={"ignore_eos": True})
    assert [c.index for c in response.choices] == [0, 1]
    for choice in response.choices:
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
        assert all(len(top) <= 2 and v <= 0 for top, v in zip(lp.top_logprobs, lp.token_logprobs, strict=True))
        assert "".join(lp.tokens) == choice.text
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob >= t.logprob
                                     for t in content)


def _metric(server: BackgroundServer, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert match is not None, f"{name} not in /metrics"
    return float(match.group(1))


def _wait_for(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_client_that_disconnects_aborts_its_request_and_frees_its_blocks(server: BackgroundServer) -> None:
    aborted = '{finish_reason="aborted"}'
    before = _metric(server, f"paged_requests_finished_total{aborted}")
    body = {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 200, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        assert _metric(server, "paged_kv_blocks_in_use") > 0
    # the connection is closed mid-stream: the request is aborted, its blocks freed
    _wait_for(lambda: _metric(server, f"paged_requests_finished_total{aborted}") == before + 1)
    assert _metric(server, "paged_kv_blocks_in_use") == 0
    request = server.engine_loop.requests[-1]
    assert request.abort_reason == "client disconnected" and len(request.outputs()[0].token_ids) < 200
    assert httpx.get(f"{server.url}/health").status_code == 200


BAD = [
    ("not json", "{", None, "not valid JSON"),
    ("unknown model", {"model": "gpt-4", "prompt": "Hi"}, "model", "'gpt-4' is not served here"),
    ("negative max_tokens", {"prompt": "Hi", "max_tokens": -3}, "max_tokens", "max_tokens must be an integer >= 1"),
    ("huge max_tokens", {"prompt": "Hi", "max_tokens": 10**9}, "max_tokens", f"max_model_len={MAX_MODEL_LEN}"),
    ("prompt too long", {"prompt": [1] * (MAX_MODEL_LEN + 1)}, "prompt", f"more than max_model_len={MAX_MODEL_LEN}"),
    ("token id out of vocabulary", {"prompt": [1, 10**7]}, "prompt", "outside the vocabulary"),
    ("n over the engine's limit", {"prompt": "Hi", "n": 9}, "n", "max_num_seqs=8"),
    ("bad top_p", {"prompt": "Hi", "top_p": 0}, "top_p", "top_p must be in (0, 1]"),
    ("bad stop", {"prompt": "Hi", "stop": 3}, "stop", "stop must be a string or a list of strings"),
    ("no prompt", {"max_tokens": 3}, "prompt", "prompt is required"),
]


@pytest.mark.parametrize(("body", "param", "message"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_is_a_400_naming_the_field_and_the_next_request_is_served(
    server: BackgroundServer, body: object, param: str | None, message: str
) -> None:
    content = body if isinstance(body, str) else json.dumps(body)
    response = httpx.post(f"{server.url}/v1/completions", content=content, timeout=60)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and message in error["message"]
    good = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 2


def test_bad_chat_input_names_messages_and_unknown_fields_are_ignored(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user"}], max_tokens=2)
    assert caught.value.body["param"] == "messages"
    response = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=2, extra_body={"some_vendor_field": {"x": 1}})
    assert response.usage.completion_tokens <= 2


def test_metrics_carry_the_summary_counters_and_histograms(server: BackgroundServer, client: openai.OpenAI) -> None:
    client.completions.create(model=MODEL, prompt="Hello", **GREEDY)
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("paged_time_to_first_token_seconds_count", "paged_time_per_output_token_seconds_count",
                 "paged_inter_token_latency_seconds_count", "paged_e2e_request_latency_seconds_count",
                 "paged_generation_tokens_total", "paged_prompt_tokens_total"):
        assert _metric(server, name) > 0
    for name in ("paged_kv_cache_usage_ratio", "paged_prefix_cache_hit_rate", "paged_num_preemptions_total",
                 "paged_num_requests_running", "paged_num_requests_waiting", "paged_kv_blocks_in_use"):
        assert re.search(rf"^{name} ", text, re.MULTILINE), name
    assert '# TYPE paged_time_to_first_token_seconds histogram' in text


def test_server_config_is_checked_before_weights_load() -> None:
    with pytest.raises(ConfigError, match=r"server.port=70000 must be in \[0, 65535\]"):
        validate(compose_config([f"model={MODEL}", "server.port=70000"]))
    with pytest.raises(ConfigError, match="executor=sim: the server runs a model on the wall clock"):
        check_server_config(compose_config(["executor=sim", "model=llama-13b", "hardware=a100-40g"]))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"server.port={port}: cannot listen there"):
            check_server_config(compose_config([f"model={MODEL}", f"server.port={port}"]))


@pytest.mark.subprocess
@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_python_m_paged_serve_stops_on_a_signal_aborts_what_runs_and_writes_the_run(
    tmp_path: Path, sig: int, code: int
) -> None:
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "paged.serve", f"model={MODEL}", "logger=none", "server.port=0",
           f"hydra.run.dir={run_dir}"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=dict(os.environ, WANDB_MODE="disabled"), stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stderr.readline, "")))
    reader.start()
    try:
        _wait_for(lambda: any("serving on" in line for line in lines) or proc.poll() is not None, timeout=180)
        url = re.search(r"serving on (\S+)", "".join(lines))
        assert url is not None, "".join(lines)[-2000:]
        done = httpx.post(f"{url.group(1)}/v1/completions", json={"prompt": "Hello", "max_tokens": 3}, timeout=60)
        assert done.status_code == 200
        # a stream in flight when the signal comes: it ends with finish_reason "abort", then [DONE]
        body = {"prompt": "Hello", "max_tokens": 1500, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url.group(1)}/v1/completions", json=body, timeout=60) as response:
            events = response.iter_lines()
            assert next(e for e in events if e.startswith("data: "))
            proc.send_signal(sig)
            rest = [e[len("data: "):] for e in events if e.startswith("data: ")]
        assert rest[-1] == "[DONE]" and json.loads(rest[-2])["choices"][0]["finish_reason"] == "abort"
        assert proc.wait(timeout=60) == code, "".join(lines)[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        reader.join(timeout=10)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["num_requests"], summary["num_finished"], summary["num_aborted"]) == (2, 1, 1)
    assert summary["interrupted"] is True and summary["kv_blocks_in_use_end"] == 0
    first, second = [json.loads(line) for line in (run_dir / "requests.jsonl").read_text().splitlines()]
    assert first["output_len"] == 3 and first["output_text"] == done.json()["choices"][0]["text"]
    assert second["abort_reason"] == "interrupted" and second["output_len"] < 1500
    assert "Traceback" not in "".join(lines)


@pytest.mark.slow
def test_smollm2_greedy_over_http_equals_llm_generate_streamed_and_not() -> None:
    smol = LLM("smollm2-135m", max_model_len=512, max_num_seqs=4)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    expected = [o.text for o in smol.generate(prompts, _greedy(16), use_tqdm=False)]
    served = BackgroundServer(smol.engine, limits_for(smol.config, smol.engine)).start()
    try:
        client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
        whole = client.completions.create(model="smollm2-135m", prompt=prompts, **{**GREEDY, "max_tokens": 16})
        assert [c.text for c in whole.choices] == expected
        for prompt, text in zip(prompts, expected, strict=True):
            chunks = client.completions.create(model="smollm2-135m", prompt=prompt, stream=True,
                                               **{**GREEDY, "max_tokens": 16})
            assert "".join(c.choices[0].text for c in chunks) == text
    finally:
        served.stop()
        smol.executor.shutdown()
