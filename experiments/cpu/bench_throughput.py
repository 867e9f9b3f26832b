"""paged vs HF transformers `generate` on this CPU, same requests, greedy, ignore_eos.

Requests: prompts 32-512 tokens, outputs 16-256 tokens (uniform, seeded), cut from the built-in
corpus. HF runs static batches in submission order (left padding, each batch decodes until its
longest request is done) at batch 8, 16 and 32; the best is the baseline. Useful tokens are the
requested output tokens only, for both. Prints one table; run:

    python experiments/cpu/bench_throughput.py [--num-requests 64] [--hf-batch-sizes 8 16 32]
"""

from __future__ import annotations

import argparse
import time
from importlib import resources

import numpy as np
import torch
from rich.console import Console
from rich.table import Table
from transformers import AutoModelForCausalLM

from paged import LLM, SamplingParams
from paged.experiment.summary import summarize
from paged.model.locate import locate_smollm2


def make_requests(n: int, seed: int, corpus_tokens: list[int]) -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(32, 513, n)
    output_lens = rng.integers(16, 257, n)
    prompts = []
    for length in prompt_lens:
        start = int(rng.integers(len(corpus_tokens)))
        prompts.append([corpus_tokens[(start + i) % len(corpus_tokens)] for i in range(int(length))])
    return prompts, [int(x) for x in output_lens]


def run_paged(llm: LLM, prompts: list[list[int]], outputs: list[int]) -> tuple[float, int, dict]:
    params = [SamplingParams(max_tokens=o, ignore_eos=True, temperature=0.0) for o in outputs]
    start = time.perf_counter()
    results = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(r.token_ids) for r in results)
    summary = summarize(llm.config, llm.engine)
    return elapsed, tokens, summary


def run_hf(model, prompts: list[list[int]], outputs: list[int], batch_size: int, pad_id: int) -> tuple[float, int]:
    start = time.perf_counter()
    useful = 0
    for i in range(0, len(prompts), batch_size):
        batch, outs = prompts[i : i + batch_size], outputs[i : i + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=max(outs), min_new_tokens=max(outs),
                do_sample=False, pad_token_id=pad_id,
            )
        assert out.shape[1] - width == max(outs)
        useful += sum(outs)
    return time.perf_counter() - start, useful


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--hf-batch-sizes", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--allocator", default="prefix")
    args = ap.parse_args()
    torch.manual_seed(args.seed)

    llm = LLM("smollm2-135m", allocator=args.allocator, overrides=["scheduler.max_num_seqs=64"])
    corpus = llm.executor.tokenizer.encode(resources.files("paged.data").joinpath("corpus.txt").read_text())
    prompts, outputs = make_requests(args.num_requests, args.seed, corpus)
    rows = []
    elapsed, tokens, summary = run_paged(llm, prompts, outputs)
    assert tokens == sum(outputs)
    paged_tps = tokens / elapsed
    rows.append(("paged (continuous batching)", f"{elapsed:.1f}", tokens, f"{paged_tps:.1f}"))

    gguf = locate_smollm2()
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    pad_id = llm.executor.tokenizer.pad_token_id or 0
    best = 0.0
    for bs in args.hf_batch_sizes:
        hf_elapsed, hf_tokens = run_hf(hf, prompts, outputs, bs, pad_id)
        tps = hf_tokens / hf_elapsed
        best = max(best, tps)
        rows.append((f"HF generate, static batch {bs}", f"{hf_elapsed:.1f}", hf_tokens, f"{tps:.1f}"))

    threads = torch.get_num_threads()
    table = Table(title=f"Throughput, {args.num_requests} requests, SmolLM2-135M fp32, {threads} threads")
    for col in ("system", "time (s)", "useful output tokens", "tokens/s"):
        table.add_column(col)
    for row in rows:
        table.add_row(*map(str, row))
    console = Console()
    console.print(table)
    console.print(f"paged / best HF = {paged_tps / best:.2f}x")
    console.print(f"engine overhead fraction = {summary['engine_overhead_fraction']:.3f}, "
                  f"mean decode batch = {summary['mean_decode_batch_size']:.1f}")


if __name__ == "__main__":
    main()
