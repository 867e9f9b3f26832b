"""One mixed step against the same rows as a decode step plus a prefill step, on SmolLM2-135M here.

    python experiments/cpu/mixed_step.py [--repeats 15] [--decodes 24] [--context 200] [--prompt 300]

Chunked prefill with decode-first batching runs decode rows beside a prompt in one step; vLLM V0
runs them as two steps. This times `ModelExecutor.execute` on both shapes (median of `--repeats`,
alternating), so the cost or saving of mixing itself is seen apart from any scheduling effect.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from paged.config import compose_config
from paged.engine.builder import build_executor
from paged.executor.model_executor import ModelExecutor
from paged.request import Request, SamplingParams
from paged.step import ScheduledSeq, SchedulerOutput

BLOCK = 16


def rows(decodes: int, context: int, prompt: int) -> tuple[list[ScheduledSeq], ScheduledSeq]:
    """`decodes` sequences with `context` tokens cached and one new token each, and one prompt."""
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    blocks = -(-(context + 1) // BLOCK)
    decode_rows = []
    for i in range(decodes):
        seq = Request(f"d{i}", rng.integers(1, 40000, context).tolist(), params).seqs[0]
        seq.token_ids.append(5)
        seq.num_computed_tokens = context
        decode_rows.append(ScheduledSeq(seq, 1, list(range(i * blocks, (i + 1) * blocks))))
    seq = Request("p", rng.integers(1, 40000, prompt).tolist(), params).seqs[0]
    first = decodes * blocks
    return decode_rows, ScheduledSeq(seq, prompt, list(range(first, first + -(-prompt // BLOCK))))


def timed(executor: ModelExecutor, items: list[ScheduledSeq], prefill: bool) -> float:
    start = time.perf_counter()
    executor.execute(SchedulerOutput(items, is_prefill=prefill))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--decodes", type=int, default=24)
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--prompt", type=int, default=300)
    args = parser.parse_args()
    executor = build_executor(compose_config(["model=smollm2-135m"]))
    decode_rows, prompt_row = rows(args.decodes, args.context, args.prompt)
    executor.init_kv_cache(len(decode_rows) * 64 + 64, BLOCK)
    for _ in range(2):  # thread pools and native kernels warm up here
        timed(executor, decode_rows, False), timed(executor, [prompt_row], True)
    separate, mixed = [], []
    for _ in range(args.repeats):
        separate.append(timed(executor, decode_rows, False) + timed(executor, [prompt_row], True))
        mixed.append(timed(executor, [*decode_rows, prompt_row], True))
    sep, mix = statistics.median(separate), statistics.median(mixed)
    print(f"{args.decodes} decode rows (context {args.context}) + a {args.prompt}-token prompt, median of "
          f"{args.repeats}: two steps {sep * 1e3:.0f} ms, one mixed step {mix * 1e3:.0f} ms ({mix / sep:.2f}x)")


if __name__ == "__main__":
    main()
