"""A built wheel carries kernels_cu/ and conf/, and the installed package finds them inside itself."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from paged.kernels.toolchain.source import source_hash

pytestmark = pytest.mark.subprocess

ROOT = Path(__file__).resolve().parents[1]
UNSHIPPED = (
    ".git", ".venv", "build", "*.egg-info", "__pycache__", "outputs", "multirun", "wandb", ".*cache", ".hypothesis"
)

PROBE = """
import json
from paged.utils.assets import asset_dir
from paged.kernels.toolchain.source import source_hash
from paged.config import compose_config
from paged.api.llm import LLM  # the offline API imports from the wheel
from paged.model.locate import shipped_tokenizer
print(json.dumps({"kernels": str(asset_dir("kernels_cu")), "conf": str(asset_dir("conf")),
                  "tokenizer": sorted(str(p) for p in shipped_tokenizer().iterdir()),
                  "hash": source_hash(), "allocator": compose_config(["allocator=naive"]).allocator.name}))
"""


def test_wheel_ships_kernel_sources_and_configs(tmp_path):
    pytest.importorskip("setuptools", reason="building the wheel without network needs setuptools installed")
    # A copy, so setuptools' build/ cannot leak stale files into the wheel or litter the checkout.
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(*UNSHIPPED))
    pip = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    build = subprocess.run([*pip, "-w", str(tmp_path), str(src)], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    (wheel,) = tmp_path.glob("paged-*.whl")
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    probe = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=tmp_path,
                           env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"})
    assert probe.returncode == 0, probe.stderr
    found = json.loads(probe.stdout)
    assert found["kernels"] == str(site / "paged" / "_kernels_cu")
    assert found["conf"] == str(site / "paged" / "_conf")
    assert found["hash"] == source_hash()  # every CUDA source made it into the wheel
    assert (site / "paged" / "_kernels_cu" / "cpu" / "paged_attention_cpu.cpp").is_file()
    assert found["allocator"] == "naive"
    tokenizer = site / "paged" / "data" / "tokenizers" / "smollm2"
    assert {str(tokenizer / name) for name in ("tokenizer.json", "tokenizer_config.json")} <= set(found["tokenizer"])
