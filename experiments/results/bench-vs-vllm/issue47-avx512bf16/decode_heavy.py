"""A decode-heavy run: N prompts of 64 tokens, 96 tokens out each, greedy, best of two generate calls.

Run from the project root, old and new kernels alternating in separate processes:

    PAGED_KERNELS_DIR=<kernels_cu of a tree> \
        python experiments/results/bench-vs-vllm/issue47-avx512bf16/decode_heavy.py bfloat16|float32 32
"""

from __future__ import annotations

import sys
import time

from paged import LLM, SamplingParams


def main() -> None:
    dtype, num_requests = sys.argv[1], int(sys.argv[2])
    llm = LLM("smollm2-135m", overrides=[f"model.dtype={dtype}"])
    prompts = [{"prompt_token_ids": [1 + (i * 7 + j) % 1000 for j in range(64)]} for i in range(num_requests)]
    params = [SamplingParams(max_tokens=96, ignore_eos=True, temperature=0.0) for _ in prompts]
    llm.generate(["hi"], [SamplingParams(max_tokens=4)], use_tqdm=False)  # warm-up
    seconds = []
    for _ in range(2):
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        seconds.append(time.perf_counter() - start)
    print(f"{dtype} n={num_requests} {min(seconds):.2f}s")


if __name__ == "__main__":
    main()
