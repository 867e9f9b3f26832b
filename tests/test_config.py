"""Bad config fails before any model loads, with a message naming the value and what is allowed."""

import pytest

from paged.config import ConfigError, compose_config, parse_bytes, validate
from paged.engine.builder import check_config


def test_default_config_is_valid_and_picks_documented_defaults():
    cfg = compose_config()
    validate(cfg)
    assert (cfg.model.name, cfg.allocator.name, cfg.scheduler.name, cfg.kernel.name) == (
        "smollm2-135m", "prefix", "fcfs", "auto",
    )
    assert cfg.kernel.partition_size == 512
    assert cfg.logger.mode == "offline"


def test_unknown_group_option_lists_available_options():
    with pytest.raises(ConfigError) as err:
        compose_config(["allocator=prefx"])
    assert str(err.value) == (
        "allocator=prefx is not an option; did you mean prefix?; the options of allocator: "
        "naive, orca-max, orca-oracle, orca-pow2, prefix"
    )
    with pytest.raises(ConfigError, match="model=smollm3 is not an option"):
        compose_config(["model=tiny-random,smollm3"])


def test_wrong_type_is_rejected_by_schema():
    # checked against the schema before Hydra composes (paged/config/keys.py): one line, the value named
    with pytest.raises(ConfigError, match="allocator.block_size=abc: Value 'abc' of type 'str'"):
        compose_config(["allocator.block_size=abc"])


def test_mistyped_key_is_rejected_by_schema():
    with pytest.raises(ConfigError, match="unknown key kernel.partiton_size; did you mean kernel.partition_size"):
        compose_config(["kernel.partiton_size=10"])


def test_mistyped_key_in_a_plugin_node_is_rejected_naming_the_key_and_the_close_one():
    # plugin nodes take a plugin's own settings, so the key is checked against the class
    cfg = compose_config(["allocator.num_blokcs=10"])
    with pytest.raises(ConfigError) as err:
        check_config(cfg)
    assert str(err.value) == (
        "allocator.num_blokcs=10 is not a setting of PrefixCachingAllocator (its settings: none); "
        "did you mean allocator.num_blocks?"
    )


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("allocator.num_blocks=0", "allocator.num_blocks=0 must be > 0"),
        ("allocator.num_blocks=-5", "allocator.num_blocks=-5 must be > 0"),
        ("allocator.block_size=12", "allocator.block_size=12 is not supported; allowed: 8, 16, 32"),
        ("allocator.block_size=64", "allowed: 8, 16, 32"),
        ("kernel.backend=rocm", "kernel.backend='rocm' is not supported"),
        ("kernel.partition_size=100", "multiple of allocator.block_size"),
        ("scheduler.max_num_seqs=0", "scheduler.max_num_seqs=0 must be > 0"),
        ("scheduler.max_num_batched_tokens=8", "is below one KV block (allocator.block_size=16)"),
        ("scheduler.batch_order=random", "scheduler.batch_order='random' is not supported"),
        ("scheduler.max_num_partial_prefills=0", "scheduler.max_num_partial_prefills=0 must be > 0"),
        ("scheduler.long_prefill_token_threshold=-1", "must be >= 0"),
        ("model.dtype=float8", "model.dtype='float8' is not supported"),
        ("model.gemm=cublas", "model.gemm='cublas' is not supported; allowed: auto, torch, onednn, packed"),
        ("allocator.watermark=1.5", "allocator.watermark=1.5 must be in [0, 1)"),
        ("model.dtype=half", "model.dtype='half' is not supported; allowed: auto, float32, float16, bfloat16"),
    ],
)
def test_out_of_range_values_raise_config_error(override, message):
    cfg = compose_config([override])
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert message in str(err.value)


def test_num_blocks_and_kv_cache_memory_together_are_refused():
    # num_blocks would otherwise win silently over the budget the user gave
    cfg = compose_config(["allocator.num_blocks=2048", "allocator.kv_cache_memory=45MiB"])
    with pytest.raises(ConfigError, match="num_blocks=2048 and allocator.kv_cache_memory='45MiB' both size"):
        validate(cfg)


def test_kv_cache_memory_budget_parses_units():
    assert parse_bytes("1MiB") == 2**20
    assert parse_bytes("2GB") == 2 * 10**9
    assert parse_bytes(4096) == 4096
    for bad in ("-1MiB", "lots", "0"):
        with pytest.raises(ConfigError, match="kv_cache_memory"):
            parse_bytes(bad)


def test_hf_model_needs_a_path():
    with pytest.raises(Exception, match="model.path"):
        validate(compose_config(["model=hf"]))
