"""What the host pays for each GPU step, measured on this CPU without a GPU.

    python experiments/host_overhead.py [--json FILE] [--batches 1 64 256] [--steps 50] [--repeats 5]
        [--real-driver] [--no-freeze]

- `launch_us`: host µs per kernel launch of the cuda backend (`CudaRunner.run`), on the recording
  fake driver (tests/fake_driver, built with the C compiler; it records nothing here, so what is
  timed is our side: kernel lookup, parameter packing, the driver call), or with `--real-driver` on
  this machine's GPU (`make gpu-report` runs that). The plan is SmolLM2-135M's decode attention for a
  batch of that many 512-token rows (fp16, v1). Beside it: `layer_us`, one decode-attention call as
  the model's layers make it (`paged.kernels.planned.DecodeAttention`: the step's rows checked once,
  then per layer the launch plan and its launch); `op_us`, one `paged.kernels.paged_attention` call
  (every input checked, plan, launch); `cuda_core_launch_us`, the same launch through cuda.core's
  `launch()`, which packs its arguments on every call; `torch_op_us`, one layer's attention as the
  model calls it, through `torch.ops.paged.attention` (`paged.kernels.torch_ops.layer_attention`:
  its output allocated, the dispatcher, the step's planned cache write and decode attention from the
  forward context, two launches), and `attention_us`, that step's attention called without the op:
  the difference is what the op adds; `layer_ops_us`, one decode layer's fused ops as the model
  calls them (`RunnerLayerOps`: RoPE, two residual adds with RMSNorm, SiLU-and-mul; four launches);
  `prefill_us`, one layer of a step whose rows each prefill 16 tokens, through the executor's
  attention (its cache write and prefill attention; two launches).
- `step_overhead_ms`: host ms of one engine step of that many decode rows with a model whose
  forward returns at once (as vLLM measures its engine's overhead): scheduling, block tables,
  the step's input tensors, attention planning, sampling bookkeeping, output processing. The heap is
  frozen once the batch decodes (`gc.freeze()`, as `paged.experiment.run` and the server freeze it
  before they drive the engine); `--no-freeze` times the steps without.

All are keyed by batch size ("1", "64", "256"); medians of `--repeats` timings. Where the fake
driver cannot be built (no C compiler or NVRTC), the launch columns are null with the reason.
`torch_ops_registration_ms` is what defining the `torch.ops.paged` ops cost this process.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from paged.utils.threads import cpu_name  # noqa: E402  (the repository root is on sys.path only now)

# SmolLM2-135M's attention: 9 query heads over 3 KV heads of 64
HEADS, KV_HEADS, HEAD_SIZE, BLOCK, SEQ_LEN = 9, 3, 64, 16, 512
LAUNCH_KEYS = ("launch_us", "layer_us", "op_us", "cuda_core_launch_us", "torch_op_us", "attention_us", "layer_ops_us",
               "prefill_us")
PROMPT = 16  # tokens each row of `prefill_us`'s step prefills
# SmolLM2-135M's hidden and intermediate sizes, for a layer's fused ops
HIDDEN, INTERMEDIATE = 576, 1536


def median_us(fn: Callable[[], object], calls: int, repeats: int) -> float:
    """Median over `repeats` of the mean µs per call of `calls` back-to-back calls."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


# -- launches, in a child process whose libcuda.so.1 is the recording fake ----------------------------


def launch_costs(batches: Sequence[int], repeats: int, *, real_driver: bool = False) -> dict[str, dict[str, float]]:
    """On the recording fake (in the child, whose LD_LIBRARY_PATH names it) over host tensors, or
    with `real_driver` on this machine's GPU over CUDA tensors on torch's current stream."""
    import torch
    from cuda.core import Device

    from paged.kernels.backends.cuda import CudaBackend, CudaRunner

    if real_driver:
        device = torch.device("cuda", torch.cuda.current_device())
        runner = CudaBackend().runner(torch.empty(0, device=device))
        stream = Device(device.index).create_stream(torch.cuda.current_stream(device))
        backend_of = _cuda_backend_of
    else:
        from tests.fake_driver.scenario import HostMemoryCuda

        Device(0).set_current()
        device, stream = torch.device("cpu"), Device(0).create_stream()
        handle = int(stream.handle)
        runner = CudaRunner(0, stream_source=lambda index: handle)
        backend_of = HostMemoryCuda
    results: dict[str, dict[str, float]] = {key: {} for key in LAUNCH_KEYS}
    for batch in batches:
        for key, value in _batch_launch_costs(batch, runner, stream, backend_of, device, repeats).items():
            results[key][str(batch)] = value
    return results


def _cuda_backend_of(runner: Any) -> Any:
    """The cuda backend with `runner` for every tensor."""
    from paged.kernels.backends.cuda import CudaBackend

    class OneRunner(CudaBackend):
        def runner(self, tensor: Any) -> Any:
            return runner

    return OneRunner()


def _batch_launch_costs(
    batch: int, runner: Any, stream: Any, backend_of: Callable[[Any], Any], device: Any, repeats: int
) -> dict[str, float]:
    import torch
    from cuda.core import LaunchConfig
    from cuda.core import launch as cuda_core_launch

    from paged import kernels
    from paged.kernels.backends.launch_api import Ptr
    from paged.kernels.forward_context import forward_context
    from paged.kernels.planned import AttentionSettings, DecodeAttention, Rows
    from paged.kernels.testing import AttentionCase, attention_inputs
    from paged.kernels.torch_ops import layer_attention

    case = AttentionCase(torch.float16, HEAD_SIZE, BLOCK, HEADS // KV_HEADS, KV_HEADS, 512, (SEQ_LEN,) * batch)
    x = attention_inputs(case, device=device)
    direct = backend_of(runner)

    def op() -> torch.Tensor:
        return kernels.paged_attention(x.query, x.key_cache, x.value_cache, x.block_tables, x.seq_lens, x.scale,
                                       version="v1", backend=direct)

    # as a model's layers call it: the step's rows checked once, then one call per layer; the first call's
    # launches (`layer_launches.plan`) are what the runner is timed on alone
    starts = torch.arange(batch + 1, dtype=torch.int32)
    tables, lens = x.block_tables.cpu().numpy(), x.seq_lens.cpu().numpy()
    rows = Rows(x.block_tables, x.seq_lens, starts.to(device), tables, lens, starts.numpy(), max_seq_len=SEQ_LEN,
                max_query_len=1)
    layer = DecodeAttention(rows, AttentionSettings(direct, x.scale, 512), "v1", HEADS, KV_HEADS, HEAD_SIZE,
                            x.key_cache.shape[0], BLOCK)
    layer(x.query, x.key_cache, x.value_cache)
    assert layer.layer_launches is not None, "the first layer's launches were not kept"
    unit, launches = layer.layer_launches.plan.unit, layer.layer_launches.plan.launches
    item = launches[0]
    kernel = runner._kernels[item.kernel].handle
    config = LaunchConfig(grid=item.grid, block=item.block, shmem_size=item.shared_memory)
    args = [int(a) if isinstance(a, Ptr) else a for a in item.args]
    # under inference mode, as the executor runs the model
    step = _decode_step(x, direct, device)
    # the new keys and values apart, as a model's projection gives them (one tensor for both would
    # make the cache write plan its launch at every layer)
    k, v = (torch.randn(batch, KV_HEADS, HEAD_SIZE).to(device, torch.float16) for _ in range(2))
    with torch.inference_mode(), forward_context(step):
        layer_attention(0, x.query, k, v)  # the first layer plans the launches the later ones run
        torch_op_us = median_us(lambda: layer_attention(0, x.query, k, v), 500, repeats)
        attention_us = median_us(lambda: step(0, x.query, k, v), 500, repeats)
    costs = {
        "layer_ops_us": _layer_ops_us(backend_of(runner), batch, device, repeats),
        "prefill_us": _prefill_us(backend_of(runner), batch, device, repeats),
        "launch_us": median_us(lambda: runner.run(unit, launches), 5000, repeats) / len(launches),
        "layer_us": median_us(lambda: layer(x.query, x.key_cache, x.value_cache), 500, repeats),
        "op_us": median_us(op, 500, repeats),
        "cuda_core_launch_us": median_us(lambda: cuda_core_launch(stream, config, kernel, *args), 5000, repeats),
        "torch_op_us": torch_op_us,
        "attention_us": attention_us,
    }
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return costs


def _layer_ops_us(backend: Any, batch: int, device: Any, repeats: int) -> float:
    """Host µs of one decode layer's fused ops as the model calls them (`RunnerLayerOps`): RoPE over
    the fused qkv output, two residual adds with RMSNorm, SiLU-and-mul; after a first layer, as a
    step's later layers run them."""
    import torch

    from paged.model.layer_ops import RunnerLayerOps

    ops = RunnerLayerOps(backend)
    half = torch.float16
    qkv = torch.randn(batch, (HEADS + 2 * KV_HEADS) * HEAD_SIZE).to(device, half)
    x, residual = (torch.randn(batch, HIDDEN).to(device, half) for _ in range(2))
    weight = torch.ones(HIDDEN, dtype=half, device=device)
    gate_up = torch.randn(batch, 2 * INTERMEDIATE).to(device, half)
    rotation = ops.rotation(torch.arange(batch, device=device), *(torch.randn(2048, HEAD_SIZE).to(device, half)
                                                                   for _ in range(2)))

    def layer() -> None:
        ops.rope(qkv, rotation, HEADS + KV_HEADS, HEAD_SIZE)
        ops.add_rms_norm(x, residual, weight, 1e-5)
        ops.silu_and_mul(gate_up)
        ops.add_rms_norm(x, residual, weight, 1e-5)

    with torch.inference_mode():
        layer()
        return median_us(layer, 500, repeats)


def _prefill_us(backend: Any, batch: int, device: Any, repeats: int) -> float:
    """Host µs of one layer of a step whose `batch` rows each prefill `PROMPT` tokens, through the
    executor's attention (`PagedAttention`: the cache write and the prefill attention), after a
    first layer, as a step's later layers run it."""
    import numpy as np
    import torch

    from paged.executor.attention import PagedAttention
    from paged.executor.step_plan import HostBatch, HostRows, InputBuffers
    from paged.kernels.planned import AttentionSettings
    from paged.kernels.testing import random_cache

    blocks = -(-PROMPT // BLOCK)
    tables = np.arange(batch * blocks, dtype=np.int32).reshape(batch, blocks)
    lens = np.full(batch, PROMPT, dtype=np.int32)
    starts = np.arange(0, batch * PROMPT + 1, PROMPT, dtype=np.int32)
    positions = np.tile(np.arange(PROMPT, dtype=np.int64), batch)
    rows = np.repeat(np.arange(batch), PROMPT)
    slots = tables[rows, positions // BLOCK].astype(np.int64) * BLOCK + positions % BLOCK
    host = HostBatch(np.zeros(len(slots), dtype=np.int64), positions, slots, starts[1:] - 1, None,
                     HostRows(None, tables, lens, starts, PROMPT, PROMPT))
    layers = [[t.to(device) for t in random_cache(batch * blocks, KV_HEADS, HEAD_SIZE, BLOCK, torch.float16)]
              for _ in range(2)]
    step = PagedAttention(InputBuffers(device).upload(host), [c[0] for c in layers], [c[1] for c in layers],
                          AttentionSettings(backend, HEAD_SIZE**-0.5, 512), decode_version=None, num_heads=HEADS)
    qkv = torch.randn(len(slots), (HEADS + 2 * KV_HEADS) * HEAD_SIZE).to(device, torch.float16)
    q, k, v = (qkv[:, a * HEAD_SIZE : b * HEAD_SIZE].view(len(slots), -1, HEAD_SIZE)
               for a, b in ((0, HEADS), (HEADS, HEADS + KV_HEADS), (HEADS + KV_HEADS, HEADS + 2 * KV_HEADS)))
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    with torch.inference_mode():
        step(0, q, k, v, out)
        return median_us(lambda: step(1, q, k, v, out), 500, repeats)


def _decode_step(x: Any, backend: Any, device: Any) -> Any:
    """The executor's planned attention (`PagedAttention`) for a decode step of `x`'s rows, one layer
    over `x`'s caches: each row's new token written at its last position."""
    import numpy as np

    from paged.executor.attention import PagedAttention
    from paged.executor.step_plan import HostBatch, HostRows, InputBuffers
    from paged.kernels.planned import AttentionSettings

    tables, lens = x.block_tables.cpu().numpy(), x.seq_lens.cpu().numpy()
    rows = np.arange(lens.shape[0])
    positions = lens.astype(np.int64) - 1
    slots = tables[rows, positions // BLOCK].astype(np.int64) * BLOCK + positions % BLOCK
    decode = HostRows(None, tables, lens, np.arange(lens.shape[0] + 1, dtype=np.int32), SEQ_LEN, 1)
    host = HostBatch(rows, positions, slots, rows, decode, None)
    return PagedAttention(InputBuffers(device).upload(host), [x.key_cache], [x.value_cache],
                          AttentionSettings(backend, x.scale, 512), decode_version="v1", num_heads=HEADS)


def measure_launches(batches: Sequence[int], repeats: int) -> tuple[dict[str, dict[str, float]] | None, str | None]:
    """The child's results, or None and why the fake driver cannot run here."""
    from tests import fake_driver

    missing = fake_driver.nvrtc_missing()
    if missing:
        return None, missing
    with tempfile.TemporaryDirectory() as tmp:
        try:
            driver_dir = fake_driver.build(Path(tmp))
        except fake_driver.NoCompilerError as e:
            return None, str(e)
        out = Path(tmp) / "launches.json"
        env = {**os.environ, "LD_LIBRARY_PATH": os.pathsep.join(filter(None, [str(driver_dir),
                                                                             os.environ.get("LD_LIBRARY_PATH")]))}
        env.pop("FAKE_CUDA_LOG", None)
        cmd = [sys.executable, __file__, "--launch-child", str(out), "--repeats", str(repeats),
               "--batches", *map(str, batches)]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"the launch benchmark failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        return json.loads(out.read_text()), None


# -- engine steps without the model -----------------------------------------------------------------


class InstantModel:
    """A model whose forward returns at once: hidden states and (one-token-wide) logits made once
    for the largest step, so that what remains of a step is the engine's own host work."""

    def __init__(self, arch: Any, max_tokens: int) -> None:
        import torch

        self.arch = arch
        self._hidden = torch.zeros(max_tokens, arch.hidden_size)
        self._logits = torch.zeros(max_tokens, 1)

    def forward(self, input_ids: Any, positions: Any, attn: Any = None) -> Any:
        return self._hidden[: input_ids.shape[0]]

    def compute_logits(self, hidden: Any) -> Any:
        return self._logits[: hidden.shape[0]]


def step_overhead_ms(batch: int, steps: int, repeats: int, *, freeze: bool = True) -> float:
    """Median host ms of an engine step of `batch` decode rows (prompts of 16, greedy, no EOS);
    `freeze`: the heap frozen once the batch decodes, as a run's is (`gc.freeze`)."""
    from paged.config import compose_config
    from paged.engine.builder import build_engine
    from paged.engine.runner import to_request
    from paged.workload import load_workload

    output_len = repeats * steps + 8
    cfg = compose_config([
        "model=tiny-random", "model.device=cpu", "logger=none", "progress=false", "workload=fixed",
        f"workload.num_requests={batch}", "workload.prompt_len=16", f"workload.output_len={output_len}",
        f"scheduler.max_num_seqs={batch}", f"scheduler.max_model_len={16 + output_len}",
        f"scheduler.max_num_batched_tokens={max(16 * batch, 512)}", f"allocator.num_blocks={batch * 64}",
    ])
    engine = build_engine(cfg)
    executor = engine.executor
    executor.model = InstantModel(executor.shard, 16 * batch)
    for item in load_workload(cfg.workload, tokenizer=executor.tokenizer, vocab_size=executor.vocab_size):
        engine.add_request(to_request(item))
    while not engine.metrics.steps or engine.metrics.steps[-1].num_decode_rows < batch:
        engine.step()
    # as a run does (`paged.experiment.run`, the server): the engine and its requests frozen, so that
    # the collector's full collections do not re-scan the model's and the engine's objects
    if freeze:
        gc.freeze()
    times = []
    try:
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(steps):
                engine.step()
            times.append((time.perf_counter() - start) / steps * 1e3)
    finally:
        if freeze:
            gc.unfreeze()
    assert all(s.num_decode_rows == batch for s in engine.metrics.steps[-steps:]), "a timed step was not a full decode"
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--steps", type=int, default=50, help="engine steps per timing")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--real-driver", action="store_true",
                        help="launches on this machine's GPU and driver instead of the recording fake")
    parser.add_argument("--no-freeze", action="store_true",
                        help="time the engine steps without gc.freeze() (a run freezes its heap once built)")
    parser.add_argument("--launch-child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.launch_child:
        args.launch_child.write_text(json.dumps(launch_costs(args.batches, args.repeats)))
        return
    logging.basicConfig(level=logging.WARNING)
    if args.real_driver:
        import torch

        if not torch.cuda.is_available():
            parser.error(f"--real-driver needs a CUDA device, and torch {torch.__version__} sees none; "
                         "without it the launches run on the recording fake driver")
        launches, why = launch_costs(args.batches, args.repeats, real_driver=True), None
    else:
        launches, why = measure_launches(args.batches, args.repeats)
    results: dict[str, Any] = {
        **(launches or dict.fromkeys(LAUNCH_KEYS)),
        "launch_unavailable": why,
        "step_overhead_ms": {str(b): step_overhead_ms(b, args.steps, args.repeats, freeze=not args.no_freeze)
                             for b in args.batches},
        "torch_ops_registration_ms": _registration_ms(),
        "cpu": cpu_name(),
        "driver": "real" if args.real_driver else "recording fake",
    }
    _print(results, args.batches)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


def _registration_ms() -> float:
    """What defining `torch.ops.paged` cost this process (the engine above imported the models, which
    import the ops)."""
    from paged.kernels.torch_ops import REGISTRATION_MS

    return REGISTRATION_MS


def _print(results: dict[str, Any], batches: Sequence[int]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Host overhead on {results['cpu']}, launches on the {results['driver']} driver "
                        "(targets: launch <= 5 us, step at 256 <= 0.5 ms)")
    table.add_column("batch", justify="right")
    for column in (*LAUNCH_KEYS, "step_overhead_ms"):
        table.add_column(column, justify="right")
    for b in batches:
        row = [results[k][str(b)] if results[k] else None for k in (*LAUNCH_KEYS, "step_overhead_ms")]
        table.add_row(str(b), *("n/a" if v is None else f"{v:.2f}" for v in row))
    Console(width=160).print(table)  # wide enough for every column's name
    print(f"torch.ops.paged defined in {results['torch_ops_registration_ms']:.2f} ms")
    if results["launch_unavailable"]:
        print(f"launch_us: not measured ({results['launch_unavailable']})")


if __name__ == "__main__":
    main()
