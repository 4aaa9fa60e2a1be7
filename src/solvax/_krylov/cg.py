"""Preconditioned conjugate gradients on pytrees: one step function per method."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from . import _checks, _driver, _method, _recycle, _reduce, _sstep
from . import _tree as tree
from ._driver import Outcome, Problem
from ._method import masked_div
from ._solution import RUNNING, Solution, Status, first_status

PyTree = Any


#: deflated CG keeps this many directions per slot of its space for the next
#: solve's Rayleigh-Ritz update (measured on the 256^2 diffusion sequence of
#: `benchmark_recycling.py`, k = 20: 4 -> 0.73x of CG's matvecs, 6 -> 0.67x;
#: at 128^2, 2/4/6 per slot: 0.77/0.67/0.63x)
DIRECTIONS_PER_SLOT = 6


class _Scalars(NamedTuple):
    """The scalars every CG variant carries from step to step."""

    gamma: jax.Array  # <r, M r> of the previous step
    alpha: jax.Array  # previous step length
    tol2: jax.Array  # squared stopping threshold max(atol, rtol ||b||)^2
    k: jax.Array  # steps run (the last one did not update x unless `go`)
    go: jax.Array  # the last step went on; else it stopped the loop, and
    rr: jax.Array  # its <r, r> and
    curvature: jax.Array  # its <p, A p> (with gamma, tol2) say why (`_stop_reason`)
    history: jax.Array | None  # recursive residual norm per step (if recorded)


class _Standard(NamedTuple):
    x: PyTree
    r: PyTree  # recursively updated residual b - A x
    p: PyTree  # search direction
    sc: _Scalars


class _Single(NamedTuple):
    x: PyTree
    r: PyTree
    p: PyTree
    s: PyTree  # A p
    sc: _Scalars


class _Deflated(NamedTuple):
    x: PyTree
    r: PyTree
    p: PyTree  # search direction, A-conjugate to the recycled space
    P: PyTree  # the first `ell` directions (row `ell`: scratch for the later ones)
    Q: PyTree  # A P
    curvatures: jax.Array  # their <p, A p> (0 where no step went)
    sc: _Scalars


class _Pipelined(NamedTuple):
    x: PyTree
    r: PyTree
    p: PyTree
    s: PyTree  # A p
    w: PyTree  # A u
    z: PyTree  # A q
    u: PyTree | None  # M r (None without a preconditioner: u = r)
    q: PyTree | None  # M s (None without a preconditioner: q = s)
    sc: _Scalars
    checks: _method.Confirmation | None = None  # confirming convergence on the true residual


class _Context(NamedTuple):
    """What a step reads besides its state (all from the `Problem`)."""

    A: Callable
    M: Callable
    identity: bool  # no preconditioner: M r = r, one product fewer
    ip: _reduce.Reduction
    rtol: jax.Array
    atol: jax.Array
    tol_from_rr: bool  # x0 = None: ||b||^2 is the first step's <r, r>
    max_steps: int  # a step with k = max_steps only checks the residual
    space: Any = None  # deflated CG: the recycled (C, U), U^H C = I
    ell: int = 0  # deflated CG: the directions kept for the next space


def _may_go(rr, gamma, tol2):
    """`tol2 < rr < inf` and `0 < gamma < inf`: comparisons only (false for NaN)."""
    return (tol2 < rr) & (rr < jnp.inf) & (0 < gamma) & (gamma < jnp.inf)


def _top_of_step(sc: _Scalars, ctx: _Context, rr, gamma):
    """The stopping threshold and history, updated from the reduced values at
    the top of a step, and whether the step may go on (`_may_go`)."""
    tol2 = sc.tol2
    if ctx.tol_from_rr:
        tol2 = jnp.where(sc.k == 0, _driver.squared_threshold(rr, ctx.rtol, ctx.atol), tol2)
    history = sc.history
    if history is not None:
        history = history.at[sc.k].set(_reduce.real_sqrt(rr))
    return sc._replace(tol2=tol2, history=history), _may_go(rr, gamma, tol2) & (
        sc.k < ctx.max_steps)


def _goes(go, curvature):
    """The step updates `x`: its top passed (`_may_go`) and `0 < <p, A p> < inf`."""
    return go & (0 < curvature) & (curvature < jnp.inf)


def _stop_reason(sc: _Scalars):
    """Why a step that did not go on stopped, in order: non-finite values,
    convergence, a non-positive-definite preconditioner or operator.

    Evaluated once after the loop from the last step's carried values, not in
    every step: the loop itself decides with comparisons only (`_may_go`,
    `_goes`), and when only `x` is used the compiler drops this altogether.
    """
    return first_status([(~(jnp.isfinite(sc.rr) & jnp.isfinite(sc.gamma)), Status.NONFINITE),
                         (sc.rr <= sc.tol2, Status.CONVERGED),
                         ((sc.gamma <= 0) | jnp.isfinite(sc.curvature), Status.INDEFINITE)],
                        Status.NONFINITE)


def _products(ctx: _Context, r, u, w):
    """`(gamma, delta, rr) = (<r, u>, <u, w>, <r, r>)` in one reduction (with
    `u = r` when there is no preconditioner: one product fewer)."""
    if ctx.identity:
        rr, delta = jnp.real(ctx.ip.multi_dot([(r, r), (u, w)]))
        return rr, delta, rr
    return tuple(jnp.real(ctx.ip.multi_dot([(r, u), (u, w), (r, r)])))


def _recurrence(sc: _Scalars, gamma, delta, go):
    """Chronopoulos–Gear coefficients from `gamma = <r, M r>`, `delta = <M r, A M r>`:
    `beta = gamma / gamma_prev`, `<p, A p> = delta - beta gamma / alpha_prev`."""
    beta = gamma / sc.gamma  # see `_standard_step`
    curvature = jnp.where(sc.k == 0, delta, delta - beta * gamma / sc.alpha)
    go = _goes(go, curvature)
    return beta, masked_div(go, gamma, curvature), curvature, go


def _advance(sc: _Scalars, go, alpha, rr, gamma, curvature) -> _Scalars:
    """The scalars after a step. `k` counts steps run, whether or not they went
    on (the loop ends with the first that did not), so it does not depend on
    the step's outcome."""
    return sc._replace(go=go, alpha=alpha, rr=rr, gamma=gamma, curvature=curvature, k=sc.k + 1)


def _along(p, ctx: _Context, go, gamma):
    """The second half of a Hestenes–Stiefel step from its direction `p`:
    `(q, <p, q>, go, alpha)` with `q = A p` (one reduction), whether the
    step goes on (`_goes`) and its length `<r, z> / <p, A p>`."""
    with jax.named_scope("solvax.pcg.matvec"):
        q = ctx.A(p)
    with jax.named_scope("solvax.pcg.reduce"):
        pq = jnp.real(ctx.ip.dot(p, q))
    go = _goes(go, pq)
    return q, pq, go, masked_div(go, gamma, pq)


def _standard_step(st: _Standard, ctx: _Context) -> _Standard:
    """Hestenes–Stiefel: two reductions, `<r, z>` with `<r, r>`, then `<p, A p>`."""
    with jax.named_scope("solvax.pcg.precond"):
        z = ctx.M(st.r)
    with jax.named_scope("solvax.pcg.reduce"):
        if ctx.identity:
            rr = gamma = jnp.real(ctx.ip.dot(st.r, st.r))
        else:
            gamma, rr = jnp.real(ctx.ip.multi_dot([(st.r, z), (st.r, st.r)]))
    sc, go = _top_of_step(st.sc, ctx, rr, gamma)
    # No guard needed: a step runs only after one that went on (gamma, alpha > 0)
    # or from the initial 1s, and the first step's beta multiplies p = 0.
    beta = gamma / sc.gamma
    p = tree.axpy(beta, st.p, z)
    q, pq, go, alpha = _along(p, ctx, go, gamma)
    return _Standard(x=tree.axpy(alpha, p, st.x), r=tree.axpy(-alpha, q, st.r), p=p,
                     sc=_advance(sc, go, alpha, rr, gamma, pq))


def _deflated_step(st: _Deflated, ctx: _Context) -> _Deflated:
    """Deflated CG (Saad, Yeung, Erhel, Guyomarc'h 2000): the standard step
    with each direction made A-conjugate to the recycled space, `p = z - U
    C^H z + beta p` (`C = A U`, `U^H C = I`), the projections `C^H z` riding
    in the step's `<r, z>`, `<r, r>` reduction: still two reductions per
    step. The first `ell` directions and their `A p` are kept (written in
    place) for the next solve's space (`_recycle.ritz_space`)."""
    C, U = ctx.space
    with jax.named_scope("solvax.pcg.precond"):
        z = ctx.M(st.r)
    with jax.named_scope("solvax.pcg.reduce"):
        cz, products = ctx.ip.project_many(C, [z], [(st.r, z), (st.r, st.r)])
        gamma, rr = jnp.real(products)
    sc, go = _top_of_step(st.sc, ctx, rr, gamma)
    beta = gamma / sc.gamma
    p = tree.axpy(beta, st.p, tree.sub(z, tree.basis_combine(U, cz[0])))
    q, pq, go, alpha = _along(p, ctx, go, gamma)
    row = jnp.minimum(sc.k, ctx.ell)
    return _Deflated(x=tree.axpy(alpha, p, st.x), r=tree.axpy(-alpha, q, st.r), p=p,
                     P=tree.basis_fill(st.P, row, [p], go),
                     Q=tree.basis_fill(st.Q, row, [q], go),
                     curvatures=st.curvatures.at[row].set(jnp.where(go, pq, 0)),
                     sc=_advance(sc, go, alpha, rr, gamma, pq))


def _deflated_start(problem: Problem, ctx: _Context, k: int):
    """`(ctx, x, r, tol2)` for deflated CG: the recycled space (given: made
    A-orthonormal for this operator, `k` matvecs and one reduction; else
    empty), and the start projected on it, `x += U U^H r`, `r -= C U^H r`
    (exact for `A U = C`, `U^H C = I`), `||b||^2` in the same reduction."""
    with jax.named_scope("solvax.pcg.recycle"):
        given = problem.data
        space = (_recycle.empty(problem.b, k) if given is None
                 else _recycle.conjugated(problem.A, problem.ip, given[1]))
        x, r = problem.residual()
        mu, products = problem.ip.project_many(space.U, [r], [(problem.b, problem.b)])
        bb = jnp.real(products[0])
        x = tree.add(x, tree.basis_combine(space.U, mu[0]))
        r = tree.sub(r, tree.basis_combine(space.C, mu[0]))
        x, r = problem.settled(x, r, bb)
    return ctx._replace(space=space, tol_from_rr=False), x, r, _driver.squared_threshold(
        bb, ctx.rtol, ctx.atol)


def _single_step(st: _Single, ctx: _Context) -> _Single:
    """Chronopoulos & Gear (1989): with u = M r and w = A u, the three products
    <r, u>, <u, w>, <r, r> are independent and share one reduction."""
    with jax.named_scope("solvax.pcg.precond"):
        u = ctx.M(st.r)
    with jax.named_scope("solvax.pcg.matvec"):
        w = ctx.A(u)
    with jax.named_scope("solvax.pcg.reduce"):
        gamma, delta, rr = _products(ctx, st.r, u, w)
    sc, go = _top_of_step(st.sc, ctx, rr, gamma)
    beta, alpha, curvature, go = _recurrence(sc, gamma, delta, go)
    p = tree.axpy(beta, st.p, u)
    s = tree.axpy(beta, st.s, w)
    # p reads the old r; r is updated after p (in place, no copy of r).
    return _Single(x=tree.axpy(alpha, p, st.x), r=tree.after(tree.axpy(-alpha, s, st.r), p),
                   p=p, s=s, sc=_advance(sc, go, alpha, rr, gamma, curvature))


def _pipelined_step(st: _Pipelined, ctx: _Context) -> _Pipelined:
    """Ghysels & Vanroose (2014), Alg. 4: the one reduction of the step does not
    feed M w and A M w, so it can overlap with them. With M = I, u = r and q = s."""
    u = st.r if ctx.identity else st.u
    with jax.named_scope("solvax.pcg.reduce"):
        gamma, delta, rr = _products(ctx, st.r, u, st.w)
    with jax.named_scope("solvax.pcg.precond"):
        m = ctx.M(st.w)
    with jax.named_scope("solvax.pcg.matvec"):
        n = ctx.A(m)
    sc, go = _top_of_step(st.sc, ctx, rr, gamma)
    beta, alpha, curvature, go = _recurrence(sc, gamma, delta, go)
    z = tree.axpy(beta, st.z, n)
    s = tree.axpy(beta, st.s, st.w)
    p = tree.axpy(beta, st.p, u)
    q = None if ctx.identity else tree.axpy(beta, st.q, m)
    # Each vector is overwritten after the readers of its old value (in place).
    return _Pipelined(
        x=tree.axpy(alpha, p, st.x), r=tree.after(tree.axpy(-alpha, s, st.r), p),
        p=p, s=s, w=tree.after(tree.axpy(-alpha, z, st.w), s), z=z,
        u=None if ctx.identity else tree.after(tree.axpy(-alpha, q, u), p), q=q,
        sc=_advance(sc, go, alpha, rr, gamma, curvature), checks=st.checks)


def _replace_residuals(st: _Pipelined, ctx: _Context, b) -> _Pipelined:
    """Residual replacement: recompute the recursively updated vectors from x and p."""
    with jax.named_scope("solvax.pcg.residual_replacement"):
        r = tree.sub(b, ctx.A(st.x))
        u = ctx.M(r)
        s = ctx.A(st.p)
        q = ctx.M(s)
        return st._replace(r=r, w=ctx.A(u), s=s, z=ctx.A(q),
                           u=None if ctx.identity else u, q=None if ctx.identity else q)


def _restart(st: _Pipelined, ctx: _Context, b) -> _Pipelined:
    """Pipelined CG restarted from `x`: `r = b - A x`, `u = M r`, `w = A u`,
    directions zero (2 matvecs, 1 preconditioner application, no reduction).

    A restart rather than a replacement that keeps `p`: when the recursive
    residual has drifted far from the true one (17x on Poisson 512^2 at
    1e-8), the recurrence's `<p, A p> = <u, w> - beta <r, u> / alpha`, which
    assumes the two agree, came out negative (measured)."""
    with jax.named_scope("solvax.pcg.restart"):
        st = st._replace(x=st.checks.restart_point(st.x))
        r = tree.sub(b, ctx.A(st.x))
        u = ctx.M(r)
        zeros = tree.zeros_like(r)
        # alpha = inf: the next step's curvature is <u, w> and p = u, as at the
        # start (gamma = 1: beta multiplies p = 0 and must be finite, also for b = 0)
        return st._replace(r=r, w=ctx.A(u), p=zeros, s=zeros, z=zeros,
                           u=None if ctx.identity else u, q=None if ctx.identity else zeros,
                           sc=st.sc._replace(alpha=jnp.full_like(st.sc.alpha, jnp.inf),
                                             gamma=jnp.ones_like(st.sc.gamma),
                                             go=st.checks.pending),
                           checks=st.checks.restarted(st.x))


def _pipelined_with_replacement(st: _Pipelined, ctx: _Context, b, every: int) -> _Pipelined:
    st = _pipelined_step(st, ctx)
    return lax.cond(st.sc.go & (st.sc.k % every == 0),
                    lambda s: _replace_residuals(s, ctx, b), lambda s: s, st)


def _confirmed_step(st: _Pipelined, ctx: _Context) -> _Pipelined:
    """A pipelined step whose stopping test is confirmed on the true residual
    (`_method.Confirmation`): a step whose own residual met the tolerance, or
    whose recurrences drifted, ends the round (`pending`) and does not count;
    so does one whose own residual fell by the round's `progress` (it
    counts); one after a restart whose true residual is not below the
    previous restart's stops the solve (after retries: `Confirmation`)."""
    new = _pipelined_step(st, ctx)
    sc = new.sc
    stopped = ~sc.go & (sc.k <= ctx.max_steps)
    # A step that passed its residual test but found <p, A p> (or <r, M r>) not
    # positive: in float32 the recurrences drift from the vectors they stand
    # for (measured: a negative curvature on SPD Poisson 128^2 at 1e-5, and
    # an x worse than 0), so the round restarts from x; the step after the
    # restart, from directly computed vectors, decides INDEFINITE.
    drifted = stopped & (sc.rr > sc.tol2) & jnp.isfinite(sc.rr) & jnp.isfinite(sc.gamma)
    progressed = sc.go & st.checks.progressed(sc.rr)
    checks = st.checks.after_step(stopped & (sc.rr <= sc.tol2) | drifted | progressed,
                                  sc.rr, sc.tol2)
    # a pending step that stopped updated neither x nor r (alpha = 0)
    uncounted = (checks.pending & ~sc.go).astype(sc.k.dtype)
    sc = sc._replace(go=sc.go & ~checks.stalled & ~checks.pending, k=sc.k - uncounted)
    return new._replace(sc=sc, checks=checks)


def _confirmed_rounds(state: _Pipelined, ctx: _Context, b) -> _Pipelined:
    """Pipelined CG in rounds whose stopping test is confirmed on the true
    residual: the restart from `x` costs 2 matvecs and no reduction (the next
    step's reduction tests it)."""
    return _method.confirmed_rounds(
        ctx.ip, b, state, checks=lambda st: st.checks,
        step=functools.partial(_confirmed_step, ctx=ctx),
        going=lambda st: st.sc.go & (st.sc.k <= ctx.max_steps),
        restart=lambda st: _restart(st, ctx, b))


def _initial_state(method: str, ctx: _Context, x, r, sc: _Scalars):
    """The state of `method` before its first step (directions zero)."""
    zeros = tree.zeros_like(r)
    if method == "standard":
        return _Standard(x=x, r=r, p=zeros, sc=sc)
    if method == "single_reduction":
        return _Single(x=x, r=r, p=zeros, s=zeros, sc=sc)
    with jax.named_scope("solvax.pcg.setup"):
        u = ctx.M(r)
        return _Pipelined(x=x, r=r, p=zeros, s=zeros, w=ctx.A(u), z=zeros,
                          u=None if ctx.identity else u, q=None if ctx.identity else zeros,
                          sc=sc, checks=_method.Confirmation.start(sc.rr.dtype, x))


def _start(problem: Problem, ctx: _Context, real, max_steps: int, record_history: bool):
    """`(x, r, scalars)` at the start: from x0 (one setup reduction for ||b||)
    or from zero (then ||b||^2 is the first step's <r, r>)."""
    with jax.named_scope("solvax.pcg.setup"):
        x, r, tol2 = problem.start(ctx.rtol, ctx.atol)
    one = jnp.ones((), real)
    history = problem.history(max_steps + 1, record_history)
    sc = _Scalars(gamma=one, alpha=one, tol2=tol2, k=jnp.int32(0), go=jnp.bool_(True),
                  rr=one, curvature=one, history=history)
    return x, r, sc


def _run_deflated(problem: Problem, ctx: _Context, real, record_history: bool, k: int,
                  ell: int) -> Outcome:
    """Deflated CG from its recycled space to the space for the next solve."""
    ctx, x, r, tol2 = _deflated_start(problem, ctx._replace(ell=ell), k)
    one = jnp.ones((), real)
    sc = _Scalars(gamma=one, alpha=one, tol2=tol2, k=jnp.int32(0), go=jnp.bool_(True),
                  rr=one, curvature=one,
                  history=problem.history(ctx.max_steps + 1, record_history))
    P = tree.basis_alloc(problem.b, ell + 1)
    state = _Deflated(x=x, r=r, p=tree.zeros_like(r), P=P, Q=P,
                      curvatures=jnp.zeros((ell + 1,), real), sc=sc)
    state = _method.while_loop(problem.ip, problem.b,
                               lambda st: st.sc.go & (st.sc.k <= ctx.max_steps),
                               functools.partial(_deflated_step, ctx=ctx), state)
    with jax.named_scope("solvax.pcg.recycle"):
        first = functools.partial(tree.tree_map, lambda leaf: leaf[:ell])
        C, U = ctx.space
        space = _recycle.ritz_space(problem.ip, U, C, first(state.P), first(state.Q),
                                    state.curvatures[:ell], k, _recycle.RecycleSpace(C, U))
    outcome = _finished(state.sc, state.x, ctx.max_steps)
    return outcome._replace(recycle=space)


def _finished(sc: _Scalars, x, max_steps: int, stalled=False) -> Outcome:
    """The outcome of a CG loop from its last step's scalars (`stalled`:
    pipelined CG's confirmation found no progress)."""
    # Every step run updated x, except the last one, which stopped the loop.
    steps = sc.k - (~sc.go).astype(jnp.int32)
    at_limit = (sc.k > max_steps) & _may_go(sc.rr, sc.gamma, sc.tol2)
    status = first_status([(sc.go | at_limit, RUNNING), (stalled, Status.STAGNATION)],
                          _stop_reason(sc))
    return Outcome(x=x, status=status, iterations=steps, history=sc.history)


def _run(problem: Problem, *, method: str, max_steps: int | None, residual_replacement: int | None,
         record_history: bool, recycle_size: int = 0) -> Outcome:
    """The PCG iteration of `method` (not differentiated itself; see `pcg`)."""
    real = problem.real_dtype()
    max_steps = problem.step_limit(max_steps)
    identity = problem.precond is None
    rtol, atol = problem.tolerances()
    ctx = _Context(A=problem.A, M=(lambda v: v) if identity else problem.precond,
                   identity=identity, ip=problem.ip, rtol=rtol, atol=atol,
                   tol_from_rr=problem.x0 is None, max_steps=max_steps)
    if method == "deflated":
        ell = min(DIRECTIONS_PER_SLOT * recycle_size, problem.size())
        return _run_deflated(problem, ctx, real, record_history, recycle_size, ell)
    x, r, sc = _start(problem, ctx, real, max_steps, record_history)
    state = _initial_state(method, ctx, x, r, sc)
    if method == "pipelined" and residual_replacement:
        step = functools.partial(_pipelined_with_replacement, b=problem.b,
                                 every=residual_replacement)
    else:
        step = _STEPS[method]
    # Up to max_steps steps, then one that only checks the residual it reduces
    # anyway (no update): at the limit, the loop's own test still says whether
    # x converged, with no reduction after the loop.
    confirmed = method == "pipelined" and not residual_replacement
    if confirmed:
        state = _confirmed_rounds(state, ctx, problem.b)
    else:
        state = _method.while_loop(problem.ip, problem.b,
                                   lambda st: st.sc.go & (st.sc.k <= max_steps),
                                   functools.partial(step, ctx=ctx), state)
    if confirmed:
        return _finished(state.sc, state.checks.returned(state.x), max_steps,
                         state.checks.stalled)
    return _finished(state.sc, state.x, max_steps)


_STEPS = {"standard": _standard_step, "single_reduction": _single_step,
          "pipelined": _pipelined_step}
METHOD_NAMES = (*_STEPS, "s_step")
CG = _driver.register(_driver.Method("pcg", _run))


def pcg(
    matvec: Callable[[PyTree], PyTree],
    b: PyTree,
    *,
    x0: PyTree | None = None,
    precond: Callable[[PyTree], PyTree] | None = None,
    rtol: float | None = None,
    atol: float = 0.0,
    max_steps: int | None = None,
    single_reduction: bool = False,
    method: str | None = None,
    residual_replacement: int | None = None,
    s: int = 4,
    basis: str = "chebyshev",
    spectrum: tuple | None = None,
    record_history: bool = False,
    inner_product=None,
    axis_name: str | tuple[str, ...] | None = None,
    failed_derivative: str = "nan",
    recycle: _recycle.RecycleSpace | tuple | None = None,
    recycle_size: int | None = None,
) -> Solution:
    """Preconditioned conjugate gradients for a Hermitian positive-definite `A`.

    Standard recurrence (Hestenes & Stiefel), with `z = M r`:

        alpha = <r, z> / <p, A p>,  x += alpha p,  r -= alpha A p,
        beta = <r', z'> / <r, z>,   p = z' + beta p

    two reductions per step: `<p, A p>`, then `<r, z>` with `<r, r>` fused.
    `single_reduction=True` uses the Chronopoulos–Gear recurrence: with
    `u = M r`, `w = A u`, the products `<r, u>`, `<u, w>`, `<r, r>` are
    computed in *one* reduction and `<p, A p> = <u, w> - beta <r, u> / alpha`
    by recurrence, at the cost of one more stored vector (`s = A p`).

    `method="pipelined"` is pipelined CG (Ghysels & Vanroose): it also keeps
    `w = A u`, `z = A q`, `q = M s` by recurrence, so the single reduction of
    a step is not needed by that step's `M w` and `A M w` and can overlap with
    them (hiding its latency where collectives run asynchronously), at the
    cost of four more stored vectors and extra recurrences. Finite precision:
    the recursively updated vectors drift from their definitions faster than
    in standard CG, so the attainable accuracy is lower (often 1e-10 rather
    than 1e-14 relative); `residual_replacement=k` recomputes `r, u, w, s, q,
    z` from `x` and `p` every k steps (4 matvecs and 2 preconditioner
    applications each time, no reduction), restoring accuracy. Without it,
    pipelined CG confirms its stopping test: when its own residual meets the
    tolerance it restarts from `x` (the true residual: 2 matvecs, no
    reduction) and stops only when the next step's reduction finds the true
    residual within the tolerance (a restart that no longer lowers it stops
    as `STAGNATION`).

    **Recycling** (`recycle_size=k` or `recycle=`, standard method only):
    deflated CG for sequences of systems. A recycled space `(C, U)` (`C = A
    U`, `U` A-orthonormal; pytrees like `b` with `k` rows per leaf, sharding
    kept) is deflated from the solve: the start is projected on it (`x += U
    U^H r`) and every direction is made A-conjugate to it (`p = z - U C^H z +
    beta p`, the `k` projections riding in the step's second reduction:
    still two reductions per step, `2 k` more vectors read). After the solve
    the space becomes the `k` Ritz vectors of smallest Ritz value on the old
    space plus the solve's first `6 k` directions (one more reduction; no
    eigen-solver beyond a replicated `eigh` of `7 k x 7 k`), returned as
    `Solution.recycle`; passing it to the next solve (a changed operator and
    right-hand side) costs `k` matvecs and one reduction to make it
    A-orthonormal for the new operator. From `recycle_size=k` alone the
    space starts empty (no deflation in that first solve). Derivatives hand
    the space to the transposed solve. (Saad, Yeung, Erhel, Guyomarc'h,
    SIAM J. Sci. Comput. 21, 2000.) Memory: `14 k + 2` vectors more.

    `method="s_step"` is s-step (communication-avoiding) CG: each outer step
    builds `s` Krylov vectors with a polynomial basis (`basis`: Chebyshev or
    Newton on the interval `spectrum = (lmin, lmax)` of `M A`'s eigenvalues,
    or, by default, from the Ritz values of each block; monomial only for
    comparison), gets all their inner products with the previous block in
    **one** reduction and takes s CG steps at once on the small coordinates.
    One reduction per `s` iterations and as many matvecs as CG (s per outer
    step); the price is `4 s + 2` stored vectors, more local arithmetic and a
    basis whose conditioning limits `s` (directions it loses are dropped; see
    `docs/krylov.md`). `iterations` counts CG iterations (a multiple of `s`),
    `history` has a value every `s` entries.

    Differs from the textbook / `jax.scipy.sparse.linalg.cg`:
      1. `converged` is decided on the true residual `||b - A x||` (one extra
         matvec after the loop), never on the recursively updated one.
      2. With `x0=None`, `||b||` is the first step's `<r, r>`: no setup reduction.
      3. Non-positive curvature, a non-positive-definite preconditioner and
         non-finite values stop the loop with their own `Status`.
      4. Differentiable with `jax.grad`/`jax.jvp` by implicit differentiation:
         one more CG solve (the transposed system), never through the loop.

    Args:
        matvec: `x -> A x` on pytrees shaped like `b`.
        b: right-hand side, an array or any pytree of arrays (leaves keep
            their sharding; no leaf is ever flattened).
        x0: initial guess shaped like `b` (default zeros).
        precond: `r -> M r`, an HPD approximation of `A^{-1}` (default identity).
        rtol, atol: stop when `||b - A x|| <= max(atol, rtol * ||b||)`. The
            default `rtol` depends on the precision of `b`: `max(1e-8, 100 eps)`
            for its least precise leaf,
            1e-8 in float64 and 1.2e-5 in float32 (1e-8 is out of float32's
            reach: its rounding level is 6e-8).
        max_steps: iteration limit (default `10 * size(b)`).
        single_reduction: use the one-reduction-per-step recurrence (the same
            as `method="single_reduction"`).
        method: `"standard"` (default), `"single_reduction"`, `"pipelined"` or
            `"s_step"`.
        residual_replacement: pipelined: recompute the recursively updated
            vectors every this many steps; s-step: recompute `r = b - A x`
            every this many outer steps (default never: pipelined then
            confirms its stopping test instead).
        s: s-step only: CG iterations per outer step (default 4).
        basis: s-step only: `"chebyshev"` (default), `"newton"` or `"monomial"`.
        spectrum: s-step only: `(lmin, lmax)`, bounds of the eigenvalues of
            `M A` (e.g. from `estimate_spectrum`; traced values are fine);
            default: `[0, 1.1 lmax]` with `lmax` the largest Ritz value seen.
        record_history: store the recursive residual norm of every step in
            `Solution.history` (length `max_steps + 1`, NaN after the end).
        inner_product: a `solvax.InnerProduct` (or `(x, y) -> scalar`) used for
            every product and norm, including the stopping test.
        failed_derivative: `"nan"` (default): a derivative (`jax.grad`,
            `jax.jvp`) whose tangent or transposed solve did not converge is
            NaN, so a finite derivative is a correct one; `"keep"`: as computed.
        axis_name: inside `shard_map`, the mesh axis the vectors are split over
            (shorthand for `inner_product=InnerProduct(axis_name=...)`).
        recycle: the space of a previous solve (`Solution.recycle` of `pcg`
            or `gcrot`): deflated CG with it (its size is `k`).
        recycle_size: `k`, the recycled space's size (>= 1): deflated CG from
            an empty space (or checked against `recycle`'s).

    Returns:
        A `Solution` with `x`, `status`, `converged`, `iterations` and the true
        `residual_norm`; with recycling, `recycle`: the space for the next
        solve (the `k` refresh matvecs are not in `iterations`).

    Raises:
        TypeError, ValueError: at trace time, for a `b`, `x0`, `matvec(b)` or
            `precond(b)` whose structure, shapes or dtypes disagree, negative
            tolerances, a negative `max_steps`, an unknown `method` or
            `basis`, `s < 1`, a `spectrum` that is not `0 <= lmin < lmax`, or
            `residual_replacement`, `s`, `basis`, `spectrum` with a method
            that does not take them.

    References: A. T. Chronopoulos and C. W. Gear, "s-step iterative methods
    for symmetric linear systems", J. Comput. Appl. Math. 25 (1989);
    P. Ghysels and W. Vanroose, "Hiding global synchronization latency in the
    preconditioned conjugate gradient algorithm", Parallel Comput. 40 (2014);
    M. Hoemmen, "Communication-avoiding Krylov subspace methods", PhD thesis,
    UC Berkeley (2010); E. Carson and J. Demmel, "A residual replacement
    strategy for improving the maximum attainable accuracy of s-step Krylov
    subspace methods", SIAM J. Matrix Anal. Appl. 35 (2014).
    """
    _checks.check_flag("single_reduction", single_reduction)
    if method is None:
        method = "single_reduction" if single_reduction else "standard"
    _checks.check_choice("method", method, METHOD_NAMES)
    if single_reduction and method != "single_reduction":
        raise ValueError(f"`single_reduction=True` contradicts `method={method!r}`; pass one.")
    if residual_replacement is not None:
        _checks.check_int("residual_replacement", residual_replacement, 1)
        if method not in ("pipelined", "s_step"):
            raise ValueError("`residual_replacement` applies to `method='pipelined'` and "
                             f"`method='s_step'` only; got method={method!r}.")
    if method == "s_step":
        return _sstep.solve(matvec, b, x0=x0, precond=precond, rtol=rtol, atol=atol,
                            max_steps=max_steps, s=s, basis=basis, spectrum=spectrum,
                            residual_replacement=residual_replacement,
                            record_history=record_history, inner_product=inner_product,
                            axis_name=axis_name, failed_derivative=failed_derivative)
    if recycle is not None or recycle_size is not None:
        return _recycled(matvec, b, method=method, recycle=recycle, recycle_size=recycle_size,
                         x0=x0, precond=precond, rtol=rtol, atol=atol, max_steps=max_steps,
                         record_history=record_history, inner_product=inner_product,
                         axis_name=axis_name, failed_derivative=failed_derivative)
    if (s, basis, spectrum) != (4, "chebyshev", None):
        raise ValueError("`s`, `basis` and `spectrum` apply to `method='s_step'` only; "
                         f"got method={method!r}.")
    # A^T = conj(A) is HPD too (symmetric for real b): see `_driver.solve`.
    return _driver.solve(CG, matvec, b, x0=x0, precond=precond, rtol=rtol, atol=atol,
                         inner_product=inner_product, axis_name=axis_name,
                         failed_derivative=failed_derivative, method=method,
                         max_steps=max_steps, residual_replacement=residual_replacement,
                         record_history=record_history)


def _recycled(matvec, b, *, method, recycle, recycle_size, **options) -> Solution:
    """`pcg` with a recycled space: deflated CG (validated here)."""
    if method != "standard":
        raise ValueError(f"`recycle`/`recycle_size` apply to the standard method only (deflated "
                         f"CG); got method={method!r}.")
    _checks.check_vector("b", b)
    if recycle_size is not None:
        recycle_size = _checks.check_int("recycle_size", recycle_size, 1)
    if recycle is not None:
        leaves = jax.tree_util.tree_leaves(recycle[1] if isinstance(recycle, tuple) and
                                           len(recycle) == 2 else recycle)
        k = recycle_size or (jnp.shape(leaves[0])[0] if leaves and jnp.ndim(leaves[0]) else 0)
        recycle = _recycle.checked(recycle, b, k)
        recycle_size = k
    return _driver.solve(CG, matvec, b, data=recycle,
                         adjoint_data=lambda out: out.recycle, method="deflated",
                         residual_replacement=None, recycle_size=recycle_size, **options)


def pcg_linear_solve(matvec: Callable[[PyTree], PyTree], b: PyTree, **pcg_options) -> Solution:
    """`linear_solve` around `pcg` (symmetric): the same `Solution`, diagnostics included.

    `pcg` itself is already differentiated implicitly; this entry point exists
    for symmetry with `linear_solve` and accepts exactly `pcg`'s options.

    Args:
        matvec: `x -> A x` (Hermitian positive definite).
        b: right-hand side.
        **pcg_options: any keyword option of `pcg`.

    Returns:
        The `Solution` of `pcg(matvec, b, **pcg_options)`.

    Raises:
        TypeError: for an option `pcg` does not take; otherwise as `pcg`.

    Reference: as `pcg`.
    """
    return pcg(matvec, b, **pcg_options)
