"""NVRTC builds of kernels_cu/ to cubin, with no GPU: every dispatchable instantiation, the cache,
resource use of the default configurations, and the errors users see."""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import pytest
import torch

from paged.kernels.backends.prefill_plans import prefill_shared_memory
from paged.kernels.features import FP8_DTYPES
from paged.kernels.toolchain import aot, nvrtc, source, specs
from paged.kernels.toolchain.cache_dir import ENV_VAR

pytestmark = pytest.mark.compiles

ARCHS = ("sm_80", "sm_90")
ELF = b"\x7fELF"


@pytest.fixture(autouse=True, scope="module")
def _needs_nvrtc() -> None:
    try:
        nvrtc.toolchain()
    except nvrtc.NVRTCUnavailableError as e:
        pytest.skip(str(e))


@pytest.fixture
def fresh_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(ENV_VAR, str(tmp_path))
    return tmp_path


@pytest.mark.serial("asserts a cold NVRTC compile under 45 s and a warm load under 0.2 s; a neighbour breaks that")
@pytest.mark.parametrize("arch", ARCHS)
def test_default_configurations_compile_cold_fast_without_spills_then_hit_the_cache(
    arch: str, fresh_cache: Path
) -> None:
    units = specs.default_units()
    start = time.perf_counter()
    cold = nvrtc.compile_units(units, arch)
    cold_s = time.perf_counter() - start
    assert not any(c.cached for c in cold)
    # 26 units (fp16/bf16 x own-dtype/fp8 caches: decode v1/v2, v3 for groups of 4 and 8, prefill, cache ops; and
    # their layer ops); generous for a loaded 2-core machine
    assert cold_s < 45, f"cold compile of the default configurations took {cold_s:.1f} s"
    for compiled in cold:
        assert compiled.cubin.startswith(ELF)
        assert sorted(i.kernel for i in compiled.infos) == sorted(compiled.unit.kernels)
        for info in compiled.infos:
            assert (info.spill_stores, info.spill_loads) == (0, 0), info
            assert 0 < info.registers <= 255
    start = time.perf_counter()
    warm = nvrtc.compile_units(units, arch)
    warm_s = time.perf_counter() - start
    assert all(c.cached for c in warm) and warm_s < 0.2, f"warm load took {warm_s:.3f} s"
    assert [c.cubin for c in warm] == [c.cubin for c in cold]


def _check_compiles(units: list[specs.Unit], arch: str) -> None:
    for compiled in nvrtc.compile_units(units, arch):
        assert compiled.cubin.startswith(ELF), compiled.unit
        assert {i.kernel for i in compiled.infos} == set(compiled.unit.kernels)
        assert all(f"'{arch}'" in line for line in compiled.log.splitlines() if "Compiling entry" in line)


@pytest.mark.parametrize("arch", ARCHS)
def test_every_dispatchable_instantiation_with_a_model_dtype_cache_compiles_to_cubin(arch: str) -> None:
    """Uses the shared cache: the first run on a machine compiles ~110 units per arch."""
    units = specs.dispatchable_units()
    # activation dtypes x (own, e4m3, e5m2) caches: cache ops and attention mass; decode v1, v2, prefill and v3
    # in its 4 head tiles, plain or with the features, per head size and block size; layer ops
    assert len(units) == 3 * 3 * 2 + 3 * 3 * 6 * 3 * 2 * (3 + 4) + 3
    # prefill's CUDA-core fp32 variant and v3's 4 head tiles take seconds each: their covering sets are
    # in the test below
    _check_compiles([u for u in units if not u.cache and not u.features and u.op not in ("prefill", "attention_v3")],
                    arch)


def test_fp8_and_feature_instantiations_compile_to_cubin() -> None:
    """A covering set of the fp8 and the ALiBi / block-sparse units (each head size, block size,
    activation dtype and format; `python -m paged.kernels.toolchain.build --report` compiles all)."""
    configs = [(torch.float32, 64, 8), (torch.float16, 80, 16), (torch.bfloat16, 96, 32),
               (torch.float32, 112, 16), (torch.float16, 128, 32), (torch.bfloat16, 256, 8)]
    units = [specs.cache_unit(dtype, fp8) for dtype in specs.CXX_TYPES for fp8 in FP8_DTYPES]
    for fp8 in FP8_DTYPES:
        for dtype, head, block in configs:
            units += [specs.attention_unit(dtype, head, block, v, 512, fp8) for v in ("v1", "v2")]
    for dtype, head, block in configs:
        units += [specs.attention_unit(dtype, head, block, v, 512, features=True) for v in ("v1", "v2")]
    # prefill: each configuration once, its cache, features and format rotating
    caches = (None, *FP8_DTYPES)
    units += [specs.prefill_unit(dtype, head, block, caches[i % 3], i % 2 == 1)
              for i, (dtype, head, block) in enumerate(configs)]
    # v3: each configuration once, its head tile (group 1, 2, 4, 8), cache and features rotating
    units += [specs.attention_unit(dtype, head, block, "v3", 0, caches[i % 3], i % 2 == 1, (1, 2, 4, 8)[i % 4])
              for i, (dtype, head, block) in enumerate(configs)]
    _check_compiles(units, "sm_90")


# An H100 SM: 228 KB of shared memory, of which the driver reserves 1 KB per CTA.
H100_SMEM, CTA_RESERVED = 228 * 1024, 1024


def test_prefill_tensor_core_tiles_fit_registers_and_two_ctas_per_sm() -> None:
    """prefill.cuh's two row tiles per warp at their largest S and O fragments (64 keys at head 64,
    head 128 with an fp8 cache) and with every feature compiled in: no spills on sm_90, and the
    shared memory of every 16-bit head size up to 128 lets an H100 SM hold two CTAs."""
    units = [specs.prefill_unit(torch.float16, 64, 16, features=True),
             specs.prefill_unit(torch.bfloat16, 128, 16, torch.float8_e4m3fn, features=True)]
    for compiled in nvrtc.compile_units(units, "sm_90"):
        (info,) = compiled.infos
        assert (info.spill_stores, info.spill_loads) == (0, 0), info
    for dtype in (torch.float16, torch.bfloat16):
        for head in (64, 80, 96, 112, 128):
            assert 2 * (prefill_shared_memory(dtype, head) + CTA_RESERVED) <= H100_SMEM, (dtype, head)


def _cache_files(root: Path) -> tuple[Path, Path]:
    (payload,) = (root / "cubin").glob("*.cubin")
    return payload, payload.with_suffix(".json")


@pytest.mark.parametrize("damage", ["payload", "sidecar", "missing"])
def test_a_corrupt_cache_entry_is_recompiled(damage: str, fresh_cache: Path) -> None:
    unit = specs.Unit("cache", "__half")
    first = nvrtc.compile_unit(unit, "sm_90")
    payload, sidecar = _cache_files(fresh_cache)
    if damage == "payload":
        payload.write_bytes(payload.read_bytes()[:100])
    elif damage == "sidecar":
        sidecar.write_text("{not json")
    else:
        payload.unlink()
    again = nvrtc.compile_unit(unit, "sm_90")
    assert not again.cached and again.cubin.startswith(ELF) and again.symbol_mapping == first.symbol_mapping
    assert nvrtc.compile_unit(unit, "sm_90").cached
    assert json.loads(sidecar.read_text())["unit"] == unit.label


def test_a_source_edit_changes_the_cache_key(
    fresh_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    unit = specs.Unit("cache", "float")
    assert not nvrtc.compile_unit(unit, "sm_80").cached
    edited = tmp_path / "src"
    shutil.copytree(Path(nvrtc.source_dir()), edited)
    (edited / "cache.cuh").write_text((edited / "cache.cuh").read_text() + "\n// edited\n")
    monkeypatch.setenv("PAGED_KERNELS_DIR", str(edited))
    assert not nvrtc.compile_unit(unit, "sm_80").cached


def test_an_emulator_edit_leaves_the_cubins_cached_and_rebuilds_the_emulator(
    fresh_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    unit = specs.Unit("cache", "float")
    copy = tmp_path / "src"
    shutil.copytree(Path(nvrtc.source_dir()), copy)
    monkeypatch.setenv("PAGED_KERNELS_DIR", str(copy))
    assert not nvrtc.compile_unit(unit, "sm_80").cached
    before = source.source_hash()
    (copy / "emu" / "runtime.h").write_text((copy / "emu" / "runtime.h").read_text() + "\n// edited\n")
    source._hash_of.cache_clear()  # hashes are kept per folder for the process; this one changed under it
    try:
        assert nvrtc.compile_unit(unit, "sm_80").cached
        assert source.source_hash() != before  # the emulator's key
    finally:
        source._hash_of.cache_clear()


def test_compile_errors_carry_the_full_nvrtc_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    broken = tmp_path / "src"
    shutil.copytree(Path(nvrtc.source_dir()), broken)
    cache = broken / "cache.cuh"
    cache.write_text(cache.read_text().replace("if (slot < 0) return;", "if (slot < 0) return undefined_name;"))
    monkeypatch.setenv("PAGED_KERNELS_DIR", str(broken))
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "cache"))
    with pytest.raises(nvrtc.KernelCompileError, match=r"(?s)cache float.*cache\.cuh.*undefined_name"):
        nvrtc.compile_unit(specs.Unit("cache", "float"), "sm_90")


def test_missing_nvrtc_names_the_packages_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    nvrtc.toolchain.cache_clear()
    monkeypatch.setitem(sys.modules, "cuda.bindings.nvrtc", None)
    try:
        with pytest.raises(nvrtc.NVRTCUnavailableError, match="pip install nvidia-cuda-nvrtc nvidia-cuda-runtime"):
            nvrtc.toolchain()
    finally:
        nvrtc.toolchain.cache_clear()


def test_missing_headers_name_the_packages_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import cuda.pathfinder

    nvrtc.toolchain.cache_clear()
    monkeypatch.setattr(cuda.pathfinder, "find_nvidia_header_directory", lambda _: None)
    try:
        with pytest.raises(nvrtc.NVRTCUnavailableError, match="cuda_fp16.h.*pip install .*nvidia-cuda-runtime"):
            nvrtc.toolchain()
    finally:
        nvrtc.toolchain.cache_clear()


def test_build_cli_prints_the_resource_report(capsys: pytest.CaptureFixture[str]) -> None:
    assert aot.main(["--arch", "sm_90", "--default-only", "--report"]) == 0
    out = capsys.readouterr().out
    assert "regs" in out and "spill st" in out and "compile s" in out
    v1_default = "paged::paged_attention_v1_kernel<__half, __half, 128, 16"
    row = next(line for line in out.splitlines() if line.startswith(v1_default))
    regs, spill_st, spill_ld, smem, seconds = row.split()[-5:]
    assert int(regs) > 0 and (spill_st, spill_ld) == ("0", "0") and int(smem) > 0 and float(seconds) > 0
    assert "26 units (58 kernels) for sm_90" in out


def test_build_cli_refuses_an_unknown_arch(capsys: pytest.CaptureFixture[str]) -> None:
    assert aot.main(["--arch", "sm_70"]) == 2
    assert "sm_80" in capsys.readouterr().err
