"""BiCGStab with right preconditioning on pytrees: two synchronizations per step."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from .._core import checks, contract, driver, reduce, tree
from .._core.contract import Outcome, Problem
from .._core.options import documented
from .._core.registry import Row, Variant, register_solver
from .._core.solution import RUNNING, Solution, Status, first_status
from . import steps
from .steps import negligible, nonzero

PyTree = Any


class _State(NamedTuple):
    x: PyTree
    r: PyTree  # residual b - A x (recursively updated)
    p: PyTree  # search direction
    v: PyTree  # A M p
    rho: jax.Array  # <r0, r> of the current r
    rho_prev: jax.Array  # the previous step's rho
    alpha: jax.Array
    omega: jax.Array
    k: jax.Array  # steps that updated x
    go: jax.Array  # the loop goes on
    status: jax.Array  # RUNNING (also at the step limit) or why the loop stopped
    history: jax.Array | None  # ||r|| at the top of each step (if recorded)
    shadow: PyTree  # r0, the shadow residual: the residual at the last (re)start
    shadow_norm: jax.Array  # ||r0||
    rr: jax.Array  # <r, r> measured at the top of the last step
    start: jax.Array  # k at the last (re)start: the next step takes beta = 0
    pending: jax.Array  # <r0, A M p> vanished after progress: restart (`_restart`)


class _Context(NamedTuple):
    A: Callable
    M: Callable
    ip: reduce.Reduction
    tol2: jax.Array  # max(atol, rtol ||b||)^2
    max_steps: int


def _directions(st: _State, ctx: _Context):
    """`p = r + beta (p - omega v)`, `M p` and `v = A M p`."""
    ratio = (st.rho / nonzero(st.rho_prev)) * (st.alpha / nonzero(st.omega))
    beta = jnp.where(st.k == st.start, jnp.zeros_like(ratio), ratio)
    p = tree.axpy(beta, tree.axpy(-st.omega, st.v, st.p), st.r)
    with jax.named_scope("solvax.bicgstab.precond"):
        phat = ctx.M(p)
    with jax.named_scope("solvax.bicgstab.matvec"):
        return p, phat, ctx.A(phat)


def _step(st: _State, ctx: _Context) -> _State:
    """One BiCGStab step (van der Vorst 1992, right-preconditioned), its products
    grouped into two reductions: `[<r0, v>, <r, r>, <v, v>]` (the check of the step's
    starting residual rides along) and `[<t, s>, <t, t>, <s, s>, <r0, s>,
    <r0, t>]`, which give `omega`, the next `rho = <r0, s> - omega <r0, t>` and
    the half-step check `||s||`. A step at the step limit only checks."""
    p, phat, v = _directions(st, ctx)
    with jax.named_scope("solvax.bicgstab.reduce"):
        rv, rr, vv = ctx.ip.multi_dot([(st.shadow, v), (st.r, st.r), (v, v)])
    rr, vv = jnp.real(rr), jnp.real(vv)
    history = None if st.history is None else st.history.at[st.k].set(reduce.real_sqrt(rr))
    norm = reduce.real_sqrt
    lost_alpha = negligible(rv, st.shadow_norm, norm(vv))  # <r0, A M p> ~ 0
    # a lost alpha is not applied: s = r, and the step leaves x and r as they are
    alpha = jnp.where(lost_alpha, jnp.zeros_like(rv), st.rho / nonzero(rv))
    s = tree.axpy(-alpha, v, st.r)
    with jax.named_scope("solvax.bicgstab.precond"):
        shat = ctx.M(s)
    with jax.named_scope("solvax.bicgstab.matvec"):
        t = ctx.A(shat)
    with jax.named_scope("solvax.bicgstab.reduce"):
        ts, tt, ss, rs, rt = ctx.ip.multi_dot([(t, s), (t, t), (s, s), (st.shadow, s),
                                               (st.shadow, t)])
    tt, ss = jnp.real(tt), jnp.real(ss)
    omega = ts / nonzero(tt).astype(ts.dtype)
    rho = rs - omega * rt
    done, limit = rr <= ctx.tol2, st.k >= ctx.max_steps
    finite = jnp.isfinite(rr) & jnp.isfinite(jnp.abs(rv)) & jnp.isfinite(ss) & jnp.isfinite(
        jnp.abs(ts))
    half = ss <= ctx.tol2  # s meets the tolerance: x + alpha M p is the answer
    lost_omega = (tt == 0) | negligible(ts, norm(tt), norm(ss))  # t orthogonal to s
    # rho = <r0, r_next> exactly 0 (a small one is no breakdown yet: in float32
    # it reaches rounding level on problems BiCGStab still solves)
    lost_rho = rho == 0
    # the Lanczos part broke down after progress since the last (re)start:
    # restart with the current residual as the shadow (`_restart`); without
    # progress (the operator itself, e.g. skew-symmetric) it is a breakdown
    restart = lost_alpha & (st.k > st.start)
    status = first_status([(done, Status.CONVERGED), (limit, RUNNING),
                           (~finite, Status.NONFINITE), (restart, RUNNING),
                           (lost_alpha, Status.BREAKDOWN), (half, Status.CONVERGED),
                           (lost_omega | lost_rho, Status.BREAKDOWN)], RUNNING)
    pending = restart & (status == RUNNING) & ~limit
    take_alpha = ~done & ~limit & finite & ~lost_alpha
    take_omega = take_alpha & ~half & ~lost_omega
    x = tree.axpy(jnp.where(take_alpha, alpha, jnp.zeros_like(alpha)), phat, st.x)
    omega = jnp.where(take_omega, omega, jnp.zeros_like(omega))
    x = tree.axpy(omega, shat, x)
    # r is overwritten after every read of the old r, <r, r> included: in
    # place, not copied every step
    r = tree.after(tree.axpy(-omega, t, s), rr)
    return _State(x=x, r=r, p=p, v=v, rho=rho, rho_prev=st.rho,
                  alpha=alpha, omega=omega, k=st.k + take_alpha.astype(jnp.int32),
                  go=(status == RUNNING) & ~limit & ~pending, status=status, history=history,
                  shadow=st.shadow, shadow_norm=st.shadow_norm, rr=rr, start=st.start,
                  pending=pending)


def _restart(st: _State) -> _State:
    """BiCGStab restarted from `x` after a breakdown of its Lanczos part
    (`<r0, A M p>` zero up to rounding): the current residual `r` (not
    updated by that step) becomes the shadow, so `rho = <r, r>`, measured
    by the step; no matvec and no reduction."""
    zeros = tree.zeros_like(st.r)
    one = jnp.ones_like(st.rho)
    return st._replace(p=zeros, v=zeros, rho=st.rr.astype(st.rho.dtype), rho_prev=one,
                       alpha=one, omega=one, shadow=st.r, shadow_norm=reduce.real_sqrt(st.rr),
                       start=st.k, pending=jnp.zeros_like(st.pending), go=jnp.ones_like(st.go))


def _start(problem: Problem):
    """`(x, r, <r, r>, ||b||^2)`: one setup reduction (the residual's norm is
    the first `rho`: the shadow residual is `r0`)."""
    b = problem.b
    x, r = problem.residual()
    if problem.x0 is None:
        rr = bb = jnp.real(problem.ip.dot(b, b))
        return x, r, rr, bb
    rr, bb = jnp.real(problem.ip.multi_dot([(r, r), (b, b)]))
    x, r = problem.settled(x, r, bb)
    return x, r, jnp.where(bb == 0, bb, rr), bb


class _OneSyncState(NamedTuple):
    """The one-synchronization recurrences (`_one_sync_step`); the iterate is
    `x = x0 + M u`, so the preconditioner is applied inside `B = A M` only."""

    x: PyTree  # the iterate at the last (re)start; the current one is x + M u
    shadow: PyTree  # r0: the residual at the last (re)start
    u: PyTree
    r: PyTree  # b - (A x + B u) (recursively updated)
    p: PyTree  # search direction
    v: PyTree  # B p
    w: PyTree  # B r
    q: PyTree  # B v
    best: jax.Array  # the least <r, r> so far ...
    since: jax.Array  # ... and the steps since it was last lowered
    peak: jax.Array  # the largest <r, r> so far
    k: jax.Array
    go: jax.Array
    status: jax.Array
    history: jax.Array | None
    start: jax.Array  # k at the last (re)start
    start_rr: jax.Array  # <r, r> measured at the first step after it
    pending: jax.Array  # the recurrences drifted after progress: restart (`_one_sync_restart`)


def _preconditioned(ctx: _Context):
    """`B = A M`: the one-synchronization recurrences' operator."""
    return lambda y: ctx.A(ctx.M(y))


def _one_sync_coefficients(rr, r0r, r0v, r0w, r0q, wr, wv, qr, qv, ww, wq, qq, rv, vv):
    """`alpha`, `|alpha|^2`, `omega`, `beta`, the next `rho` and the expanded
    `<s, s>`, `<t, t>`, `<t, s>` from the step's 14 products."""
    rho = r0r  # measured; the next one (for beta) by the expansion
    alpha = rho / nonzero(r0v)
    a2 = jnp.real(alpha * jnp.conj(alpha))
    ss = jnp.maximum(rr - 2 * jnp.real(alpha * rv) + a2 * vv, 0)
    tt = jnp.maximum(ww - 2 * jnp.real(alpha * wq) + a2 * qq, 0)
    ts = wr - alpha * wv - jnp.conj(alpha) * qr + a2 * qv
    omega = ts / nonzero(tt).astype(ts.dtype)
    rho_next = rho - alpha * r0v - omega * (r0w - alpha * r0q)
    beta = (rho_next / nonzero(rho)) * (alpha / nonzero(omega))
    return alpha, a2, omega, beta, rho_next, ss, tt, ts


def _rounding_level(st: _OneSyncState, rr, tt, ww, a2, qq):
    """`(since, peak, rounding)`. The rounding level: <t, t> cancelled down to
    the rounding of its terms (omega would be noise), or the recursive
    residual near the rounding of the largest one and not lowered for STALL
    steps. Past it the recursive residual hovers while x drifts away
    (measured: rtol 1e-14 on convection-diffusion 64^2, the residual held
    near 2e-12 for 2800 steps while x reached Inf)."""
    eps = jnp.finfo(rr.dtype).eps
    since = jnp.where(rr < st.best, 0, st.since + 1)
    peak = jnp.maximum(st.peak, rr)
    stalled = (since >= STALL) & (rr <= (1e4 * eps) ** 2 * peak)
    return since, peak, (tt <= 100 * eps * (ww + a2 * qq)) | stalled


def _one_sync_step(st: _OneSyncState, ctx: _Context) -> _OneSyncState:
    """One BiCGStab step with one synchronization (after Yang & Brent 2002).

    With `w = B r` and `q = B v` carried along, `s = r - alpha v` and
    `t = B s = w - alpha q` are known before their products are: every
    product of the step expands into products of `r0, r, v, w, q`, all taken
    in **one** reduction at the top of the step. Two matvecs follow it:
    `B t` (for `w' = B r' = t - omega B t`) and `q' = B v'`. The expansions
    of `<s, s>`, `<t, s>` and `<t, t>` lose relative accuracy when `s` is
    much smaller than `r` (cancellation): the finite-precision cost of the
    saved synchronization (docs/krylov.md).
    """
    B = _preconditioned(ctx)
    with jax.named_scope("solvax.bicgstab.reduce"):
        products = ctx.ip.multi_dot(
            [(st.r, st.r), (st.shadow, st.r), (st.shadow, st.v), (st.shadow, st.w),
             (st.shadow, st.q), (st.w, st.r), (st.w, st.v), (st.q, st.r), (st.q, st.v),
             (st.w, st.w), (st.w, st.q), (st.q, st.q), (st.r, st.v), (st.v, st.v)])
    (rr, r0r, r0v, r0w, r0q, wr, wv, qr, qv, ww, wq, qq, rv, vv) = products
    rr, ww, qq, vv = (jnp.real(a) for a in (rr, ww, qq, vv))
    history = None if st.history is None else st.history.at[st.k].set(reduce.real_sqrt(rr))
    alpha, a2, omega, beta, rho_next, ss, tt, ts = _one_sync_coefficients(
        rr, r0r, r0v, r0w, r0q, wr, wv, qr, qv, ww, wq, qq, rv, vv)
    done, limit = rr <= ctx.tol2, st.k >= ctx.max_steps
    finite = jnp.isfinite(rr) & jnp.isfinite(jnp.abs(r0v)) & jnp.isfinite(tt) & jnp.isfinite(
        jnp.abs(ts))
    norm = reduce.real_sqrt
    start_rr = jnp.where(st.k == st.start, rr, st.start_rr)  # <r0, r0>
    lost_alpha = negligible(r0v, norm(start_rr), norm(vv))
    lost_omega = (tt == 0) | negligible(ts, norm(tt), norm(ss))
    since, peak, rounding = _rounding_level(st, rr, tt, ww, a2, qq)
    half = ss <= ctx.tol2
    # The expansions drift from the vectors they stand for, and the Lanczos
    # part breaks down (float32 Poisson 128^2: BREAKDOWN at 1e-3 to 1.1 ||b||,
    # where standard BiCGStab reaches its floor). As standard BiCGStab does,
    # a lost alpha after a step since the last (re)start, and a stop on
    # omega, rho or the rounding level after the residual fell 10x since it,
    # restart from the true residual, which becomes the shadow
    # (`_one_sync_restart`: matvecs, no reduction).
    drifted = rounding | lost_omega | (rho_next == 0)
    fell = jnp.minimum(st.best, rr) <= 1e-2 * start_rr
    restart = (st.k > st.start) & (lost_alpha | (drifted & fell))
    status = first_status([(done, Status.CONVERGED), (limit, RUNNING),
                           (~finite, Status.NONFINITE), (restart, RUNNING),
                           (lost_alpha, Status.BREAKDOWN), (half, Status.CONVERGED),
                           (rounding, Status.STAGNATION),
                           (lost_omega | (rho_next == 0), Status.BREAKDOWN)], RUNNING)
    pending = restart & (status == RUNNING) & ~limit
    take_alpha = ~done & ~limit & finite & ~lost_alpha & ~pending
    take_omega = take_alpha & ~half & ~rounding & ~lost_omega
    alpha = jnp.where(take_alpha, alpha, jnp.zeros_like(alpha))
    omega = jnp.where(take_omega, omega, jnp.zeros_like(omega))
    s = tree.axpy(-alpha, st.v, st.r)
    t = tree.axpy(-alpha, st.q, st.w)
    with jax.named_scope("solvax.bicgstab.matvec"):
        bt = B(t)
    u = tree.axpy(omega, s, tree.axpy(alpha, st.p, st.u))
    r = tree.axpy(-omega, t, s)
    w = tree.axpy(-omega, bt, t)
    p = tree.axpy(beta, tree.axpy(-omega, st.v, st.p), r)
    v = tree.axpy(beta, tree.axpy(-omega, st.q, st.v), w)
    with jax.named_scope("solvax.bicgstab.matvec"):
        q = B(v)
    return st._replace(u=u, r=r, p=p, v=v, w=w, q=q, best=jnp.minimum(st.best, rr),
                       since=since, peak=peak, k=st.k + take_alpha.astype(jnp.int32),
                       go=(status == RUNNING) & ~limit & ~pending, status=status,
                       history=history, start_rr=start_rr, pending=pending)


def _one_sync_from(st: _OneSyncState, ctx: _Context, x, r) -> _OneSyncState:
    """The one-synchronization recurrences (re)started at `x` with residual
    `r`: `r` becomes the shadow, `p = r`, and `w = B r = v`, `q = B v` are
    computed (two matvecs, no reduction: the next step's one measures them)."""
    B = _preconditioned(ctx)
    w = B(r)
    q = B(w)
    return st._replace(x=x, shadow=r, u=tree.zeros_like(r), r=r, p=r, v=w, w=w, q=q,
                       start=st.k, since=jnp.zeros_like(st.since), pending=jnp.bool_(False),
                       go=jnp.bool_(True))


def _one_sync_restart(st: _OneSyncState, ctx: _Context, b) -> _OneSyncState:
    """Restarted from the current iterate `x + M u` and its true residual (a
    preconditioner application and three matvecs in all)."""
    with jax.named_scope("solvax.bicgstab.restart"):
        x = tree.add(st.x, ctx.M(st.u))
        return _one_sync_from(st, ctx, x, tree.sub(b, ctx.A(x)))


def _run_one_sync(problem: Problem, ctx: _Context, x, r, history) -> Outcome:
    """The one-synchronization loop from `x` (`x0` or 0) and its residual `r`."""
    real = problem.real_dtype()
    state = _OneSyncState(x=x, shadow=r, u=r, r=r, p=r, v=r, w=r, q=r,
                          best=jnp.full((), jnp.inf, real), since=jnp.int32(0),
                          peak=jnp.zeros((), real), k=jnp.int32(0),
                          go=jnp.bool_(True), status=jnp.int32(RUNNING), history=history,
                          start=jnp.int32(0), start_rr=jnp.full((), jnp.inf, real),
                          pending=jnp.bool_(False))
    with jax.named_scope("solvax.bicgstab.setup"):
        state = _one_sync_from(state, ctx, x, r)
    state = steps.confirmed_rounds(
        problem.ip, problem.b, state, checks=lambda st: st, going=lambda st: st.go,
        step=functools.partial(_one_sync_step, ctx=ctx),
        restart=functools.partial(_one_sync_restart, ctx=ctx, b=problem.b))
    x = tree.add(state.x, ctx.M(state.u))
    return Outcome(x=x, status=state.status, iterations=state.k, history=state.history)


METHOD_NAMES = ("standard", "one_sync")
#: Steps without a new least residual, at its rounding level, that stop the
#: one-synchronization recurrences (`_one_sync_step`).
STALL = 30


def _run(problem: Problem, *, method: str, max_steps: int | None,
         record_history: bool) -> Outcome:
    """The BiCGStab iteration (not differentiated itself; see `bicgstab`)."""
    max_steps = problem.step_limit(max_steps)
    rtol, atol = problem.tolerances()
    with jax.named_scope("solvax.bicgstab.setup"):
        x, r, rr, bb = _start(problem)
    tol2 = contract.squared_threshold(bb, rtol, atol)
    ctx = _Context(A=problem.A, M=problem.precond or (lambda v: v), ip=problem.ip, tol2=tol2,
                   max_steps=max_steps)
    if method == "one_sync":
        return _run_one_sync(problem, ctx, x, r, problem.history(max_steps + 1, record_history))
    one = jnp.ones((), tree.result_dtype(problem.b))
    state = _State(x=x, r=r, p=tree.zeros_like(r), v=tree.zeros_like(r), rho=rr.astype(one.dtype),
                   rho_prev=one, alpha=one, omega=one, k=jnp.int32(0), go=jnp.bool_(True),
                   status=jnp.int32(RUNNING), history=problem.history(max_steps + 1,
                                                                      record_history),
                   shadow=r, shadow_norm=reduce.real_sqrt(rr), rr=rr, start=jnp.int32(0),
                   pending=jnp.bool_(False))
    # steps in rounds, each after a restart where the last one asked for it
    state = steps.confirmed_rounds(problem.ip, problem.b, state, checks=lambda st: st,
                                     going=lambda st: st.go,
                                     step=functools.partial(_step, ctx=ctx), restart=_restart)
    return Outcome(x=state.x, status=state.status, iterations=state.k, history=state.history)


BICGSTAB = driver.register(contract.Method("bicgstab", _run))


@documented
def bicgstab(
    matvec: Callable[[PyTree], PyTree],
    b: PyTree,
    *,
    x0: PyTree | None = None,
    precond: Callable[[PyTree], PyTree] | None = None,
    rtol: float | None = None,
    atol: float = 0.0,
    max_steps: int | None = None,
    method: str = "standard",
    record_history: bool = False,
    inner_product=None,
    axis_name: str | tuple[str, ...] | None = None,
    failed_derivative: str = "nan",
) -> Solution:
    """BiCGStab for a general (nonsymmetric) `A`, right-preconditioned.

    With the shadow residual `r0` (the initial residual) and `s = r - alpha v`:

        rho = <r0, r>,  beta = (rho / rho') (alpha / omega),  p = r + beta (p - omega v),
        v = A M p,  alpha = rho / <r0, v>,  t = A M s,  omega = <t, s> / <t, t>,
        x += alpha M p + omega M s,  r = s - omega t

    two matvecs and **two synchronizations** per step: `[<r0, v>, <r, r>, <v, v>]`,
    then `[<t, s>, <t, t>, <s, s>, <r0, s>, <r0, t>]` (the next `rho` follows
    from the last two, so it needs no reduction of its own).

    Differs from the textbook / `jax.scipy.sparse.linalg.bicgstab`:
      1. Two synchronizations per step, not four: the next `rho` and the
         residual check share the other products' reductions.
      2. Right preconditioning: the residual tested is `b - A x` itself.
      3. `converged` is decided on the true residual after the loop; a
         `<r0, v>` that is zero up to rounding (below `10 eps` times the
         norms, which the reductions carry) after progress restarts the
         method from `x` with the current residual as the shadow (no extra
         matvec or reduction; jax.scipy divides by it and goes on with a
         step made of rounding); one with no progress since the last
         (re)start, a `<t, s>` zero up to rounding or a `rho` that is
         exactly zero stops the loop as `Status.BREAKDOWN` instead of
         dividing by it (use `gmres`). The `one_sync` method does not
         restart.
      4. Differentiable by implicit differentiation: one more BiCGStab solve
         with the transposed operator.

    Args:
        matvec: `x -> A x` on pytrees shaped like `b`.
        b: right-hand side (array or pytree; each leaf keeps its sharding).
        x0, rtol, atol, inner_product, axis_name, failed_derivative: the common options.
        precond: `v -> M v`, a right preconditioner (default identity).
        max_steps: step limit (default `10 * size(b)`); each step is two matvecs.
        method: `"standard"` (two synchronizations per step, above) or
            `"one_sync"`: **one** synchronization per step (after Yang & Brent;
            `w = A M r` and `q = A M v` are carried, so every product of a step
            expands into products taken at its top; 14 scalars in one
            reduction, two matvecs, two more vectors of memory). Its
            expanded norms lose accuracy to cancellation near convergence:
            measured in docs/krylov.md; the true residual still decides
            `converged`.
        record_history: store the residual norm at the start of every step
            in `Solution.history` (length `max_steps + 1`, NaN after the end).

    Returns:
        A `Solution`; `iterations` counts steps that updated `x`.

    Raises:
        TypeError, ValueError: at trace time, for mismatched structures,
            shapes or dtypes, negative tolerances or a negative `max_steps`.

    Reference: H. A. van der Vorst, "Bi-CGSTAB: a fast and smoothly converging
    variant of Bi-CG for the solution of nonsymmetric linear systems", SIAM J.
    Sci. Stat. Comput. 13 (1992).
    """
    checks.check_choice("method", method, METHOD_NAMES)
    return driver.solve(BICGSTAB, matvec, b, x0=x0, precond=precond, rtol=rtol, atol=atol,
                         inner_product=inner_product, axis_name=axis_name,
                         failed_derivative=failed_derivative, method=method,
                         max_steps=max_steps,
                         record_history=record_history)


# Counts: the scale, the setup's ||r||^2 (the first rho), and two per step (one
# with method="one_sync").
register_solver(bicgstab, nonsymmetric=True, newton=True, variants=(
    Variant("bicgstab", {}, "bicgstab", (4, 8, 2)),
    Variant("bicgstab_one_sync", {"method": "one_sync"}, "bicgstab", (3, 6, 1)),
), rows=(
    Row("BiCGStab"),
    Row("BiCGStab, method='one_sync'", {"method": "one_sync"}),
    Row("shard_map: BiCGStab (axis_name)", {}, "shard_map"),
    Row("shard_map: BiCGStab one_sync (axis_name)", {"method": "one_sync"}, "shard_map"),
))
