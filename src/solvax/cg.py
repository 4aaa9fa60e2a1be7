"""Preconditioned conjugate gradients on pytrees."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from . import _checks, _reduce
from . import _tree as tree
from ._solution import RUNNING, Solution, Status, first_status, make_solution
from .linear_solve import krylov_solve

PyTree = Any


METHODS = ("standard", "single_reduction", "pipelined")


class _State(NamedTuple):
    x: PyTree
    r: PyTree  # recursively updated residual b - A x
    p: PyTree  # search direction
    s: PyTree  # A p (single-reduction and pipelined; else None)
    u: PyTree  # M r (pipelined with a preconditioner; else None)
    w: PyTree  # A u (pipelined)
    q: PyTree  # M s (pipelined with a preconditioner)
    z: PyTree  # A q (pipelined)
    gamma: jax.Array  # <r, M r> of the previous step
    alpha: jax.Array  # previous step length
    tol2: jax.Array  # squared stopping threshold max(atol, rtol ||b||)^2
    k: jax.Array  # steps run (the last one did not update x unless `go`)
    go: jax.Array  # the last step went on; else it stopped the loop, and
    rr: jax.Array  # its <r, r> and
    curvature: jax.Array  # its <p, A p> (with gamma, tol2) say why (`_stop_reason`)
    history: jax.Array | None  # recursive residual norm per step (if recorded)


def _masked_div(pred, num, den):
    """`num / den` where `pred` holds, else 0, with the division last: XLA then
    computes the scalar once per step, where a final select would be fused
    into (and recompiled with) every vector update that reads it."""
    return jnp.where(pred, num, 0) / jnp.where(pred, den, 1)


def _squared_threshold(bb, rtol, atol):
    """`max(atol, rtol ||b||)^2` from `bb = ||b||^2` (no square root)."""
    return jnp.maximum(atol * atol, rtol * rtol * bb)


def _may_go(rr, gamma, tol2):
    """`tol2 < rr < inf` and `0 < gamma < inf`: comparisons only (false for NaN)."""
    return (tol2 < rr) & (rr < jnp.inf) & (0 < gamma) & (gamma < jnp.inf)


def _top_of_step(state: _State, rr, gamma, rtol, atol, tol_from_rr: bool):
    """The stopping threshold and history, updated from the reduced values at
    the top of a step, and whether the step may go on (`_may_go`)."""
    first = state.k == 0
    if tol_from_rr:  # x0 = None: ||b||^2 is the first step's <r, r>
        tol2 = jnp.where(first, _squared_threshold(rr, rtol, atol), state.tol2)
    else:
        tol2 = state.tol2
    history = state.history
    if history is not None:
        history = history.at[state.k].set(_reduce.real_sqrt(rr))
    return state._replace(tol2=tol2, history=history), _may_go(rr, gamma, tol2)


def _goes(go, curvature):
    """The step updates `x`: its top passed (`_may_go`) and `0 < <p, A p> < inf`."""
    return go & (0 < curvature) & (curvature < jnp.inf)


def _stop_reason(rr, gamma, curvature, tol2):
    """Why a step that did not go on stopped, in order: non-finite values,
    convergence, a non-positive-definite preconditioner or operator.

    Evaluated once after the loop from the last step's carried values, not in
    every step: the loop itself decides with comparisons only (`_may_go`,
    `_goes`), and when only `x` is used the compiler drops this altogether.
    """
    return first_status([(~(jnp.isfinite(rr) & jnp.isfinite(gamma)), Status.NONFINITE),
                         (rr <= tol2, Status.CONVERGED),
                         ((gamma <= 0) | jnp.isfinite(curvature), Status.INDEFINITE)],
                        Status.NONFINITE)


def _recurrence(st: _State, gamma, delta, go):
    """Chronopoulos–Gear coefficients from `gamma = <r, M r>`, `delta = <M r, A M r>`:
    `beta = gamma / gamma_prev`, `<p, A p> = delta - beta gamma / alpha_prev`."""
    beta = gamma / st.gamma  # see `_pcg_solve.standard`
    curvature = jnp.where(st.k == 0, delta, delta - beta * gamma / st.alpha)
    go = _goes(go, curvature)
    return beta, _masked_div(go, gamma, curvature), curvature, go


def _advance(st: _State, go, alpha, rr, gamma, curvature, **vectors) -> _State:
    """The state after a step. `k` counts steps run, whether or not they went on
    (the loop ends with the first that did not; see `_pcg_solve`), so it does
    not depend on the step's outcome."""
    return st._replace(go=go, alpha=alpha, rr=rr, gamma=gamma, curvature=curvature,
                       k=st.k + 1, **vectors)


def _pcg_solve(matvec, b, *, x0, precond, rtol, atol, max_steps, method, ip,
               residual_replacement, record_history):
    """The PCG iteration (not differentiated itself; see `pcg`)."""
    dtype = tree.result_dtype(b)
    real = jnp.finfo(dtype).dtype
    identity = precond is None
    M = (lambda v: v) if identity else precond
    rtol = jnp.asarray(rtol, real)
    atol = jnp.asarray(atol, real)

    if x0 is None:
        x, r, tol2 = tree.zeros_like(b), b, jnp.asarray(jnp.inf, real)
    else:
        with jax.named_scope("solvax.pcg.setup"):
            bb = jnp.real(ip.dot(b, b))
            zero_b = bb == 0  # b = 0: the answer is exactly 0, whatever x0
            x = tree.where(zero_b, tree.zeros_like(b), x0)
            r = tree.where(zero_b, b, tree.sub(b, matvec(x0)))
            tol2 = _squared_threshold(bb, rtol, atol)
    one = jnp.ones((), real)
    zeros = tree.zeros_like(b)
    state = _State(x=x, r=r, p=zeros, s=None, u=None, w=None, q=None, z=None, gamma=one,
                   alpha=one, tol2=tol2, k=jnp.int32(0), go=jnp.bool_(True), rr=one,
                   curvature=one,
                   history=jnp.full((max_steps + 1,), jnp.nan, real) if record_history else None)
    if method == "single_reduction":
        state = state._replace(s=zeros)
    elif method == "pipelined":
        with jax.named_scope("solvax.pcg.setup"):
            u = M(r)
            state = state._replace(s=zeros, w=matvec(u), z=zeros,
                                   **({} if identity else dict(u=u, q=zeros)))
    top = functools.partial(_top_of_step, rtol=rtol, atol=atol, tol_from_rr=x0 is None)

    def standard(st: _State) -> _State:
        with jax.named_scope("solvax.pcg.precond"):
            z = M(st.r)
        with jax.named_scope("solvax.pcg.reduce"):
            if identity:
                rr = jnp.real(ip.dot(st.r, st.r))
                gamma = rr
            else:
                gamma, rr = jnp.real(ip.multi_dot([(st.r, z), (st.r, st.r)]))
        st, go = top(st, rr, gamma)
        # No guard needed: a step runs only after one that went on (gamma, alpha > 0)
        # or from the initial 1s, and the first step's beta multiplies p = 0.
        beta = gamma / st.gamma
        p = tree.axpy(beta, st.p, z)
        with jax.named_scope("solvax.pcg.matvec"):
            q = matvec(p)
        with jax.named_scope("solvax.pcg.reduce"):
            pq = jnp.real(ip.dot(p, q))
        go = _goes(go, pq)
        alpha = _masked_div(go, gamma, pq)
        return _advance(st, go, alpha, rr, gamma, pq, x=tree.axpy(alpha, p, st.x),
                        r=tree.axpy(-alpha, q, st.r), p=p)

    def single(st: _State) -> _State:
        # Chronopoulos & Gear (1989): with u = M r and w = A u, the three products
        # <r, u>, <u, w>, <r, r> are independent and share one reduction.
        with jax.named_scope("solvax.pcg.precond"):
            u = M(st.r)
        with jax.named_scope("solvax.pcg.matvec"):
            w = matvec(u)
        with jax.named_scope("solvax.pcg.reduce"):
            if identity:
                rr, delta = jnp.real(ip.multi_dot([(st.r, st.r), (u, w)]))
                gamma = rr
            else:
                gamma, delta, rr = jnp.real(ip.multi_dot([(st.r, u), (u, w), (st.r, st.r)]))
        st, go = top(st, rr, gamma)
        beta, alpha, curvature, go = _recurrence(st, gamma, delta, go)
        p = tree.axpy(beta, st.p, u)
        s = tree.axpy(beta, st.s, w)
        # p reads the old r; r is updated after p (in place, no copy of r).
        return _advance(st, go, alpha, rr, gamma, curvature, x=tree.axpy(alpha, p, st.x),
                        r=tree.after(tree.axpy(-alpha, s, st.r), p), p=p, s=s)

    def pipelined(st: _State) -> _State:
        # Ghysels & Vanroose (2014), Alg. 4: the one reduction of the step does not
        # feed M w and A M w, so it can overlap with them. With M = I, u = r and q = s.
        u = st.r if identity else st.u
        with jax.named_scope("solvax.pcg.reduce"):
            if identity:
                rr, delta = jnp.real(ip.multi_dot([(st.r, st.r), (u, st.w)]))
                gamma = rr
            else:
                gamma, delta, rr = jnp.real(ip.multi_dot([(st.r, u), (u, st.w), (st.r, st.r)]))
        with jax.named_scope("solvax.pcg.precond"):
            m = M(st.w)
        with jax.named_scope("solvax.pcg.matvec"):
            n = matvec(m)
        st, go = top(st, rr, gamma)
        beta, alpha, curvature, go = _recurrence(st, gamma, delta, go)
        z = tree.axpy(beta, st.z, n)
        s = tree.axpy(beta, st.s, st.w)
        p = tree.axpy(beta, st.p, u)
        q = s if identity else tree.axpy(beta, st.q, m)
        # Each vector is overwritten after the readers of its old value (in place).
        new = dict(x=tree.axpy(alpha, p, st.x), r=tree.after(tree.axpy(-alpha, s, st.r), p),
                   w=tree.after(tree.axpy(-alpha, z, st.w), s), p=p, s=s, z=z)
        if not identity:
            new.update(u=tree.after(tree.axpy(-alpha, q, u), p), q=q)
        st = _advance(st, go, alpha, rr, gamma, curvature, **new)
        if residual_replacement:
            st = lax.cond(go & (st.k % residual_replacement == 0), replace, lambda s: s, st)
        return st

    def replace(st: _State) -> _State:
        """Residual replacement: recompute the recursively updated vectors from x and p."""
        with jax.named_scope("solvax.pcg.residual_replacement"):
            r = tree.sub(b, matvec(st.x))
            u = M(r)
            s = matvec(st.p)
            q = M(s)
            new = dict(r=r, w=matvec(u), s=s, z=matvec(q))
            if not identity:
                new.update(u=u, q=q)
            return st._replace(**new)

    def running(st: _State):
        return st.go & (st.k < max_steps)

    body = {"standard": standard, "single_reduction": single, "pipelined": pipelined}[method]
    state = lax.while_loop(running, body, state)

    # The true residual decides `converged`; ||b|| rides along in the same reduction.
    with jax.named_scope("solvax.pcg.true_residual"):
        r_true = tree.sub(b, matvec(state.x))
        rr, bb = jnp.real(ip.multi_dot([(r_true, r_true), (b, b)]))
    tol = jnp.maximum(atol, rtol * _reduce.real_sqrt(bb))
    # Every step run updated x, except a last one that stopped the loop.
    steps = state.k - (~state.go).astype(jnp.int32)
    status = first_status([(state.go, RUNNING)],
                          _stop_reason(state.rr, state.gamma, state.curvature, state.tol2))
    return make_solution(state.x, status, steps, _reduce.real_sqrt(rr), tol,
                         history=state.history)


def pcg(
    matvec: Callable[[PyTree], PyTree],
    b: PyTree,
    *,
    x0: PyTree | None = None,
    precond: Callable[[PyTree], PyTree] | None = None,
    rtol: float = 1e-8,
    atol: float = 0.0,
    max_steps: int | None = None,
    single_reduction: bool = False,
    method: str | None = None,
    residual_replacement: int | None = None,
    record_history: bool = False,
    inner_product=None,
    axis_name: str | tuple[str, ...] | None = None,
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
    applications each time, no reduction), restoring accuracy. The true
    residual check (1.) reports any shortfall honestly as `STAGNATION`.

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
        rtol, atol: stop when `||b - A x|| <= max(atol, rtol * ||b||)`.
        max_steps: iteration limit (default `10 * size(b)`).
        single_reduction: use the one-reduction-per-step recurrence (the same
            as `method="single_reduction"`).
        method: `"standard"` (default), `"single_reduction"` or `"pipelined"`.
        residual_replacement: pipelined only: recompute the recursively
            updated vectors every this many steps (default never).
        record_history: store the recursive residual norm of every step in
            `Solution.history` (length `max_steps + 1`, NaN after the end).
        inner_product: a `solvax.InnerProduct` (or `(x, y) -> scalar`) used for
            every product and norm, including the stopping test.
        axis_name: inside `shard_map`, the mesh axis the vectors are split over
            (shorthand for `inner_product=InnerProduct(axis_name=...)`).

    Returns:
        A `Solution` with `x`, `status`, `converged`, `iterations` and the true
        `residual_norm`.

    Raises:
        TypeError, ValueError: at trace time, for a `b`, `x0`, `matvec(b)` or
            `precond(b)` whose structure, shapes or dtypes disagree, negative
            tolerances, a negative `max_steps`, an unknown `method`, or
            `residual_replacement` with a method other than `"pipelined"`.

    References: A. T. Chronopoulos and C. W. Gear, "s-step iterative methods
    for symmetric linear systems", J. Comput. Appl. Math. 25 (1989);
    P. Ghysels and W. Vanroose, "Hiding global synchronization latency in the
    preconditioned conjugate gradient algorithm", Parallel Comput. 40 (2014).
    """
    _checks.check_solver_inputs(matvec, b, x0, precond, rtol, atol)
    max_steps = 10 * tree.size(b) if max_steps is None else _checks.check_int("max_steps",
                                                                              max_steps, 0)
    if not isinstance(single_reduction, bool):
        raise TypeError(f"`single_reduction` must be a bool; got {single_reduction!r}.")
    if method is None:
        method = "single_reduction" if single_reduction else "standard"
    _checks.check_choice("method", method, METHODS)
    if single_reduction and method != "single_reduction":
        raise ValueError(f"`single_reduction=True` contradicts `method={method!r}`; pass one.")
    if residual_replacement is not None:
        _checks.check_int("residual_replacement", residual_replacement, 1)
        if method != "pipelined":
            raise ValueError("`residual_replacement` applies to `method='pipelined'` only; "
                             f"got method={method!r}.")
    ip = _reduce.resolve(inner_product, axis_name)
    solve = functools.partial(_pcg_solve, max_steps=max_steps, method=method,
                              residual_replacement=residual_replacement,
                              record_history=bool(record_history))
    # A^T = conj(A) is HPD too (symmetric for real b).
    return krylov_solve(matvec, b, solve, x0=x0, precond=precond, rtol=rtol, atol=atol, ip=ip,
                        symmetric=_checks.is_real(b))


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
