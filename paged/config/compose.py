"""The config `run.py` would see for a list of overrides (Hydra's compose API), with its keys checked
(`paged.config.keys`) before and after composing."""

from __future__ import annotations

import copy
import functools
import sys
from collections.abc import Sequence
from typing import Any

from hydra import compose, initialize_config_dir
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.errors import ConfigCompositionException
from omegaconf.errors import OmegaConfBaseException

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
    """The same config `run.py` would see for these overrides; an unknown key raises ConfigError.

    Hydra spends ~0.3 s of CPU per compose building the defaults list and merging ~20 YAML files,
    while callers (the API's `LLM`, sweeps of studies, tests) mostly vary values over a few group
    choices. So the config of a set of group choices is composed once per process (and per state of
    the conf files), and the value overrides are applied to a copy with Hydra's own function, as
    `compose` applies them after merging."""
    if not CONF_DIR.is_dir():
        raise FileNotFoundError(f"config dir {CONF_DIR} not found; reinstall paged (pip install -e .)")
    options = config_options()
    check_overrides(overrides, options)
    parsed = OverridesParser.create().parse_overrides(overrides=list(overrides))
    if any(o.is_sweep_override() for o in parsed):
        cfg = _hydra_compose(tuple(overrides))  # Hydra's own error for a sweep outside -m
    else:
        chosen = [_chooses(o, options) for o in parsed]
        choices = tuple(o.input_line for o, c in zip(parsed, chosen) if c)
        values = [o for o, c in zip(parsed, chosen) if not c]
        cfg = copy.deepcopy(_composed(choices, _conf_state()))
        try:
            ConfigLoaderImpl._apply_overrides_to_config(values, cfg)
        except OmegaConfBaseException as e:  # as Hydra's `load_configuration` wraps it
            raise ConfigCompositionException().with_traceback(sys.exc_info()[2]) from e
    check_keys(cfg)
    return cfg


def _chooses(override: Override, options: dict[str, list[str]]) -> bool:
    """Whether Hydra takes `override` while building the defaults list (a config group, Hydra's own
    settings, a package) rather than as a value set after merging."""
    key = override.key_or_group
    return key in options or key.split("/")[0].split(".")[0] == "hydra" or override.package is not None


def _conf_state() -> tuple[tuple[str, int, int], ...]:
    """Each YAML file of `conf/` with its mtime and size: an edited or added option recomposes."""
    files = sorted(CONF_DIR.rglob("*.yaml"))
    return tuple((p.as_posix(), (st := p.stat()).st_mtime_ns, st.st_size) for p in files)


@functools.lru_cache(maxsize=64)
def _composed(choices: tuple[str, ...], conf_state: tuple[tuple[str, int, int], ...]) -> Any:
    """Hydra's composition for these group choices (callers copy it: configs are mutable)."""
    return _hydra_compose(choices)


def _hydra_compose(overrides: tuple[str, ...]) -> Any:
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides))
