"""The compiled-kernel cache shared by every build of a run (the suite's workers, a sweep's jobs): one
build per key however many processes miss it at once, and no build's failure or damage reaching the
next one. Driven through `host_compiler.build` with a stand-in compiler that logs each invocation."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from paged.kernels.toolchain import host_compiler
from paged.kernels.toolchain.cache_dir import ENV_VAR, ArtifactCache

# Answers the version query, fails once if asked to (the file $FAIL names exists), else writes the
# output after a pause long enough for a second caller to arrive while it builds.
FAKE_CXX = """#!/bin/sh
case "$1" in -dumpfullversion) echo 12.2.0; exit 0;; esac
echo build >> "$LOG"
if [ -e "$FAIL" ]; then rm "$FAIL"; echo "error: planted" >&2; exit 1; fi
sleep 0.3
while [ $# -gt 0 ]; do if [ "$1" = -o ]; then echo built > "$2"; fi; shift; done
"""


@pytest.fixture
def fake_cxx(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The build log; the stand-in compiler is $CXX and the cache a fresh directory."""
    cxx = tmp_path / "fake-g++"
    cxx.write_text(FAKE_CXX)
    cxx.chmod(0o755)
    log = tmp_path / "builds.log"
    for name, value in (("CXX", cxx), ("LOG", log), ("FAIL", tmp_path / "fail-once"), (ENV_VAR, tmp_path / "c")):
        monkeypatch.setenv(name, str(value))
    host_compiler.find_compiler.cache_clear()
    yield log
    host_compiler.find_compiler.cache_clear()


def _build(source: str = "int unit;") -> Path:
    return host_compiler.build(ArtifactCache("lock-test", ".so"), source, ["-O2"], include_dir=Path("."))


def _builds(log: Path) -> int:
    return len(log.read_text().splitlines()) if log.exists() else 0


def test_callers_that_miss_one_key_at_once_build_it_once(fake_cxx: Path) -> None:
    with ThreadPoolExecutor(4) as pool:
        paths = list(pool.map(lambda _: _build(), range(4)))
    assert _builds(fake_cxx) == 1
    assert len(set(paths)) == 1 and paths[0].read_text() == "built\n"
    with ThreadPoolExecutor(2) as pool:  # other keys do not wait on each other's lock
        list(pool.map(_build, ["int a;", "int b;"]))
    assert _builds(fake_cxx) == 3


def test_a_failed_build_stores_nothing_and_the_next_caller_builds_again(fake_cxx: Path, tmp_path: Path) -> None:
    (tmp_path / "fail-once").touch()
    with pytest.raises(host_compiler.HostBuildError, match="error: planted"):
        _build()
    assert _build().read_text() == "built\n"
    assert _builds(fake_cxx) == 2


@pytest.mark.parametrize("damage", ["payload", "sidecar", "missing payload"])
def test_a_damaged_entry_is_rebuilt_not_loaded(fake_cxx: Path, damage: str) -> None:
    path = _build()
    sidecar = path.with_suffix(".json")
    if damage == "payload":
        path.write_text("half-writ")
    elif damage == "sidecar":
        sidecar.write_text("{not json")
    else:
        path.unlink()
    assert _build().read_text() == "built\n"
    assert _builds(fake_cxx) == 2
