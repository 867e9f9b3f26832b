"""vLLM-CPU side of experiments/cpu/bench_vs_vllm.py; runs with the vLLM venv's python, never imports paged.

    python vllm_worker.py JOB.json

JOB.json: {"model_dir", "prompts" (token id lists), "output_lens", "dtype", "max_model_len", "result_dir"}.
The worker builds one `vllm.LLM` in `dtype` (float32 or bfloat16; the KV cache takes the model's
dtype, `kv_cache_dtype` is left at auto; its start time is measured apart from serving), writes
`ready.json`, then serves one round per line "round K" read from stdin, each from a reset prefix
cache, writing `round_K.json` (elapsed, per-request TTFT / TPOT, output token ids); "quit" or end
of input stops it. Results travel as files because vLLM logs to stdout. The thread binding comes
from VLLM_CPU_OMP_THREADS_BIND in the environment the benchmark sets.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

# 64 requests of at most 768 tokens need 2.3 GB of SmolLM2's fp32 KV (46 KB a token; bf16 half): no preemption
KV_CACHE_BYTES = 3 * 2**30


def omp_state(worker: Any = None) -> dict[str, Any]:
    """Threads of the process that runs the model (called there through collective_rpc)."""
    import torch

    return {"torch_threads": torch.get_num_threads(), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")}


def latencies(output: Any) -> tuple[float | None, float | None]:
    """TTFT and TPOT (s) from V1's RequestStateStats, filled only with disable_log_stats=False."""
    stats = output.metrics
    if stats is None or not stats.first_token_ts:
        return None, None
    n = stats.num_generation_tokens
    tpot = (stats.last_token_ts - stats.first_token_ts) / (n - 1) if n > 1 else None
    return stats.first_token_latency, tpot


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write then rename, so the benchmark polling for `path` never reads half a file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.rename(path)


def main() -> None:
    job = json.loads(Path(sys.argv[1]).read_text())
    result_dir = Path(job["result_dir"])
    # collective_rpc pickles `omp_state` to the model process; vLLM refuses pickled callables otherwise
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    start = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams

    # An explicit KV cache size: the default reserves 92% of memory, which fails on a shared machine.
    llm = LLM(model=job["model_dir"], dtype=job["dtype"], max_num_seqs=64, max_model_len=job["max_model_len"],
              kv_cache_memory_bytes=KV_CACHE_BYTES, disable_log_stats=False, seed=0)
    start_s = time.perf_counter() - start
    try:
        threads = llm.collective_rpc(omp_state)[0]
    except Exception as exc:  # the numbers are informative only; serving works without them
        threads = {"error": repr(exc)}
    write_json(result_dir / "ready.json", {"start_s": start_s, "vllm_version": vllm.__version__, "threads": threads})

    prompts = [{"prompt_token_ids": p} for p in job["prompts"]]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in job["output_lens"]]
    for line in sys.stdin:
        command = line.split()
        if not command or command[0] == "quit":
            break
        llm.reset_prefix_cache()  # each round starts cold, as paged's do
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        ttft, tpot = zip(*(latencies(o) for o in outputs))
        write_json(result_dir / f"round_{command[1]}.json", {
            "elapsed_s": elapsed, "ttft_s": list(ttft), "tpot_s": list(tpot),
            "outputs": [list(o.outputs[0].token_ids) for o in outputs],
        })


if __name__ == "__main__":  # vLLM's engine processes re-import this file: the guard keeps them from serving
    main()
