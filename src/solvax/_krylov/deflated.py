"""Deflated (recycled) CG: the steps projected off a recycled space `U`
(`A U = C`), its start, and the next space harvested from the run."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from .._core import contract, tree
from .._core.contract import Outcome, Problem
from . import recycling, steps
from .cg_steps import Context, PyTree, Scalars, advance, finished, next_direction, top_of_step

#: deflated CG keeps this many directions per slot of its space for the next
#: solve's Rayleigh-Ritz update (measured on the 256^2 diffusion sequence of
#: `benchmark_recycling.py`, k = 20: 4 -> 0.73x of CG's matvecs, 6 -> 0.67x;
#: at 128^2, 2/4/6 per slot: 0.77/0.67/0.63x)
DIRECTIONS_PER_SLOT = 6


class _Deflated(NamedTuple):
    x: PyTree
    r: PyTree
    p: PyTree  # search direction, A-conjugate to the recycled space
    P: PyTree  # the first `ell` directions (row `ell`: scratch for the later ones)
    Q: PyTree  # A P
    curvatures: jax.Array  # their <p, A p> (0 where no step went)
    sc: Scalars


def _deflated_step(st: _Deflated, ctx: Context) -> _Deflated:
    """Deflated CG (Saad, Yeung, Erhel, Guyomarc'h 2000): the standard step
    with each direction made A-conjugate to the recycled space, `p = z - U
    C^H z + beta p` (`C = A U`, `U^H C = I`), the projections `C^H z` riding
    in the step's `<r, z>`, `<r, r>` reduction: still two reductions per
    step. The first `ell` directions and their `A p` are kept (written in
    place) for the next solve's space (`recycling.ritz_space`)."""
    C, U = ctx.space
    with jax.named_scope("solvax.pcg.precond"):
        z = ctx.M(st.r)
    with jax.named_scope("solvax.pcg.reduce"):
        cz, products = ctx.ip.project_many(C, [z], [(st.r, z), (st.r, st.r)])
        gamma, rr = jnp.real(products)
    sc, go = top_of_step(st.sc, ctx, rr, gamma)
    beta = gamma / sc.gamma
    p = tree.axpy(beta, st.p, tree.sub(z, tree.basis_combine(U, cz[0])))
    q, pq, go, alpha = next_direction(p, ctx, go, gamma)
    row = jnp.minimum(sc.k, ctx.ell)
    return _Deflated(x=tree.axpy(alpha, p, st.x), r=tree.axpy(-alpha, q, st.r), p=p,
                     P=tree.basis_fill(st.P, row, [p], go),
                     Q=tree.basis_fill(st.Q, row, [q], go),
                     curvatures=st.curvatures.at[row].set(jnp.where(go, pq, 0)),
                     sc=advance(sc, go, alpha, rr, gamma, pq))


def _deflated_start(problem: Problem, ctx: Context, k: int):
    """`(ctx, x, r, tol2)` for deflated CG: the recycled space (given: made
    A-orthonormal for this operator, `k` matvecs and one reduction; else
    empty), and the start projected on it, `x += U U^H r`, `r -= C U^H r`
    (exact for `A U = C`, `U^H C = I`), `||b||^2` in the same reduction."""
    with jax.named_scope("solvax.pcg.recycle"):
        given = problem.data
        space = (recycling.empty(problem.b, k) if given is None
                 else recycling.conjugated(problem.A, problem.ip, given[1]))
        x, r = problem.residual()
        mu, products = problem.ip.project_many(space.U, [r], [(problem.b, problem.b)])
        bb = jnp.real(products[0])
        x = tree.add(x, tree.basis_combine(space.U, mu[0]))
        r = tree.sub(r, tree.basis_combine(space.C, mu[0]))
        x, r = problem.settled(x, r, bb)
    return ctx._replace(space=space, tol_from_rr=False), x, r, contract.squared_threshold(
        bb, ctx.rtol, ctx.atol)


def run_deflated(problem: Problem, ctx: Context, real, record_history: bool, k: int,
                  ell: int) -> Outcome:
    """Deflated CG from its recycled space to the space for the next solve."""
    ctx, x, r, tol2 = _deflated_start(problem, ctx._replace(ell=ell), k)
    one = jnp.ones((), real)
    sc = Scalars(gamma=one, alpha=one, tol2=tol2, k=jnp.int32(0), go=jnp.bool_(True),
                  rr=one, curvature=one,
                  history=problem.history(ctx.max_steps + 1, record_history),
                  cap2=jnp.full((), jnp.inf, real))
    P = tree.basis_alloc(problem.b, ell + 1)
    state = _Deflated(x=x, r=r, p=tree.zeros_like(r), P=P, Q=P,
                      curvatures=jnp.zeros((ell + 1,), real), sc=sc)
    state = steps.while_loop(problem.ip, problem.b,
                               lambda st: st.sc.go & (st.sc.k <= ctx.max_steps),
                               functools.partial(_deflated_step, ctx=ctx), state)
    with jax.named_scope("solvax.pcg.recycle"):
        first = functools.partial(tree.tree_map, lambda leaf: leaf[:ell])
        C, U = ctx.space
        space = recycling.ritz_space(problem.ip, U, C, first(state.P), first(state.Q),
                                    state.curvatures[:ell], k, recycling.RecycleSpace(C, U))
    outcome = finished(state.sc, state.x, ctx.max_steps)
    return outcome._replace(recycle=space)
