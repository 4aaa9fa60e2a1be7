"""Preconditioned MINRES for Hermitian operators: one synchronization per step."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from .._core import contract, driver, reduce, tree
from .._core.contract import Outcome, Problem
from .._core.options import documented
from .._core.registry import Row, Variant, register_solver
from .._core.solution import RUNNING, Solution, Status, code, first_status
from . import steps
from .steps import negligible, nonzero

PyTree = Any


class _State(NamedTuple):
    x: PyTree  # x_{k-1}: the update lags the Lanczos process by one step
    r1: PyTree  # r_{k-1}: Lanczos vectors, unpreconditioned, of M-norm beta
    r2: PyTree  # r_k
    z1: PyTree  # M r_{k-1}
    z2: PyTree  # M r_k
    w1: PyTree  # the last two directions of x's update
    w2: PyTree
    alpha: jax.Array  # alpha_{k-1}
    oldb: jax.Array  # beta_{k-1}
    cs: jax.Array  # the last Givens rotation
    sn: jax.Array
    dbar: jax.Array
    epsln: jax.Array
    phibar: jax.Array  # ||b - A x||_M of the current x (from the QR)
    tnorm2: jax.Array  # ||T_k||_F^2, of the tridiagonal matrix so far (estimates ||A||^2)
    k: jax.Array  # Lanczos steps (matvecs)
    status: jax.Array  # RUNNING, or why the Lanczos process stopped
    history: jax.Array | None


class _Context(NamedTuple):
    A: Callable
    M: Callable
    ip: reduce.Reduction
    max_steps: int
    rtol: jax.Array  # the least-squares test's tolerance


def _step(st: _State, ctx: _Context) -> _State:
    """Lanczos step k (Paige & Saunders 1975, the Givens update as
    `scipy.sparse.linalg.minres` writes it) with its two products in **one**
    reduction and no cancellation.

    The Lanczos vectors are carried unnormalized: `r_k` with `z_k = M r_k`
    and `beta_k^2 = <r_k, z_k>`. So `a = A z_k` is available before either
    coefficient, and `[<r_k, z_k>, <z_k, a>]` (one reduction) gives both
    `beta_k` and `alpha_k = <z_k, a> / beta_k^2` directly, each from its own
    product (an expansion of `<r_{k+1}, M r_{k+1}>` into products at the top
    of the step cancelled catastrophically: measured on 2-D Poisson, it went
    negative after 25 steps). Then

        r_{k+1} = (a - alpha_k r_k) / beta_k - (beta_k / beta_{k-1}) r_{k-1}

    (and `z_{k+1}` from `u = M a` the same way: one preconditioner
    application). The price: `beta_k` arrives one step after `alpha_{k-1}`,
    so the rotation of column `k-1`, and `x`, lag one step behind.
    """
    with jax.named_scope("solvax.minres.matvec"):
        a = ctx.A(st.z2)
    with jax.named_scope("solvax.minres.precond"):
        u = ctx.M(a)
    with jax.named_scope("solvax.minres.reduce"):
        rz, za = ctx.ip.multi_dot([(st.r2, st.z2), (st.z2, a)])
    rz, za = jnp.real(rz), jnp.real(za)
    first = st.k == 0
    beta = reduce.real_sqrt(rz)
    # r_k is rounding noise next to the last step's coefficients: the Krylov
    # space is invariant (the last rotation below finishes the solve)
    invariant = ~first & negligible(beta, jnp.abs(st.alpha) + st.oldb)
    beta = jnp.where(invariant, jnp.zeros_like(beta), beta)
    inv = 1 / nonzero(beta)
    alpha = za * inv * inv
    # the QR factorization of the tridiagonal matrix: column k-1 (alpha_{k-1}, beta_k)
    delta = st.cs * st.dbar + st.sn * st.alpha
    gbar = st.sn * st.dbar - st.cs * st.alpha
    epsln = st.sn * beta
    dbar = -st.cs * beta
    gamma = jnp.hypot(gbar, beta)
    tnorm2 = st.tnorm2 + st.alpha * st.alpha + st.oldb * st.oldb + beta * beta
    # ||A r|| / (||A|| ||r||) of the current x (Paige & Saunders' test 2):
    # small, with the residual not, means a least-squares solution of a
    # singular A and an inconsistent b; its column is not applied (the
    # tridiagonal matrix is singular there: the update would blow up)
    least_squares = ~first & (jnp.hypot(gbar, dbar) <= ctx.rtol * jnp.sqrt(tnorm2))
    gamma = nonzero(gamma)
    cs, sn = gbar / gamma, beta / gamma
    phi, phibar = cs * st.phibar, sn * st.phibar
    v = tree.scale(1 / nonzero(st.oldb), st.z1)  # v_{k-1}
    w = tree.scale(1 / gamma, tree.sub(tree.sub(v, tree.scale(st.epsln, st.w1)),
                                       tree.scale(delta, st.w2)))
    finite = jnp.isfinite(rz) & jnp.isfinite(za)
    status = first_status([(~finite, Status.NONFINITE), (rz < 0, Status.INDEFINITE),
                           (least_squares | invariant, Status.BREAKDOWN)], RUNNING)
    update = ~first & finite & ~least_squares & (rz >= 0)
    phi = jnp.where(update, phi, jnp.zeros_like(phi))
    turn = lambda new, old: jnp.where(first, old, new)  # noqa: E731  (no column yet at k = 0)
    c1 = beta / nonzero(st.oldb)
    r_next = tree.sub(tree.scale(inv, tree.axpy(-alpha, st.r2, a)), tree.scale(c1, st.r1))
    z_next = tree.sub(tree.scale(inv, tree.axpy(-alpha, st.z2, u)), tree.scale(c1, st.z1))
    phibar = jnp.where(first, beta, jnp.where(update, phibar, st.phibar))
    return _State(
        x=tree.axpy(phi, w, st.x), r1=st.r2, r2=r_next, z1=st.z2, z2=z_next,
        w1=tree.where(first, st.w1, st.w2), w2=tree.where(first, st.w2, w),
        alpha=alpha, oldb=beta, cs=turn(cs, st.cs), sn=turn(sn, st.sn),
        dbar=turn(dbar, st.dbar), epsln=turn(epsln, st.epsln), phibar=phibar,
        tnorm2=turn(tnorm2, st.tnorm2), k=st.k + 1, status=status,
        history=None if st.history is None else st.history.at[st.k].set(phibar))


class _Round(NamedTuple):
    """The outer loop: Lanczos steps until the QR's residual estimate meets
    `target`, then the true residual decides (see `_run`)."""

    st: _State
    target: jax.Array  # the estimate's tolerance, tightened while the true residual misses
    true: tuple  # (||b - A x||, max(atol, rtol ||b||), ||x||) of the last check
    status: jax.Array  # RUNNING, or what the solve ended on
    go: jax.Array


def _lanczos(st: _State, ctx: _Context, target) -> _State:
    """Steps until the estimate meets `target`, the step limit, or a breakdown."""

    def going(st):
        return (st.status == RUNNING) & (st.phibar > target) & (st.k <= ctx.max_steps)

    return steps.stepped(going, functools.partial(_step, ctx=ctx), st)


def _round(rd: _Round, ctx: _Context, problem: Problem, tol) -> _Round:
    """Lanczos steps, then the true residual (one matvec and one reduction,
    `||b||` and `||x||` with it, which `finish` then reuses). A miss with the
    estimate met tightens the target by the ratio of the two and goes on from
    the same Lanczos state; a round that does not lower the true residual
    is rounding-limited (reported as stagnation)."""
    st = _lanczos(rd.st, ctx, rd.target)
    with jax.named_scope("solvax.minres.true_residual"):
        r = tree.sub(problem.b, problem.A(st.x))
        rr, xx = jnp.real(problem.ip.multi_dot([(r, r), (st.x, st.x)]))
    norm = reduce.real_sqrt(rr)
    ok = norm <= tol
    met = (st.status == RUNNING) & (st.phibar <= rd.target)  # the estimate met its target
    stalled = met & ~ok & ~(norm < rd.true[0])
    more = met & ~ok & ~stalled & (st.k < ctx.max_steps)
    status = first_status([(ok, Status.CONVERGED), (stalled, Status.CONVERGED),
                           (more, RUNNING), (st.status != RUNNING, st.status)], RUNNING)
    ratio = tol / nonzero(norm)
    target = jnp.minimum(rd.target, st.phibar) * jnp.minimum(ratio, 0.5)
    return _Round(st=st, target=jnp.where(more, target, rd.target),
                  true=(norm, tol, reduce.real_sqrt(xx)), status=status, go=more)


def _run(problem: Problem, *, max_steps: int | None, record_history: bool) -> Outcome:
    """The MINRES iteration (not differentiated itself; see `minres`)."""
    max_steps = problem.step_limit(max_steps)
    rtol, atol = problem.tolerances()
    b, ip = problem.b, problem.ip
    M = problem.precond or (lambda v: v)
    with jax.named_scope("solvax.minres.setup"):
        x, r = problem.residual()
        bb = jnp.real(ip.dot(b, b))
        x, r = problem.settled(x, r, bb)
        z = M(r)
    real = problem.real_dtype()
    tol = contract.threshold(bb, rtol, atol)
    zero = jnp.zeros((), real)
    st = _State(x=x, r1=tree.zeros_like(b), r2=r, z1=tree.zeros_like(b), z2=z,
                w1=tree.zeros_like(b), w2=tree.zeros_like(b), alpha=zero, oldb=zero,
                cs=-jnp.ones((), real), sn=zero, dbar=zero, epsln=zero,
                phibar=jnp.full((), jnp.inf, real), tnorm2=zero, k=jnp.int32(0),
                status=jnp.int32(RUNNING), history=problem.history(max_steps + 1,
                                                                   record_history))
    # The least-squares test at most sqrt(eps): for a consistent system
    # ||A r|| / (||A|| ||r||) stays above 1 / cond(A), which a loose `rtol`
    # (0.5, as Newton's first steps ask) exceeds on an SPD Laplacian after 2
    # steps: it was reported as a singular system's breakdown
    ls_tol = jnp.minimum(rtol, jnp.sqrt(jnp.finfo(real).eps).astype(real))
    ctx = _Context(A=problem.A, M=M, ip=ip, max_steps=max_steps, rtol=ls_tol)
    inf = jnp.full((), jnp.inf, real)
    rd = _Round(st=st, target=tol, true=(inf, tol, zero), status=code(RUNNING),
                go=jnp.bool_(True))
    rd = steps.while_loop(ip, b, lambda rd: rd.go,
                            functools.partial(_round, ctx=ctx, problem=problem, tol=tol), rd,
                            per_step=False)
    st = rd.st
    return Outcome(x=st.x, status=rd.status, iterations=jnp.maximum(st.k - 1, 0),
                   history=st.history,
                   residual=rd.true)


MINRES = driver.register(contract.Method("minres", _run))


@documented
def minres(
    matvec: Callable[[PyTree], PyTree],
    b: PyTree,
    *,
    x0: PyTree | None = None,
    precond: Callable[[PyTree], PyTree] | None = None,
    rtol: float | None = None,
    atol: float = 0.0,
    max_steps: int | None = None,
    record_history: bool = False,
    inner_product=None,
    axis_name: str | tuple[str, ...] | None = None,
    failed_derivative: str = "nan",
) -> Solution:
    """MINRES for a Hermitian (possibly indefinite) `A` with a Hermitian
    positive-definite preconditioner `M`.

    The Lanczos process of `M A` (self-adjoint in the `M^{-1}` inner product)
    with a QR factorization of its tridiagonal matrix updated by one Givens
    rotation per step (Paige & Saunders 1975): `x_k` minimizes
    `||b - A x||_M` over the Krylov space, short recurrences, 7 vectors of
    memory. Symmetric indefinite systems (saddle points, Helmholtz-like
    shifted operators) are what it is for; for a positive-definite `A`,
    `pcg` needs the same matvecs and less memory.

    Communication: **one synchronization per step**. The Lanczos vectors are
    carried unnormalized (`r_k`, `z_k = M r_k`), so `a = A z_k` is known before
    either coefficient and one reduction of 2 scalars, `[<r_k, z_k>, <z_k, a>]`,
    gives `beta_k` and `alpha_k` each from its own product (see
    `_step`); the Givens update of `x` lags one step behind. One
    matvec and one preconditioner application per step.

    Stopping: the QR gives `||b - A x||_M` for free; when it meets the
    tolerance the true 2-norm residual is computed (one more matvec and
    reduction). If that misses (the preconditioned norm differs, or rounding
    separated the two), the estimate's target is tightened by their ratio
    and the same Lanczos process goes on; a round that no longer lowers the
    true residual stops as `Status.STAGNATION`.

    Statuses: `Status.INDEFINITE` when `<r, M r> < 0` (the preconditioner is
    not positive definite); `Status.BREAKDOWN` when the Krylov space became
    invariant before the tolerance was met: for a singular `A` and an
    inconsistent `b`, `x` then minimizes `||b - A x||_M` over the Krylov
    space, a least-squares solution (not necessarily the minimum-norm one;
    detected as `||A r|| <= min(rtol, sqrt(eps)) ||A|| ||r||`, Paige &
    Saunders' test, with `eps` the rounding unit). A
    consistent singular system converges.

    Args:
        matvec: `x -> A x`, Hermitian, on pytrees shaped like `b`.
        b: right-hand side (array or pytree; each leaf keeps its sharding).
        x0, rtol, atol, inner_product, axis_name, failed_derivative: the common options.
        precond: `v -> M v` with `M` Hermitian positive definite (default identity).
        max_steps: step limit (default `10 * size(b)`); one matvec per step.
        record_history: the QR's residual estimate `||b - A x||_M` at the
            start of every step in `Solution.history` (length `max_steps + 1`).
        inner_product: a `solvax.InnerProduct` (or `(x, y) -> scalar`); `A`
            and `M` must be self-adjoint in it.

    Returns:
        A `Solution`; `iterations` counts Lanczos steps (matvecs).

    Raises:
        TypeError, ValueError: at trace time, for mismatched structures,
            shapes or dtypes, negative tolerances or a negative `max_steps`.

    Differentiable by implicit differentiation: one more MINRES solve with the
    transposed operator (`jax.linear_transpose`; for Hermitian `A` that is
    `conj(A)`, Hermitian too).

    Reference: C. C. Paige and M. A. Saunders, "Solution of sparse indefinite
    systems of linear equations", SIAM J. Numer. Anal. 12 (1975).
    """
    return driver.solve(MINRES, matvec, b, x0=x0, precond=precond, rtol=rtol, atol=atol,
                         inner_product=inner_product, axis_name=axis_name,
                         failed_derivative=failed_derivative, max_steps=max_steps,
                         record_history=record_history)


# Counts: the scale, the setup's ||b||^2, one per Lanczos step (the inner loop),
# and the true residual of each round (the outer loop, like GMRES's restarts).
register_solver(minres, nonsymmetric=False, newton=True,
                variants=(Variant("minres", {}, "minres", (4, 8, 2)),), rows=(
    Row("MINRES"),
    Row("shard_map: MINRES (axis_name)", {}, "shard_map"),
    Row("pytree MINRES, P('i') + P(None,'i') leaves", {}, "pytree"),
))
