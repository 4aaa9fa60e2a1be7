"""Implicit differentiation of a black-box linear solve."""

from __future__ import annotations

from typing import Any, Callable

import jax

from . import _checks
from ._solution import Solution

PyTree = Any
Solver = Callable[[Callable[[PyTree], PyTree], PyTree], Any]


def _split(solver: Solver) -> Callable:
    """Adapt `solver` to `custom_linear_solve(..., has_aux=True)`: `(x, aux)`."""

    def solve(matvec, rhs):
        out = solver(matvec, rhs)
        if isinstance(out, Solution):
            return out.x, out._replace(x=None)
        return out, None

    return solve


def linear_solve(
    matvec: Callable[[PyTree], PyTree],
    b: PyTree,
    *,
    solver: Solver,
    transpose_solver: Solver | None = None,
    symmetric: bool = False,
):
    """Solve `A x = b` with `solver`, differentiated implicitly.

    The solve is wrapped in `jax.lax.custom_linear_solve`: `solver` itself is
    never differentiated. With `x = A^{-1} b`,

        dx = A^{-1} (db - dA x)            (forward mode: one more solve)
        b_bar = A^{-T} x_bar,  A_bar = -b_bar x^T   (reverse mode: one transposed solve)

    so the gradient with respect to `b` and to everything `matvec` closes over
    costs exactly one transposed solve, with the same communication as the
    primal solve.

    Args:
        matvec: the linear operator `x -> A x` on pytrees shaped like `b`.
        b: right-hand side (array or pytree of arrays).
        solver: `solver(matvec, rhs)` returning either a `Solution` or the
            solution pytree. A black box: it may use any loop.
        transpose_solver: `transpose_solver(vecmat, rhs)` for `A^T y = rhs`,
            where `vecmat` is the transpose of `matvec` (derived automatically).
            Defaults to `solver`.
        symmetric: `A^T == A` (real symmetric, or complex symmetric; *not*
            Hermitian). Then `matvec` is used as its own transpose.

    Returns:
        Whatever `solver` returns: a `Solution` (diagnostics kept, `x`
        differentiable) or the solution pytree.

    Raises:
        TypeError, ValueError: if `b` is not a pytree of inexact arrays or
            `matvec(b)` does not have the structure, shapes and dtypes of `b`.

    Reference: JAX `lax.custom_linear_solve`; M. Blondel et al., "Efficient
    and modular implicit differentiation", NeurIPS 2022.
    """
    _checks.check_vector("b", b)
    _checks.check_operator("matvec", matvec, b)
    if not callable(solver):
        raise TypeError(f"`solver` must be a function `(matvec, b) -> x`; got {solver!r}.")
    if transpose_solver is None:
        transpose_solver = solver
    x, aux = jax.lax.custom_linear_solve(
        matvec,
        b,
        _split(solver),
        _split(transpose_solver),
        symmetric=symmetric,
        has_aux=True,
    )
    if aux is None:
        return x
    return aux._replace(x=x)
