"""The shape of `paged/` (issue 26): imports point down the layers, no import circles, no two modules
with one file name, no file over 400 lines, and (issue 42) folders that name their layer, with only the
shared vocabulary left at the top. `python experiments/import_graph.py` prints the graph."""

from __future__ import annotations

import importlib.util
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "paged"


def _import_graph():
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "experiments" / "import_graph.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["import_graph"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_no_import_runs_up_a_layer():
    graph = _import_graph()
    assert [(e.source, e.target) for e in graph.upward(graph.edges())] == []


def test_no_import_circles():
    graph = _import_graph()
    assert graph.circles(graph.edges()) == []


def test_every_unit_has_a_layer():
    graph = _import_graph()
    units = {graph.unit_of(graph.module_name(p)) for p in PACKAGE.rglob("*.py")}
    assert sorted(units - set(graph.LAYER_OF)) == []


def test_the_checker_finds_an_upward_import_and_a_circle():
    graph = _import_graph()
    up = graph.Edge("paged.step", "paged.engine.engine", 1)
    down = graph.Edge("paged.engine.engine", "paged.step", 1)
    assert graph.upward([up, down]) == [up]
    assert graph.circles([up, down]) == [["paged.engine.engine", "paged.step"]]


def test_no_two_modules_share_a_file_name():
    names = Counter(p.name for p in PACKAGE.rglob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert sorted(name for name, count in names.items() if count > 1) == []


def test_the_top_of_the_package_is_folders_and_the_shared_vocabulary():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert top == ["__init__.py", "detokenizer.py", "kv_layout.py", "request.py", "step.py"]


def test_no_file_over_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > 400}
    assert long == {}


def test_config_and_step_contract_import_no_torch():
    """Schemas and the step contract are plain types: importing them must not pull in torch."""
    import subprocess

    code = "import sys, paged.config, paged.step; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "False"
