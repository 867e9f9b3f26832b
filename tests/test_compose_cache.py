"""`compose_config` composes each set of group choices once per process and applies the value
overrides to a copy; what it returns must be exactly Hydra's composition of the whole list."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from paged.config import compose as compose_module
from paged.config import compose_config
from paged.config.schema import register_configs

CASES = [
    [],
    # a value before the choice of its group: Hydra applies values after the defaults list either way
    ["allocator.num_blocks=64", "model=tiny-random", "logger=none", "progress=false", "allocator=naive"],
    ["allocator/eviction=s3fifo", "scheduler=priority", "scheduler.max_num_seqs=3", "+deploy=2p2d"],
    ["executor=sim", "model=llama-3-70b", "hardware=h100-sxm", "kernel=v3", "hardware.num_gpus=8", "+load=sharegpt"],
    ["+experiment=bench-policies", "workload.num_requests=7"],
    ["+setup=opt-13b", "seed=3"],
    ["workload=fixed", "workload.num_requests=5", "~router", "kernel.kv_cache_dtype=fp8_e4m3", "++seed=9",
     "hydra.job.chdir=true"],
]


def _hydra(overrides: list[str]) -> dict:
    register_configs()
    with initialize_config_dir(config_dir=str(compose_module.CONF_DIR), version_base="1.3"):
        return OmegaConf.to_container(compose("config", overrides=overrides))


@pytest.mark.parametrize("overrides", CASES, ids=lambda o: " ".join(o) or "defaults")
def test_the_config_is_hydras_composition_of_the_whole_list(overrides: list[str]) -> None:
    compose_config(overrides)  # the second call below reads the composed group choices
    assert OmegaConf.to_container(compose_config(overrides)) == _hydra(overrides)


def test_a_returned_config_is_the_callers_to_change() -> None:
    first = compose_config(["model=tiny-random"])
    first.seed = 123
    first.allocator.num_blocks = 7
    second = compose_config(["model=tiny-random"])
    assert second.seed == 0 and second.allocator.num_blocks != 7


@pytest.mark.parametrize("bad", [["+seed=5"], ["~seed=5"], ["~allocator.nothing_here"]])
def test_a_bad_value_fails_as_hydra_fails_it(bad: list[str]) -> None:
    with pytest.raises(ConfigCompositionException) as ours:
        compose_config(bad)
    with pytest.raises(ConfigCompositionException) as hydras:
        _hydra(bad)
    assert str(ours.value) == str(hydras.value)
    assert str(ours.value.__cause__) == str(hydras.value.__cause__)


def test_a_sweep_outside_multirun_is_hydras_error() -> None:
    with pytest.raises(ConfigCompositionException, match="multirun"):
        compose_config(["seed=1,2"])


def test_an_edited_option_file_is_read_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    conf = tmp_path / "conf"
    shutil.copytree(compose_module.CONF_DIR, conf)
    monkeypatch.setattr(compose_module, "CONF_DIR", conf)
    naive = conf / "allocator" / "naive.yaml"
    before = compose_config(["allocator=naive"]).allocator.watermark
    naive.write_text(naive.read_text().replace("watermark: 0.01", "watermark: 0.25"))
    assert before != 0.25
    assert compose_config(["allocator=naive"]).allocator.watermark == 0.25
