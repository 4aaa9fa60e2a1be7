"""The communication table: the seed's cases measured live with `count_collectives`.

Shared by `python -m solvax` and `benchmarks/benchmark_collectives.py`.
Measurement rules: sharded operands are runtime arguments (never closure
constants); the adjoint is `jax.grad` of the nonlinear loss `sum(|x|^2)`; the
primal returns `x` (diagnostics, when used, add one reduction after the loop).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .._core.parallel import shard_map
from .._core.registry import SOLVERS
from .._grid.multigrid import multigrid
from .._grid.stationary import multigrid_solve
from .._grid.stencil import diffusion_operator
from .._krylov.cg import pcg
from .._nonlinear.newton import newton_krylov
from .._preconditioners.diagonal import jacobi
from .._structured.block_tridiagonal import block_tridiagonal_solve
from .._structured.partitioned import (
    partitioned_block_tridiagonal_solve,
    partitioned_tridiagonal_solve,
)
from .._structured.tridiagonal import cyclic_tridiagonal_solve, tridiagonal_solve
from .counter import count_collectives


@dataclasses.dataclass(frozen=True)
class Row:
    case: str
    devices: int
    primal: int
    adjoint: int
    per_step: int          # synchronizations one step executes (all-reduces, all-gathers)
    all_gathers: int
    bytes_per_step: int
    halos_per_step: int = 0  # neighbour exchanges one step executes (collective-permutes)


def _diag(d):
    return lambda x: jax.tree_util.tree_map(jnp.multiply, d, x)


def _shard_mapped(mesh, solve):
    """`solve(d, b, axis_name="i")` inside `shard_map`, vectors split over 'i'."""

    def run(d, b):
        specs = jax.tree_util.tree_map(lambda _: P("i"), b)
        return shard_map(lambda d, b: solve(d, b, axis_name="i"), mesh=mesh,
                         in_specs=(specs, specs), out_specs=specs)(d, b)

    return run


def _registered_rows(layout: str) -> list:
    """`(case, solver, options)` of every registered solver's table rows in
    `layout` (`_core.registry.Row`): each run as `solver(diagonal operator,
    b, **options).x` on a vector sharded P('i'); `"jacobi"` with a Jacobi
    preconditioner, `"shard_map"` inside `shard_map` with axis_name='i',
    `"pytree"` on a dict mixing a P('i') vector and a P(None, 'i') field."""
    return [(row.case, solver.function, {**row.options, "jacobi": layout == "jacobi"})
            for solver in SOLVERS.values() for row in solver.rows if row.layout == layout]


# PCG of every method preconditioned by multigrid on the 64 x 64 grid
_PCG_METHODS = [("", {}), (", single_reduction", {"method": "single_reduction"}),
                (", pipelined", {"method": "pipelined"}),
                (", s_step s=4", {"method": "s_step", "s": 4})]


def _krylov(solver, options):
    options = dict(options)
    if options.pop("jacobi", False):
        return lambda d, b, **kw: solver(_diag(d), b, precond=jacobi(d), **options, **kw).x
    return lambda d, b, **kw: solver(_diag(d), b, **options, **kw).x


def _structured_cases(mesh: Mesh, n: int, put, rng) -> dict[str, tuple[Callable, tuple]]:
    """The direct solves: batched (batch axis sharded) and partitioned (solve axis)."""
    batch = 4 * n // 64
    lower, upper, rhs = (put(rng.standard_normal((24, batch)), None, "i") for _ in range(3))
    bands = (lower, put(4.0 + rng.random((24, batch)), None, "i"), upper, rhs)
    split = tuple(put(rng.standard_normal((n, 4)) + (4.0 if k == 1 else 0.0), "i")
                  for k in range(4))
    blocks = tuple(put(rng.standard_normal((n // 8, 8, 4, 4)) + (8 * np.eye(4) if k == 1 else 0),
                       "i") for k in range(3))
    block_rhs = put(rng.standard_normal((n // 8, 8, 4)), "i")
    split_blocks = tuple(put(rng.standard_normal((n // 8, 4, 4)) + (8 * np.eye(4) if k == 1
                                                                     else 0), "i")
                         for k in range(3)) + (put(rng.standard_normal((n // 8, 4)), "i"),)
    return {
        "batched tridiagonal, batch axis sharded": (
            lambda lo, d, up, r: tridiagonal_solve(lo, d, up, r), bands),
        "cyclic tridiagonal, batch axis sharded": (
            lambda lo, d, up, r: cyclic_tridiagonal_solve(lo, d, up, r), bands),
        "tridiagonal, solve axis sharded (partitioned)": (
            lambda lo, d, up, r: partitioned_tridiagonal_solve(lo, d, up, r, axis_name="i",
                                                               mesh=mesh), split),
        "block tridiagonal 4x4, batch sharded (vmap)": (
            jax.vmap(block_tridiagonal_solve), (*blocks, block_rhs)),
        "block tridiagonal 4x4, solve axis sharded (partitioned)": (
            lambda lo, d, up, r: partitioned_block_tridiagonal_solve(lo, d, up, r,
                                                                     axis_name="i", mesh=mesh),
            split_blocks),
    }


def _multigrid_cg(k, b, coarse="direct", coarse_size=64, **options):
    A = diffusion_operator(k)
    return pcg(A, b, precond=multigrid(A, coarse=coarse, coarse_size=coarse_size), **options).x


def _multigrid_cycles(k, b):
    return multigrid_solve(diffusion_operator(k), b).x


def _newton(d, b):
    """Newton–Krylov on `d u + u^3 = b` (BiCGStab inside): a step is its linear
    solve's collectives and one norm of `F` per step length tried."""
    return newton_krylov(lambda u: d * u + u**3 - b, jnp.zeros_like(b), rtol=1e-10).u


def _multigrid_cases(mesh: Mesh, rng) -> dict[str, tuple[Callable, tuple]]:
    """MG-preconditioned CG on a 64 x 64 diffusion problem (coefficient field
    and right-hand side sharded; the hierarchy built inside the program): the
    grid's rows over the mesh, and rows and columns over a 2 x (P / 2) mesh."""
    meshes = {"P('i', None)": (mesh, P("i", None))}
    devices = list(mesh.devices.flat)
    if len(devices) >= 4 and len(devices) % 2 == 0:
        square = Mesh(np.array(devices).reshape(2, len(devices) // 2), ("i", "j"))
        meshes[f"P('i', 'j') on 2x{len(devices) // 2}"] = (square, P("i", "j"))
    cases = {}
    for label, (m, spec) in meshes.items():
        k, b = (jax.device_put(jnp.asarray(v), NamedSharding(m, spec))
                for v in (np.exp(rng.standard_normal((64, 64))), rng.standard_normal((64, 64))))
        cases[f"multigrid-preconditioned CG, 64x64 grid {label}"] = (_multigrid_cg, (k, b))
        if spec == P("i", None):
            for method, options in _PCG_METHODS[1:]:
                cases[f"multigrid-preconditioned CG{method}, 64x64 grid {label}"] = (
                    functools.partial(_multigrid_cg, **options), (k, b))
            cases[f"multigrid-preconditioned CG, Chebyshev coarsest level, 64x64 grid "
                  f"{label}"] = (functools.partial(_multigrid_cg, coarse="chebyshev"), (k, b))
            cases[f"multigrid-preconditioned CG, 32x32 coarsest level solved by lines, 64x64 "
                  f"grid {label}"] = (functools.partial(_multigrid_cg, coarse="lines",
                                                        coarse_size=1024), (k, b))
            cases[f"multigrid_solve (V-cycles alone), 64x64 grid {label}"] = (
                _multigrid_cycles, (k, b))
    return cases


def _cases(mesh: Mesh, n: int) -> dict[str, tuple[Callable, tuple]]:
    rng = np.random.default_rng(0)

    def put(x, *spec):
        return jax.device_put(jnp.asarray(x), NamedSharding(mesh, P(*spec)))

    diag, b = put(2.0 + rng.random(n), "i"), put(rng.standard_normal(n), "i")
    tree_d = {"vector": diag, "field": put(2.0 + rng.random((4, n)), None, "i")}
    tree_b = {"vector": b, "field": put(rng.standard_normal((4, n)), None, "i")}
    return {
        **_structured_cases(mesh, n, put, rng),
        **{case: (_krylov(solver, options), (diag, b))
           for case, solver, options in _registered_rows("jit") + _registered_rows("jacobi")},
        **{case: (_shard_mapped(mesh, _krylov(solver, options)), (diag, b))
           for case, solver, options in _registered_rows("shard_map")},
        **{case: (_krylov(solver, options), (tree_d, tree_b))
           for case, solver, options in _registered_rows("pytree")},
        **_multigrid_cases(mesh, rng),
        "Newton-Krylov (BiCGStab inside), F(u) = d u + u^3 - b, P('i')": (_newton, (diag, b)),
    }


def _loss(fn):
    def loss(*args):
        return sum(jnp.sum(jnp.abs(leaf) ** 2) for leaf in jax.tree_util.tree_leaves(fn(*args)))

    return loss


def _step_counts(report) -> tuple[int, int, int]:
    """What one pass of the innermost communicating loop executes (one CG
    iteration, one Arnoldi or Lanczos step, one IDR(s) cycle of s + 1
    matvecs, one s-step CG outer step of s iterations): synchronizations
    (every collective but the neighbour exchanges: all-reduces, each array
    of a variadic one counted, and all-gathers), collective-permutes, and
    the bytes they all move."""
    if report.step_loop is None:
        return 0, 0, 0
    halos = report.step_count("collective-permute")
    syncs = sum(report.per_step.values()) - halos
    step = [c for c in report.collectives if c.loops and c.loops[-1] == report.step_loop]
    return syncs, halos, sum(c.bytes for c in step)


def measure(devices: int, n: int = 512, cases: list[str] | None = None,
            on_row: Callable | None = None) -> list[Row]:
    """The table's rows (all, or those named in `cases`) on a mesh of the first
    `devices` devices; `on_row(i, total, row)` is called as each is measured."""
    if devices > len(jax.devices()):
        raise ValueError(f"{devices} devices requested, {len(jax.devices())} available; set "
                         "XLA_FLAGS=--xla_force_host_platform_device_count=8 before JAX starts.")
    mesh = Mesh(np.array(jax.devices()[:devices]), ("i",))
    every = _cases(mesh, n)
    unknown = sorted(set(cases or ()) - set(every))
    if unknown:
        raise ValueError(f"unknown table cases {unknown}; the cases are {list(every)}")
    chosen = [(case, fn, args) for case, (fn, args) in every.items()
              if cases is None or case in cases]
    rows = []
    for i, (case, fn, args) in enumerate(chosen):
        rows.append(measure_row(case, fn, args, devices))
        if on_row is not None:
            on_row(i, len(chosen), rows[-1])
    return rows


def measure_row(case: str, fn: Callable, args: tuple, devices: int) -> Row:
    """One row: the primal's and the adjoint's collectives."""
    primal = count_collectives(fn, *args)
    adjoint = count_collectives(jax.grad(_loss(fn), argnums=tuple(range(len(args)))), *args)
    syncs, halos, step_bytes = _step_counts(primal)
    return Row(case, devices, primal.total, adjoint.total, syncs,
               primal.count("all-gather") + adjoint.count("all-gather"), step_bytes, halos)


_HEADER = ("case", "devices", "primal", "adjoint", "syncs/step", "halos/step",
           "all-gathers (p+a)", "bytes/step")


def _cells(r: Row) -> tuple:
    return (r.case, str(r.devices), str(r.primal), str(r.adjoint), str(r.per_step),
            str(r.halos_per_step), str(r.all_gathers), str(r.bytes_per_step))


def format_table(rows: list[Row]) -> str:
    body = [_cells(r) for r in rows]
    width = [max(len(line[i]) for line in [_HEADER, *body]) for i in range(len(_HEADER))]
    fmt = lambda line: "  ".join(c.ljust(w) for c, w in zip(line, width)).rstrip()  # noqa: E731
    return "\n".join([fmt(_HEADER), fmt(tuple("-" * w for w in width))] + [fmt(b) for b in body])


def format_row(row: Row) -> str:
    """One row as a line of its own (printed as it is measured): the case,
    then the columns named."""
    return row.case + ": " + ", ".join(f"{name} {value}" for name, value in
                                      zip(_HEADER[2:], _cells(row)[2:]))


def write_json(rows: list[Row], path: str) -> None:
    """The rows (and the JAX version) as JSON: what the tests and benchmarks read."""
    with open(path, "w") as f:
        json.dump({"jax": jax.__version__, "rows": [dataclasses.asdict(r) for r in rows]}, f,
                  indent=2)


MEANING = ("Collective instructions in the optimized HLO (async pairs once): 'primal' = the "
           "solve, 'adjoint' = jax.grad of sum(x**2); 'syncs/step' = global synchronizations "
           "one CG/BiCGStab iteration, Arnoldi/Lanczos step, IDR(s) cycle of s + 1 matvecs or "
           "s-step CG outer step of s iterations (so 1/s per CG iteration) executes: "
           "all-reduces (each array of a variadic one: XLA:CPU synchronizes once per array) "
           "and all-gathers; 'halos/step' = neighbour exchanges (collective-permutes) it "
           "executes; "
           "'all-gathers (p+a)' = those of the primal and the adjoint together, "
           "'bytes/step' = what they move.")
