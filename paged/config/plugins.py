"""Pluggable parts named by `_target_` in their config node, checked before anything heavy is built.

A node's keys are either core keys (typed by the schema in `paged/config/schema.py`, read by the framework)
or the plugin's own settings, passed to its constructor by `hydra.utils.instantiate`. `check_plugin`
imports the class, checks it is the expected base type, and checks the settings against the
constructor's signature and type hints (through an OmegaConf schema built from them), so a bad
plugin setting fails with its key named before any model weights load.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import logging
import typing
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, NoReturn

from hydra.errors import InstantiationException
from hydra.utils import get_class, instantiate
from omegaconf import Container, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from paged.config import ConfigError, did_you_mean


@dataclass(frozen=True)
class Plugin:
    """A checked plugin: its config key, class and own settings; `build` constructs it."""

    key: str
    cls: type
    settings: dict[str, Any]

    def build(self, **provided: Any) -> Any:
        """Instantiate with the framework-provided arguments plus the plugin's own settings.

        Settings arrive as plain Python values, config sections (`model=cfg.model`) as their
        schema dataclasses; a settings node with its own `_target_` is instantiated first. A
        constructor's ValueError (a setting out of range) is a config error naming this plugin's
        key; a ConfigError (it names its own key or file, e.g. a checkpoint's) propagates as it is,
        and so does any other error, with its traceback.
        """
        if _has_target(self.settings):
            try:
                return instantiate({"_target_": self.path, **self.settings}, _convert_="object", **provided)
            except InstantiationException as e:
                self._raise(e.__cause__ or e)
        # Hydra's instantiate would copy the settings and the provided values through OmegaConf
        # (~9 ms a plugin, and an engine builds five); without a nested `_target_` it only converts
        # config sections to their dataclasses, as `to_object` does, and hands each build its own copy;
        # a provided value replaces a setting of the same name, as Hydra merges it over the node.
        settings = copy.deepcopy(self.settings)
        objects = {k: OmegaConf.to_object(v) if isinstance(v, Container) else v for k, v in provided.items()}
        try:
            return self.cls(**{**settings, **objects})
        except ValueError as e:
            self._raise(e)

    def _raise(self, cause: BaseException) -> NoReturn:
        if isinstance(cause, ValueError) and not isinstance(cause, ConfigError):
            raise ConfigError(f"{self.key}._target_={self.path!r}: {_one_line(cause)}") from cause
        raise cause from None

    @property
    def path(self) -> str:
        return f"{self.cls.__module__}.{self.cls.__qualname__}"


def check_plugin(
    node: DictConfig | dict[str, Any],
    key: str,
    base: type,
    *,
    core: Collection[str] = (),
    provided: Collection[str] = (),
) -> Plugin:
    """Import `node._target_`, check it subclasses `base`, and check the node's settings (keys other
    than `_target_` and `core`) against its constructor, which the framework calls with `provided`."""
    target = node.get("_target_")
    expected = f"the import path of a {base.__module__}.{base.__qualname__} subclass (package.module.ClassName)"
    if not isinstance(target, str) or not target:
        raise ConfigError(f"{key}._target_ is not set; expected {expected}")
    try:
        cls = _load_class(target)
    except Exception as e:  # noqa: BLE001 - Hydra raises ImportError or ValueError with the cause inside
        raise ConfigError(f"{key}._target_={target!r} cannot be loaded ({_one_line(e)}); expected {expected}") from None
    if not issubclass(cls, base):
        raise ConfigError(f"{key}._target_={target!r} is not a subclass of {base.__qualname__}; expected {expected}")
    container = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
    settings = {k: v for k, v in container.items() if k != "_target_" and k not in core}
    _check_settings(key, cls, settings, set(core), set(provided))
    return Plugin(key, cls, settings)


def _has_target(value: Any) -> bool:
    """Whether a setting holds a node of its own to instantiate (a `_target_` at any depth)."""
    if isinstance(value, dict):
        return "_target_" in value or any(_has_target(v) for v in value.values())
    return isinstance(value, list) and any(_has_target(v) for v in value)


def _load_class(path: str) -> type:
    # get_class logs every failure at error level; the ConfigError raised instead says it all.
    hydra_log = logging.getLogger("hydra.utils")
    level = hydra_log.level
    hydra_log.setLevel(logging.CRITICAL)
    try:
        return get_class(path)
    finally:
        hydra_log.setLevel(level)


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split()) or type(error).__name__


def _check_settings(key: str, cls: type, settings: dict[str, Any], core: set[str], provided: set[str]) -> None:
    params = inspect.signature(cls).parameters
    named = {n: p for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    # a parameter named like a core key is the framework's to pass (the allocator's eviction policy), not a setting
    own = {n: p for n, p in named.items() if n not in provided and n not in core}
    missing_provided = sorted(provided - set(named)) if not takes_any else []
    if missing_provided:
        raise ConfigError(
            f"{key}: {cls.__qualname__} must accept the constructor arguments {', '.join(missing_provided)} "
            "that the framework passes it"
        )
    for name in settings:
        if name in provided:
            raise ConfigError(f"{key}.{name} is set by the framework, not by config")
        if name not in own and not takes_any:
            accepted = ", ".join(own) or "none"
            raise ConfigError(
                f"{key}.{name}={settings[name]!r} is not a setting of {cls.__qualname__} "
                f"(its settings: {accepted}){did_you_mean(name, [*own, *core], key)}"
            )
    for name, param in own.items():
        if param.default is param.empty and name not in settings:
            raise ConfigError(f"{key}.{name} is required by {cls.__qualname__} but not set")
    try:
        OmegaConf.merge(_settings_node(cls, tuple(n for n in settings if n in own)),
                        {n: settings[n] for n in settings if n in own})
    except OmegaConfBaseException as e:
        full_key = getattr(e, "full_key", None) or ""
        raise ConfigError(f"{key}.{full_key}: {_one_line(e)} (a setting of {cls.__qualname__})") from None


@functools.cache
def _settings_node(cls: type, names: tuple[str, ...]) -> DictConfig:
    """A node of the given constructor parameters with their type hints, for OmegaConf to check
    values against; a hint OmegaConf cannot express (a class of the plugin's own, say) becomes Any.
    Built once per plugin class and set of settings: every engine build checks each of its plugins."""
    try:
        hints = typing.get_type_hints(cls.__init__)
    except Exception:  # noqa: BLE001 - unresolvable annotations: check names only
        hints = {}
    fields = []
    for name in names:
        hint = hints.get(name, Any)
        try:
            OmegaConf.structured(dataclasses.make_dataclass("Probe", [(name, hint)]))
        except OmegaConfBaseException:
            hint = Any
        fields.append((name, hint))
    return OmegaConf.structured(dataclasses.make_dataclass(f"{cls.__name__}Settings", fields))
