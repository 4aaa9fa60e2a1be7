"""Shared test problems, solvers and tolerances."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import solvax as sx
from solvax._core import registry


def entry_point_env() -> dict:
    """The environment for an entry point a test starts (`python -m solvax`, an
    example): the tests' XLA flags (`conftest.py`: 8 devices, LLVM level 0),
    which the entry points keep since they name the device count."""
    return dict(os.environ)


def mesh(ndev: int = 8) -> Mesh:
    return Mesh(np.array(jax.devices()[:ndev]), ("i",))


def put(x, m: Mesh, *spec):
    return jax.device_put(x, NamedSharding(m, P(*spec)))


# ----------------------------------------------------------------- problems
def laplacian_1d(n: int) -> np.ndarray:
    return 2 * np.eye(n) - np.eye(n, k=1) - np.eye(n, k=-1)


def poisson_1d(x):
    """Dirichlet 1-D Laplacian along the leading axis (no flattening)."""
    pad = [(1, 1)] + [(0, 0)] * (x.ndim - 1)
    xp = jnp.pad(x, pad)
    return 2 * x - xp[:-2] - xp[2:]


def poisson_2d(x):
    """5-point Dirichlet Laplacian on a 2-D grid."""
    xp = jnp.pad(x, 1)
    return 4 * x - xp[:-2, 1:-1] - xp[2:, 1:-1] - xp[1:-1, :-2] - xp[1:-1, 2:]


def halo_laplacian(x):
    """Dirichlet 1-D Laplacian (+0.1 I) on one shard of 8 (inside `shard_map`
    over 'i'), neighbours exchanged with `ppermute`: the dense matrix is
    `laplacian_1d(n) + 0.1 I`."""
    idx = jax.lax.axis_index("i")
    left = jax.lax.ppermute(x[-1:], "i", [(k, (k + 1) % 8) for k in range(8)])
    right = jax.lax.ppermute(x[:1], "i", [(k, (k - 1) % 8) for k in range(8)])
    left = jnp.where(idx == 0, 0.0, left)
    right = jnp.where(idx == 7, 0.0, right)
    xp = jnp.concatenate([left, x, right])  # the halo of a shard, not a solver vector
    return 2.1 * x - xp[:-2] - xp[2:]


def dense_of(matvec, shape, dtype=np.float64) -> np.ndarray:
    """The dense matrix of a matvec on arrays of `shape` (row-major order)."""
    n = int(np.prod(shape))
    cols = jax.vmap(lambda e: matvec(e.reshape(shape)).reshape(-1))(jnp.eye(n, dtype=dtype))
    return np.asarray(cols).T


def dense_tridiagonal(lower, diag, upper, cyclic: bool = False):
    """The dense matrices of tridiagonal systems: bands `(n, *B)` -> `(*B, n, n)`
    (differentiable). `lower[0]` and `upper[-1]` are unused, or with `cyclic`
    the corners `A[0, n-1]` and `A[n-1, 0]`. The one dense builder for every
    tridiagonal test."""
    l, d, u = (jnp.moveaxis(jnp.asarray(a), 0, -1) for a in (lower, diag, upper))
    n = d.shape[-1]
    eye = jnp.eye(n, dtype=d.dtype)
    below, above = jnp.eye(n, k=-1, dtype=d.dtype), jnp.eye(n, k=1, dtype=d.dtype)
    if cyclic:
        below, above = below.at[0, n - 1].set(1), above.at[n - 1, 0].set(1)
    # row i holds lower[i] at column i - 1 (mod n), upper[i] at column i + 1 (mod n)
    return l[..., :, None] * below + d[..., :, None] * eye + u[..., :, None] * above


def solve_dense_tridiagonal(lower, diag, upper, rhs, cyclic: bool = False):
    """`x` of the systems along the leading axis (rhs `(n, *B)` or `(n, *B, *K)`)."""
    A = dense_tridiagonal(lower, diag, upper, cyclic)
    nb = jnp.ndim(diag) - 1
    r = jnp.moveaxis(jnp.asarray(rhs), 0, nb)  # (*B, n, *K)
    r2 = r.reshape(r.shape[: nb + 1] + (-1,))
    return jnp.moveaxis(jnp.linalg.solve(A, r2).reshape(r.shape), nb, 0)


def convection_diffusion(strength: float = 10.0):
    """Upwind convection-diffusion on a 2-D grid: -Δu + c ∂u/∂x (nonsymmetric)."""

    def matvec(x):
        xp = jnp.pad(x, 1)
        h = 1.0 / (x.shape[0] + 1)
        return poisson_2d(x) + strength * h * (x - xp[:-2, 1:-1])

    return matvec


def random_spd(n: int, seed: int = 0, dtype=np.float64) -> np.ndarray:
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((n, n))
    if np.issubdtype(dtype, np.complexfloating):
        a = a + 1j * rng.standard_normal((n, n))
    return (a @ a.conj().T / n + np.eye(n)).astype(dtype)


def random_nonsymmetric(n: int, seed: int = 0, dtype=np.float64) -> np.ndarray:
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((n, n))
    if np.issubdtype(dtype, np.complexfloating):
        a = a + 1j * rng.standard_normal((n, n))
    return (np.diag(3 + np.arange(n) / n) + 0.5 * a / np.sqrt(n)).astype(dtype)


def rhs(shape, seed=1, dtype=np.float64):
    rng = np.random.default_rng(seed)
    v = rng.standard_normal(shape)
    if np.issubdtype(dtype, np.complexfloating):
        v = v + 1j * rng.standard_normal(shape)
    return jnp.asarray(v.astype(dtype))


def rel_err(x, y) -> float:
    x, y = np.asarray(x), np.asarray(y)
    return float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-300))


def tree_rel_err(x, y) -> float:
    return max(rel_err(a, b) for a, b in zip(jax.tree_util.tree_leaves(x),
                                             jax.tree_util.tree_leaves(y)))


# ------------------------------------------------------------------ solvers
@dataclasses.dataclass(frozen=True)
class Solver:
    """One registered solver variant and what every generic test needs to know.

    `solve(matvec, b, **options) -> Solution` (every option of the method,
    `axis_name` included, passes through); `method` is the driver method it
    runs (`solvax._core.driver.REGISTRY`); `counts` are its pinned collective counts
    on a diagonal operator under `jit` with a sharded vector: (primal total,
    adjoint total, per iteration; a GMRES restart and its Arnoldi step both
    count); `limit`: the option that caps its outer loop.
    """

    name: str
    solve: Callable
    method: str
    nonsymmetric: bool  # accepts nonsymmetric (and non-Hermitian) operators
    counts: tuple[int, int, int]
    limit: str = "max_steps"


def _linear_solve_gmres(matvec, b, **options):
    """`linear_solve` around GMRES: a black-box solver (it carries the options)."""
    return sx.linear_solve(matvec, b, solver=lambda A, r: sx.gmres(A, r, restart=20, **options))


# Every registered variant (`solvax._core.registry`: each solver's module
# registers its variants and their counts, with why), and `linear_solve`
# around GMRES, whose options pass through to the solver it wraps.
SOLVERS = {
    **{name: Solver(name, functools.partial(solver.function, **variant.options), variant.method,
                    solver.nonsymmetric, variant.counts, solver.limit)
       for name, (solver, variant) in registry.variants().items()},
    "linear_solve_gmres": Solver("linear_solve_gmres", _linear_solve_gmres, "gmres", True,
                                 (3, 6, 2), "max_restarts"),
}
KRYLOV = {name: s.solve for name, s in SOLVERS.items()}
# The variants with code paths of their own (the restart-5 ones differ only in size):
# the expensive generic checks (every leaf layout, shard_map) run these.
DISTINCT = [name for name in SOLVERS if not name.endswith("restart5")]
SPD_SOLVERS = DISTINCT
# One variant per method module (its loop, its carries, its own reductions):
# the costliest generic checks (every nesting of transformations, every single
# leaf layout) run these in full and the other variants in the combined case.
REPRESENTATIVE = {"pcg", "pcg_pipelined", "pcg_s_step", "gmres", "bicgstab", "idrs", "minres"}
# ... and the two `linear_solve` wrappers (their own path through the driver)
WITH_WRAPPERS = REPRESENTATIVE | {"pcg_linear_solve", "linear_solve_gmres"}
GENERAL_SOLVERS = [name for name, s in SOLVERS.items() if s.nonsymmetric]
# Methods limited by restarts (`max_restarts`) rather than steps (`max_steps`).
RESTARTED = tuple(s.name for s in registry.SOLVERS.values() if s.limit == "max_restarts")


def step_limit(name: str, steps: int) -> dict:
    """The option that limits a registered solver's outer loop to `steps`."""
    return {SOLVERS[name].limit: steps}


def tolerance(dtype, name: str = "") -> tuple[float, float]:
    """(solver rtol, check tolerance) for a dtype (and solver).

    Some recurrences attain less accuracy in single precision (the gap between
    their recursive and the true residual), measured on the 1-D Poisson test
    (condition 660) in float32: pipelined CG without residual replacement
    stalls near 5e-4; one-synchronization BiCGStab at 7.5e-5 (its expanded
    products); IDR(s) at 1.9e-4 (its intermediate residuals peak); MINRES at
    1.3e-5 (its direction recurrences: a gap growing like eps * cond^2,
    Sleijpen, van der Vorst & Modersitzki 2000, against eps * cond for CG).
    They are asked for 1e-3 there; every solver still reports honestly (the
    true residual decides `converged`).
    """
    if jnp.dtype(dtype) in (jnp.float32, jnp.complex64):
        return (1e-3, 1e-2) if name in LOW_SINGLE_PRECISION_ACCURACY else (1e-5, 1e-3)
    return 1e-10, 1e-7


LOW_SINGLE_PRECISION_ACCURACY = {"pcg_pipelined", "bicgstab_one_sync", "idrs", "minres"}


def all_equations(jaxpr):
    """Every equation of `jaxpr` (a `Jaxpr` or `ClosedJaxpr`), those of its
    nested jaxprs (loops, conditionals, calls) included."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)

    def subjaxprs(value):
        if hasattr(value, "eqns"):
            yield value
        elif hasattr(value, "jaxpr") and hasattr(value.jaxpr, "eqns"):
            yield value.jaxpr
        elif isinstance(value, (tuple, list)):
            for v in value:
                yield from subjaxprs(v)

    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in subjaxprs(value):
                yield from all_equations(sub)


def count_primitives(closed_jaxpr, prefix: str) -> int:
    """Occurrences of primitives whose name starts with `prefix`, in nested jaxprs too."""
    return sum(eqn.primitive.name.startswith(prefix) for eqn in all_equations(closed_jaxpr))


@contextlib.contextmanager
def patched_rule(monkeypatch, module, rule: str, value):
    """`module.rule` (a backend rule such as `stacks_products`) patched to
    return `value` inside the block; JAX's caches cleared around it, so
    nothing traced under one value is reused under another."""
    jax.clear_caches()
    monkeypatch.setattr(module, rule, lambda *a, **k: value)
    try:
        yield
    finally:
        monkeypatch.undo()
        jax.clear_caches()


def traced_with_rule(monkeypatch, module, rule: str, value, solve, b):
    """`(jaxpr, solve(b))` with `module.rule` returning `value` (`patched_rule`)."""
    with patched_rule(monkeypatch, module, rule, value):
        return jax.make_jaxpr(solve)(b), solve(b)
