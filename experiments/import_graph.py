"""The import graph of `paged/`, held against its layers: import circles and imports that run up.

    python experiments/import_graph.py          # the table; exit 1 on any circle or upward import

Every `import` counts, at module level or inside a function. A name taken from a package whose
`__init__.py` re-exports it counts as an import of the module that defines it. A unit is a folder of
`paged/` (every file in it) or a top-level file; layers from the bottom (`LAYERS`); an import may
point to its own layer or below. Circles are looked for between files, so a circle inside one folder
counts too.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "paged"

# Bottom first. A unit: a folder of paged/ or a top-level module, by its name.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("step", "request", "detokenizer", "kv_layout", "config", "data", "utils"),
    ("memory", "kernels", "model"),
    ("scheduler", "executor", "sim", "workload"),
    ("engine",),
    ("cluster",),
    ("api",),
    ("experiment", "report", "serve", "__init__"),
)
LAYER_OF = {unit: i for i, units in enumerate(LAYERS) for unit in units}


@dataclass(frozen=True)
class Edge:
    source: str  # module names
    target: str
    line: int


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit_of(module: str) -> str:
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def _modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _reexports(modules: dict[str, Path]) -> dict[str, dict[str, str]]:
    """package -> {name: the module its __init__ takes the name from}."""
    out: dict[str, dict[str, str]] = {}
    for name, path in modules.items():
        if path.name != "__init__.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in modules:
                for alias in node.names:
                    out.setdefault(name, {})[alias.asname or alias.name] = node.module
    return out


def _imports(tree: ast.AST) -> Iterator[tuple[str, str | None, int]]:
    """(module, name taken from it or None, line) for every import in `tree`."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None, node.lineno
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                yield node.module, alias.name, node.lineno


def edges() -> list[Edge]:
    modules = _modules()
    reexports = _reexports(modules)
    found: list[Edge] = []
    for source, path in modules.items():
        for module, name, line in _imports(ast.parse(path.read_text())):
            if module != "paged" and not module.startswith("paged."):
                continue
            if name is not None and f"{module}.{name}" in modules:
                target = f"{module}.{name}"  # `from paged.kernels import ops`: the submodule
            elif name is not None and name in reexports.get(module, {}):
                target = reexports[module][name]
            else:
                target = module
            if target != source and target in modules:
                found.append(Edge(source, target, line))
    return found


def upward(all_edges: list[Edge]) -> list[Edge]:
    """Imports from a lower layer's unit into a higher one's (an unplaced unit counts as a finding)."""
    out = []
    for e in all_edges:
        src, dst = unit_of(e.source), unit_of(e.target)
        if src not in LAYER_OF or dst not in LAYER_OF or LAYER_OF[dst] > LAYER_OF[src]:
            out.append(e)
    return out


def circles(all_edges: list[Edge]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    graph: dict[str, set[str]] = {}
    for e in all_edges:
        graph.setdefault(e.source, set()).add(e.target)
        graph.setdefault(e.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def main() -> int:
    all_edges = edges()
    up, loops = upward(all_edges), circles(all_edges)
    units = sorted({unit_of(m) for m in _modules()})
    unplaced = [u for u in units if u not in LAYER_OF]
    print(f"{len(_modules())} modules, {len(all_edges)} imports, {len(units)} units in {len(LAYERS)} layers")
    for i, layer in reversed(list(enumerate(LAYERS))):
        print(f"  layer {i}: {', '.join(u for u in layer if u in units)}")
    print(f"import circles: {len(loops)}")
    for loop in loops:
        print("  " + " <-> ".join(loop))
    print(f"imports from a lower layer to a higher one: {len(up)}")
    for e in up:
        print(f"  {e.source} ({unit_of(e.source)}) -> {e.target} ({unit_of(e.target)}), line {e.line}")
    if unplaced:
        print(f"units in no layer: {', '.join(unplaced)}")
    return 1 if up or loops or unplaced else 0


if __name__ == "__main__":
    sys.exit(main())
