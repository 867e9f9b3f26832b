"""One paged run of bench_vs_vllm's first 16 requests, outputs capped at 64 tokens; prints output tok/s.
Issue 33's quick A/B of process-wide settings (OMP_WAIT_POLICY, OMP_PROC_BIND), one process per run."""

import sys
import time
from importlib import resources
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from bench_throughput import make_requests  # noqa: E402

from paged import LLM, SamplingParams  # noqa: E402

llm = LLM("smollm2-135m", overrides=["scheduler.max_num_seqs=64"])
corpus = llm.executor.tokenizer.encode(resources.files("paged.data").joinpath("corpus.txt").read_text())
prompts, outs = make_requests(16, 0, corpus)
params = [SamplingParams(max_tokens=min(o, 64), ignore_eos=True, temperature=0.0) for o in outs]
llm.generate(prompts[:2], params[:2], use_tqdm=False)
start = time.perf_counter()
results = llm.generate(prompts, params, use_tqdm=False)
print(f"{sum(len(r.token_ids) for r in results) / (time.perf_counter() - start):.1f}")
