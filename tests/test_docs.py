"""The documentation site stays complete: every public name in the API
reference, every page in the navigation, every figure it shows on disk.
(`mkdocs build --strict` in `.ci/run` checks links and docstrings.)"""

import importlib
import inspect
import pathlib
import re

import solvax as sx
from solvax._core import registry
from solvax._core.options import COMMON

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def test_api_reference_lists_every_public_name():
    """Each entry under the package that defines it (`::: solvax._pkg.module.name`)
    is the public `sx.name`."""
    paths = re.findall(r"^::: (solvax[\w.]*)$", (DOCS / "api.md").read_text(), re.M)
    listed = {path.rsplit(".", 1)[-1] for path in paths}
    assert set(sx.__all__) <= listed, set(sx.__all__) - listed
    assert listed - set(sx.__all__) == {"distributed"}
    for path in paths:
        module, name = path.rsplit(".", 1)
        if name != "distributed":
            assert getattr(importlib.import_module(module), name) is getattr(sx, name), path


def test_api_reference_states_the_common_options_of_the_registry():
    """The common options' entries (`_core.options.COMMON`, inserted into every
    solver's docstring) are the API reference's list, and every registered
    solver's docstring holds them."""
    page = (DOCS / "api.md").read_text()
    for names, text in COMMON.items():
        assert f"- `{names}`: {text}" in page, names
    for solver in registry.SOLVERS.values():
        taken = inspect.signature(solver.function).parameters
        if "failed_derivative" in taken and "x0" in taken:
            assert COMMON["rtol, atol"] in " ".join(solver.function.__doc__.split()), solver.name


def test_every_page_is_in_the_navigation():
    config = (ROOT / "mkdocs.yml").read_text()
    pages = {p.name for p in DOCS.glob("*.md")}
    in_nav = set(re.findall(r":\s+(\w+\.md)\s*$", config, re.M))
    assert pages == in_nav, pages ^ in_nav


def test_every_figure_shown_exists():
    shown = {m for page in DOCS.glob("*.md")
             for m in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", page.read_text())}
    assert shown, "the site shows no figure"
    assert all((DOCS / path).is_file() for path in shown), shown


def test_the_api_reference_renders_parameters_as_lists():
    """Its parameter tables overflowed the content column (the Default column
    cut off at 1400 px): sections render as lists, and no page of the site
    links to a placeholder repository."""
    config = (ROOT / "mkdocs.yml").read_text()
    assert re.search(r"^\s+docstring_section_style: list\s*$", config, re.M), config
    assert "example.invalid" not in config and "repo_url" not in config


# README rows (their own labels) -> the live table's cases
_README_ROWS = {
    "MG-preconditioned CG, 64² grid `P('i', None)`":
        "multigrid-preconditioned CG, 64x64 grid P('i', None)",
    "the same, single-reduction":
        "multigrid-preconditioned CG, single_reduction, 64x64 grid P('i', None)",
    "the same, `multigrid(A, coarse=\"chebyshev\")`":
        "multigrid-preconditioned CG, Chebyshev coarsest level, 64x64 grid P('i', None)",
    "the same, 32² coarsest level, `coarse=\"lines\"`":
        "multigrid-preconditioned CG, 32x32 coarsest level solved by lines, 64x64 grid "
        "P('i', None)",
}


def test_documented_counts_come_from_the_live_table():
    """The counts in docs/sharding.md's table (written by
    `benchmarks/docs_table.py`) and the README's multigrid rows are the live
    table's (`benchmarks/results/table.json`, from `python -m solvax --json`;
    the README once said 126 / 179 where the table printed 122 / 175).
    The JSON's own counts are pinned against the code by tests/test_main.py."""
    import json

    rows = {r["case"]: r for r in
            json.loads((ROOT / "benchmarks/results/table.json").read_text())["rows"]}
    documented = [line for line in (DOCS / "sharding.md").read_text().splitlines()
                  if line.startswith("| ") and not line.startswith("| case")]
    assert len(documented) == len(rows)
    for line in documented:
        case, *numbers = [c.strip() for c in line.strip("|").split(" | ")]
        r = rows[case]
        assert numbers == [str(r[k]) for k in ("primal", "adjoint", "per_step", "halos_per_step",
                                               "all_gathers", "bytes_per_step")], case
    readme = (ROOT / "README.md").read_text().splitlines()
    for label, case in _README_ROWS.items():
        line = next(line for line in readme if line.startswith(f"| {label} |"))
        primal, adjoint = [c.strip() for c in line.strip("|").split(" | ")][1:3]
        assert (int(primal), int(adjoint)) == (rows[case]["primal"], rows[case]["adjoint"]), label


def test_all_is_a_literal_list_that_matches_the_registry():
    """`__all__` is read statically by the API reference's generator (griffe
    takes string literals only): it is a literal list of strings, and it and
    the names imported in `__init__.py` hold every registered solver, so a new
    solver cannot be forgotten."""
    import ast

    tree = ast.parse((ROOT / "src" / "solvax" / "__init__.py").read_text())
    (node,) = [n for n in tree.body if isinstance(n, ast.Assign)
               and any(getattr(t, "id", None) == "__all__" for t in n.targets)]
    assert isinstance(node.value, ast.List)
    assert all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.value.elts)
    literal = [e.value for e in node.value.elts]
    assert literal == list(sx.__all__) and len(set(literal)) == len(literal)
    imported = {alias.asname or alias.name for n in tree.body if isinstance(n, ast.ImportFrom)
                for alias in n.names}
    for name, solver in registry.SOLVERS.items():
        assert name in literal and name in imported, name
        assert getattr(sx, name) is solver.function, name
    assert set(literal) <= imported, set(literal) - imported
