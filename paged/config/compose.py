"""The config `run.py` would see for a list of overrides (Hydra's compose API)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hydra import compose, initialize_config_dir

from paged.assets import asset_dir
from paged.config.schema import register_configs

CONF_DIR = asset_dir("conf")


def compose_config(overrides: Sequence[str] = ()) -> Any:
    """The same config `run.py` would see for these overrides."""
    if not CONF_DIR.is_dir():
        raise FileNotFoundError(f"config dir {CONF_DIR} not found; reinstall paged (pip install -e .)")
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides))
