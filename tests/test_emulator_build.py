"""The emulator's library builds start from one precompiled header of paged.cu per source hash,
except a source that defines macros before it, which the header would silently override."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from paged.kernels.toolchain import emulator, specs

pytestmark = pytest.mark.compiles


def _command(library: Path) -> list[str]:
    return json.loads(library.with_suffix(".json").read_text())["command"]


@pytest.fixture(autouse=True, scope="module")
def _needs_a_compiler() -> None:
    from paged.kernels.toolchain import host_compiler

    if (reason := host_compiler.unavailable_reason()) is not None:
        pytest.skip(reason)


def test_a_library_is_built_on_the_precompiled_header() -> None:
    units = [specs.layer_unit(torch.float32)]
    command = _command(emulator.compile_shared_library(emulator.translation_unit(units)))
    stub = Path(command[command.index("-include") + 1])
    assert stub.read_text() == '#include "paged.cu"\n'
    assert Path(f"{stub}.gch").stat().st_size > 0


def test_a_source_with_defines_before_the_sources_is_built_without_it() -> None:
    source = emulator.translation_unit([specs.layer_unit(torch.float32)], defines=["PAGED_TEST_UNUSED"])
    assert "-include" not in _command(emulator.compile_shared_library(source))
