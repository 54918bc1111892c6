"""The pack's shape: layers that import only those below them, adapters that never import
one another, no import cycle, and every adapter a declared surface with its ledger."""

from __future__ import annotations

import ast
import pathlib

import pytest

from sglang_dsv41_adapters import ADAPTERS, load
from sglang_dsv41_adapters.framework import surface as surfaces
from harness.engines import ROOT

PACKAGE = ROOT / "adapter"
TOP = "sglang_dsv41_adapters"
# Each layer may import the layers listed for it (and itself); the package root holds the
# registry, which loads adapters by name, never by import.
ALLOWED = {
    "engine": {"engine"},
    "framework": {"engine", "framework", "<root>"},
    "spectpsync": {"engine", "framework", "spectpsync"},
    "<adapter>": {"engine", "framework", "spectpsync", "<self>"},
    "rollout": {"rollout"},  # judges running servers from outside: nothing of the engine or the adapters
    "cli": {"engine", "framework", "rollout", "<root>"},
    "<root>": {"framework"},
}


def layer_of(module: str) -> str:
    parts = module.split(".")[1:]
    if not parts or parts == ["__init__"]:
        return "<root>"
    if parts[0] in ADAPTERS:
        return "<adapter>"
    return parts[0]


def modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).with_suffix("")
        parts = [p for p in rel.parts if p != "__init__"]
        found[".".join([TOP, *parts])] = path
    return found


def imports(module: str, path: pathlib.Path) -> set[str]:
    """The pack's modules `module` imports, at module level or inside a function."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == TOP or target.startswith(TOP + "."):
                for alias in node.names:
                    candidate = f"{target}.{alias.name}"
                    found.add(candidate if candidate in modules() else target)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith(TOP)}
    return found - {module}


GRAPH = {module: imports(module, path) for module, path in modules().items()}


def test_the_layers_import_only_what_they_may():
    wrong = []
    for module, targets in GRAPH.items():
        mine = layer_of(module)
        for target in targets:
            theirs = layer_of(target)
            allowed = ALLOWED[mine]
            same_adapter = theirs == "<adapter>" and target.split(".")[1] == module.split(".")[1]
            if theirs in allowed or (mine == "<adapter>" and same_adapter):
                continue
            wrong.append(f"{module} ({mine}) imports {target} ({theirs})")
    assert wrong == []


def test_no_adapter_imports_another():
    crossing = [(m, t) for m, targets in GRAPH.items() for t in targets
                if layer_of(m) == "<adapter>" == layer_of(t) and m.split(".")[1] != t.split(".")[1]]
    assert crossing == []


def test_there_is_no_import_cycle():
    state: dict[str, str] = {}
    cycles = []

    def visit(module, trail):
        state[module] = "open"
        for target in sorted(GRAPH.get(module, ())):
            if state.get(target) == "open":
                cycles.append(trail[trail.index(target):] + [target] if target in trail else [module, target])
            elif target not in state:
                visit(target, trail + [target])
        state[module] = "done"

    for module in sorted(GRAPH):
        if module not in state:
            visit(module, [module])
    # A package's __init__ that imports its own submodule, which reads names the package
    # defined before that import (the adapters' before_0_5_19.py), is no cycle of layers.
    real = [c for c in cycles if len({m.split(".")[1] if layer_of(m) == "<adapter>" else m for m in c}) > 1]
    assert real == []


def test_the_layout_test_can_see_a_wrong_import():
    assert layer_of(f"{TOP}.engine.census") == "engine"
    assert "framework" not in ALLOWED["engine"]
    assert f"{TOP}.engine.contract" in GRAPH[f"{TOP}.engine.census"]  # it reads the graph it judges


@pytest.mark.parametrize("name", ADAPTERS)
def test_every_adapter_is_a_declared_surface_with_a_ledger(name):
    surface = load(name)
    assert surface.name == name and surface.ledger.why and surface.ledger.retire_when
    for legacy in surface.ledger.legacy:
        assert (PACKAGE / name / legacy).is_file(), legacy


def test_a_wrong_declaration_is_refused_when_it_loads():
    good = load("folded_fence")
    cases = {
        "flag 'FOLDED_FENCE' is not DSV41_ and capitals": dict(flag="FOLDED_FENCE"),
        "reads 'no_such_adapter', which is not another registered adapter": dict(reads={"no_such_adapter": "setting"}),
        "reads 'verdict' of rank0_broadcast": dict(reads={"rank0_broadcast": "verdict"}),
        "check does not take (engine, setting, context)": dict(check=lambda engine: None),
        "check_value 'off' does not switch DSV41_FOLDED_FENCE on": dict(check_value="off"),
        "check_with names an adapter whose setting it does not declare it reads": dict(check_with={"rank0_broadcast": "all"}),
        "server_args 'speculative_algorithm' is not a tuple of server argument names": dict(
            server_args="speculative_algorithm"),
        "server_args ('--tp-size',) is not a tuple of server argument names": dict(server_args=("--tp-size",)),
        "command 'Build_Kernel' is not lower-case words joined by hyphens": dict(commands={"Build_Kernel": good.commands["build-kernel"]}),
        "command 'build' does not take (argv) with a docstring for its help": dict(commands={"build": lambda: 0}),
    }
    for problem, change in cases.items():
        with pytest.raises(surfaces.SurfaceError, match=problem.replace("(", r"\(").replace(")", r"\)")):
            surfaces.validate(surfaces.Surface(**{**good.__dict__, **change}), "folded_fence", ADAPTERS)
    with pytest.raises(surfaces.SurfaceError, match="named 'folded_fence', its folder 'other'"):
        surfaces.validate(good, "other", ADAPTERS)


def test_every_package_folder_is_in_the_distribution():
    """pyproject.toml lists the packages one by one: a folder left out would be missing from the wheel and the image.
    A folder of data only (the kernel's sources) is listed with the files it ships (package-data), every one of them."""
    import tomllib

    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {".".join([TOP, *path.parent.relative_to(PACKAGE).parts]) for path in PACKAGE.rglob("*.py")}
    data = setuptools.get("package-data", {})
    assert sorted(folders | set(data)) == sorted(setuptools["packages"])
    for package, patterns in data.items():
        folder = PACKAGE.joinpath(*package.split(".")[1:])
        shipped = {path for pattern in patterns for path in folder.glob(pattern)}
        assert shipped and shipped == set(folder.iterdir()), package
