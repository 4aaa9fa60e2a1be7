"""The communication table: the seed's cases measured live with `count_collectives`.

Shared by `python -m solvax` and `benchmarks/benchmark_collectives.py`.
Measurement rules: sharded operands are runtime arguments (never closure
constants); the adjoint is `jax.grad` of the nonlinear loss `sum(|x|^2)`; the
primal returns `x` (diagnostics, when used, add one reduction after the loop).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ._bicgstab import bicgstab
from ._block_tridiagonal import block_tridiagonal_solve
from ._cg import pcg
from ._comm import count_collectives
from ._gmres import gmres
from ._idrs import idrs
from ._linear_solve import linear_solve
from ._minres import minres
from ._parallel import shard_map
from ._partitioned import partitioned_block_tridiagonal_solve, partitioned_tridiagonal_solve
from ._tridiagonal import cyclic_tridiagonal_solve, tridiagonal_solve


@dataclasses.dataclass(frozen=True)
class Row:
    case: str
    devices: int
    primal: int
    adjoint: int
    per_step: int
    all_gathers: int
    bytes_per_step: int


def _diag(d):
    return lambda x: jax.tree_util.tree_map(jnp.multiply, d, x)


def _gmres16(matvec, b):
    return gmres(matvec, b, restart=16)


def _shard_mapped(mesh, solve):
    """`solve(d, b, axis_name="i")` inside `shard_map`, vectors split over 'i'."""

    def run(d, b):
        specs = jax.tree_util.tree_map(lambda _: P("i"), b)
        return shard_map(lambda d, b: solve(d, b, axis_name="i"), mesh=mesh,
                         in_specs=(specs, specs), out_specs=specs)(d, b)

    return run


def _cases(mesh: Mesh, n: int) -> dict[str, tuple[Callable, tuple]]:
    rng = np.random.default_rng(0)

    def put(x, *spec):
        return jax.device_put(jnp.asarray(x), NamedSharding(mesh, P(*spec)))

    vec = lambda: put(rng.standard_normal(n), "i")  # noqa: E731
    diag = put(2.0 + rng.random(n), "i")
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
    tree_d = {"vector": diag, "field": put(2.0 + rng.random((4, n)), None, "i")}
    tree_b = {"vector": vec(), "field": put(rng.standard_normal((4, n)), None, "i")}
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
        "PCG": (lambda d, b: pcg(_diag(d), b).x, (diag, vec())),
        "PCG, single_reduction=True": (
            lambda d, b: pcg(_diag(d), b, single_reduction=True).x, (diag, vec())),
        "PCG, pipelined": (lambda d, b: pcg(_diag(d), b, method="pipelined").x, (diag, vec())),
        "PCG, s_step s=4 (a step = 4 CG iterations)": (
            lambda d, b: pcg(_diag(d), b, method="s_step", s=4).x, (diag, vec())),
        "PCG, s_step s=8 (a step = 8 CG iterations)": (
            lambda d, b: pcg(_diag(d), b, method="s_step", s=8).x, (diag, vec())),
        "FGMRES(16) via linear_solve": (
            lambda d, b: linear_solve(_diag(d), b, solver=_gmres16).x, (diag, vec())),
        "FGMRES(16), CGS2 orthogonalization": (
            lambda d, b: gmres(_diag(d), b, restart=16, orthogonalization="cgs2").x,
            (diag, vec())),
        "BiCGStab": (lambda d, b: bicgstab(_diag(d), b).x, (diag, vec())),
        "BiCGStab, method='one_sync'": (
            lambda d, b: bicgstab(_diag(d), b, method="one_sync").x, (diag, vec())),
        "IDR(4)": (lambda d, b: idrs(_diag(d), b, s=4).x, (diag, vec())),
        "MINRES": (lambda d, b: minres(_diag(d), b).x, (diag, vec())),
        "shard_map: PCG, single_reduction (axis_name)": (_shard_mapped(
            mesh, lambda d, b, **kw: pcg(_diag(d), b, single_reduction=True, **kw).x),
            (diag, vec())),
        "shard_map: PCG, pipelined (axis_name)": (_shard_mapped(
            mesh, lambda d, b, **kw: pcg(_diag(d), b, method="pipelined", **kw).x),
            (diag, vec())),
        "shard_map: PCG, s_step s=4 (axis_name)": (_shard_mapped(
            mesh, lambda d, b, **kw: pcg(_diag(d), b, method="s_step", s=4, **kw).x),
            (diag, vec())),
        "shard_map: FGMRES(16) (axis_name)": (_shard_mapped(
            mesh, lambda d, b, **kw: gmres(_diag(d), b, restart=16, **kw).x), (diag, vec())),
        "shard_map: BiCGStab (axis_name)": (_shard_mapped(
            mesh, lambda d, b, **kw: bicgstab(_diag(d), b, **kw).x), (diag, vec())),
        "shard_map: BiCGStab one_sync (axis_name)": (_shard_mapped(
            mesh, lambda d, b, **kw: bicgstab(_diag(d), b, method="one_sync", **kw).x),
            (diag, vec())),
        "shard_map: IDR(4) (axis_name)": (_shard_mapped(
            mesh, lambda d, b, **kw: idrs(_diag(d), b, s=4, **kw).x), (diag, vec())),
        "shard_map: MINRES (axis_name)": (_shard_mapped(
            mesh, lambda d, b, **kw: minres(_diag(d), b, **kw).x), (diag, vec())),
        "pytree PCG, P('i') + P(None,'i') leaves": (
            lambda d, b: pcg(_diag(d), b).x, (tree_d, tree_b)),
        "pytree PCG single_reduction, P('i') + P(None,'i')": (
            lambda d, b: pcg(_diag(d), b, single_reduction=True).x, (tree_d, tree_b)),
        "pytree PCG s_step s=4, P('i') + P(None,'i')": (
            lambda d, b: pcg(_diag(d), b, method="s_step", s=4).x, (tree_d, tree_b)),
        "pytree FGMRES(16), P('i') + P(None,'i') leaves": (
            lambda d, b: gmres(_diag(d), b, restart=16).x, (tree_d, tree_b)),
        "pytree IDR(4), P('i') + P(None,'i') leaves": (
            lambda d, b: idrs(_diag(d), b).x, (tree_d, tree_b)),
        "pytree MINRES, P('i') + P(None,'i') leaves": (
            lambda d, b: minres(_diag(d), b).x, (tree_d, tree_b)),
    }


def _loss(fn):
    def loss(*args):
        return sum(jnp.sum(jnp.abs(leaf) ** 2) for leaf in jax.tree_util.tree_leaves(fn(*args)))

    return loss


def _innermost_step(report) -> tuple[int, int]:
    """Collectives (and bytes) of one pass of the innermost communicating loop:
    one CG iteration, one Arnoldi or Lanczos step, one IDR(s) cycle (s + 1
    matvecs), one s-step CG outer step (s iterations)."""
    if not report.loops:
        return 0, 0
    deepest = max(loop.depth for loop in report.loops)
    loop = max((lp for lp in report.loops if lp.depth == deepest), key=lambda lp: lp.collectives)
    step = [c for c in report.collectives if c.loops and c.loops[-1] == loop.name]
    return len(step), sum(c.bytes for c in step)


def measure(devices: int, n: int = 512) -> list[Row]:
    """All table rows on a mesh of the first `devices` devices."""
    if devices > len(jax.devices()):
        raise ValueError(f"{devices} devices requested, {len(jax.devices())} available; set "
                         "XLA_FLAGS=--xla_force_host_platform_device_count=8 before JAX starts.")
    mesh = Mesh(np.array(jax.devices()[:devices]), ("i",))
    rows = []
    for case, (fn, args) in _cases(mesh, n).items():
        primal = count_collectives(fn, *args)
        adjoint = count_collectives(jax.grad(_loss(fn), argnums=tuple(range(len(args)))), *args)
        per_step, step_bytes = _innermost_step(primal)
        rows.append(Row(case, devices, primal.total, adjoint.total, per_step,
                        primal.count("all-gather") + adjoint.count("all-gather"), step_bytes))
    return rows


def format_table(rows: list[Row]) -> str:
    header = ("case", "devices", "primal", "adjoint", "per step", "all-gathers", "bytes/step")
    body = [(r.case, str(r.devices), str(r.primal), str(r.adjoint), str(r.per_step),
             str(r.all_gathers), str(r.bytes_per_step)) for r in rows]
    width = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    fmt = lambda line: "  ".join(c.ljust(w) for c, w in zip(line, width)).rstrip()  # noqa: E731
    return "\n".join([fmt(header), fmt(tuple("-" * w for w in width))] + [fmt(b) for b in body])


def write_json(rows: list[Row], path: str) -> None:
    """The rows (and the JAX version) as JSON: what the tests and benchmarks read."""
    with open(path, "w") as f:
        json.dump({"jax": jax.__version__, "rows": [dataclasses.asdict(r) for r in rows]}, f,
                  indent=2)


MEANING = ("Collective instructions in the optimized HLO (async pairs once): 'primal' = the "
           "solve, 'adjoint' = jax.grad of sum(x**2); 'per step' = synchronization points in one "
           "CG/BiCGStab iteration, Arnoldi/Lanczos step, IDR(s) cycle of s + 1 matvecs or s-step "
           "CG outer step of s iterations (so 1/s per CG iteration), "
           "'bytes/step' = what they move.")
