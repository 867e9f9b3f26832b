"""`make test`'s two phases (tests/conftest.py): the serial tests left out of the parallel phase and
run alone in the serial one, a serial marker without its reason refused at collection, and the
parallel workers' shares of the cores."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import excludes_all, module_marks, worker_cores

CONFTEST = Path(__file__).with_name("conftest.py").read_text()
PLANTED = """
import pytest

def test_free():
    pass

@pytest.mark.serial("times a sleep")
def test_timed():
    pass
"""


@pytest.fixture
def planted(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_planted=PLANTED)
    pytester.makeini("[pytest]\nmarkers =\n    serial(reason): runs alone\n")
    return pytester


@pytest.mark.parametrize(("phase", "ran"), [("all", 2), ("parallel", 1), ("serial", 1)])
def test_each_phase_runs_its_share_and_together_they_run_all(planted: pytest.Pytester, phase: str, ran: int) -> None:
    result = planted.runpytest_inprocess(f"--phase={phase}", "-v")
    result.assert_outcomes(passed=ran, deselected=2 - ran)
    names = {"parallel": ["*test_free PASSED*"], "serial": ["*test_timed PASSED*"]}
    if phase in names:
        result.stdout.fnmatch_lines(names[phase])


def test_a_serial_marker_without_a_reason_stops_the_collection(planted: pytest.Pytester) -> None:
    planted.makepyfile(test_bare="import pytest\n\n@pytest.mark.serial\ndef test_bare():\n    pass\n")
    result = planted.runpytest_inprocess("--phase=parallel")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*test_bare.py::test_bare: @pytest.mark.serial needs a reason*"])


def test_the_serial_phase_leaves_files_without_a_serial_marker_unimported(planted: pytest.Pytester) -> None:
    planted.makepyfile(test_unimported="raise RuntimeError('imported')\n\ndef test_never():\n    pass\n")
    planted.runpytest_inprocess("--phase=serial").assert_outcomes(passed=1, deselected=1)
    planted.runpytest_inprocess("--phase=parallel").stdout.fnmatch_lines(["*RuntimeError: imported*"])


def test_workers_split_the_cores_between_them() -> None:
    assert worker_cores(None, 1, [0, 1]) is None and worker_cores("master", 2, [0, 1]) is None
    assert [worker_cores(f"gw{i}", 2, [0, 1]) for i in range(2)] == [{0}, {1}]
    assert [worker_cores(f"gw{i}", 2, [0, 1, 2, 3]) for i in range(2)] == [{0, 2}, {1, 3}]
    assert [worker_cores(f"gw{i}", 3, [4, 5]) for i in range(3)] == [{4}, {5}, {4}]  # more workers than cores


def test_a_marker_expression_leaves_files_it_excludes_unimported(planted: pytest.Pytester) -> None:
    planted.makepyfile(test_built="import pytest\n\npytestmark = [pytest.mark.compiles]\n"
                                  "raise RuntimeError('imported')\n\ndef test_build():\n    pass\n")
    planted.makeini("[pytest]\nmarkers =\n    serial(reason): runs alone\n    compiles: builds\n    slow: slow\n")
    planted.runpytest_inprocess("-m", "not compiles and not slow").assert_outcomes(passed=2)
    planted.runpytest_inprocess("-m", "compiles").stdout.fnmatch_lines(["*RuntimeError: imported*"])


@pytest.mark.parametrize(("expression", "marks", "excluded"), [
    ("not slow and not compiles", {"compiles"}, True),
    ("not slow and not compiles", {"skipif"}, False),
    ("slow", {"compiles"}, False),  # a test of the file may add `slow`
    ("compiles or slow", {"subprocess"}, False),
    ("not (compiles or slow)", {"slow", "subprocess"}, True),
    ("subprocess and not slow", {"slow"}, True),
])
def test_a_file_is_left_out_only_when_no_marks_its_tests_add_could_select_them(
    expression: str, marks: set[str], excluded: bool
) -> None:
    assert excludes_all(expression, marks) is excluded


def test_module_marks_reads_the_files_pytestmark() -> None:
    source = "import pytest\n\npytestmark = [pytest.mark.compiles, pytest.mark.skipif(True, reason='x')]\n"
    assert module_marks(source) == {"compiles", "skipif"}
    assert module_marks("import pytest\n\n@pytest.mark.slow\ndef test_one():\n    pass\n") == set()
