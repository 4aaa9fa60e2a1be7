"""Restarted flexible GMRES on pytrees: the restart loop around an Arnoldi
cycle (`arnoldi.py`), and the public `gmres`."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from .._core import checks, contract, driver, reduce, tree
from .._core.contract import Outcome, Problem
from .._core.dense import mm
from .._core.options import documented
from .._core.registry import Row, Variant, register_solver
from .._core.solution import RUNNING, Solution, Status, code, first_status
from . import steps
from .arnoldi import PyTree, least_squares, make_arnoldi, record

ORTHOGONALIZATIONS = ("cgs2", "one_sync")


class _Outer(NamedTuple):
    x: PyTree
    k: jax.Array  # accepted Arnoldi steps in all
    restarts: jax.Array
    status: jax.Array
    broke: jax.Array  # the last cycle hit a breakdown
    stalls: jax.Array  # restarts in a row whose true residual set no new least
    rnorm: jax.Array  # true residual norm at the last restart
    least: jax.Array  # the least true residual norm at a restart so far
    first: jax.Array  # ... and at the first (before a recycled space's projection)
    xnorm: jax.Array  # ||x|| there
    tol: jax.Array
    anorm: jax.Array
    history: jax.Array | None  # residual norm per accepted step (if recorded)
    space: Any = None  # the recycled pair (C, U), A U = C (`gcrot`); None: GMRES


def _cycle(st: _Outer, problem: Problem, arnoldi, max_restarts: int, renew=None) -> _Outer:
    """One restart: the true residual, then (if it is not done) one Arnoldi
    cycle and the update of `x`.

    With a recycled space `st.space = (C, U)` (GCRO-DR, `gcrot`): the
    residual's projections `C^H r` ride in the residual's reduction, `x += U
    C^H r` and `r -= C C^H r` (exact for `A U = C`), the cycle runs with
    `(C, U)` ahead of its basis and `renew(V, Z, H, est, space, go, E, D)`
    gives the space for the next cycle (`recycling.harmonic_space`; without
    a preconditioner the directions are `V + D E`, `D = C - U`)."""
    with jax.named_scope("solvax.gmres.residual"):
        # b tied to x: its norm rides in this reduction (a loop-invariant
        # product of its own would be hoisted out of the loop by XLA, into a
        # synchronization of its own)
        b, x = jax.lax.optimization_barrier((problem.b, st.x))
        Ax = problem.A(x)
        r = tree.sub(b, Ax)
        pairs = [(r, r), (b, b), (Ax, Ax), (x, x)]
        if st.space is None:
            rr, bb, axax, xx = jnp.real(problem.ip.multi_dot(pairs))
        else:
            cr, products = problem.ip.project_many(st.space[0], [r], pairs)
            rr, bb, axax, xx = jnp.real(products)
    beta = reduce.real_sqrt(rr)
    tol = contract.threshold(bb, *problem.tolerances())
    zero_b = bb == 0  # b = 0: the answer is exactly 0, whatever x0
    beta = jnp.where(zero_b, 0, beta)
    stalls, least = _stalls(st, beta)
    stagnated, rounding_limited = _stagnated(st, stalls, beta, bb, axax)
    # Another cycle runs if `tol < beta < inf` (comparisons only: false for NaN),
    # the last one neither broke down nor stagnated, and restarts are left.
    go = ((tol < beta) & (beta < jnp.inf) & ~st.broke & ~stagnated
          & (st.restarts < max_restarts))
    if st.space is None:
        offset, space, x = 0, None, st.x
        V, Z, H, est, anorm, _ = arnoldi(r, beta, tol, st.anorm, go)
        y = least_squares(H, beta, est.j)
        directions = Z if problem.precond is not None else V
        update = tree.basis_combine(directions, _pad(y, directions))
    else:
        (C, U), cr = st.space, cr[0]
        offset = jax.tree_util.tree_leaves(C)[0].shape[0]
        # the part of r in span(C) solved for in span(U) (x unchanged if no cycle runs)
        x = tree.where(go, tree.add(st.x, tree.basis_combine(U, cr)), st.x)
        r = tree.sub(r, tree.basis_combine(C, cr))
        beta_perp = reduce.real_sqrt(jnp.maximum(rr - jnp.sum(jnp.abs(cr) ** 2), 0))
        V, Z, H, est, anorm, E = arnoldi(r, beta_perp, tol, st.anorm, go, st.space)
        y = least_squares(H, est.beta, est.j, row=offset)
        D = None
        if Z is not None:
            update = tree.basis_combine(Z, _pad(y, Z))
        else:  # directions [U, V + D E], D = C - U: V y + D (E y - y_C)
            D = tree.sub(C, U)
            update = tree.add(tree.basis_combine(V, _pad(y, V)),
                              tree.basis_combine(D, mm(E[:, : y.shape[0]], y) - y[:offset]))
        space = renew(V, Z, H, est, st.space, go, E, D)
    x = tree.where(zero_b, tree.zeros_like(b), tree.add(x, update))
    # After a cycle the next pass checks the true residual; with no cycle run,
    # this pass was that check and the loop ends, saying why no cycle ran.
    status = first_status([(go & (est.flag == code(Status.NONFINITE)), Status.NONFINITE),
                           (go, RUNNING),
                           (~(jnp.isfinite(rr) & jnp.isfinite(bb)), Status.NONFINITE),
                           (beta <= tol, Status.CONVERGED),
                           (st.broke & ~rounding_limited, Status.BREAKDOWN),
                           (stagnated | st.broke, Status.STAGNATION)], Status.MAX_STEPS)
    return _Outer(x=x, k=st.k + est.j - offset, restarts=st.restarts + go.astype(jnp.int32),
                  status=status, broke=est.flag == code(Status.BREAKDOWN), stalls=stalls,
                  rnorm=beta, least=least, first=jnp.where(st.restarts == 0, beta, st.first),
                  xnorm=reduce.real_sqrt(xx), tol=tol,
                  anorm=anorm, history=record(st.history, st.k, est, offset), space=space)


def _stalls(st: _Outer, beta):
    """`(stalls, least)` after a restart with true residual `beta`: a restart
    that does not lower the least true residual so far is a stall (not only
    one above the last: at float32's floor the true residual of a
    backward-Euler system alternated between 1.1934e-5 and 1.2104e-5 of its
    start at every restart, and GMRES ran all its restarts, 3276 matvecs,
    to MAX_STEPS)."""
    stalls = jnp.where((st.restarts > 0) & (beta >= st.least), st.stalls + 1, 0)
    return stalls, jnp.minimum(st.least, beta)


def _stagnated(st: _Outer, stalls, beta, bb, axax):
    """`(stagnated, rounding_limited)` at a restart after a cycle.

    Stagnated: more restarts cannot help, because the true residual fell
    below its least value so far in neither of the last two cycles (GMRES
    never increases it in exact arithmetic, so the next
    cycle would repeat these: e.g. GMRES(1) on a skew-symmetric operator; the
    second cycle is where a singular operator shows as a breakdown) or it is
    at the rounding level of its own evaluation, `eps (||A x|| + ||b||)`.
    Rounding-limited: it is within `sqrt(eps)` of that scale, so a cycle that
    found no new direction met rounding, not a singular operator (`BREAKDOWN`
    is kept for residuals well above it, e.g. an inconsistent system).
    """
    eps = jnp.finfo(beta.dtype).eps
    scale = reduce.real_sqrt(axax) + reduce.real_sqrt(bb)
    ran = st.restarts > 0
    return ran & ((stalls >= 2) | (beta <= eps * scale)), beta <= jnp.sqrt(eps) * scale


def cycle_sizes(size: int, restart: int, max_restarts: int | None) -> tuple[int, int]:
    """`(restart, max_restarts)` for `size` unknowns: at most `size` steps per
    cycle; by default `ceil(10 * size / restart)` cycles."""
    restart = min(restart, size)
    if max_restarts is None:
        max_restarts = -(-10 * size // restart)
    return restart, max_restarts


def restarted(problem: Problem, arnoldi, *, m: int, max_restarts: int, record_history: bool,
              space=None, renew=None) -> tuple[Outcome, jax.Array]:
    """The restart loop of `gmres` and `gcrot` (with a recycled `space` and
    its `renew`, see `_cycle`): its `Outcome`, whose `recycle` is the final
    space, and the true residual norm it started from."""
    real = problem.real_dtype()
    x = tree.zeros_like(problem.b) if problem.x0 is None else problem.x0
    state = _Outer(x=x, k=jnp.int32(0), restarts=jnp.int32(0), status=code(RUNNING),
                   broke=jnp.bool_(False), stalls=jnp.int32(0),
                   rnorm=jnp.asarray(jnp.inf, real), least=jnp.asarray(jnp.inf, real),
                   first=jnp.asarray(jnp.inf, real), xnorm=jnp.zeros((), real),
                   tol=jnp.zeros((), real), anorm=jnp.zeros((), real),
                   history=problem.history(max_restarts * m + m + 1, record_history),
                   space=space)
    # Each pass starts with the true residual; a pass with nothing left to do
    # (converged, broken down or out of restarts) ends the loop after that check,
    # so the driver needs no residual of its own.
    state = steps.while_loop(problem.ip, problem.b, lambda st: st.status == RUNNING,
                               functools.partial(_cycle, problem=problem, arnoldi=arnoldi,
                                                 max_restarts=max_restarts, renew=renew),
                               state, per_step=False)
    return Outcome(x=state.x, status=state.status, iterations=state.k, history=state.history,
                   residual=(state.rnorm, state.tol, state.xnorm),
                   recycle=state.space), state.first


def _run(problem: Problem, *, restart: int, max_restarts: int | None, orthogonalization: str,
         record_history: bool) -> Outcome:
    """The FGMRES iteration (not differentiated itself; see `gmres`)."""
    m, max_restarts = cycle_sizes(problem.size(), restart, max_restarts)
    arnoldi = make_arnoldi(problem.A, problem.b, precond=problem.precond, ip=problem.ip, m=m,
                       orthogonalization=orthogonalization)
    return restarted(problem, arnoldi, m=m, max_restarts=max_restarts,
                     record_history=record_history)[0]


GMRES = driver.register(contract.Method("gmres", _run))


def arnoldi_basis(matvec, b, *, restart: int, orthogonalization: str = "cgs2", precond=None,
                  inner_product=None):
    """The orthonormal basis of one full Arnoldi cycle from `b` (diagnostics).

    Returns `(V, j)`: the basis pytree (leading axis: basis index) and the number
    of accepted steps; rows `0..j` of `V` are the basis vectors. Used to measure
    the loss of orthogonality `||I - V^H V||` of each orthogonalization.
    """
    ip = reduce.resolve(inner_product)
    real = jnp.finfo(tree.result_dtype(b)).dtype
    V, _, _, est, _, _ = make_arnoldi(matvec, b, precond=precond, ip=ip, m=restart,
                               orthogonalization=orthogonalization)(
        b, ip.norm(b), jnp.zeros((), real), jnp.zeros((), real), True)
    return V, est.j


def _pad(y, basis):
    """Coefficients `y` padded with zeros to the basis length."""
    rows = jax.tree_util.tree_leaves(basis)[0].shape[0]
    return jnp.pad(y, (0, rows - y.shape[0]))


@documented
def gmres(
    matvec: Callable[[PyTree], PyTree],
    b: PyTree,
    *,
    x0: PyTree | None = None,
    precond: Callable[[PyTree], PyTree] | None = None,
    restart: int = 30,
    max_restarts: int | None = None,
    rtol: float | None = None,
    atol: float = 0.0,
    orthogonalization: str = "one_sync",
    record_history: bool = False,
    inner_product=None,
    axis_name: str | tuple[str, ...] | None = None,
    failed_derivative: str = "nan",
) -> Solution:
    """Restarted flexible GMRES (FGMRES) with right preconditioning.

    Each cycle starts from the true residual `r = b - A x`, `v_0 = r / ||r||`,
    and builds `A z_j = sum_i h_ij v_i` with `z_j = M_j(v_j)` (the
    preconditioner may change from step to step), orthogonalized by classical
    Gram–Schmidt run twice (CGS2) — by default with the second pass delayed
    one step so that each step needs a single reduction (`"one_sync"`).
    The least-squares residual `min ||beta e_1 - H y||` is kept current
    through the left null vector of `H` (one short dot product per step, no
    Givens rotations); the cycle ends at the tolerance, a breakdown or after
    `restart` steps, and `x += Z y` with `y` from one Householder QR of `H`.

    Differs from the textbook / `jax.scipy.sparse.linalg.gmres`:
      1. One reduction per Arnoldi step (`"one_sync"`), or two with
         `orthogonalization="cgs2"`: each CGS pass is one stacked projection
         `[V^H w, <w, w>]`, and the new norm follows by Pythagoras on the
         second pass, where it is free of cancellation.
      2. `||b||` is computed with each restart's residual norm: no setup reduction.
      3. `converged` is decided on the true residual computed at the start of
         a cycle, never on the least-squares estimate.
      4. A new column that adds nothing to the range of `H` (singular `A`)
         is dropped and reported as `Status.BREAKDOWN`, as is an invariant
         Krylov space whose residual is above the tolerance; upstream
         implementations return huge `x` there.

    `orthogonalization="one_sync"` (the default) needs one reduction per
    Arnoldi step: the second CGS pass of each vector is delayed to the next
    step and shares its reduction (see `_one_sync_step`; Bielich et al. 2022,
    Świrydowicz et al. 2020). Each Hessenberg column becomes final one step
    later, so a cycle costs one more matvec than its accepted steps, while the
    accepted steps and the orthogonality (`||I - V^H V||` near machine
    precision on our test problems, like CGS2) stay the same; `docs/krylov.md`
    has the numbers.

    Args:
        matvec: `x -> A x` on pytrees shaped like `b`.
        b: right-hand side, an array or any pytree of arrays (leaves keep
            their sharding; the basis is built leaf by leaf).
        x0, rtol, atol, inner_product, axis_name, failed_derivative: the common options.
        precond: `v -> M v`, a right preconditioner (default identity); may be
            nonlinear or vary between calls (flexible GMRES).
        restart: Arnoldi steps per cycle (basis size).
        max_restarts: cycle limit (default `ceil(10 * size(b) / restart)`).
        orthogonalization: `"one_sync"` (one reduction per step) or `"cgs2"` (two).
        record_history: store the residual norm after every accepted step in
            `Solution.history` (the true norm at each restart, the
            least-squares estimate within a cycle; NaN-padded to
            `max_restarts * restart + restart + 1`).

    Returns:
        A `Solution`; `iterations` counts accepted Arnoldi steps (columns of
        the Hessenberg matrix used for the solution).

    Raises:
        TypeError, ValueError: at trace time, for mismatched structures,
            shapes or dtypes, negative tolerances, `restart < 1`,
            `max_restarts < 0` or an unknown `orthogonalization`.

    Reference: Y. Saad, "A flexible inner-outer preconditioned GMRES
    algorithm", SIAM J. Sci. Comput. 14 (1993); L. Giraud et al., "Rounding
    error analysis of the classical Gram-Schmidt orthogonalization process",
    Numer. Math. 101 (2005); D. Bielich et al., "Low-synch Gram–Schmidt with
    delayed reorthogonalization for Krylov solvers", Parallel Comput. 112
    (2022); K. Świrydowicz et al., "Low synchronization Gram–Schmidt and
    generalized minimal residual algorithms", Numer. Linear Algebra Appl. 28
    (2020).
    """
    checks.check_int("restart", restart, 1)
    if max_restarts is not None:
        # accepted steps (up to max_restarts * restart) are counted in int32
        checks.check_int("max_restarts", max_restarts, 0, checks.INT32_MAX // restart)
    checks.check_choice("orthogonalization", orthogonalization, ORTHOGONALIZATIONS)
    return driver.solve(GMRES, matvec, b, x0=x0, precond=precond, rtol=rtol, atol=atol,
                         inner_product=inner_product, axis_name=axis_name,
                         failed_derivative=failed_derivative, restart=int(restart),
                         max_restarts=max_restarts, orthogonalization=orthogonalization,
                         record_history=record_history)


# Counts: the scale, the restart's fused [||r||^2, ||b||^2] plus, per Arnoldi
# step, one stacked projection (one_sync, the default) or two (CGS2).
register_solver(gmres, nonsymmetric=True, newton=True, limit="max_restarts", cycle="restart",
                variants=(
    Variant("gmres", {"restart": 20}, "gmres", (3, 6, 2)),
    Variant("gmres_cgs2", {"restart": 20, "orthogonalization": "cgs2"}, "gmres", (4, 8, 3)),
    Variant("gmres_restart5", {"restart": 5}, "gmres", (3, 6, 2)),
    Variant("gmres_cgs2_restart5", {"restart": 5, "orthogonalization": "cgs2"}, "gmres",
            (4, 8, 3)),
), rows=(
    Row("FGMRES(16), CGS2 orthogonalization", {"restart": 16, "orthogonalization": "cgs2"}),
    Row("shard_map: FGMRES(16) (axis_name)", {"restart": 16}, "shard_map"),
    Row("pytree FGMRES(16), P('i') + P(None,'i') leaves", {"restart": 16}, "pytree"),
))
