"""Where the non-Python trees `kernels_cu/` and `conf/` live.

In a checkout (and an editable install) they sit next to `paged/`; a wheel carries them inside the
package as `paged._kernels_cu` and `paged._conf` (see setup.py), so both layouts are looked up.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path


def asset_dir(name: str) -> Path:
    """The directory of the shipped tree `name` ("kernels_cu" or "conf")."""
    try:
        spec = importlib.util.find_spec(f"paged._{name}")
    except ModuleNotFoundError:
        spec = None
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return Path(__file__).resolve().parents[2] / name
