"""The solver registry: every public solve function, registered once by its
own module, and everything derived from it.

A `Solver` is a public function `solve(matvec, b, **options) -> Solution`
with what the rest of the library and the tests need to know about it:

- `solvax.__init__` exports every registered solver under its `name`;
- `newton_krylov(solver=...)` offers those with `newton=True`;
- the live communication table (`python -m solvax`) measures its `rows`;
- the tests run every `Variant` through the generic checks (convergence,
  gradients, sharding, bad input) and pin each variant's collective counts.

Adding a Krylov method is its module (a `run` registered with the driver,
and the public function) plus one `register_solver` call; `docs/api.md`
lists it for the reference.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class Variant:
    """A configuration the tests run: `solve(matvec, b, **options)`.

    `method`: the driver method it runs (`driver.REGISTRY`); `counts`: its
    collective counts on the tests' diagonal operator under `jit`, vectors
    sharded over 8 devices (primal total, adjoint total, per iteration; a
    GMRES restart and its Arnoldi step both count), pinned by the tests.
    """

    name: str
    options: Mapping[str, Any]
    method: str
    counts: tuple[int, int, int]


@dataclasses.dataclass(frozen=True)
class Row:
    """A row of the live communication table: `case` (its label) measured
    with `options` on a diagonal operator, as `layout` says: `"jit"` (a
    vector sharded `P('i')` under `jit`), `"jacobi"` (the same with a
    Jacobi preconditioner), `"shard_map"` (inside `shard_map`, `axis_name`
    given) or `"pytree"` (a dict of a `P('i')` vector and a `P(None, 'i')`
    field)."""

    case: str
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    layout: str = "jit"


LAYOUTS = ("jit", "jacobi", "shard_map", "pytree")


@dataclasses.dataclass(frozen=True)
class Solver:
    """A public solve function and what is derived from it (module docstring).

    `nonsymmetric`: it accepts nonsymmetric (and non-Hermitian) operators;
    `newton`: an inner solver of `newton_krylov`; `limit`: the option that
    caps its outer loop (`max_steps`, or `max_restarts` for restarted
    methods); `cycle`: the option that sets a restart cycle's length, if it
    has one (`newton_krylov` caps it by `max_inner`).
    """

    name: str
    function: Callable
    nonsymmetric: bool
    variants: tuple[Variant, ...] = ()
    rows: tuple[Row, ...] = ()
    newton: bool = False
    limit: str = "max_steps"
    cycle: str | None = None


#: Every registered solver by name, in registration order.
SOLVERS: dict[str, Solver] = {}


def register_solver(function: Callable, *, nonsymmetric: bool, variants=(), rows=(),
                    newton: bool = False, limit: str = "max_steps",
                    cycle: str | None = None) -> Callable:
    """Register `function` (under its `__name__`) and return it unchanged."""
    for row in rows:
        if row.layout not in LAYOUTS:
            raise ValueError(f"row {row.case!r}: layout must be one of {LAYOUTS}")
    solver = Solver(function.__name__, function, nonsymmetric, tuple(variants), tuple(rows),
                    newton, limit, cycle)
    if solver.name in SOLVERS:
        raise ValueError(f"a solver named {solver.name!r} is registered already")
    SOLVERS[solver.name] = solver
    return function


def variants() -> dict[str, tuple[Solver, Variant]]:
    """Every registered variant by name, with its solver."""
    return {v.name: (s, v) for s in SOLVERS.values() for v in s.variants}


def newton_solvers() -> dict[str, Callable]:
    """The inner solvers `newton_krylov` offers, by name."""
    return {s.name: s.function for s in SOLVERS.values() if s.newton}
