"""Resolve the `module:Name` strings that config groups use to name pluggable classes."""

from __future__ import annotations

import importlib
from typing import Any


def load_object(path: str) -> Any:
    """`'paged.memory.naive:NaiveAllocator'` -> the class. Any importable module works, tests/ included."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{path!r} is not a 'package.module:ClassName' path")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"cannot import module {module_name!r} named by {path!r}: {e}") from e
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"module {module_name!r} has no attribute {attr!r} (from {path!r})") from None
