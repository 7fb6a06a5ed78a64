"""The layout's rules (README.md, "Layout"), read from the source with ast:
every import counts, the ones inside functions too (only ``if
TYPE_CHECKING:`` blocks, which never run, are left out).

* The packages form layers: a module imports only its own package and the
  packages below it (LAYERS, lowest first; README.md lists the same order).
* No import cycle between modules.
* Every product module is imported by another product module or is an entry
  point: nothing in rcgrpo exists only for the tests.
* ``scripts/`` imports nothing from ``tests/`` or ``benchmarks/``.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "rcgrpo"

# Lowest first. A package may import the ones before it, never the ones after.
LAYERS = (
    "base",          # errors, atomic writes, JSON input, distributed, command line, stage names, host
    "envs",          # BFCL: data, split, episodes, calls, reward
    "conditioning",  # reward tokens, prompts
    "run",           # the run folder: paths, lock, metrics, trackers, checkpoints
    "model",         # loading, LoRA, packing, prefix sharing, attention, the policy
    "rollout",       # engines, the multi-turn agent loop
    "config",        # the schema, presets, file and command-line input, validation
    "data",          # RCTP's data set
    "evaluation",    # BFCL scoring of a policy
    "training",      # the updates: SFT/RCTP, GRPO/RC-GRPO, losses, optimizer, memory plan
    "report",        # report.md and the plots
    "pipeline",      # the stages as objects, the run's engine, preparing and resuming a run
    "train",         # entry points: python -m rcgrpo.train / rcgrpo.eval
    "eval",
    "trainer",       # the Python trainer (RCGRPOTrainer, RCGRPOConfig) over rcgrpo.train
)
# Entry points: run as commands, so imported by nothing of rcgrpo.
ENTRY_POINTS = {"rcgrpo.train", "rcgrpo.eval", "rcgrpo.config.__main__", "rcgrpo.report.__main__", "rcgrpo.evaluation.cli",
                "rcgrpo.report.cli", "rcgrpo.trainer",
                # adapters a user imports to build an environment_factory (rcgrpo.envs.tool_env's contract)
                "rcgrpo.envs.mcp_tools", "rcgrpo.envs.openenv_tools"}
# rcgrpo/__init__.py and the old paths' aliases (rcgrpo/moved.py) stand outside the layers.
OUTSIDE = {"rcgrpo", "rcgrpo.moved"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imported_names(path: Path) -> set[str]:
    """Every dotted name an import statement in `path` names (relative ones resolved)."""
    names: set[str] = set()
    module = _module_name(path) if path.is_relative_to(ROOT / "rcgrpo") else ""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]

    def visit(node):
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    return names


def _owning_module(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def internal_imports() -> dict[str, set[str]]:
    graph = {}
    for module, path in MODULES.items():
        owners = {_owning_module(n) for n in imported_names(path) if n.split(".")[0] == "rcgrpo"}
        graph[module] = {o for o in owners if o and o != module and o != "rcgrpo"}
    return graph


def layer_of(module: str) -> int | None:
    if module in OUTSIDE:
        return None
    top = module.split(".")[1]
    assert top in LAYERS, f"{module}: rcgrpo.{top} is in no layer (add it to LAYERS and README's list)"
    return LAYERS.index(top)


def test_every_import_goes_down_the_layers():
    upward = []
    for module, deps in internal_imports().items():
        here = layer_of(module)
        if here is None:
            continue
        for dep in deps:
            there = layer_of(dep)
            if there is not None and there > here:
                upward.append(f"{module} imports {dep} (layer {LAYERS[there]} is above {LAYERS[here]})")
    assert not upward, "\n".join(sorted(upward))


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def connect(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                connect(w)
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

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def test_no_import_cycles():
    assert import_cycles(internal_imports()) == []


def test_the_cycle_finder_finds_a_cycle():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_product_module_exists_only_for_the_tests():
    imported = set().union(*internal_imports().values())
    packages = {m for m, p in MODULES.items() if p.name == "__init__.py"}
    orphans = set(MODULES) - imported - ENTRY_POINTS - OUTSIDE - packages
    assert not orphans, f"imported by no product module and no entry point: {sorted(orphans)}"


def test_readme_lists_the_layers_in_this_order():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    listed = re.search(r"<!-- layers -->(.*?)<!-- /layers -->", readme, re.S)
    assert listed, "README.md has no <!-- layers --> list"
    order = re.findall(r"`rcgrpo\.(\w+)`", listed.group(1))
    assert tuple(order) == LAYERS


@pytest.mark.parametrize("script", sorted((ROOT / "scripts").glob("*.py")), ids=lambda p: p.name)
def test_scripts_import_nothing_from_tests_or_benchmarks(script):
    names = {n.split(".")[0] for n in imported_names(script)}
    assert not names & {"tests", "benchmarks"}, f"{script.name} imports {sorted(names & {'tests', 'benchmarks'})}"
    # ... nor through sys.path: no statement that changes it names those folders
    tree = ast.parse(script.read_text(encoding="utf-8"))
    for statement in ast.walk(tree):
        if isinstance(statement, (ast.Assign, ast.AugAssign, ast.Expr)) and "sys.path" in ast.unparse(statement):
            named = {n.value for n in ast.walk(statement) if isinstance(n, ast.Constant)} & {"tests", "benchmarks"}
            assert not named, f"{script.name}:{statement.lineno} puts {sorted(named)} on sys.path"
