"""The config `run.py` would see for a list of overrides (Hydra's compose API), with its keys checked
(`paged.config.keys`) before and after composing."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hydra import compose, initialize_config_dir

from paged.config.keys import check_keys, check_overrides
from paged.config.schema import register_configs
from paged.utils.assets import asset_dir

CONF_DIR = asset_dir("conf")


def config_groups() -> list[str]:
    """The config groups of `conf/` (`allocator`, `experiment`, ...): an override naming one chooses an option."""
    return sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir()) if CONF_DIR.is_dir() else []


def config_options() -> dict[str, list[str]]:
    """Each config group of `conf/`, nested ones too (`allocator/eviction`), and its options (the
    YAML files in it), sorted."""
    groups = sorted(p.relative_to(CONF_DIR).as_posix() for p in CONF_DIR.rglob("*") if p.is_dir())
    return {group: sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml")) for group in groups}


def check_command_line(argv: Sequence[str]) -> None:
    """`check_overrides` on the overrides of a `run.py` command line (Hydra's own flags, `-m`,
    `--cfg job`, `--help`, ..., are Hydra's); raises ConfigError before Hydra composes anything."""
    from hydra._internal.utils import get_args_parser  # Hydra's parser: the flags exactly as run.py takes them

    args, _ = get_args_parser().parse_known_args(list(argv))
    # a config folder of the user's (--config-dir, hydra.searchpath) may add options: Hydra checks those
    own_options = args.config_dir or args.config_path or any("searchpath" in o for o in args.overrides)
    check_overrides(args.overrides, config_groups() if own_options else config_options())


def compose_config(overrides: Sequence[str] = ()) -> Any:
    """The same config `run.py` would see for these overrides; an unknown key raises ConfigError."""
    if not CONF_DIR.is_dir():
        raise FileNotFoundError(f"config dir {CONF_DIR} not found; reinstall paged (pip install -e .)")
    check_overrides(overrides, config_options())
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=list(overrides))
    check_keys(cfg)
    return cfg
