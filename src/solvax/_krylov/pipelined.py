"""Pipelined CG (Ghysels & Vanroose): one stacked reduction per step
overlapping the matvec, residual replacement, and the restarts that confirm
convergence on the true residual."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from .._core import tree
from . import steps
from .cg_steps import Context, PyTree, Scalars, advance, products, recurrence, top_of_step


class Pipelined(NamedTuple):
    x: PyTree
    r: PyTree
    p: PyTree
    s: PyTree  # A p
    w: PyTree  # A u
    z: PyTree  # A q
    u: PyTree | None  # M r (None without a preconditioner: u = r)
    q: PyTree | None  # M s (None without a preconditioner: q = s)
    sc: Scalars
    checks: steps.Confirmation | None = None  # confirming convergence on the true residual


def pipelined_step(st: Pipelined, ctx: Context) -> Pipelined:
    """Ghysels & Vanroose (2014), Alg. 4: the one reduction of the step does not
    feed M w and A M w, so it can overlap with them. With M = I, u = r and q = s."""
    u = st.r if ctx.identity else st.u
    with jax.named_scope("solvax.pcg.reduce"):
        gamma, delta, rr = products(ctx, st.r, u, st.w)
    with jax.named_scope("solvax.pcg.precond"):
        m = ctx.M(st.w)
    with jax.named_scope("solvax.pcg.matvec"):
        n = ctx.A(m)
    sc, go = top_of_step(st.sc, ctx, rr, gamma)
    beta, alpha, curvature, go = recurrence(sc, gamma, delta, go)
    z = tree.axpy(beta, st.z, n)
    s = tree.axpy(beta, st.s, st.w)
    p = tree.axpy(beta, st.p, u)
    q = None if ctx.identity else tree.axpy(beta, st.q, m)
    # Each vector is overwritten after the readers of its old value (in place).
    return Pipelined(
        x=tree.axpy(alpha, p, st.x), r=tree.after(tree.axpy(-alpha, s, st.r), p),
        p=p, s=s, w=tree.after(tree.axpy(-alpha, z, st.w), s), z=z,
        u=None if ctx.identity else tree.after(tree.axpy(-alpha, q, u), p), q=q,
        sc=advance(sc, go, alpha, rr, gamma, curvature), checks=st.checks)


def _replace_residuals(st: Pipelined, ctx: Context, b) -> Pipelined:
    """Residual replacement: recompute the recursively updated vectors from x and p."""
    with jax.named_scope("solvax.pcg.residual_replacement"):
        r = tree.sub(b, ctx.A(st.x))
        u = ctx.M(r)
        s = ctx.A(st.p)
        q = ctx.M(s)
        return st._replace(r=r, w=ctx.A(u), s=s, z=ctx.A(q),
                           u=None if ctx.identity else u, q=None if ctx.identity else q)


def _restart(st: Pipelined, ctx: Context, b) -> Pipelined:
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


def pipelined_with_replacement(st: Pipelined, ctx: Context, b, every: int) -> Pipelined:
    st = pipelined_step(st, ctx)
    return lax.cond(st.sc.go & (st.sc.k % every == 0),
                    lambda s: _replace_residuals(s, ctx, b), lambda s: s, st)


def replaced_blocks(st: Pipelined, ctx: Context, b, every: int, ip, like) -> Pipelined:
    """`pipelined_with_replacement`'s loop where a conditional's index goes to
    the host (a GPU, `target.branches_on_device`): blocks of `every` steps in
    a counted loop, each step selected only while the loop goes on, then the
    replacement, selected the same way. The replacement comes after the
    same steps (`k` a multiple of `every`) as with one test per step, and
    the loop tests once per block."""
    def going(s):
        return s.sc.go

    def block(s):
        s = steps.frozen_steps(going, lambda s: pipelined_step(s, ctx), s, every)
        return tree.where(s.sc.go, _replace_residuals(s, ctx, b), s)

    return steps.while_loop(ip, like, going, block, st, per_step=False)


def _confirmed_step(st: Pipelined, ctx: Context) -> Pipelined:
    """A pipelined step whose stopping test is confirmed on the true residual
    (`steps.Confirmation`): a step whose own residual met the tolerance, or
    whose recurrences drifted, ends the round (`pending`) and does not count;
    so does one whose own residual fell by the round's `progress` (it
    counts); one after a restart whose true residual is not below the
    previous restart's stops the solve (after retries: `Confirmation`)."""
    new = pipelined_step(st, ctx)
    sc = new.sc
    stopped = ~sc.go & (sc.k <= ctx.max_steps)
    # A step that passed its residual test but found <p, A p> (or <r, M r>) not
    # positive: in float32 the recurrences drift from the vectors they stand
    # for (measured: a negative curvature on SPD Poisson 128^2 at 1e-5, and
    # an x worse than 0), so the round restarts from x; the step after the
    # restart, from directly computed vectors, decides INDEFINITE.
    drifted = stopped & (sc.rr > sc.tol2) & (sc.rr < sc.cap2) & jnp.isfinite(sc.gamma)
    progressed = sc.go & st.checks.progressed(sc.rr)
    confirmed = st.checks.after_step(stopped & (sc.rr <= sc.tol2) | drifted | progressed,
                                     sc.rr, sc.tol2)
    # a pending step that stopped updated neither x nor r (alpha = 0)
    uncounted = (confirmed.pending & ~sc.go).astype(sc.k.dtype)
    sc = sc._replace(go=sc.go & ~confirmed.stalled & ~confirmed.pending, k=sc.k - uncounted)
    return new._replace(sc=sc, checks=confirmed)


def pipelined_rounds(state: Pipelined, ctx: Context, b) -> Pipelined:
    """Pipelined CG in rounds whose stopping test is confirmed on the true
    residual: the restart from `x` costs 2 matvecs and no reduction (the next
    step's reduction tests it)."""
    return steps.confirmed_rounds(
        ctx.ip, b, state, checks=lambda st: st.checks,
        step=functools.partial(_confirmed_step, ctx=ctx),
        going=lambda st: st.sc.go & (st.sc.k <= ctx.max_steps),
        restart=lambda st: _restart(st, ctx, b))
