"""32 requests of bench_throughput.py's kind through `LLM("smollm2-135m")` in one generate call: output tok/s.

Run from the project root, once per tree and dtype, alternating (the old tree in a worktree):

    PYTHONPATH=<tree> python experiments/results/bench-vs-vllm/issue47-avx512bf16/tokps.py bfloat16|float32 \
        [num_requests] [override ...]
"""

from __future__ import annotations

import sys
import time
from importlib import resources
from pathlib import Path

from paged import LLM, SamplingParams

sys.path.insert(0, str(Path("experiments/cpu").resolve()))
from bench_throughput import make_requests  # noqa: E402  (sibling script, not a package)


def main() -> None:
    dtype = sys.argv[1]
    num_requests = int(sys.argv[2]) if len(sys.argv) > 2 else 32
    llm = LLM("smollm2-135m", overrides=[f"model.dtype={dtype}", *sys.argv[3:]])
    corpus = llm.executor.tokenizer.encode(resources.files("paged.data").joinpath("corpus.txt").read_text())
    prompts, outputs = make_requests(num_requests, 0, corpus)
    llm.generate(["hi"], [SamplingParams(max_tokens=4)], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    llm.generate(prompts, [SamplingParams(max_tokens=o, ignore_eos=True, temperature=0.0) for o in outputs],
                 use_tqdm=False)
    elapsed = time.perf_counter() - start
    print(f"{dtype} {sum(outputs) / elapsed:.1f} tok/s {elapsed:.2f}s")


if __name__ == "__main__":
    main()
