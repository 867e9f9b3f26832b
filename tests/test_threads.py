"""paged.utils.threads (issue 30): how many CPU threads a run uses and how its idle OpenMP threads wait."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from paged.config import ConfigError, compose_config, validate
from paged.utils import threads

pytestmark = pytest.mark.subprocess

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def torch_threads():
    """Restores torch's thread count after a test that changes it."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_the_default_is_one_thread_per_core_this_process_may_use(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 2, 5})
    assert threads.available_cores() == 3
    assert threads.choose_num_threads(None, threads.available_cores(), environ={}) == 3


def test_model_num_threads_wins_over_the_cores_and_omp_num_threads():
    assert threads.choose_num_threads(1, 8, environ={"OMP_NUM_THREADS": "4"}) == 1
    assert threads.choose_num_threads(6, 2, environ={}) == 6


@pytest.mark.parametrize(("value", "expected"), [("3", 3), ("2,1", 2), ("0", 8), ("many", 8), ("", 8)])
def test_a_users_omp_num_threads_is_the_default_when_it_is_a_count(value, expected):
    assert threads.choose_num_threads(None, 8, environ={"OMP_NUM_THREADS": value}) == expected


def test_configure_applies_the_choice_to_torch_and_logs_it(monkeypatch, caplog, torch_threads):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    with caplog.at_level(logging.INFO, logger="paged.utils.threads"):
        choice = threads.configure(None)
    assert (choice.num_threads, choice.cores) == (1, 1)
    assert torch.get_num_threads() == 1
    assert f"1 CPU thread ({choice.wait_policy}; 1 cores available)" in caplog.text

    choice = threads.configure(3)
    assert choice.num_threads == torch.get_num_threads() == 3


def test_the_wait_policy_is_set_only_where_the_user_chose_none():
    env: dict[str, str] = {}
    assert threads.set_wait_policy_env(env) is True
    assert env == {"GOMP_SPINCOUNT": str(threads.DEFAULT_SPIN_COUNT)}
    assert threads.wait_policy(env) == f"GOMP_SPINCOUNT={threads.DEFAULT_SPIN_COUNT}"
    for name, value in [("OMP_WAIT_POLICY", "ACTIVE"), ("GOMP_SPINCOUNT", "300000"), ("KMP_BLOCKTIME", "200")]:
        env = {name: value}
        assert threads.set_wait_policy_env(env) is False
        assert env == {name: value}  # a user's spin count or block time is not overridden by a policy either
        assert threads.wait_policy(env) == f"{name}={value}"
    assert threads.wait_policy({}) == "libgomp's default spin"


def _python(code: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in threads.WAIT_VARIABLES}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT,
                          env={**clean, **env})
    return done.stdout.strip()


def test_run_py_sets_the_wait_policy_before_torch_loads():
    # run.py's module level (its imports) without its main: the policy must be in the environment
    # before torch (and with it libgomp, which reads it once) is imported.
    code = (
        "import importlib.util, os, sys\n"
        "spec = importlib.util.spec_from_file_location('run_module', 'run.py')\n"
        "spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
        "from paged.utils import threads\n"
        "print(os.environ.get('GOMP_SPINCOUNT'), threads._env_before_torch, threads.wait_policy())"
    )
    spin = threads.DEFAULT_SPIN_COUNT
    assert _python(code) == f"{spin} True GOMP_SPINCOUNT={spin}"
    assert _python(code, OMP_WAIT_POLICY="PASSIVE") == "None None OMP_WAIT_POLICY=PASSIVE"


def test_a_child_that_is_not_paged_inherits_the_users_wait_not_pageds():
    # a peer benchmark's vLLM must wait as it does without paged: paged's own spin count is left out
    code = ("import os, paged\nfrom paged.utils import threads\n"
            "env = threads.user_environment()\n"
            "print(os.environ.get('GOMP_SPINCOUNT'), env.get('GOMP_SPINCOUNT'), env.get('OMP_WAIT_POLICY'))")
    assert _python(code) == f"{threads.DEFAULT_SPIN_COUNT} None None"
    assert _python(code, GOMP_SPINCOUNT="7") == "7 7 None"
    assert _python(code, OMP_WAIT_POLICY="PASSIVE") == "None None PASSIVE"


def test_torch_imported_first_is_reported_as_the_default_spin_unless_the_user_chose():
    code = "import torch, paged\nfrom paged.utils import threads\nprint(threads.wait_policy())"
    assert _python(code) == "libgomp's default spin (torch was imported before paged)"
    assert _python(code, GOMP_SPINCOUNT="1000") == "GOMP_SPINCOUNT=1000"


@pytest.mark.parametrize("value", ["0", "-2"])
def test_a_bad_num_threads_is_a_one_line_config_error(value):
    cfg = compose_config([f"model.num_threads={value}"])
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert str(err.value) == (
        f"model.num_threads={value} must be an int >= 1, or null for the cores this process may use"
    )


def test_a_good_num_threads_validates():
    validate(compose_config(["model.num_threads=4"]))
    validate(compose_config(["model.num_threads=null"]))
