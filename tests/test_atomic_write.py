"""Output files are written whole or not at all (issue 30): a failed write names the file, keeps the
old one and leaves no temp file; an output folder that cannot be made is a one-line error, rc 2."""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from paged.api.outputs import write_outputs
from paged.engine.metrics import RequestMetrics
from paged.request import Request, SamplingParams
from paged.utils.atomic_file import OutputError, atomic_open, write_text

pytestmark = pytest.mark.subprocess

REPO = Path(__file__).resolve().parent.parent


def _load_run_py():
    spec = importlib.util.spec_from_file_location("run_py_under_test", REPO / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_write_replaces_the_file_whole_with_the_umask_permissions(tmp_path: Path) -> None:
    path = tmp_path / "out" / "summary.json"  # the folder is made too
    write_text(path, "old\n")
    write_text(path, "new\n")
    assert path.read_text() == "new\n"
    plain = tmp_path / "plain"
    plain.write_text("")
    assert path.stat().st_mode & 0o777 == plain.stat().st_mode & 0o777
    assert os.listdir(path.parent) == ["summary.json"]


def test_a_full_disk_names_the_file_keeps_the_old_one_and_leaves_no_temp_file(tmp_path, monkeypatch) -> None:
    path = tmp_path / "requests.jsonl"
    path.write_text("complete old content\n")

    def no_space(fd: int) -> None:  # where a full disk (or an NFS quota) shows up at the latest
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", no_space)
    with pytest.raises(OutputError, match=rf"^cannot write {path}: No space left on device$"):
        with atomic_open(path) as f:
            f.write("half of the new content")
    assert path.read_text() == "complete old content\n"
    assert os.listdir(tmp_path) == ["requests.jsonl"]


def test_an_error_in_the_writer_keeps_the_old_file_and_is_raised_as_it_is(tmp_path: Path) -> None:
    path = tmp_path / "table.md"
    path.write_text("old")
    with pytest.raises(ValueError, match="not JSON"):
        with atomic_open(path) as f:
            f.write("partial")
            raise ValueError("not JSON")
    assert path.read_text() == "old"
    assert os.listdir(tmp_path) == ["table.md"]


def test_a_folder_that_cannot_be_made_names_the_file(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(OutputError, match=rf"^cannot write {blocker}/run/error.json: Not a directory$"):
        write_text(blocker / "run" / "error.json", "{}")


def test_a_failed_requests_jsonl_leaves_no_summary_beside_it(tmp_path: Path) -> None:
    """summary.json marks a job done: it is written only after requests.jsonl is whole."""
    (tmp_path / "requests.jsonl").mkdir()  # the rename onto it fails, as a vanished disk would
    request = Request("r0", [1, 2, 3], SamplingParams(max_tokens=1))
    with pytest.raises(OutputError, match=r"requests\.jsonl: Is a directory"):
        write_outputs(tmp_path, {"num_requests": 1}, [request], [RequestMetrics.of(request)], None)
    assert sorted(os.listdir(tmp_path)) == ["requests.jsonl"]


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (["hydra.run.dir={bad}"], "hydra.run.dir={bad}: cannot create the run folder, {blocker} takes no new files"),
        (["-m", "hydra.sweep.dir={bad}", "seed=0,1"], "hydra.sweep.dir={bad}: cannot create the run folder"),
        (["hydra.run.dir={good}"], None),
        (["-m", "hydra.run.dir={bad}"], None),  # a sweep makes hydra.sweep.dir, not the run dir
        (["--cfg", "job", "hydra.run.dir={bad}"], None),  # Hydra's flags keep their meaning: nothing is made
        (["--help", "hydra.run.dir={bad}"], None),
        ([], None),  # the default folder, under the current one
    ],
)
def test_the_run_folder_is_checked_before_hydra_makes_it(tmp_path: Path, argv: list[str], problem) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    names = {"bad": blocker / "x" / "${now:%H}", "good": tmp_path / "new" / "deeper", "blocker": blocker}
    found = _load_run_py()._run_dir_problem([a.format(**names) for a in argv])
    if problem is None:
        assert found is None
    else:
        assert found is not None and found.startswith(problem.format(**names)) and "\n" not in found


def test_run_py_with_an_unwritable_run_dir_is_a_one_line_error(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    proc = subprocess.run(
        [sys.executable, "run.py", "model=tiny-random", "logger=none", f"hydra.run.dir={blocker}/run"],
        cwd=REPO, env=dict(os.environ, WANDB_MODE="disabled"), capture_output=True, text=True, timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: hydra.run.dir={blocker}/run: cannot create the run folder, {blocker} takes no new files "
        "(Not a directory)"
    ]


@pytest.mark.slow
def test_run_py_that_cannot_write_its_summary_names_it_and_exits_2(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    (run_dir / "summary.json").mkdir(parents=True)  # a folder in its place: the rename fails
    proc = subprocess.run(
        [sys.executable, "run.py", "model=tiny-random", "logger=none", "progress=false", "workload.num_requests=2",
         "workload.output_len_max=4", f"hydra.run.dir={run_dir}"],
        cwd=REPO, env=dict(os.environ, WANDB_MODE="disabled"), capture_output=True, text=True, timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == f"error: cannot write {run_dir}/summary.json: Is a directory"
    assert len(json.loads("[" + ",".join((run_dir / "requests.jsonl").read_text().splitlines()) + "]")) == 2
    assert not [p for p in run_dir.iterdir() if p.name.endswith(".tmp")]
