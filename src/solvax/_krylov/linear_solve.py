"""`linear_solve`: implicit differentiation of a black-box solver, on the driver."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax

from .._core import checks
from .._core.closure import close, transposed
from .._core.implicit import implicit_solve, solution_of, solved_ok
from .._core.options import checked_failed_derivative
from .._core.registry import Row, register_solver
from .._core.validation import make_problem
from .gmres import gmres

PyTree = Any
Solver = Callable[[Callable[[PyTree], PyTree], PyTree], Any]


def _primal(problem):
    return solved_ok(problem.data[0](problem.b, problem.A))


def _dual(problem):
    return solved_ok(problem.data[1](problem.b, problem.A))


def linear_solve(
    matvec: Callable[[PyTree], PyTree],
    b: PyTree,
    *,
    solver: Solver,
    transpose_solver: Solver | None = None,
    symmetric: bool = False,
    failed_derivative: str = "nan",
):
    """Solve `A x = b` with `solver`, differentiated implicitly.

    `solver` itself is never differentiated. With `x = A^{-1} b`,

        dx = A^{-1} (db - dA x)                      (forward mode: one more solve)
        b_bar = A^{-T} x_bar,  A_bar = -b_bar x^T    (reverse mode: one transposed solve)

    so the gradient with respect to `b` and to everything `matvec` closes over
    costs exactly one transposed solve, with the same communication as the
    primal solve. The tangent solve is a `jax.lax.custom_linear_solve`.

    Args:
        matvec: the linear operator `x -> A x` on pytrees shaped like `b`; it
            may close over (differentiable) parameters.
        b: right-hand side (array or pytree of arrays).
        solver: `solver(matvec, rhs)` returning either a `Solution` or the
            solution pytree. A black box: it may use any loop, and may close
            over values that are not differentiated (they do not change `x`).
        transpose_solver: `transpose_solver(vecmat, rhs)` for `A^T y = rhs`,
            where `vecmat` is the transpose of `matvec` (derived automatically).
            Defaults to `solver`.
        symmetric: `A^T == A` (real symmetric, or complex symmetric; *not*
            Hermitian). Kept for compatibility; it changes nothing: the
            transposed operator is always `jax.linear_transpose(matvec)`
            (exact for a symmetric operator as well, and right for second
            derivatives along perturbations of the parameters that are not
            symmetric, where `matvec` standing for its transpose is not).
        failed_derivative: `"nan"` (default): a derivative whose tangent or
            transposed solve did not converge is NaN (when `solver` returns
            a `Solution`; a bare pytree carries no status); `"keep"`: as
            computed.

    Returns:
        Whatever `solver` returns: a `Solution` (diagnostics kept, `x`
        differentiable, diagnostics constant) or the solution pytree.

    Raises:
        TypeError, ValueError: if `b` is not a pytree of inexact arrays,
            `matvec(b)` does not have the structure, shapes and dtypes of `b`,
            or `solver` is not callable.

    Reference: M. Blondel et al., "Efficient and modular implicit
    differentiation", NeurIPS 2022; JAX `lax.custom_linear_solve`.
    """
    for name, fn in (("solver", solver), ("transpose_solver", transpose_solver)):
        if (fn is not None or name == "solver") and not callable(fn):
            raise TypeError(f"`{name}` must be a function `(matvec, b) -> x`; got {fn!r}.")
    checks.check_flag("symmetric", symmetric)
    checked_failed_derivative(failed_derivative)
    problem = make_problem(matvec, b)
    A = problem.A
    # The user's solvers may close over anything: closing them makes those values
    # explicit (traced now, a distinct transposed solver included).
    At = transposed(A)
    primal = close(lambda r, A: solver(A, r), b, A)
    dual = close(lambda r, At: (transpose_solver or solver)(At, r), b, At)
    for name, closed, op in (("solver", primal, A), ("transpose_solver", dual, At)):
        checks.check_like(f"{name}(matvec, b)", solution_of(jax.eval_shape(closed, b, op)),
                           "b", problem.b)
    return implicit_solve(problem._replace(data=(primal, dual)), _primal, _dual,
                          failed_derivative)


register_solver(linear_solve, nonsymmetric=True, rows=(
    Row("FGMRES(16) via linear_solve", {"solver": functools.partial(gmres, restart=16)}),))
