"""Iterative refinement: answers in `b`'s precision from corrections solved in a
narrower one (`iterative_refinement`)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from .._core import checks, contract, driver, reduce, tree, validation
from .._core.closure import Closed, apply_transposed, transposed
from .._core.contract import Outcome, Problem
from .._core.options import documented
from .._core.registry import Row, Variant, register_solver
from .._core.solution import RUNNING, Solution, Status, first_status
from .._krylov import steps
from .._krylov.gmres import gmres
from . import narrowing

PyTree = Any

#: A refinement step must lower the true residual at least this much (a
#: factor 2); otherwise the inner precision cannot resolve the system
#: (condition number times its unit roundoff near 1 or more): STAGNATION.
CONTRACTION = 0.5
#: The last step's correction is solved to `FINAL_MARGIN * tol / ||r||`.
FINAL_MARGIN = 0.5


class _State(NamedTuple):
    x: PyTree
    r: PyTree  # b - A x, computed in b's precision
    rnorm: jax.Array
    xnorm: jax.Array
    k: jax.Array  # refinement steps taken
    status: jax.Array
    history: jax.Array | None


def _narrow(x, dtype):
    return tree.tree_map(lambda v: narrowing.cast(v, dtype), x)


def _inner_operator(problem: Problem, inner_dtype):
    """The operator in the inner precision: the given `inner_matvec`
    (`problem.data`), transposed as often as the driver transposed `A` (the
    derivative's solve runs on `A^T`), or `A` narrowed (`narrowing.lowered`)."""
    if problem.data is None:
        return narrowing.lowered(problem.A, problem.b, inner_dtype)
    A, inner = problem.A, problem.data
    while isinstance(A, Closed) and A.fn is apply_transposed:
        A, inner = A.consts[0], transposed(inner)
    return inner


def _inner_precond(problem: Problem):
    """The preconditioner as given (its precision is its own: see
    `mixed_precision`), fed and read back in the inner precision; None
    without one."""
    M, b = problem.precond, problem.b
    if M is None:
        return None

    def precond(v):
        out = M(tree.tree_map(lambda u, like: u.astype(like.dtype), v, b))
        return tree.tree_map(lambda o, u: o.astype(u.dtype), out, v)

    return precond


def _run(problem: Problem, *, solver, inner_dtype, inner_rtol: float, max_refinements: int,
         record_history: bool) -> Outcome:
    """Refinement steps until the true residual meets the tolerance, stops
    contracting by `CONTRACTION`, or `max_refinements` ran."""
    b, ip = problem.b, problem.ip
    rtol, atol = problem.tolerances()
    real = problem.real_dtype()
    inner_A = _inner_operator(problem, inner_dtype)
    inner_ip = jax.tree_util.tree_map(lambda w: narrowing.cast(w, inner_dtype), ip)
    precond = _inner_precond(problem)
    with jax.named_scope("solvax.refinement.setup"):
        x, r = problem.residual()
        bb, rr, xx = jnp.real(ip.multi_dot([(b, b), (r, r), (x, x)]))
        x, r = problem.settled(x, r, bb)
        rr = jnp.where(bb == 0, 0, rr)
    tol = contract.threshold(bb, rtol, atol)
    rnorm = reduce.real_sqrt(rr)
    history = problem.history(max_refinements + 1, record_history)
    if history is not None:
        history = history.at[0].set(rnorm)
    status = first_status([(~jnp.isfinite(rr), Status.NONFINITE), (rnorm <= tol, Status.CONVERGED)],
                          RUNNING)
    st = _State(x=x, r=r, rnorm=rnorm, xnorm=reduce.real_sqrt(xx), k=jnp.int32(0),
                status=status, history=history)

    def body(st: _State) -> _State:
        scale = jnp.where(st.rnorm > 0, st.rnorm, 1)
        rhs = _narrow(tree.scale(1 / scale, st.r), inner_dtype)
        # never more than the tolerance needs: a last step close to it solves
        # its correction to the remaining factor (with a margin of 2), not to
        # `inner_rtol` (Poisson 1024^2 to 1e-12: 14 -> 12 inner iterations)
        rtol = jnp.maximum(inner_rtol, FINAL_MARGIN * tol / scale).astype(real)
        with jax.named_scope("solvax.refinement.inner"):
            sol = solver(inner_A, rhs, precond=precond, rtol=jnp.minimum(rtol, 0.5),
                         atol=0.0, inner_product=inner_ip)
        d = tree.tree_map(lambda v, like: v.astype(like.dtype), sol.x, st.x)
        x = tree.add(st.x, tree.scale(scale, d))
        with jax.named_scope("solvax.refinement.residual"):
            r = tree.sub(b, problem.A(x))
            rr, xx = jnp.real(ip.multi_dot([(r, r), (x, x)]))
        rnorm = reduce.real_sqrt(rr)
        # a step that does not halve the residual (or is not finite) is not
        # taken: the best iterate is returned with the reason it stopped
        taken = rnorm <= CONTRACTION * st.rnorm
        status = first_status([(rnorm <= tol, Status.CONVERGED),
                               (~taken, Status.STAGNATION)], RUNNING)
        history = None if st.history is None else st.history.at[st.k + 1].set(rnorm)
        keep = (rnorm <= tol) | taken
        new = _State(x=x, r=r, rnorm=rnorm, xnorm=reduce.real_sqrt(xx), k=st.k + 1,
                     status=status, history=history)
        # a step not kept ends the loop, and `r` is not read after it: only
        # `x` and the scalars are selected (no pass over `r` in b's precision)
        old = st._replace(r=r, k=st.k + 1, status=status, history=history)
        return jax.tree_util.tree_map(lambda n, o: n if n is o else jnp.where(keep, n, o),
                                      new, old)

    st = steps.while_loop(ip, b, lambda st: (st.status == RUNNING) & (st.k < max_refinements),
                            body, st, per_step=False)
    return Outcome(x=st.x, status=st.status, iterations=st.k, history=st.history,
                   residual=(st.rnorm, tol, st.xnorm))


REFINEMENT = driver.register(contract.Method("iterative_refinement", _run))


@documented
def iterative_refinement(
    matvec: Callable[[PyTree], PyTree],
    b: PyTree,
    *,
    solver: Callable[..., Solution] | None = None,
    inner_dtype=jnp.float32,
    inner_matvec: Callable[[PyTree], PyTree] | None = None,
    x0: PyTree | None = None,
    precond: Callable[[PyTree], PyTree] | None = None,
    rtol: float | None = None,
    atol: float = 0.0,
    inner_rtol: float = 1e-4,
    max_refinements: int = 30,
    record_history: bool = False,
    inner_product=None,
    axis_name: str | tuple[str, ...] | None = None,
    failed_derivative: str = "nan",
) -> Solution:
    """Solve `A x = b` to `b`'s precision with corrections solved in a narrower one.

    Each refinement step takes the true residual `r = b - A x` in `b`'s
    precision (float64, say), solves the correction `A d = r / ||r||` with a
    solvax Krylov method in `inner_dtype` (float32: half the bytes of every
    vector, stencil and multigrid cycle it streams) to `inner_rtol`, and
    updates `x += ||r|| d` in `b`'s precision (Carson & Higham's GMRES-based
    refinement, with any solver). Each step lowers the error by about
    `max(inner_rtol, kappa u)` (`u` the inner precision's unit roundoff,
    6e-8 in float32), so it reaches `b`'s precision whenever `kappa u` is
    well below 1.

    The operator in the inner precision: `inner_matvec` if given, else
    `matvec` itself re-evaluated with every floating value it holds (the
    arrays it closes over, its constants) narrowed to `inner_dtype`
    (`mixed_precision`'s mechanism; a `matvec` with a loop or conditional
    inside is refused: pass `inner_matvec`). The preconditioner is applied
    to the inner solves as given: build it in the inner precision
    (`sx.multigrid(A, dtype=jnp.float32)` or `sx.mixed_precision(M)`) to
    save its bytes too.

    Statuses: `CONVERGED` when the true residual in `b`'s precision meets
    `max(atol, rtol ||b||)`; `STAGNATION` when a step fails to halve it (the
    system is too ill-conditioned for the inner precision, or the inner
    solver could not solve it; the best `x` is returned); `MAX_STEPS` after
    `max_refinements`; `NONFINITE` for non-finite data. Never a claimed
    convergence the residual does not show.

    Args:
        matvec: `x -> A x` on pytrees shaped like `b` (float64, say).
        b: right-hand side.
        solver: the inner Krylov method, `sx.pcg` (default), `sx.gmres`,
            `sx.bicgstab`, ... or a `functools.partial` of one with its
            options (`restart=`, `max_steps=`).
        inner_dtype: the corrections' precision: a real floating dtype of
            32 bits or more (complex vectors take the complex dtype of that
            width), narrower than `b`'s for any saving.
        inner_matvec: `d -> A d` in `inner_dtype`, for operators that cannot
            be narrowed automatically.
        x0, rtol, atol, inner_product, axis_name, failed_derivative: the common options.
        precond: a preconditioner for the inner solves.
        inner_rtol: each correction's relative tolerance (default 1e-4:
            4 orders per step; at least 10 times the inner unit roundoff).
        max_refinements: the most refinement steps (>= 0).
        record_history: the true residual before each step in `history`.
        inner_product, axis_name: as for the solvers (a `solvax.InnerProduct`;
            a function is refused: it cannot be narrowed).

    Returns:
        A `Solution`; `iterations` counts refinement steps (each one inner
        solve; `history`, when recorded, is the true residual before each).

    Communication: the inner solves' reductions, plus one per refinement step
    (`||r||^2` and `||x||^2` together) and one before the first; no gather.

    Differentiable implicitly, as every solver: the derivative is one more
    refinement on the transposed system (with `inner_matvec`, its transpose).

    Raises:
        TypeError, ValueError: at trace time, for a bad `inner_dtype`,
            `solver`, tolerance or count, a callable `inner_product`, a
            `matvec` that cannot be narrowed, and what every solver refuses.

    Reference: E. Carson, N. J. Higham, "Accelerating the solution of linear
    systems by iterative refinement in three precisions", SIAM J. Sci.
    Comput. 40 (2018).
    """
    inner_dtype = narrowing.checked_dtype("inner_dtype", inner_dtype)
    if solver is None:
        from .._krylov.cg import pcg as solver
    if not callable(solver):
        raise TypeError(f"`solver` must be a solvax solver such as `sx.pcg` or a "
                        f"functools.partial of one; got {solver!r}.")
    checks.check_tolerance("inner_rtol", inner_rtol)
    if not 0 < float(inner_rtol) < 1:
        raise ValueError(f"`inner_rtol` must be in (0, 1): each step's correction is solved "
                         f"to it (e.g. 1e-4); got {inner_rtol!r}.")
    max_refinements = checks.check_int("max_refinements", max_refinements, 0)
    if inner_product is not None and not isinstance(inner_product, reduce.InnerProduct):
        raise TypeError("`inner_product` must be None or a `solvax.InnerProduct` for "
                        "iterative refinement (a function cannot be narrowed to `inner_dtype`).")
    checks.check_vector("b", b)
    data = None
    if inner_matvec is not None:
        data = validation.closed_operator("inner_matvec", inner_matvec, _narrow(b, inner_dtype),
                                       arg="b narrowed")
    return driver.solve(REFINEMENT, matvec, b, x0=x0, precond=precond, rtol=rtol, atol=atol,
                         inner_product=inner_product, axis_name=axis_name,
                         failed_derivative=failed_derivative, data=data,
                         solver=solver, inner_dtype=inner_dtype, inner_rtol=float(inner_rtol),
                         max_refinements=max_refinements, record_history=record_history)


# Counts: around GMRES (nonsymmetric operators), corrections in float32: the
# scale and the setup's [||b||^2, ||r||^2, ||x||^2]; per refinement step the
# step's [||r||^2, ||x||^2] and the inner GMRES's scale (the refinement loop),
# its restart (the restart loop) and one per Arnoldi step (the innermost loop).
register_solver(iterative_refinement, nonsymmetric=True, limit="max_refinements", variants=(
    Variant("iterative_refinement", {"solver": functools.partial(gmres, restart=20)},
            "iterative_refinement", (6, 12, 4)),
), rows=(
    Row("iterative_refinement, float32 FGMRES(16) corrections",
        {"solver": functools.partial(gmres, restart=16)}),
))
