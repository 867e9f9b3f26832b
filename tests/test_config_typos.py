"""An unknown key is an error in every group, added with `+` or not, with the closest key suggested
(paged/config/keys.py): in compose_config (the LLM API, the experiments) and on run.py's command line."""

from __future__ import annotations

import pytest
from omegaconf import open_dict

from paged.config import ConfigError, check_keys, check_overrides, compose_config, config_groups, did_you_mean
from paged.engine.builder import check_config
from tests.test_cli import TINY, run_cli

pytestmark = pytest.mark.subprocess


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("+scheduler.max_num_seq=4", "unknown key scheduler.max_num_seq; did you mean scheduler.max_num_seqs?"),
        ("scheduler.max_num_seq=4", "unknown key scheduler.max_num_seq; did you mean scheduler.max_num_seqs?"),
        ("+kernel.partiton_size=64", "unknown key kernel.partiton_size; did you mean kernel.partition_size?"),
        ("kernel.partiton_size=64", "unknown key kernel.partiton_size; did you mean kernel.partition_size?"),
        ("+workload.num_request=3", "unknown key workload.num_request; did you mean workload.num_requests?"),
        ("+model.dtyp=float16", "unknown key model.dtyp; did you mean model.dtype?"),
        ("+logger.projet=x", "unknown key logger.projet; did you mean logger.project?"),
        ("+hardware.num_gpu=2", "unknown key hardware.num_gpu; did you mean hardware.num_gpus?"),
        ("+report.titel=x", "unknown key report.titel; did you mean report.title?"),
        ("+sed=1", "unknown key sed; did you mean seed?"),
        ("allocater=naive", "unknown key allocater; did you mean allocator?"),
        ("+experimnt=fig2", "unknown key experimnt; did you mean experiment?"),
        ("+scheduler.policy._targt_=x", None),  # a plugin node: the plugin's settings, checked by its class
    ],
)
def test_a_mistyped_key_names_the_close_one(override: str, message: str | None) -> None:
    if message is None:
        cfg = compose_config([override])
        with pytest.raises(ConfigError, match="is not a setting of"):
            check_config(cfg)
        return
    with pytest.raises(ConfigError) as err:
        compose_config([override])
    assert str(err.value) == message


def test_an_unknown_top_level_key_lists_the_keys_there_are() -> None:
    with pytest.raises(ConfigError) as err:
        compose_config(["+foo=1"])
    message = str(err.value)
    assert message.startswith("unknown key foo; top-level keys: allocator, scheduler, kernel")
    assert "experiment" in message and message.count("allocator") == 1


def test_an_unknown_key_far_from_any_lists_the_groups_keys() -> None:
    with pytest.raises(ConfigError, match=r"unknown key workload\.zzz; the keys of workload: name, kind, path"):
        compose_config(["+workload.zzz=1"])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("seed=abc", "seed=abc: Value 'abc' of type 'str' could not be converted to Integer"),
        ("workload.num_requests=2.5", "workload.num_requests=2.5: Value '2.5' of type 'float'"),
        ("workload.num_requests=1e8", "workload.num_requests=100000000.0: Value '100000000.0' of type 'float'"),
        ("workload.n=1,2,x", "workload.n=x: Value 'x' of type 'str' could not be converted to Integer"),
        ("scheduler.max_num_seqs=null", "scheduler.max_num_seqs=null: Incompatible value 'None'"),
    ],
)
def test_a_value_of_the_wrong_type_is_one_config_error(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        compose_config([override])
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "override",
    [
        "hydra.run.dir=/tmp/x", "hydra/launcher=joblib", "+experiment=fig2", "allocator=naive,prefix",
        "+load=alpaca", "model.arch.num_layers=2", "+model.arch.num_layers=2", "allocator.some_setting=1",
        "scheduler.policy.aging=1", "kernel.blocksparse={local_blocks: 2}", "workload.client_weights=[4,1]",
        "workload.prompt_len_max=null", "workload.arrival_rate=1,2.5", "seed=${repeat}", "~logger.tags",
    ],
)
def test_groups_hydra_keys_plugin_settings_and_untyped_nodes_pass_the_override_check(override: str) -> None:
    check_overrides([override], config_groups())


def test_a_key_a_yaml_adds_is_caught_after_composing() -> None:
    cfg = compose_config(["model=tiny-random"])
    with open_dict(cfg.scheduler):
        cfg.scheduler.max_num_seq = 4
    with pytest.raises(ConfigError, match="did you mean scheduler.max_num_seqs"):
        check_keys(cfg)
    with pytest.raises(ConfigError, match="did you mean scheduler.max_num_seqs"):
        check_config(cfg)


def test_plugin_settings_share_the_did_you_mean_wording() -> None:
    hint = did_you_mean("num_blokcs", ["num_blocks", "block_size"], "allocator")
    assert hint == "; did you mean allocator.num_blocks?"
    assert did_you_mean("zzz", ["num_blocks"], "allocator") == ""
    with pytest.raises(ConfigError, match=r"; did you mean allocator\.num_blocks\?$"):
        check_config(compose_config(["allocator.num_blokcs=10"]))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["scheduler.max_num_seq=4"], "error: unknown key scheduler.max_num_seq; did you mean scheduler.max_num_seqs?"),
        (["+kernel.partiton_size=64"], "error: unknown key kernel.partiton_size; did you mean kernel.partition_size?"),
        (["+foo=1"], "error: unknown key foo; top-level keys:"),
        (["workload.num_requests=2.5"], "error: workload.num_requests=2.5: Value '2.5' of type 'float'"),
    ],
)
def test_run_py_rejects_a_typo_with_one_line_and_rc_2(tmp_path, args, message) -> None:
    proc = run_cli(tmp_path / "run", *TINY, *args)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and proc.stderr.startswith(message)
    assert not (tmp_path / "run").exists()  # stopped before Hydra made the run folder


def test_run_py_rejects_a_typo_in_a_sweep_before_any_job(tmp_path) -> None:
    proc = run_cli(tmp_path / "sweep", *TINY, "scheduler.max_num_seq=4,8", multirun=True)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: unknown key scheduler.max_num_seq; did you mean scheduler.max_num_seqs?")
    assert not (tmp_path / "sweep").exists()


def test_run_py_cfg_job_still_prints_a_valid_config(tmp_path) -> None:
    proc = run_cli(tmp_path / "run", "--cfg", "job", *TINY, "scheduler.max_num_seqs=4")
    assert proc.returncode == 0, proc.stderr
    assert "max_num_seqs: 4" in proc.stdout
