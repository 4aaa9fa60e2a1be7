"""Implicit differentiation of a solve: the tangent is one
`custom_linear_solve` of `A dx = db - dA x`, its transpose one solve with
`A^T`; a derivative whose solve failed is NaN."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from . import tree
from .closure import close, transposed
from .contract import Problem, PyTree
from .solution import Solution


# ----------------------------------------------------------- differentiation
def solution_of(out) -> PyTree:
    return out.x if isinstance(out, Solution) else out


def _diagnostics_as_reals(out):
    """Integer and boolean diagnostics cast to the residual's real dtype (exact
    for statuses, and for iteration counts up to 2^24 in float32, 2^53 in
    float64), so every output of the custom derivative has a plain zero
    tangent. Integer outputs would need `float0` tangents, whose avals jax 0.6
    compares with the primal's sharding included (a sharded solve's gradient
    then fails its shape/dtype check)."""
    if not isinstance(out, Solution):
        return out
    real = out.residual_norm.dtype
    return out._replace(status=out.status.astype(real), converged=out.converged.astype(real),
                        iterations=out.iterations.astype(real))


def _diagnostics_restored(out):
    if not isinstance(out, Solution):
        return out
    return out._replace(status=out.status.astype(np.int32), converged=out.converged != 0,
                        iterations=out.iterations.astype(np.int32))




def solved_ok(out):
    """`(out, ok)` for a solver that reports through a `Solution` (ok: converged)
    or returns a bare pytree (no status: ok)."""
    return out, (out.converged if isinstance(out, Solution) else jnp.bool_(True))


def solution_checked(out_ok, failed_derivative: str):
    """The solution of `(out, ok)`; NaN where its solve failed (`"nan"`), so a
    finite derivative is a correct one."""
    out, ok = out_ok
    x = solution_of(out)
    if failed_derivative == "keep":
        return x
    ok = ok.astype(jnp.bool_)
    return jax.tree_util.tree_map(lambda leaf: jnp.where(ok, leaf, jnp.nan), x)


def implicit_solve(problem: Problem, run, run_transposed, failed_derivative: str = "nan",
                   adjoint_data=None):
    """`run(problem)` with derivatives defined implicitly.

    `run(problem)` returns `(out, ok)`: a `Solution` (diagnostics kept) or the
    solution pytree, and whether the solve succeeded by its own test (for a
    Krylov method the iteration's test, so that judging a derivative's solve
    costs no reduction; see `_run_and_finish`);
    `run_transposed(problem with A^T and another b)` solves the
    transposed system. Both read every traced value from their argument, so
    the primal solve is traced once and the transposed solve only when a
    derivative asks for it. `A` and `b` are differentiated; the rest of the
    problem (initial guess, preconditioner, weights) is not: the solution does
    not depend on it. Diagnostics stay outside `custom_linear_solve`, so inside
    `shard_map` they keep their own (invariant) type.

    `A^T` is always `jax.linear_transpose(A)`, never `A` itself, even for a
    symmetric operator: a second derivative differentiates the transposed
    solve, and along a perturbation of `A`'s parameters that is not symmetric
    `d(A^T) = (dA)^T != dA` (with `A` standing for `A^T`, the Hessian of a
    solve with respect to the entries of a symmetric matrix is 91-97 % wrong:
    the Hessian tests in `tests/test_grad.py`). A primal, tangent
    or transposed solve that did not converge makes the derivative NaN unless
    `failed_derivative="keep"`. `adjoint_data(primal Solution)`, if given,
    replaces `Problem.data` in the transposed solve (what the primal solve
    learned about the operator, e.g. a recycled space).
    """

    @jax.custom_jvp
    def solve_(A, b, rest):
        out, ok = run(Problem(A, b, *rest))
        out = _diagnostics_as_reals(out)
        return out, ok.astype(jnp.finfo(tree.result_dtype(out)).dtype)

    @solve_.defjvp
    def solve_jvp(primals, tangents):
        A, b, rest = primals
        dA, db, _ = tangents
        # The primal solve, traced once and used for the tangent solve too; as a call
        # of `solve_` itself, so higher derivatives use this rule again instead of
        # differentiating through the iteration.
        primal = close(lambda r: solve_(A, r, rest), b)
        out, ok = primal(b)
        x = solution_of(out)
        _, dA_x = jax.jvp(lambda A: A(x), (A,), (dA,))
        At = transposed(A)
        rest_t = rest
        if adjoint_data is not None and isinstance(out, Solution):
            rest_t = Problem(A, b, *rest)._replace(data=adjoint_data(out))[2:]
        dx = jax.lax.custom_linear_solve(
            A, tree.sub(db, dA_x),
            lambda _, r: solution_checked(primal(r), failed_derivative),
            lambda _, r: solution_checked(run_transposed(Problem(At, r, *rest_t)),
                                           failed_derivative))
        if failed_derivative == "nan":  # nor of a primal that failed (its x may be 0)
            factor = jnp.where(ok > 0, 1, jnp.nan)
            dx = jax.tree_util.tree_map(lambda leaf: leaf * factor.astype(leaf.dtype), dx)
        if isinstance(out, Solution):
            dout = jax.tree_util.tree_map(jnp.zeros_like, out)._replace(x=dx)
        else:
            dout = dx
        return (out, ok), (dout, jnp.zeros_like(ok))

    out, _ = solve_(problem.A, problem.b, tuple(problem[2:]))
    return _diagnostics_restored(out)
