"""The Krylov driver: one contract for every iterative method.

A *method* is one module of `_krylov` (`cg.py`, `gmres.py`, ...) that registers a
`Method` here and whose public function validates its own static options and
calls `solve`. Everything around the iteration lives in this module, once:

1. **Validation** (`make_problem`): `b` a non-empty pytree of inexact arrays;
   `x0`, `matvec(b)` and `precond(b)` with `b`'s structure, shapes and dtypes;
   tolerances real, finite and `>= 0`; the inner product resolved. Errors are
   raised at trace time and name the argument.
2. **Closure conversion**: the operator, the preconditioner and a callable
   inner product become `Closed` pytrees, so every traced value the method
   reads is a leaf of the `Problem` it is given.
3. **Implicit differentiation** (`implicit_solve`): the tangent is one
   `lax.custom_linear_solve` of `A dx = db - dA x`, whose transpose (reverse
   mode) is one solve of the same method with `A^T` (from
   `jax.linear_transpose`), started from zero. A derivative whose solve did
   not converge is NaN (`failed_derivative="keep"` turns this off).
4. **Finishing** (`finish`): the true residual `||b - A x||` (one matvec and
   one reduction after the loop, unless the method measured it itself), the
   tolerance `max(atol, rtol ||b||)` and the final `Status`.

The contract a method keeps:

- `run(problem, **options) -> Outcome`, where `options` are static Python
  values. `run` reads every traced value from `problem` (`A`, `b`, `x0`,
  `precond`, `rtol`, `atol`, `ip`, `data`) and closes over none: the primal
  solve, the tangent solve and the transposed solve all call it with other
  problems (in traces of their own), so a captured value would be stale.
  `tests/test_driver.py` differentiates every registered method through
  `grad(jit(...))` with traced options, so a method that breaks this fails.
- All products and norms go through `problem.ip` (the reduction layer), the
  independent products of a step in one `multi_dot`/`project_many` call.
- `Outcome.status` is what the loop ended on: `RUNNING` (out of steps),
  `CONVERGED` (its own residual test passed) or a breakdown status; the
  driver turns it into the final status with the true residual.
- The transposed solve (reverse mode) runs the same method on `A^T` (from
  `jax.linear_transpose`, exact for symmetric operators too), from zero: a
  method for Hermitian operators works on `A^T = conj(A)` as well.

- Options shared by several methods are checked once (`options.py`:
  `max_steps`, `record_history`, `failed_derivative`); a method checks only its own.
- The small mechanisms of a step (safe division, the rounding-level test,
  the typed loop, confirmation on the true residual) are in `_krylov/steps.py`;
  the start from `x0` and the stopping threshold are `Problem.start` /
  `Problem.residual` / `Problem.settled` and `threshold` here.

Adding a method: write `run`, register `Method(name, run)`, call
`solve(method, ...)` from the public function, and register that function
once (`registry.register_solver`, with its test variants and table rows):
the export, Newton's choices, the table and the generic tests follow
(`docs/architecture.md`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from . import reduce, tree
from .contract import Method, Outcome, Problem, invalid_tolerances, threshold
from .implicit import implicit_solve
from .options import checked_failed_derivative, checked_loop_options
from .solution import Solution, Status, code, make_solution
from .validation import check_reduced_over, make_problem

#: Every registered method by name (`tests/test_driver.py` checks each).
REGISTRY: dict[str, Method] = {}


def register(method: Method) -> Method:
    REGISTRY[method.name] = method
    return method


def solve(method: Method, matvec, b, /, *, x0, precond, rtol, atol, inner_product, axis_name,
          failed_derivative="nan", data=None, adjoint_data=None, **options) -> Solution:
    """`method` on `A x = b`, validated, differentiable and finished (1-4 above);
    `data`: the method's own traced arguments (`Problem.data`); `adjoint_data`:
    `Solution -> data` of the transposed solve from the primal one (`gcrot`
    hands its recycled space on), else the transposed solve gets `data`."""
    checked_failed_derivative(failed_derivative)
    options = checked_loop_options(options)
    problem = make_problem(matvec, b, x0=x0, precond=precond, rtol=rtol, atol=atol,
                           inner_product=inner_product, axis_name=axis_name)
    problem = problem._replace(data=data, null=_null_vector(matvec, problem.b))
    for name, op in (("matvec", problem.A), ("precond", problem.precond)):
        if op is not None:
            check_reduced_over(name, op, problem)
    run = functools.partial(_run_and_finish, method, options)
    # The transposed solve: the same method on A^T, started from zero.
    return implicit_solve(problem, run, lambda p: run(p._replace(x0=None)), failed_derivative,
                          adjoint_data)


def _null_vector(matvec, b):
    """The operator's null vector where it can tell one (`null_vector(dtype)`,
    e.g. a periodic or pure Neumann `StencilOperator`) and `b` is one array
    of its shape; else None."""
    get = getattr(matvec, "null_vector", None)
    if get is None or not isinstance(b, jax.Array) or jnp.shape(b) != getattr(
            matvec, "shape", None):
        return None
    return get(b.dtype)


def _run_and_finish(method: Method, options: dict, problem: Problem):
    """`(Solution, ok)`: the method on the problem scaled by a power of two
    (`_scaled`), finished there, its solution and norms scaled back (exactly);
    `ok`: the method's own stopping test passed, which is what a derivative's
    solve is judged by (`implicit_solve`: no reduction beyond the iteration's)."""
    scale = problem.ip.power_of_two_scale(problem.b)
    if scale is None:  # a callable inner product: no rescaling
        outcome = method.run(problem, **options)
        sol = finish(problem, outcome, method.name)
    else:
        scaled = _scaled(problem, scale)
        outcome = method.run(scaled, **options)
        sol = finish(scaled, outcome, method.name, scale)
    return _judged_tolerances(problem, sol), _ok(outcome)


def _ok(outcome: Outcome) -> jax.Array:
    return outcome.status == code(Status.CONVERGED)


def _scaled(problem: Problem, scale) -> Problem:
    """`A (x / s) = b / s`: the problem with `b`, `x0` and `atol` divided by `s`.

    With `s` a power of two near `max |b_i|` the entries of every vector of
    the solve are near 1, so no squared norm under- or overflows for any
    finite scale of `b` (`||b||^2` of a float32 `b` of size 1e-20 is 0, of
    size 1e20 Inf), and the division is exact. Costs one reduction (a max)
    before the iteration; none in it.
    """
    inverse = 1 / scale
    real = problem.real_dtype()
    return problem._replace(
        b=tree.scale(inverse, problem.b),
        x0=None if problem.x0 is None else tree.scale(inverse, problem.x0),
        # behind a barrier: XLA's algebraic simplifier would rewrite the squared
        # threshold's (atol s^-1)^2 as atol^2 s^-2, where s^-2 overflows
        # (|b| ~ 1e-160 in float64): 0 * inf, a NaN threshold, and the solve
        # stopped after 0 steps (measured under `jit`; not eagerly)
        atol=jax.lax.optimization_barrier(problem.tolerances()[1] * inverse.astype(real)))


def finish(problem: Problem, outcome: Outcome, name: str, scale=None) -> Solution:
    """The `Solution`: the true residual decides `converged` (module docstring,
    4); with `scale`, the problem was `_scaled` by it and `x` and the norms are
    scaled back (exactly), a solution too large for the dtype being
    `NONFINITE` (`||x||` rides in the residual's reduction). With a null
    vector `n` (a singular operator) `b`'s component `|<b, n>| / ||n||` on it,
    a lower bound of every residual, rides along too: above the tolerance,
    the system has no solution (`INCONSISTENT`)."""
    null = problem.null
    extra = [] if null is None else [(problem.b, null), (null, null)]
    if outcome.residual is None:
        with jax.named_scope(f"solvax.{name}.true_residual"):
            r = tree.sub(problem.b, problem.A(outcome.x))
            # ||b|| and ||x|| ride along in the same reduction.
            rr, bb, xx, *bn = problem.ip.multi_dot([(r, r), (problem.b, problem.b),
                                                     (outcome.x, outcome.x), *extra])
            rr, bb, xx = jnp.real(rr), jnp.real(bb), jnp.real(xx)
        norm, xnorm = reduce.real_sqrt(rr), reduce.real_sqrt(xx)
        tol = threshold(bb, *problem.tolerances())
    else:
        norm, tol, xnorm = outcome.residual
        if null is not None:
            bb, *bn = problem.ip.multi_dot([(problem.b, problem.b), *extra])
            bb = jnp.real(bb)
    inconsistent = False
    if null is not None:
        component = jnp.abs(bn[0]) / reduce.real_sqrt(jnp.real(bn[1]))
        floor = 1e3 * jnp.finfo(norm.dtype).eps * reduce.real_sqrt(bb)
        inconsistent = component > jnp.maximum(tol, floor)
    if scale is None:
        return make_solution(outcome.x, outcome.status, outcome.iterations, norm, tol,
                             history=outcome.history, recycle=outcome.recycle,
                             inconsistent=inconsistent)
    # decided in the scaled problem, where the norms neither under- nor overflow
    status = jnp.where(jnp.isfinite(scale * xnorm), outcome.status, code(Status.NONFINITE))
    sol = make_solution(tree.scale(scale, outcome.x), status, outcome.iterations, norm, tol,
                        history=None if outcome.history is None else scale * outcome.history,
                        recycle=outcome.recycle, inconsistent=inconsistent)
    return sol._replace(residual_norm=scale * norm)


def _judged_tolerances(problem: Problem, sol: Solution) -> Solution:
    """`INVALID_TOLERANCE` where a traced `rtol` or `atol` of the (unscaled)
    problem is negative or NaN (concrete ones are refused at trace time): the
    iteration stopped at once on its NaN or negative threshold, which is not a
    stagnation."""
    rtol, atol = problem.tolerances()
    status = jnp.where(invalid_tolerances(rtol, atol), code(Status.INVALID_TOLERANCE), sol.status)
    return sol._replace(status=status, converged=status == code(Status.CONVERGED))
