"""Byte sizes in config values ('256MiB', '1GB', '1048576')."""

from __future__ import annotations

from paged.config.schema import ConfigError

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_bytes(text: str | int, key: str = "allocator.kv_cache_memory") -> int:
    """'256MiB' / '1GB' / '1048576' -> bytes; `key` names the setting in the error."""
    s = str(text).strip().upper().replace(" ", "")
    digits = s.rstrip("ABEGIKM")
    unit = s[len(digits) :]
    try:
        value = float(digits)
    except ValueError:
        value = -1.0
    if unit not in _UNITS or value <= 0:
        raise ConfigError(
            f"{key}={text!r} is not a positive size; use e.g. 512MiB, 1GiB, 1048576"
        )
    return int(value * _UNITS[unit])
