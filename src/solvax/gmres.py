"""Restarted flexible GMRES on pytrees."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.scipy.linalg import solve_triangular

from . import _checks, _reduce
from . import _tree as tree
from ._solution import RUNNING, Solution, Status, code, make_solution
from .linear_solve import implicit_solve

PyTree = Any


class _Cycle(NamedTuple):
    """One Arnoldi cycle: basis, rotated Hessenberg and rotations."""

    V: PyTree  # (m + 1, ...) orthonormal basis
    Z: PyTree  # (m, ...) preconditioned directions (None without a preconditioner)
    R: jax.Array  # (m, m) upper triangular: the Hessenberg after Givens rotations
    cs: jax.Array  # (m,) rotation cosines (real)
    sn: jax.Array  # (m,) rotation sines
    g: jax.Array  # (m + 1,) rotated right-hand side beta e_1; |g[j]| estimates the residual
    j: jax.Array  # accepted columns
    anorm: jax.Array  # running estimate of ||A|| (max ||A z|| / ||z||)
    flag: jax.Array  # RUNNING, or why the cycle ended


class _Outer(NamedTuple):
    x: PyTree
    k: jax.Array  # Arnoldi steps taken in all
    restarts: jax.Array
    status: jax.Array
    broke: jax.Array  # the last cycle hit a breakdown
    rnorm: jax.Array  # true residual norm at the last restart
    tol: jax.Array
    anorm: jax.Array



def _givens(a, b):
    """Rotation `(c, s)` with `[c, s; -conj(s), c] [a; b] = [rho; 0]`, `b >= 0` real."""
    absa = jnp.abs(a)
    rho = jnp.sqrt(absa * absa + b * b)
    c = jnp.where(rho == 0, 1.0, absa / jnp.where(rho == 0, 1.0, rho)).astype(absa.dtype)
    phase = jnp.where(absa == 0, jnp.ones_like(a), a / jnp.where(absa == 0, 1.0, absa))
    s = jnp.where(rho == 0, 0.0, phase * b / jnp.where(rho == 0, 1.0, rho))
    return c, s, phase * rho


def _apply_rotations(h, cs, sn, j):
    """Apply the first `j` stored rotations to the Hessenberg column `h`."""

    def rotate(i, h):
        a, b = h[i], h[i + 1]
        return h.at[i].set(cs[i] * a + sn[i] * b).at[i + 1].set(-jnp.conj(sn[i]) * a + cs[i] * b)

    return lax.fori_loop(0, j, rotate, h)


def _arnoldi_step(cy: _Cycle, *, matvec, precond, ip, m, tol, tiny):
    """Extend the basis by one vector with CGS2: two reductions, each one stacked
    projection; ||w|| rides along with the projections (Pythagoras on the second
    pass, where the correction is already O(eps) so no cancellation occurs)."""
    j = cy.j
    v = tree.basis_get(cy.V, j)
    with jax.named_scope("solvax.gmres.precond"):
        z = precond(v) if precond is not None else v
    with jax.named_scope("solvax.gmres.matvec"):
        w = matvec(z)
    active = jnp.arange(m + 1) <= j
    with jax.named_scope("solvax.gmres.orthogonalize"):
        h1, (ww, zz) = ip.project(cy.V, w, [(w, w), (z, z)])
        h1 = jnp.where(active, h1, 0)
        w = tree.sub(w, tree.basis_combine(cy.V, h1))
        h2, (ww2,) = ip.project(cy.V, w, [(w, w)])
        h2 = jnp.where(active, h2, 0)
        w = tree.sub(w, tree.basis_combine(cy.V, h2))
    h = h1 + h2
    hnext = _reduce.real_sqrt(jnp.real(ww2) - jnp.sum(jnp.abs(h2) ** 2))
    znorm = _reduce.real_sqrt(zz)
    anorm = jnp.maximum(cy.anorm, _reduce.real_sqrt(ww) / jnp.where(znorm == 0, 1.0, znorm))
    scale = tiny * anorm * znorm

    h = _apply_rotations(h, cy.cs, cy.sn, j)
    c, s, rjj = _givens(h[j], hnext)
    gj = cy.g[j]
    g = cy.g.at[j].set(c * gj).at[j + 1].set(-jnp.conj(s) * gj)
    estimate = jnp.abs(g[j + 1])

    finite = jnp.all(jnp.isfinite(h)) & jnp.isfinite(hnext) & jnp.isfinite(zz)
    singular = jnp.abs(rjj) <= scale  # the new column adds nothing: A is singular here
    happy = hnext <= scale  # the Krylov space is invariant
    accept = finite & ~singular
    flag = jnp.where(
        ~finite, code(Status.NONFINITE),
        jnp.where(singular, code(Status.BREAKDOWN),
                  jnp.where(estimate <= tol, code(Status.CONVERGED),
                            jnp.where(happy, code(Status.BREAKDOWN), RUNNING))))
    column = h[:m].at[j].set(rjj)
    v_next = tree.scale(1.0 / jnp.where(happy, 1.0, hnext), w)
    return _Cycle(
        V=tree.where(accept & ~happy, tree.basis_set(cy.V, j + 1, v_next), cy.V),
        Z=None if cy.Z is None else tree.where(accept, tree.basis_set(cy.Z, j, z), cy.Z),
        R=jnp.where(accept, cy.R.at[:, j].set(column), cy.R),
        cs=jnp.where(accept, cy.cs.at[j].set(c), cy.cs),
        sn=jnp.where(accept, cy.sn.at[j].set(s), cy.sn),
        g=jnp.where(accept, g, cy.g),
        j=j + accept.astype(jnp.int32),
        anorm=anorm,
        flag=flag,
    )


def _gmres_solve(matvec, b, *, x0, precond, restart, max_restarts, rtol, atol, ip):
    """The FGMRES iteration (not differentiated itself; see `gmres`)."""
    dtype = tree.result_dtype(b)
    real = jnp.finfo(dtype).dtype
    m = restart
    tiny = 100 * jnp.finfo(real).eps
    rtol = jnp.asarray(rtol, real)
    atol = jnp.asarray(atol, real)
    basis_V = tree.basis_alloc(b, m + 1)
    basis_Z = tree.basis_alloc(b, m) if precond is not None else None
    step = functools.partial(_arnoldi_step, matvec=matvec, precond=precond, ip=ip, m=m, tiny=tiny)

    def cycle(st: _Outer) -> _Outer:
        with jax.named_scope("solvax.gmres.residual"):
            r = tree.sub(b, matvec(st.x))
            rr, bb = jnp.real(ip.multi_dot([(r, r), (b, b)]))
        beta = _reduce.real_sqrt(rr)
        tol = jnp.maximum(atol, rtol * _reduce.real_sqrt(bb))
        zero_b = bb == 0  # b = 0: the answer is exactly 0, whatever x0
        beta = jnp.where(zero_b, 0, beta)
        status = jnp.where(
            ~(jnp.isfinite(rr) & jnp.isfinite(bb)), code(Status.NONFINITE),
            jnp.where(beta <= tol, code(Status.CONVERGED),
                      jnp.where(st.broke, code(Status.BREAKDOWN), RUNNING)))
        go = (status == RUNNING) & (st.restarts < max_restarts)

        v0 = tree.scale(1.0 / jnp.where(beta == 0, 1.0, beta), r)
        cy = _Cycle(V=tree.basis_set(basis_V, 0, v0), Z=basis_Z,
                    R=jnp.eye(m, dtype=dtype), cs=jnp.ones((m,), real),
                    sn=jnp.zeros((m,), dtype), g=jnp.zeros((m + 1,), dtype).at[0].set(beta),
                    j=jnp.int32(0), anorm=st.anorm,
                    flag=jnp.where(go, RUNNING, code(Status.MAX_STEPS)))
        cy = lax.while_loop(lambda c: (c.flag == RUNNING) & (c.j < m),
                            functools.partial(step, tol=tol), cy)

        used = jnp.arange(m) < cy.j
        R = jnp.where(used[None, :], cy.R, jnp.eye(m, dtype=dtype))
        y = solve_triangular(R, jnp.where(used, cy.g[:m], 0), lower=False)
        update = tree.basis_combine(cy.Z, y) if precond is not None else tree.basis_combine(
            cy.V, jnp.append(y, jnp.zeros((1,), y.dtype)))
        x = tree.where(zero_b, tree.zeros_like(b), tree.add(st.x, update))
        # After a cycle the next pass checks the true residual; with no cycle run,
        # this pass was that check and the loop ends (out of restarts if undecided).
        status = jnp.where(go, jnp.where(cy.flag == code(Status.NONFINITE), cy.flag, RUNNING),
                           jnp.where(status == RUNNING, code(Status.MAX_STEPS), status))
        return _Outer(x=x, k=st.k + cy.j, restarts=st.restarts + go.astype(jnp.int32),
                      status=status,
                      broke=cy.flag == code(Status.BREAKDOWN),
                      rnorm=beta, tol=tol, anorm=cy.anorm)

    x = tree.zeros_like(b) if x0 is None else x0
    state = _Outer(x=x, k=jnp.int32(0), restarts=jnp.int32(0), status=code(RUNNING),
                   broke=jnp.bool_(False), rnorm=jnp.asarray(jnp.inf, real),
                   tol=jnp.zeros((), real), anorm=jnp.zeros((), real))
    # Each pass starts with the true residual; a pass with nothing left to do
    # (converged, broken down or out of restarts) ends the loop after that check.
    state = lax.while_loop(lambda st: st.status == RUNNING, cycle, state)
    return make_solution(state.x, state.status, state.k, state.rnorm, state.tol)


def gmres(
    matvec: Callable[[PyTree], PyTree],
    b: PyTree,
    *,
    x0: PyTree | None = None,
    precond: Callable[[PyTree], PyTree] | None = None,
    restart: int = 30,
    max_restarts: int | None = None,
    rtol: float = 1e-8,
    atol: float = 0.0,
    inner_product=None,
    axis_name: str | tuple[str, ...] | None = None,
) -> Solution:
    """Restarted flexible GMRES (FGMRES) with right preconditioning.

    Each cycle starts from the true residual `r = b - A x`, `v_0 = r / ||r||`,
    and builds `A z_j = sum_i h_ij v_i` with `z_j = M_j(v_j)` (the
    preconditioner may change from step to step), orthogonalized by classical
    Gram–Schmidt run twice (CGS2). Givens rotations keep the least-squares
    residual `|g_{j+1}|` current; the cycle ends at the tolerance, a breakdown
    or after `restart` steps, and `x += Z y` with `R y = g`.

    Differs from the textbook / `jax.scipy.sparse.linalg.gmres`:
      1. Two reductions per Arnoldi step: each CGS pass is one stacked
         projection `[V^H w, <w, w>]`; the new norm follows by Pythagoras on
         the second pass, where it is free of cancellation.
      2. `||b||` is computed with each restart's residual norm: no setup reduction.
      3. `converged` is decided on the true residual computed at the start of
         a cycle, never on the least-squares estimate.
      4. A new column with a vanishing diagonal after rotation (singular `A`)
         is dropped and reported as `Status.BREAKDOWN`, as is an invariant
         Krylov space whose residual is above the tolerance; upstream
         implementations return huge `x` there.

    Args:
        matvec: `x -> A x` on pytrees shaped like `b`.
        b: right-hand side, an array or any pytree of arrays (leaves keep
            their sharding; the basis is built leaf by leaf).
        x0: initial guess shaped like `b` (default zeros).
        precond: `v -> M v`, a right preconditioner (default identity); may be
            nonlinear or vary between calls (flexible GMRES).
        restart: Arnoldi steps per cycle (basis size).
        max_restarts: cycle limit (default `ceil(10 * size(b) / restart)`).
        rtol, atol: stop when `||b - A x|| <= max(atol, rtol * ||b||)`.
        inner_product: a `solvax.InnerProduct` (or `(x, y) -> scalar`).
        axis_name: inside `shard_map`, the mesh axis the vectors are split over.

    Returns:
        A `Solution`; `iterations` counts Arnoldi steps (matvecs in cycles).

    Raises:
        TypeError, ValueError: at trace time, for mismatched structures,
            shapes or dtypes, negative tolerances, `restart < 1` or
            `max_restarts < 0`.

    Reference: Y. Saad, "A flexible inner-outer preconditioned GMRES
    algorithm", SIAM J. Sci. Comput. 14 (1993); L. Giraud et al., "Rounding
    error analysis of the classical Gram-Schmidt orthogonalization process",
    Numer. Math. 101 (2005).
    """
    _checks.check_solver_inputs(matvec, b, x0, precond, rtol, atol)
    restart = _checks.check_int("restart", restart, 1)
    restart = min(restart, tree.size(b))
    if max_restarts is None:
        max_restarts = -(-10 * tree.size(b) // restart)
    max_restarts = _checks.check_int("max_restarts", max_restarts, 0)
    ip = _reduce.resolve(inner_product, axis_name)
    options = dict(precond=precond, restart=restart, max_restarts=max_restarts,
                   rtol=rtol, atol=atol, ip=ip)
    return implicit_solve(
        matvec,
        b,
        functools.partial(_gmres_solve, x0=x0, **options),
        functools.partial(_gmres_solve, x0=None, **options),
        symmetric=False,
    )
