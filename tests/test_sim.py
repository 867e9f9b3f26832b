"""`executor=sim`: paper-scale runs on the virtual clock, memory sizing, the cost model's shape, and
a scheduler that cannot tell the sim from the real executor when both report the same step times."""

from __future__ import annotations

import json
import logging
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paged.config import ConfigError, compose_config
from paged.engine.builder import build_engine
from paged.engine.runner import drive, run_workload
from paged.executor.base import Executor
from paged.executor.model_executor import ModelExecutor
from paged.experiment.run import run_experiment
from paged.request import Request, SamplingParams
from paged.sim.cost_model import CostModel, StepCost, StepShape, step_shape
from paged.sim.executor import SimExecutor
from paged.sim.hardware import resolve_hardware
from paged.sim.memory import plan_memory
from paged.utils.clock import VirtualClock
from paged.workload import load_workload
from tests.hypothesis_budget import examples

QUIET = ["logger=none", "progress=false"]


def _sim_cfg(*overrides: str):
    return compose_config(["executor=sim", *QUIET, *overrides])


def test_opt13b_sharegpt_runs_in_simulated_seconds_and_finishes_every_request_at_its_length(tmp_path):
    cfg = _sim_cfg("model=opt-13b", "workload=sharegpt", "workload.num_requests=300", "workload.arrival_rate=2")
    summary = run_experiment(cfg, tmp_path)
    assert summary["num_finished"] == 300 and summary["num_aborted"] == 0
    assert summary["sim_time_s"] == summary["wall_time_s"]
    # 300 requests at 2 req/s take at least the 150 s of arrivals, in a few host seconds
    assert summary["sim_time_s"] > 140 > 30 > summary["host_time_s"] > 0
    assert summary["block_size"] == 16 and summary["hardware"] == "a100-40g" and summary["num_gpus"] == 1
    assert 0 < summary["ttft_mean_s"] < summary["e2e_latency_mean_s"]
    assert 0.01 < summary["tpot_mean_s"] < 0.2  # an OPT-13B decode step on one A100 is tens of ms
    items = load_workload(cfg.workload, None, vocab_size=50272, max_model_len=2048)
    records = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert [len(r["output_token_ids"]) for r in records] == [it.params.max_tokens for it in items]
    assert all(r["finish_reason"] == "length" for r in records)


def test_kv_cache_is_sized_from_gpu_memory_as_in_the_paper(caplog):
    """Paper Table 1: OPT-13B on one A100-40GB leaves ~12 GB, 15.7K KV slots, after 26 GB of weights."""
    with caplog.at_level(logging.INFO):
        engine = build_engine(_sim_cfg("model=opt-13b"))
    slots = engine.kv_stats().num_total_blocks * 16
    assert abs(slots - 15_700) / 15_700 < 0.05
    assert "25.7 GB weights" in caplog.text and f"({slots} tokens)" in caplog.text
    smaller = build_engine(_sim_cfg("model=opt-13b", "allocator.gpu_memory_utilization=0.8"))
    assert smaller.kv_stats().num_total_blocks < slots // 16
    explicit = build_engine(_sim_cfg("model=opt-13b", "allocator.num_blocks=100"))
    assert explicit.kv_stats().num_total_blocks == 100


@pytest.mark.serial("asserts a simulated run's wall time under 5 s")
def test_idle_time_is_skipped_not_slept():
    cfg = _sim_cfg("model=llama-2-7b", "hardware=h100-sxm", "workload=fixed", "workload.num_requests=4",
                   "workload.prompt_len=32", "workload.output_len=4", "workload.arrival_rate=0.001")
    engine = build_engine(cfg)
    items = load_workload(cfg.workload, None, vocab_size=32000, max_model_len=2048)
    start = time.perf_counter()
    requests = run_workload(engine, items, progress=False)
    assert time.perf_counter() - start < 5
    assert engine.clock.now() >= max(it.arrival_time for it in items) > 100
    assert all(r.finish_time - r.arrival_time < 1 for r in requests)


def test_opt66b_needs_four_a100_40gb_as_in_the_paper():
    with pytest.raises(ConfigError, match=r"short by .* GB; try hardware.num_gpus=4"):
        build_engine(_sim_cfg("model=opt-66b"))
    engine = build_engine(_sim_cfg("model=opt-66b", "hardware.num_gpus=4"))
    assert "4 x a100-40g" in engine.executor.description


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["executor=model", "model=opt-13b"], "spec-only model .* use executor=sim"),
        (["executor=sim", "model=opt-13b", "hardware.num_gpus=3"],
         r"num_gpus=3 does not divide opt-13b's 40 .* allowed: 1, 2, 4, 5"),
        (["executor=sim", "model=opt-13b", "allocator.gpu_memory_utilization=0"],
         r"gpu_memory_utilization=0.0 must be in \(0, 1\]"),
        (["executor=sim", "model=opt-13b", "allocator.gpu_memory_utilization=1.5"],
         r"gpu_memory_utilization=1.5 must be in"),
        (["executor=sim", "model=opt-175b", "hardware=a100-80g", "hardware.num_gpus=2"],
         "short by .* hardware.num_gpus=6"),
        (["executor=sim", "model=llama-2-7b", "hardware.num_gpus=0"], "hardware.num_gpus=0 must be > 0"),
    ],
)
def test_bad_sim_configs_fail_before_the_run_with_the_value_named(overrides, message):
    with pytest.raises(ConfigError, match=message):
        build_engine(compose_config([*QUIET, *overrides]))


def test_unknown_hardware_lists_the_choices():
    with pytest.raises(ConfigError, match="hardware=b200 is not an option; .*a100-40g") as err:
        _sim_cfg("hardware=b200")
    assert "h100-sxm" in str(err.value) and "cpu-local" in str(err.value)


def test_smollm2_under_the_sim_gets_the_real_models_token_ids():
    sim_cfg = _sim_cfg("model=smollm2-135m", "hardware=a100-40g", "workload.num_requests=3")
    executor = build_engine(sim_cfg).executor
    assert executor.tokenizer is not None and executor.vocab_size == 49152
    sim_items = load_workload(sim_cfg.workload, executor.tokenizer, max_model_len=2048)
    real_items = load_workload(compose_config([*QUIET, "workload.num_requests=3"]).workload, executor.tokenizer,
                               max_model_len=2048)
    assert [it.prompt_token_ids for it in sim_items] == [it.prompt_token_ids for it in real_items]


# -- the cost model ---------------------------------------------------------------------------------


def _cost_model(model: str = "llama-2-7b", hardware: str = "a100-80g", num_gpus: int = 1, version: str = "auto"):
    cfg = _sim_cfg(f"model={model}", f"hardware={hardware}", f"hardware.num_gpus={num_gpus}")
    executor = SimExecutor(cfg.model, cfg.kernel, hardware=cfg.hardware)
    return CostModel(executor.spec, resolve_hardware(cfg.hardware), 2, version=version)


def _decode(contexts: list[int]) -> StepShape:
    return StepShape(num_tokens=len(contexts), num_sampled=len(contexts), num_seqs=len(contexts),
                     decode_contexts=list(contexts))


def _prefill(new: int, context: int) -> StepShape:
    pairs = new * (context - new) + new * (new + 1) // 2
    return StepShape(num_tokens=new, num_sampled=1, num_seqs=1, prefill_pairs=pairs, prefill_queries=new,
                     prefill_context=context, num_prefill_rows=1, decode_contexts=[])


def test_a_batch1_decode_step_is_the_weights_over_the_bandwidth():
    model = _cost_model()
    cost = model.step(_decode([128]))
    weights_s = 6.74e9 * 2 / (2039e9 * 0.9)
    assert abs(cost.linear_s + cost.head_s - weights_s) / weights_s < 0.03
    assert cost.total_s == pytest.approx(sum((cost.linear_s, cost.attention_s, cost.elementwise_s, cost.launch_bound_s,
                                              cost.communication_s, cost.head_s, cost.overhead_s)))


@settings(max_examples=examples(60), deadline=None)
@given(
    contexts=st.lists(st.integers(1, 8192), min_size=1, max_size=64),
    extra=st.integers(1, 4096),
    new=st.integers(2, 2048),
    cached=st.integers(0, 2048),
    # not auto: on a simulated GPU it prices v3, whose split plan can make a longer lone context a little
    # cheaper (more splits fill more SMs: 513 -> 737 tokens, -0.4%), as v3 itself, never in this property
    version=st.sampled_from(["vllm", "v1", "v2"]),
)
def test_more_tokens_or_longer_context_never_costs_less(contexts, extra, new, cached, version):
    model = _COST_MODELS[version]
    base = model.step(_decode(contexts)).total_s
    assert model.step(_decode([*contexts, extra])).total_s >= base
    assert model.step(_decode([contexts[0] + extra, *contexts[1:]])).total_s >= base
    prefill = model.step(_prefill(new, new + cached)).total_s
    assert model.step(_prefill(new + 1, new + 1 + cached)).total_s >= prefill
    assert model.step(_prefill(new, new + cached + extra)).total_s >= prefill


_COST_MODELS = {v: _cost_model(version=v) for v in ("auto", "vllm", "v1", "v2")}  # auto: the test below


def test_v2_beats_v1_for_a_few_long_sequences_and_vllms_rule_picks_it():
    long = _decode([8000])
    v1, v2 = _COST_MODELS["v1"].step(long), _COST_MODELS["v2"].step(long)
    assert v2.attention_s < v1.attention_s / 2
    assert _COST_MODELS["vllm"].step(long).decode_version == "v2"
    # auto prices the cuda backend's pick, v3
    assert _COST_MODELS["auto"].step(long).decode_version == "v3"


@pytest.mark.parametrize("model", ["opt-13b", "opt-175b", "llama-3-70b", "llama-2-7b"])
def test_more_gpus_never_more_memory_or_time_per_gpu(model):
    spec = SimExecutor(_sim_cfg(f"model={model}").model, _sim_cfg().kernel, hardware=_sim_cfg().hardware).spec
    plans, steps = [], []
    for g in (1, 2, 4, 8):
        hw = resolve_hardware(_sim_cfg(f"model={model}", "hardware=h200", f"hardware.num_gpus={g}").hardware)
        try:
            plans.append(plan_memory(spec, hw, 2, utilization=1.0, max_num_batched_tokens=4096, max_num_seqs=256))
        except ConfigError:
            plans.append(None)
        steps.append(CostModel(spec, hw, 2).step(_decode([512] * 32)))
    fitting = [p for p in plans if p is not None]
    assert fitting, f"{model} fits on no h200 count"
    for a, b in zip(fitting, fitting[1:]):
        assert b.weights_bytes <= a.weights_bytes and b.activation_bytes <= a.activation_bytes
        assert b.kv_cache_bytes >= a.kv_cache_bytes
    assert all(b.linear_s <= a.linear_s for a, b in zip(steps, steps[1:]))
    assert steps[-1].communication_s > steps[0].communication_s == 0


# -- the scheduler cannot tell the sim from the real executor ----------------------------------------


def _step_time(shape: StepShape) -> float:
    """Any deterministic function of the step's shape will do."""
    contexts = shape.decode_contexts or []
    return 1e-3 + 1e-5 * shape.num_tokens + 1e-7 * (shape.prefill_pairs + sum(contexts))


class _FixedCost:
    def step(self, shape: StepShape) -> StepCost:
        return StepCost(_step_time(shape), 0, 0, 0, 0, 0, 0, None)


class _TimedReal(Executor):
    """The real executor on a virtual clock advanced by `_step_time`."""

    def __init__(self, inner: ModelExecutor) -> None:
        self.inner = inner
        self.eos_token_ids = inner.eos_token_ids
        self.vocab_size = inner.arch.vocab_size
        self._clock = VirtualClock()

    @property
    def clock(self):  # type: ignore[override]
        return self._clock

    @property
    def description(self) -> str:
        return "tiny-random on a virtual clock"

    def kv_cache_spec(self, block_size):
        return self.inner.kv_cache_spec(block_size)

    def init_kv_cache(self, num_blocks, block_size, num_cpu_blocks=0):
        self.inner.init_kv_cache(num_blocks, block_size, num_cpu_blocks)

    def execute(self, sched):
        out = self.inner.execute(sched)
        self._clock.advance(_step_time(step_shape(sched)))
        return out


@pytest.fixture(scope="module")
def tiny_real() -> ModelExecutor:
    cfg = compose_config(["model=tiny-random", *QUIET])
    return ModelExecutor(cfg.model, cfg.kernel)


def _trace(engine, workload: list[tuple[int, int, float]]) -> tuple[list, list]:
    steps = []
    requests = [
        Request(f"r{i}", [(37 * i + 11 * j) % 4000 + 3 for j in range(p)],
                SamplingParams(max_tokens=o, ignore_eos=True, temperature=0.0), arrival_time=t)
        for i, (p, o, t) in enumerate(workload)
    ]
    pending = sorted(requests, key=lambda r: r.arrival_time)
    clock = engine.clock
    clock.reset()
    while pending or engine.has_unfinished:
        while pending and pending[0].arrival_time <= clock.now():
            engine.add_request(pending.pop(0))
        if not engine.has_unfinished:
            clock.wait_until(pending[0].arrival_time)
            continue
        sched = engine.scheduler.schedule(clock.now())
        steps.append(([(s.seq.request.request_id, s.num_new_tokens) for s in sched.scheduled],
                      sorted(s.request.request_id for s in sched.preempted), round(clock.now(), 9)))
        output = engine.executor.execute(sched) if sched.scheduled else None
        if output is not None:
            engine.scheduler.update_from_output(sched, output, clock.now())
    done = [(r.request_id, r.first_token_time, r.finish_time, r.num_preemptions, r.abort_reason) for r in requests]
    return steps, done


@settings(max_examples=examples(6), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    workload=st.lists(
        st.tuples(st.integers(1, 60), st.integers(1, 24), st.floats(0, 0.05)), min_size=1, max_size=10
    ),
    num_blocks=st.integers(6, 40),
    allocator=st.sampled_from(["naive", "prefix"]),
)
def test_the_scheduler_makes_the_same_decisions_on_the_sim_and_the_real_executor(
    tiny_real, workload, num_blocks, allocator
):
    overrides = ["model=tiny-random", *QUIET, f"allocator={allocator}", f"allocator.num_blocks={num_blocks}",
                 "scheduler.max_num_seqs=4", "scheduler.max_model_len=128", "scheduler.max_num_batched_tokens=128"]
    real = build_engine(compose_config(overrides), executor=_TimedReal(tiny_real))
    sim = build_engine(compose_config(["executor=sim", *overrides]))
    sim.executor.cost_model = _FixedCost()
    assert _trace(real, workload) == _trace(sim, workload)


# -- cpu-local ----------------------------------------------------------------------------------------


@pytest.fixture
def calibration_cache(tmp_path, monkeypatch):
    """An empty cache for the calibration (`PAGED_CACHE_DIR`), with the native CPU ops loaded from the
    shared cache first: the engine probe would otherwise build them again in the empty one (54-72 s
    on a 2-core EPYC) whenever this is the first test of its process to run them."""
    from paged.kernels.backends import cpu

    cpu.CpuBackend().unavailable_reason()  # loads the library, or says why it cannot
    monkeypatch.setenv("PAGED_CACHE_DIR", str(tmp_path))
    return tmp_path


@pytest.mark.serial("calibrates on this CPU's measured speed and bounds its time: a busy neighbour skews both")
def test_cpu_local_measures_once_then_reads_its_cache(calibration_cache, monkeypatch):
    cfg = _sim_cfg("model=tiny-random", "hardware=cpu-local", "allocator.num_blocks=64")
    start = time.perf_counter()
    first = build_engine(cfg).executor
    assert time.perf_counter() - start < 60
    files = list((calibration_cache / "sim").glob("cpu-local-tiny-random-*.json"))
    assert len(files) == 1
    hw = first.hardware
    assert hw.memory_bandwidth > 1e8 and hw.flops_fp32 > 1e8 and hw.step_overhead_s >= 0
    assert max(e for _, e in hw.matmul_efficiency) == 1.0

    import paged.sim.calibrate as calibrate

    monkeypatch.setattr(calibrate, "measure", lambda *a, **k: pytest.fail("measured again"))
    assert build_engine(cfg).executor.hardware == hw


def test_cpu_local_remeasures_when_what_the_executor_runs_changes():
    from paged.model.linear import onednn_unsupported_reason
    from paged.sim.calibrate import cache_path

    def key(*overrides: str):
        return cache_path(_sim_cfg("model=tiny-random", "hardware=cpu-local", *overrides)).name

    base = key("model.gemm=torch", "kernel.backend=cpu")
    # the torch backend runs the torch norms/RoPE/SwiGLU too: attention and layer ops both change
    assert base != key("model.gemm=torch", "kernel.backend=torch")
    assert base != key("model.gemm=torch", "kernel.backend=cpu", "kernel.version=v2")
    assert base != key("model.gemm=torch", "kernel.backend=cpu", "kernel.partition_size=256")
    if onednn_unsupported_reason(torch.float32, torch.device("cpu")) is None:
        assert base != key("model.gemm=onednn", "kernel.backend=cpu")
    assert base == key("model.gemm=torch", "kernel.backend=cpu", "scheduler=sjf")  # the probe's own scheduler


def test_cpu_local_calibration_times_the_real_engines_public_step(calibration_cache, monkeypatch):
    import paged.sim.calibrate as calibrate
    from paged.engine.engine import Engine

    # the microbenchmarks are beside the point here: fixed values, so only the engine probe runs
    monkeypatch.setattr(calibrate, "_matmul", lambda *a: (1e10, [[1, 0.1], [2048, 1.0]]))
    monkeypatch.setattr(calibrate, "_attention", lambda *a: {
        "decode_attention_efficiency": 0.5, "prefill_attention_efficiency": 0.5})
    stepped: list[Executor] = []
    real_step = Engine.step

    def step(self: Engine):
        stepped.append(self.executor)
        return real_step(self)

    monkeypatch.setattr(Engine, "step", step)
    hw = build_engine(_sim_cfg("model=tiny-random", "hardware=cpu-local", "allocator.num_blocks=64")).executor.hardware
    # batches of 1 and 16 sequences, 24 tokens each: a prefill step and 23 decode steps per batch
    assert len(stepped) == 48 and all(isinstance(e, ModelExecutor) for e in stepped)
    assert hw.step_overhead_s >= 0 and hw.seq_overhead_s >= 0 and hw.flops_fp32 == 1e10


def test_a_sim_executor_built_without_the_calibration_says_how_to_get_it():
    cfg = _sim_cfg("model=tiny-random", "hardware=cpu-local")
    with pytest.raises(ConfigError, match=r"step_overhead_s.* measured on this machine.*experiments/sim/calibrate.py"):
        SimExecutor(cfg.model, cfg.kernel, hardware=cfg.hardware)


def test_wandb_steps_of_a_simulated_run_are_keyed_by_sim_time(tmp_path):
    from paged.config import LoggerConfig
    from paged.engine.metrics import MetricsRecorder
    from paged.experiment.wandb_logger import WandbLogger

    class Run:
        def __init__(self) -> None:
            self.logged: list[dict] = []

        def log(self, data: dict) -> None:
            self.logged.append(data)

    engine = build_engine(_sim_cfg("model=llama-2-7b", "workload=fixed"))
    logger = WandbLogger(LoggerConfig(name="none"), tmp_path, {}, simulated=engine.clock.simulated)
    logger.run = Run()
    engine.metrics = MetricsRecorder()
    engine.metrics.step_listeners.append(logger.log_step)
    engine.add_request(Request("r", [5] * 40, SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.0)))
    drive(engine)
    times = [row["sim_time_s"] for row in logger.run.logged]
    assert len(times) == 3 and times == sorted(times) and times[-1] == pytest.approx(engine.clock.now())


def test_tier_copies_are_one_batched_transfer_and_offloads_overlap_the_step():
    cost = _cost_model()
    decode = _decode([512] * 8)
    base = cost.step(decode)
    hw, spec = cost.hw, cost.spec
    block_bytes = 2 * spec.num_layers * 16 * cost.kv_size * cost.kv_b
    onload = cost.step(StepShape(**{**decode.__dict__, "num_onload_blocks": 10}))
    expected = hw.pcie_latency_s + 10 * block_bytes / (hw.pcie_bandwidth * hw.memory_efficiency)
    assert onload.total_s - base.total_s == pytest.approx(expected)
    # a few blocks written out hide behind the step's compute; many outlast it
    few = cost.step(StepShape(**{**decode.__dict__, "num_offload_blocks": 1}))
    many = cost.step(StepShape(**{**decode.__dict__, "num_offload_blocks": 1000}))
    assert few.total_s == pytest.approx(base.total_s)
    assert many.total_s - base.total_s == pytest.approx(
        hw.pcie_latency_s + 1000 * block_bytes / (hw.pcie_bandwidth * hw.memory_efficiency) - base.total_s)
    # a swap still pays vLLM's copy per block and layer: dearer than the tier's batched copy
    swap = cost.step(StepShape(**{**decode.__dict__, "num_swap_blocks": 10}))
    assert swap.total_s - base.total_s > expected
