"""Conjugate gradients' shared mechanics: the step scalars and their stopping
rules, and the standard and single-reduction steps (one per method)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from .._core import contract, reduce, tree
from .._core.contract import Outcome, Problem
from .._core.solution import RUNNING, Status, first_status
from .steps import DIVERGENCE, masked_div

PyTree = Any


class Scalars(NamedTuple):
    """The scalars every CG variant carries from step to step."""

    gamma: jax.Array  # <r, M r> of the previous step
    alpha: jax.Array  # previous step length (inf before the first step)
    tol2: jax.Array  # squared stopping threshold max(atol, rtol ||b||)^2
    k: jax.Array  # steps run (the last one did not update x unless `go`)
    go: jax.Array  # the last step went on; else it stopped the loop, and
    rr: jax.Array  # its <r, r> and
    curvature: jax.Array  # its <p, A p> (with gamma, tol2) say why (`stop_reason`)
    history: jax.Array | None  # recursive residual norm per step (if recorded)
    cap2: jax.Array  # DIVERGENCE^2 times the first step's <r, r> (inf before it)


class Standard(NamedTuple):
    x: PyTree
    r: PyTree  # recursively updated residual b - A x
    p: PyTree  # search direction
    sc: Scalars


class Single(NamedTuple):
    x: PyTree
    r: PyTree
    p: PyTree
    s: PyTree  # A p
    sc: Scalars


class Context(NamedTuple):
    """What a step reads besides its state (all from the `Problem`)."""

    A: Callable
    M: Callable
    identity: bool  # no preconditioner: M r = r, one product fewer
    ip: reduce.Reduction
    rtol: jax.Array
    atol: jax.Array
    tol_from_rr: bool  # ||b||^2 is the first step's <r, r> (x0 = None, see `start`)
    max_steps: int  # a step with k = max_steps only checks the residual
    space: Any = None  # deflated CG: the recycled (C, U), U^H C = I
    ell: int = 0  # deflated CG: the directions kept for the next space


def may_go(rr, gamma, tol2, cap2):
    """`tol2 < rr < cap2` and `0 < gamma < inf`: comparisons only (false for
    NaN). `cap2` (the divergence stop: `DIVERGENCE^2` times the first step's
    `<r, r>`, or inf) is finite or inf, so `rr < cap2` also tests that `rr`
    is finite. Without a preconditioner `gamma` is `rr` (the same value), and
    `tol2 >= 0` (a square) makes the first test imply the second: two
    comparisons, each one instruction a TPU's scalar unit runs per step."""
    below = (tol2 < rr) & (rr < cap2)
    return below if gamma is rr else below & (0 < gamma) & (gamma < jnp.inf)


def top_of_step(sc: Scalars, ctx: Context, rr, gamma):
    """The stopping threshold and history, updated from the reduced values at
    the top of a step, and whether the step may go on (`may_go`)."""
    tol2 = sc.tol2
    first = sc.k == 0
    if ctx.tol_from_rr:
        tol2 = jnp.where(first, contract.squared_threshold(rr, ctx.rtol, ctx.atol), tol2)
    cap2 = jnp.where(first, DIVERGENCE**2 * rr, sc.cap2)
    history = sc.history
    if history is not None:
        history = history.at[sc.k].set(reduce.real_sqrt(rr))
    return sc._replace(tol2=tol2, cap2=cap2, history=history), may_go(
        rr, gamma, tol2, cap2) & (sc.k < ctx.max_steps)


def goes(go, curvature):
    """The step updates `x`: its top passed (`may_go`) and `0 < <p, A p> < inf`."""
    return go & (0 < curvature) & (curvature < jnp.inf)


def stop_reason(sc: Scalars):
    """Why a step that did not go on stopped, in order: non-finite values,
    convergence, divergence (the residual grew to `DIVERGENCE` times its
    start), a curvature breakdown at the rounding floor (`<r, r>` down by
    `eps` from its start: `FLOOR`, not the operator), a non-positive-definite
    preconditioner or operator.

    Evaluated once after the loop from the last step's carried values, not in
    every step: the loop itself decides with comparisons only (`may_go`,
    `goes`), and when only `x` is used the compiler drops this altogether.
    """
    eps = jnp.finfo(sc.rr.dtype).eps
    breakdown = (sc.gamma <= 0) | jnp.isfinite(sc.curvature)
    return first_status([(~(jnp.isfinite(sc.rr) & jnp.isfinite(sc.gamma)), Status.NONFINITE),
                         (sc.rr <= sc.tol2, Status.CONVERGED),
                         (sc.rr >= sc.cap2, Status.DIVERGED),
                         (breakdown & (DIVERGENCE**2 * sc.rr <= eps * sc.cap2), Status.FLOOR),
                         (breakdown, Status.INDEFINITE)],
                        Status.NONFINITE)


def products(ctx: Context, r, u, w):
    """`(gamma, delta, rr) = (<r, u>, <u, w>, <r, r>)` in one reduction (with
    `u = r` when there is no preconditioner: one product fewer)."""
    if ctx.identity:
        rr, delta = jnp.real(ctx.ip.multi_dot([(r, r), (u, w)]))
        return rr, delta, rr
    return tuple(jnp.real(ctx.ip.multi_dot([(r, u), (u, w), (r, r)])))


def recurrence(sc: Scalars, gamma, delta, go):
    """Chronopoulos–Gear coefficients from `gamma = <r, M r>`, `delta = <M r, A M r>`:
    `beta = gamma / gamma_prev`, `<p, A p> = delta - beta gamma / alpha_prev`."""
    beta = gamma / sc.gamma  # see `standard_step`
    # the first step (and a restart) has alpha_prev = inf: <p, A p> = delta
    curvature = delta - beta * gamma / sc.alpha
    go = goes(go, curvature)
    return beta, masked_div(go, gamma, curvature), curvature, go


def advance(sc: Scalars, go, alpha, rr, gamma, curvature) -> Scalars:
    """The scalars after a step. `k` counts steps run, whether or not they went
    on (the loop ends with the first that did not), so it does not depend on
    the step's outcome."""
    return sc._replace(go=go, alpha=alpha, rr=rr, gamma=gamma, curvature=curvature, k=sc.k + 1)


def next_direction(p, ctx: Context, go, gamma):
    """The second half of a Hestenes–Stiefel step from its direction `p`:
    `(q, <p, q>, go, alpha)` with `q = A p` (one reduction), whether the
    step goes on (`goes`) and its length `<r, z> / <p, A p>`."""
    with jax.named_scope("solvax.pcg.matvec"):
        q = ctx.A(p)
    with jax.named_scope("solvax.pcg.reduce"):
        pq = jnp.real(ctx.ip.dot(p, q))
    go = goes(go, pq)
    return q, pq, go, masked_div(go, gamma, pq)


def standard_step(st: Standard, ctx: Context) -> Standard:
    """Hestenes–Stiefel: two reductions, `<r, z>` with `<r, r>`, then `<p, A p>`."""
    with jax.named_scope("solvax.pcg.precond"):
        z = ctx.M(st.r)
    with jax.named_scope("solvax.pcg.reduce"):
        if ctx.identity:
            rr = gamma = jnp.real(ctx.ip.dot(st.r, st.r))
        else:
            gamma, rr = jnp.real(ctx.ip.multi_dot([(st.r, z), (st.r, st.r)]))
    sc, go = top_of_step(st.sc, ctx, rr, gamma)
    # No guard needed: a step runs only after one that went on (gamma, alpha > 0)
    # or from the initial 1s, and the first step's beta multiplies p = 0.
    beta = gamma / sc.gamma
    p = tree.axpy(beta, st.p, z)
    q, pq, go, alpha = next_direction(p, ctx, go, gamma)
    return Standard(x=tree.axpy(alpha, p, st.x), r=tree.axpy(-alpha, q, st.r), p=p,
                     sc=advance(sc, go, alpha, rr, gamma, pq))


def opened(st: Standard, ctx: Context) -> Standard:
    """The state `closing_step` starts from: `<r, r>` before the loop, the
    threshold and the history's first entry from it, and whether a first
    step runs (`sc.go`)."""
    with jax.named_scope("solvax.pcg.reduce"):
        rr = jnp.real(ctx.ip.dot(st.r, st.r))
    sc, go = top_of_step(st.sc, ctx, rr, rr)
    return st._replace(sc=sc._replace(rr=rr, go=go))


def closing_step(st: Standard, ctx: Context) -> Standard:
    """`standard_step` as one device runs it (`reduce.reduces_before_loop`):
    `<r, r>` closes the step, fused with the update that makes `r`, and
    decides whether another step runs, before its `M r` is applied: a
    converged solve applies the preconditioner once per step taken, one
    fewer than `standard_step` (whose last top applies it to test `<r, M r>`
    with `<r, r>`: one more V-cycle of an MG-CG solve). With `M`, `<r, M r>`
    is a reduction of its own. The same iterates, history and outcome
    (`closed`), but in one corner: an `M` found indefinite exactly at the
    step limit (`MAX_STEPS` here, `INDEFINITE` there)."""
    sc = st.sc
    with jax.named_scope("solvax.pcg.precond"):
        z = ctx.M(st.r)
    if ctx.identity:
        gamma, positive = sc.rr, True   # tol2 < rr < inf, tested at the close before
    else:
        with jax.named_scope("solvax.pcg.reduce"):
            gamma = jnp.real(ctx.ip.dot(st.r, z))
        positive = (0 < gamma) & (gamma < jnp.inf)
    p = tree.axpy(gamma / sc.gamma, st.p, z)  # sc.gamma: the previous step's (1 at first)
    q, pq, went, alpha = next_direction(p, ctx, positive, gamma)
    x, r = tree.axpy(alpha, p, st.x), tree.axpy(-alpha, q, st.r)
    with jax.named_scope("solvax.pcg.reduce"):
        rr = jnp.real(ctx.ip.dot(r, r))
    # the next step's top (its threshold set before the loop)
    top, go = top_of_step(sc._replace(k=sc.k + 1), ctx._replace(tol_from_rr=False), rr, rr)
    history = top.history
    if history is not None:
        history = jnp.where(went, history, sc.history)
    return Standard(x=x, r=r, p=p, sc=top._replace(go=went & go, alpha=alpha, rr=rr,
                                                   gamma=gamma, curvature=pq, history=history))


def closed(sc: Scalars, identity: bool) -> Scalars:
    """`closing_step`'s last scalars as `standard_step` leaves them for
    `finished`: there `k` also counts the top of the step that stopped the
    loop; here a loop that stopped at a step's close (converged, the step
    limit, non-finite `<r, r>`) ran no such step."""
    went = goes(True if identity else (0 < sc.gamma) & (sc.gamma < jnp.inf), sc.curvature)
    return sc._replace(k=sc.k + went.astype(sc.k.dtype))


def single_step(st: Single, ctx: Context) -> Single:
    """Chronopoulos & Gear (1989): with u = M r and w = A u, the three products
    <r, u>, <u, w>, <r, r> are independent and share one reduction."""
    with jax.named_scope("solvax.pcg.precond"):
        u = ctx.M(st.r)
    with jax.named_scope("solvax.pcg.matvec"):
        w = ctx.A(u)
    with jax.named_scope("solvax.pcg.reduce"):
        gamma, delta, rr = products(ctx, st.r, u, w)
    sc, go = top_of_step(st.sc, ctx, rr, gamma)
    beta, alpha, curvature, go = recurrence(sc, gamma, delta, go)
    p = tree.axpy(beta, st.p, u)
    s = tree.axpy(beta, st.s, w)
    # p reads the old r; r is updated after p (in place, no copy of r).
    return Single(x=tree.axpy(alpha, p, st.x), r=tree.after(tree.axpy(-alpha, s, st.r), p),
                   p=p, s=s, sc=advance(sc, go, alpha, rr, gamma, curvature))


def start(problem: Problem, ctx: Context, real, max_steps: int, record_history: bool):
    """`(x, r, scalars)` at the start: from x0 (one setup reduction for ||b||)
    or from zero (then ||b||^2 is the first step's <r, r>, or with
    `ctx.tol_from_rr` off, a setup reduction of its own)."""
    with jax.named_scope("solvax.pcg.setup"):
        x, r, tol2 = problem.start(ctx.rtol, ctx.atol)
        if problem.x0 is None and not ctx.tol_from_rr:   # `reduce.reduces_before_loop`
            tol2 = contract.squared_threshold(jnp.real(ctx.ip.dot(r, r)), ctx.rtol, ctx.atol)
    one = jnp.ones((), real)
    history = problem.history(max_steps + 1, record_history)
    sc = Scalars(gamma=one, alpha=jnp.full((), jnp.inf, real), tol2=tol2, k=jnp.int32(0),
                  go=jnp.bool_(True), rr=one, curvature=one, history=history,
                  cap2=jnp.full((), jnp.inf, real))
    return x, r, sc


def finished(sc: Scalars, x, max_steps: int, stalled=False) -> Outcome:
    """The outcome of a CG loop from its last step's scalars (`stalled`:
    pipelined CG's confirmation found no progress)."""
    # Every step run updated x, except the last one, which stopped the loop.
    taken = sc.k - (~sc.go).astype(jnp.int32)
    at_limit = (sc.k > max_steps) & may_go(sc.rr, sc.gamma, sc.tol2, sc.cap2)
    status = first_status([(sc.go | at_limit, RUNNING), (stalled, Status.STAGNATION)],
                          stop_reason(sc))
    return Outcome(x=x, status=status, iterations=taken, history=sc.history)
