"""The simulator's decode-attention kernel table (paged/sim/kernel_table.py): a row per variant and
shape class on every hardware, each with its source; measured rows reproduce their benchmark cell;
`executor=sim kernel=v1|v2|v3` prices the kernel it names; a bad variant is refused in one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from paged.config import ConfigError, compose_config
from paged.config.choices import VERSIONS
from paged.engine.builder import build_engine
from paged.sim.cost_model import CostModel, StepShape
from paged.sim.executor import SimExecutor
from paged.sim.hardware import Hardware, resolve_hardware
from paged.sim.kernel_table import MEASURED, SHAPE_CLASSES, decode_table, shape_class

QUIET = ["logger=none", "progress=false"]
HARDWARE = sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "conf" / "hardware").glob("*.yaml"))
GPUS = [name for name in HARDWARE if name != "cpu-local"]
# cpu-local's nulls as a calibration would fill them, so that it resolves without measuring
CALIBRATED = {"flops_fp16": 1e11, "flops_fp32": 1e11, "memory_bandwidth": 2e10, "memory": 2**34,
              "interconnect_bandwidth": 2e10, "pcie_bandwidth": 2e10, "matmul_efficiency": [[1, 0.5]],
              "memory_efficiency": 1.0, "prefill_attention_efficiency": 0.4, "decode_attention_efficiency": 0.3,
              "kernel_launch_s": 0.0, "step_overhead_s": 1e-3, "seq_overhead_s": 1e-5}


def _hardware(name: str) -> Hardware:
    cfg = compose_config(["executor=sim", *QUIET, f"hardware={name}"]).hardware
    return resolve_hardware(cfg, CALIBRATED if name == "cpu-local" else None)


def _executor(*overrides: str) -> SimExecutor:
    cfg = compose_config(["executor=sim", *QUIET, *overrides])
    return SimExecutor(cfg.model, cfg.kernel, hardware=cfg.hardware)


def _decode(contexts: list[int]) -> StepShape:
    return StepShape(num_tokens=len(contexts), num_sampled=len(contexts), num_seqs=len(contexts),
                     decode_contexts=list(contexts))


@pytest.mark.parametrize("name", HARDWARE)
def test_every_hardware_has_a_sourced_row_for_every_variant_and_shape_class(name):
    hw = _hardware(name)
    table = decode_table(hw)
    assert set(table) == {(v, s) for v in VERSIONS for s in SHAPE_CLASSES}
    for (variant, shape), entry in table.items():
        assert (entry.variant, entry.shape) == (variant, shape)
        assert 0 < entry.efficiency <= 1
        measured = (name, variant, shape) in MEASURED
        assert entry.source.startswith("measured: " if measured else ("calibrated: " if name == "cpu-local"
                                                                      else "unmeasured ("))
        if not measured:  # the documented default, not an invented measurement
            assert entry.efficiency == hw.decode_attention_efficiency
            assert "decode_attention_efficiency" in entry.source


V3_MEASURED = {("h100-sxm", s) for s in SHAPE_CLASSES} | {("h200", "few"), ("h200", "many")}


def test_v3_is_measured_on_the_h100_and_h200_only_and_elsewhere_says_so():
    assert {(key[0], key[2]) for key in MEASURED if key[1] == "v3"} == V3_MEASURED
    for name in GPUS:
        for shape in SHAPE_CLASSES:
            source = decode_table(_hardware(name))["v3", shape].source
            expected = "measured: " if (name, shape) in V3_MEASURED else "unmeasured (no kernel benchmark of v3"
            assert source.startswith(expected)


@pytest.mark.parametrize(("key", "cell"), MEASURED.items(), ids=lambda x: "-".join(x) if isinstance(x, tuple) else "")
def test_a_measured_row_reproduces_its_benchmark_cell_through_the_cost_model(key, cell):
    """Llama-3-70B on one GPU has the benchmark's attention shape (64 query / 8 KV heads, head 128)."""
    name, variant, shape = key
    assert shape_class(cell.num_seqs, cell.context) == shape
    # the source holds it (the H200's, outside the repository, is copied into docs/simulator.md)
    doc = "docs/simulator.md" if name == "h200" else "docs/gpu.md"
    assert str(cell.us).rstrip("0").rstrip(".") in Path(doc).read_text()
    executor = _executor("model=llama-3-70b", f"hardware={name}", f"kernel={variant}")
    model = executor.cost_model
    cost = model.step(_decode([cell.context] * cell.num_seqs))
    assert cost.decode_version == variant
    per_layer_us = cost.attention_s / executor.spec.num_layers * 1e6
    assert per_layer_us == pytest.approx(cell.us, rel=1e-6)


def test_the_h200_preset_prices_a_decode_step_from_its_measured_rows():
    """Llama-3-70B on one H200 (the benchmark's attention shape): one decode step's attention per
    layer is v3's measured µs at 1x16384 and 64x4096; the preset's efficiencies are the fits its
    comments give (read probe 4,454 of 4,800 GB/s; v3's 64x4096 bytes; the cuda prefill's TF/s)."""
    hw = _hardware("h200")
    assert (hw.memory_efficiency, hw.decode_attention_efficiency, hw.prefill_attention_efficiency) == (
        round(4454 / 4800, 3), round(64 * 4096 * 8 * 128 * 2 * 2 / 315.1e-6 / 4800e9, 2), round(95.6 / 989, 3))
    executor = _executor("model=llama-3-70b", "hardware=h200", "kernel=v3")
    layers = executor.spec.num_layers
    for contexts, us in (([16384], 50.3), ([4096] * 64, 315.1)):
        cost = executor.cost_model.step(_decode(contexts))
        assert cost.attention_s / layers * 1e6 == pytest.approx(us, rel=1e-6)
    table = decode_table(hw)
    assert all("2026-11-28-h200-kernel-bench.txt" in table[v, s].source for v in VERSIONS for s in ("few", "many"))
    # no 256x16384 row on the H200: many-long is priced at the preset's fitted default
    long_step = executor.cost_model.step(_decode([16384] * 256)).attention_s / layers
    kv_bytes = 2 * 256 * 16384 * 8 * 128 * 2
    assert table["v3", "many-long"].efficiency == hw.decode_attention_efficiency
    assert long_step == pytest.approx(kv_bytes / (hw.memory_bandwidth * hw.decode_attention_efficiency), rel=0.02)


def test_shape_classes_split_few_many_and_many_long():
    assert [shape_class(n, c) for n, c in [(1, 512), (15, 16384), (16, 1024), (256, 8192), (16, 8193)]] == [
        "few", "few", "many", "many", "many-long"]


@pytest.mark.parametrize("contexts", [[16384], [4096] * 64, [1024] * 256], ids=["1x16K", "64x4096", "256x1024"])
def test_kernel_v1_v2_v3_on_the_sim_price_different_sensible_decode_times(contexts):
    times = {}
    for variant in VERSIONS:
        executor = _executor("model=llama-3-70b", "hardware=h100-sxm", f"kernel={variant}")
        cost = executor.cost_model.step(_decode(contexts))
        assert cost.decode_version == variant and executor.kernel_description.startswith(variant)
        times[variant] = cost.attention_s / executor.spec.num_layers
    assert len(set(times.values())) == 3
    # no kernel reads the K/V faster than the datasheet bandwidth allows
    kv_bytes = 2 * sum(contexts) * 8 * 128 * 2
    assert min(times.values()) > kv_bytes / 3350e9
    # as measured on the H100: v2 far ahead of v1 on one long sequence, level with it on many
    ratio = times["v1"] / times["v2"]
    assert ratio > 5 if len(contexts) == 1 else 0.9 < ratio < 1.1
    # v3 is priced at the hardware's literature efficiency until it is measured: the fastest
    assert times["v3"] < min(times["v1"], times["v2"])


def test_v3_splits_a_few_long_sequences_and_not_a_full_batch():
    hw = _hardware("h100-sxm")
    spec = _executor("model=llama-3-70b").spec
    v3 = CostModel(spec, hw, 2, version="v3")
    unsplit = CostModel(spec, hw, 2, version="v3", partition_size=1 << 20)  # v3 ignores v2's partitions
    assert v3.step(_decode([16384])).attention_s == unsplit.step(_decode([16384])).attention_s
    # one sequence: 8 (sequence, KV head) items split to fill 132 SMs, so the unit floor is a split's,
    # far under v1's whole-context unit at the same efficiency
    one_long = v3.step(_decode([16384])).attention_s
    kv_bytes = 2 * 16384 * 8 * 128 * 2 * spec.num_layers
    assert one_long < 2 * kv_bytes / (hw.memory_bandwidth * decode_table(hw)["v3", "few"].efficiency)


def test_auto_prices_the_cuda_backends_choice_and_vllm_vllms_on_the_simulated_gpu():
    auto = _executor("model=llama-3-70b", "hardware=h100-sxm", "kernel=auto").cost_model
    assert {auto.step(_decode(c)).decode_version for c in ([16384], [1024] * 256)} == {"v3"}
    vllm = _executor("model=llama-3-70b", "hardware=h100-sxm", "kernel=vllm").cost_model
    assert vllm.step(_decode([16384])).decode_version == "v2"
    assert vllm.step(_decode([1024] * 256)).decode_version == "v1"


def test_a_bad_variant_is_refused_in_one_line():
    spec = _executor("model=llama-3-70b").spec
    with pytest.raises(ValueError) as err:
        CostModel(spec, _hardware("h100-sxm"), 2, version="v4")
    assert str(err.value) == "kernel.version='v4' is not supported; allowed: auto, vllm, v1, v2, v3"
    with pytest.raises(ConfigError) as config_err:
        build_engine(compose_config(["executor=sim", *QUIET, "model=llama-3-70b", "kernel.version=v4"]))
    assert "\n" not in str(config_err.value) and "v4" in str(config_err.value)
