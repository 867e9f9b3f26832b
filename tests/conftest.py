"""Suite-wide settings and the `serial` phase.

`make test` runs the suite in two phases: every test but the serial ones on all cores (pytest-xdist,
`--phase=parallel`), then the serial ones alone (`--phase=serial`). A test is serial when a second
test beside it would change its outcome: it times something against a bound, or measures the machine.
Its marker says why, `@pytest.mark.serial("why")`; one without a reason stops the collection.

Each worker of the parallel phase runs on its own share of the cores (`pin_worker`), so that its torch
and OpenMP threads (one per core it may use, paged.utils.threads) never outnumber the cores: two
workers of two threads each on two cores made every parallel loop wait for a descheduled thread: the
parallel phase took 1,858 s unpinned, 1,359 s pinned (2-core VM, cold kernel cache, docs/speed.md).
"""

import ast
import contextlib
import functools
import itertools
import os
import re
import threading
from pathlib import Path

import pytest

os.environ["WANDB_MODE"] = "disabled"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def worker_cores(worker: str | None, num_workers: int, cores: list[int]) -> set[int] | None:
    """The cores pytest-xdist worker `worker` ("gw<i>") runs on: every `num_workers`-th of `cores` from
    its i-th (workers beyond the cores share them round-robin); None outside a worker."""
    if not worker or not worker.startswith("gw") or not worker[2:].isdigit():
        return None
    return set(cores[int(worker[2:]) % len(cores) :: max(num_workers, 1)])


def pin_worker(worker: str | None, num_workers: int) -> set[int] | None:
    """Restricts this process to `worker_cores`; runs when this file is imported, before any test
    imports torch, whose OpenMP runtime counts the cores once, when it loads."""
    if not hasattr(os, "sched_setaffinity"):  # macOS: no affinity to set
        return None
    share = worker_cores(worker, num_workers, sorted(os.sched_getaffinity(0)))
    if share:
        os.sched_setaffinity(0, share)
    return share


pin_worker(os.environ.get("PYTEST_XDIST_WORKER"), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))

pytest_plugins = ["pytester"]  # tests/test_suite_phases.py runs the phases on a planted suite

PHASES = ("all", "parallel", "serial")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--phase", choices=PHASES, default="all",
        help="all: every test (default); parallel: all but the tests marked serial; serial: only those",
    )


def serial_reason(item: pytest.Item) -> str | None:
    """Why `item` must run alone, or None when it may share the machine; a serial marker without a
    reason is a usage error naming the test."""
    marker = item.get_closest_marker("serial")
    if marker is None:
        return None
    reason = marker.kwargs.get("reason", marker.args[0] if marker.args else "")
    if not isinstance(reason, str) or not reason.strip():
        raise pytest.UsageError(
            f"{item.nodeid}: @pytest.mark.serial needs a reason, e.g. "
            '@pytest.mark.serial("asserts a wall-clock bound that a busy neighbour would break")'
        )
    return reason


def pytest_sessionstart(session: pytest.Session) -> None:
    """pytest-xdist's controller (which runs no tests) builds the native CPU ops in the background while
    the workers start: nearly every engine test needs them, and from a cold cache (a fresh clone) the
    first test of each worker that did otherwise waited on one ~60 s compile, a core idle. The build
    holds its cache key's lock, so a worker that needs it waits for this one instead of building again;
    a failed build is left to the tests, which report it."""
    if not getattr(session.config.option, "numprocesses", None) or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    from paged.kernels.backends import cpu
    from paged.kernels.toolchain import host_compiler

    if host_compiler.unavailable_reason() is not None:
        return

    def build() -> None:
        with contextlib.suppress(host_compiler.HostBuildError):
            cpu.build()

    _PREBUILDS.append(threading.Thread(target=build, name="prebuild-cpu-ops", daemon=True))
    _PREBUILDS[-1].start()


def pytest_sessionfinish(session: pytest.Session) -> None:
    # a short run may end first: wait, or the compiler would outlive the run and leave its temporary files
    for thread in _PREBUILDS:
        thread.join()


_PREBUILDS: list[threading.Thread] = []


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Leaves out, unimported, the test files none of whose tests can run: in the serial phase the files
    that cannot mark a test serial, and under `-m` the files whose module marks the expression excludes
    whatever marks their tests add (`make test-fast` skips 47 this way). Importing all ~100 costs
    ~16 s of CPU per process (torch, transformers, Hydra compositions at module level)."""
    if collection_path.suffix != ".py" or not collection_path.name.startswith("test_"):
        return None
    text = collection_path.read_text()
    if config.getoption("--phase") == "serial" and "mark.serial" not in text:
        return True
    markexpr = config.getoption("markexpr")
    if markexpr and "pytestmark" in text and excludes_all(markexpr, module_marks(text)):
        return True
    return None


def module_marks(source: str) -> set[str]:
    """The marker names of a test file's module-level `pytestmark` (`pytest.mark.NAME`, called or not)."""
    marks: set[str] = set()
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets):
            for sub in ast.walk(node.value):
                if isinstance(sub, ast.Attribute) and getattr(sub.value, "attr", None) == "mark":
                    marks.add(sub.attr)
    return marks


def excludes_all(markexpr: str, marks: set[str]) -> bool:
    """Whether `-m markexpr` deselects every test carrying `marks`, whichever other marks it has: false
    for each way of adding the expression's other names."""
    from _pytest.mark.expression import Expression  # the parser `-m` itself uses

    expression = Expression.compile(markexpr)
    others = sorted(set(re.findall(r"[A-Za-z_][\w-]*", markexpr)) - {"and", "or", "not"} - marks)
    for extra in itertools.product((False, True), repeat=len(others)):
        have = marks | {name for name, on in zip(others, extra) if on}
        if expression.evaluate(functools.partial(_has_mark, have)):
            return False
    return True


def _has_mark(marks: set[str], name: str, /, **_: object) -> bool:
    return name in marks


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    phase = config.getoption("--phase")
    serial = {item.nodeid for item in items if serial_reason(item) is not None}
    if phase == "all":
        return
    keep = [item for item in items if (item.nodeid in serial) == (phase == "serial")]
    dropped = [item for item in items if (item.nodeid in serial) != (phase == "serial")]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = keep
