"""Every key a run is given must be one something reads: an unknown key is an error, with the
closest known key suggested.

One check for every group, against the schema (`paged.config.schema.Config`): `check_keys` walks a
composed config (which catches keys added with `+`, and keys a YAML adds), `check_overrides` the
overrides before Hydra composes them (Hydra's own error for a plain typo suggests adding it with
`+`, and for a mistyped value prints a multi-line message). Plugin nodes (`PLUGIN_NODES`) keep
their extra keys: those are the plugin's constructor settings, which `paged.config.plugins` checks against
its class with the same `did_you_mean` wording. Keys under an untyped node (`model.arch`,
`kernel.blocksparse`, the `report` entries) are not the schema's to know.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import typing
from collections.abc import Collection, Mapping, Sequence
from functools import cache
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from paged.config.schema import PLUGIN_NODES, Config, ConfigError


def did_you_mean(name: str, candidates: Collection[str], prefix: str = "") -> str:
    """'; did you mean PREFIX.KEY?' for the candidate closest to `name`, or '' if none is close."""
    close = difflib.get_close_matches(name, list(candidates), n=1)
    return f"; did you mean {prefix + '.' if prefix else ''}{close[0]}?" if close else ""


def unknown_key(parent: str, name: str, known: Collection[str]) -> ConfigError:
    """The error for key `name` under `parent` ('' at the top level), which allows only `known`."""
    path = f"{parent}.{name}" if parent else name
    hint = did_you_mean(name, known, parent)
    if not hint:
        hint = f"; {'the keys of ' + parent if parent else 'top-level keys'}: {', '.join(dict.fromkeys(known))}"
    return ConfigError(f"unknown key {path}{hint}")


@cache
def _hints(schema: type) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(schema)}
    return {k: v for k, v in typing.get_type_hints(schema).items() if k in names}


def _dataclass_of(hint: Any) -> type | None:
    """The schema dataclass a field holds (itself or inside Optional), or None for a leaf."""
    for candidate in (hint, *typing.get_args(hint)):
        if dataclasses.is_dataclass(candidate):
            return candidate  # type: ignore[return-value]
    return None


def check_keys(cfg: Any) -> None:
    """Raise ConfigError naming the first key of the composed `cfg` that the schema does not know.
    Hydra's own `hydra` node is not checked; a `Config` instance has no keys but the schema's."""
    if isinstance(cfg, DictConfig):
        _walk(cfg, Config, "")


def _walk(node: DictConfig, schema: type, parent: str) -> None:
    hints = _hints(schema)
    for key in node:
        name = str(key)
        if name not in hints:
            if parent in PLUGIN_NODES or (not parent and name == "hydra"):
                continue
            raise unknown_key(parent, name, list(hints))
        child_schema = _dataclass_of(hints[name])
        child = node._get_node(name)  # the node itself: no interpolation is resolved here
        if child_schema is not None and isinstance(child, DictConfig) and not child._is_none():
            _walk(child, child_schema, f"{parent}.{name}" if parent else name)


def check_overrides(overrides: Sequence[str], groups: Collection[str] | Mapping[str, Collection[str]] = ()) -> None:
    """Check the key of every override, and the value of an override of a typed schema key (each
    value of a sweep), before Hydra composes them. `groups` are the config groups (`allocator`,
    `experiment`, ...); given as a mapping to their options, a chosen option is checked too (else
    it is Hydra's to check, e.g. where a user's config folder adds options). `hydra.*` keys and
    overrides Hydra cannot parse are Hydra's."""
    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except Exception:  # noqa: BLE001 - a syntax error: Hydra's message says where
        return
    for override in parsed:
        key = override.key_or_group
        nested = "/" in key and key not in groups  # a config path Hydra resolves (`+experiment/x=y`)
        if override.is_delete() or override.package is not None or nested or key.split(".")[0] == "hydra":
            continue
        if key in groups:
            if isinstance(groups, Mapping):
                _check_options(override, key, groups[key])
            continue
        schema = _schema_of(key, [g for g in groups if "/" not in g])  # a nested group is no top-level key
        if schema is not None:
            _check_values(override, key, schema)


def _check_options(override: Any, group: str, options: Collection[str]) -> None:
    """Each option an override of `group` chooses (each of a sweep) must be one of `options`."""
    try:
        values = list(override.sweep_iterator()) if override.is_sweep_override() else [override.value()]
    except Exception:  # noqa: BLE001 - a glob or a range: Hydra expands it
        return
    for value in values:
        if isinstance(value, str) and value not in options and "${" not in value:
            hint = did_you_mean(value, options)
            raise ConfigError(f"{group}={value} is not an option{hint}; the options of {group}: {', '.join(options)}")


def _schema_of(key: str, groups: Collection[str]) -> type | None:
    """The dataclass holding `key` when it is a typed schema field; None where the schema stops
    (a plugin's own setting, a key under an untyped node). Raises ConfigError for an unknown key."""
    schema: type = Config
    parent = ""
    *path, leaf = key.split(".")
    for name in path:
        hints = _hints(schema)
        if name not in hints:
            if parent in PLUGIN_NODES:
                return None
            raise unknown_key(parent, name, [*hints, *([] if parent else groups)])
        child = _dataclass_of(hints[name])
        if child is None:
            return None
        schema, parent = child, f"{parent}.{name}" if parent else name
    hints = _hints(schema)
    if leaf not in hints:
        if parent in PLUGIN_NODES:
            return None
        raise unknown_key(parent, leaf, [*hints, *([] if parent else groups)])
    return schema if _dataclass_of(hints[leaf]) is None else None


@cache
def _field_node(schema: type, leaf: str) -> DictConfig:
    """A node of `schema`'s field `leaf` alone, built once: merging a value into a node of the whole
    top-level Config copied all of it (~14 ms a value, and every compose checks its overrides);
    OmegaConf checks the value against the field's type either way. `OmegaConf.merge` copies it."""
    (field,) = (f for f in dataclasses.fields(schema) if f.name == leaf)
    hint = typing.get_type_hints(schema)[leaf]
    return OmegaConf.structured(dataclasses.make_dataclass(schema.__name__, [(leaf, hint, copy.copy(field))]))


def _check_values(override: Any, key: str, schema: type) -> None:
    """Each value of `override` set into a fresh node of `schema`, where OmegaConf checks its type."""
    try:
        values = list(override.sweep_iterator()) if override.is_sweep_override() else [override.value()]
    except Exception:  # noqa: BLE001 - a glob or a range over a choice: Hydra expands it
        return
    leaf = key.rsplit(".", 1)[-1]
    sweep = override.is_sweep_override()
    for value in values:
        if isinstance(value, str) and "${" in value:
            continue  # an interpolation: its value is known only once composed
        try:
            OmegaConf.merge(_field_node(schema, leaf), {leaf: value})
        except OmegaConfBaseException as e:
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            text = value if sweep else override.get_value_element_as_str()
            raise ConfigError(f"{key}={text}: {reason}") from None
