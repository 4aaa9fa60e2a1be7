"""The source's layout (`docs/architecture.md`): imports run one way down the
packages, no module reaches into another's private names, modules and
functions stay small, and what the registries feed is derived from them."""

import ast
import pathlib

import pytest
from helpers import SOLVERS

import solvax as sx
from solvax._accounting import table
from solvax._core import registry
from solvax._nonlinear import newton

SRC = pathlib.Path(sx.__file__).parent
BELOW = {"_core", "_krylov", "_structured", "_preconditioners"}
ALLOWED = {"_core": set(), "_krylov": {"_core"}, "_structured": {"_core"},
           "_preconditioners": {"_core"}, "_grid": BELOW, "_precision": BELOW,
           "_nonlinear": BELOW, "_accounting": BELOW | {"_grid", "_precision", "_nonlinear"}}
MULTIGRID = ["fusion", "transfer", "galerkin", "levels", "smoothers", "coarse", "hierarchy",
             "cycle", "rule", "builder"]


def _modules():
    """`(dotted name under solvax, parsed module, its lines)` for every module."""
    for path in sorted(SRC.rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        text = path.read_text()
        yield ".".join(parts), ast.parse(text), text.splitlines()


def _imports(name: str, tree):
    """`(target module, imported names)` of every solvax import in a module."""
    package = name.split(".")[:-1]   # a package's __init__ imports relative to the package
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[:len(package) - node.level + 1]
            target = ".".join(base + ([node.module] if node.module else []))
            yield target, [alias.name for alias in node.names]


def test_imports_run_one_way_down_the_packages():
    for name, tree, _ in _modules():
        home = name.split(".")[0]
        if home not in ALLOWED:
            continue  # solvax/__init__, __main__, distributed: the public surface
        for target, names in _imports(name, tree):
            for imported in names:
                full = f"{target}.{imported}" if target else imported
                package = full.split(".")[0]
                assert package in ALLOWED[home] | {home}, (name, full)


def test_multigrid_modules_import_only_those_above_them():
    for name, tree, _ in _modules():
        if not name.startswith("_grid.multigrid.") or name.endswith("__init__"):
            continue
        own = MULTIGRID.index(name.rsplit(".", 1)[1])
        for target, names in _imports(name, tree):
            for imported in names:
                full = f"{target}.{imported}" if target else imported
                if full.startswith("_grid.multigrid."):
                    sibling = full.split(".")[2]
                    assert MULTIGRID.index(sibling) < own, (name, full)


def test_no_module_reaches_into_private_names():
    """A name imported from another module, or read off an imported module,
    has no underscore (subpackages excepted)."""
    for name, tree, _ in _modules():
        modules = set()
        for target, names in _imports(name, tree):
            for imported in names:
                assert not imported.startswith("_") or imported in ALLOWED, (name, imported)
                path = SRC.joinpath(*f"{target}.{imported}".strip(".").split("."))
                if path.with_suffix(".py").is_file() or path.is_dir():
                    modules.add(imported)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in modules and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                raise AssertionError(f"{name}:{node.lineno} reads {node.value.id}.{node.attr}")


def test_modules_and_functions_stay_small():
    for name, tree, lines in _modules():
        assert len(lines) <= 500, (name, len(lines))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef):
                body = node.body
                if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                    body = body[1:]
                if not body:
                    continue
                code = [line for line in lines[body[0].lineno - 1:node.end_lineno]
                        if line.strip() and not line.strip().startswith("#")]
                assert len(code) <= 60, (name, node.name, len(code))


def test_what_the_solver_registry_feeds_is_derived_from_it():
    solvers = registry.SOLVERS
    assert {"pcg", "gmres", "gcrot", "bicgstab", "idrs", "minres"} <= set(solvers)
    for solver in solvers.values():
        assert solver.name in sx.__all__ and getattr(sx, solver.name) is solver.function
    assert newton.LINEAR_SOLVERS == {s.name: s.function for s in solvers.values() if s.newton}
    rows = {case for layout in registry.LAYOUTS for case, _, _ in table._registered_rows(layout)}
    assert rows == {row.case for s in solvers.values() for row in s.rows}
    assert set(registry.variants()) <= set(SOLVERS)


def test_registering_refuses_a_taken_name_and_an_unknown_layout(monkeypatch):
    monkeypatch.setattr(registry, "SOLVERS", dict(registry.SOLVERS))

    def solve(matvec, b):
        return matvec(b)

    with pytest.raises(ValueError, match="registered already"):
        registry.register_solver(sx.pcg, nonsymmetric=False)
    with pytest.raises(ValueError, match="layout"):
        registry.register_solver(solve, nonsymmetric=True,
                                 rows=(registry.Row("case", {}, "vmap"),))
    # the nearest valid input: a new name, a known layout
    assert registry.register_solver(solve, nonsymmetric=True,
                                    rows=(registry.Row("case", {}, "pytree"),)) is solve
    assert registry.SOLVERS["solve"].rows[0].layout == "pytree"
