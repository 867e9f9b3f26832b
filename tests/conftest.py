"""Suite-wide settings and the `serial` phase.

`make test` runs the suite in two phases: every test but the serial ones on all cores (pytest-xdist,
`--phase=parallel`), then the serial ones alone (`--phase=serial`). A test is serial when a second
test beside it would change its outcome: it times something against a bound, or measures the machine.
Its marker says why, `@pytest.mark.serial("why")`; one without a reason stops the collection.
"""

import os

import pytest

os.environ["WANDB_MODE"] = "disabled"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

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
