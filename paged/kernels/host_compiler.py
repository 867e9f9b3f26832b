"""The host C++ compiler that builds the emu and cpu backends: `$CXX`, else `g++`, version >= 12
(C++20 `<barrier>` for the emulator, `_Float16` for both)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from functools import cache

MIN_VERSION = 12


class CompilerNotFoundError(RuntimeError):
    """No usable host C++ compiler."""


@dataclass(frozen=True)
class Compiler:
    path: str
    version: str


@cache
def find_compiler() -> Compiler:
    wanted = os.environ.get("CXX") or "g++"
    path = shutil.which(wanted)
    if path is None:
        raise CompilerNotFoundError(
            f"the emu and cpu backends need a host C++ compiler (g++ >= {MIN_VERSION}); looked for {wanted!r} "
            "($CXX, else g++) on PATH and found none"
        )
    version = subprocess.run([path, "-dumpfullversion", "-dumpversion"], capture_output=True, text=True).stdout.strip()
    major = re.match(r"(\d+)", version)
    if major is None or int(major.group(1)) < MIN_VERSION:
        raise CompilerNotFoundError(
            f"the emu and cpu backends need g++ >= {MIN_VERSION}; {path} reports version {version!r} (set $CXX)"
        )
    return Compiler(path, version)
