"""Implicit differentiation of a black-box linear solve."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from . import _checks
from . import _tree as tree
from ._closure import Closed, close, transposed
from ._solution import Solution

PyTree = Any
Solver = Callable[[Callable[[PyTree], PyTree], PyTree], Any]


def _solution_of(out) -> PyTree:
    return out.x if isinstance(out, Solution) else out


def _diagnostics_as_reals(out):
    """Integer and boolean diagnostics cast to the residual's real dtype (exact
    for statuses, and for iteration counts up to 2^24 in float32, 2^53 in
    float64), so every output of the custom derivative has a
    plain zero tangent. Integer outputs would need `float0` tangents, whose
    avals jax 0.6 compares with the primal's sharding included (a sharded
    solve's gradient then fails its shape/dtype check)."""
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


def implicit_solve(A: Closed, b, solver, transpose_solver, params, symmetric: bool):
    """`solver(A, b, params)` with derivatives defined implicitly (the core of
    `linear_solve`).

    `solver(A, rhs, params)` and `transpose_solver(A^T, rhs, params)` (None:
    `A` is symmetric and the solve the same as the primal one) read
    every traced value they need from their arguments (they close over static
    options only), so the primal solve is traced once and the transposed
    solve only when a derivative asks for it. The primal runs `solver` once
    and returns whatever it returns (a `Solution` with its diagnostics, or the
    solution pytree); the tangent is one `lax.custom_linear_solve` of
    `A dx = db - dA x`, whose transpose (reverse mode) is one
    `transpose_solver` call. `A`'s leaves are differentiated; `params`'
    (initial guess, preconditioner, weights) are not: the solution does not
    depend on them. Diagnostics stay outside `custom_linear_solve`, so inside
    `shard_map` they keep their own (invariant) type.
    """

    @jax.custom_jvp
    def solve(b, A, params):
        return _diagnostics_as_reals(solver(A, b, params))

    @solve.defjvp
    def solve_jvp(primals, tangents):
        b, A, params = primals
        db, dA, _ = tangents
        # The primal solve, traced once and used for the tangent solve too; as a call
        # of `solve` itself, so higher derivatives use this rule again instead of
        # differentiating through the iteration.
        primal = close(lambda r: solve(r, A, params), b)
        out = primal(b)
        x = _solution_of(out)
        _, dA_x = jax.jvp(lambda A: A(x), (A,), (dA,))
        At = A if symmetric else transposed(A)
        dx = jax.lax.custom_linear_solve(
            A,
            tree.sub(db, dA_x),
            lambda _, r: _solution_of(primal(r)),
            lambda _, r: _solution_of(primal(r) if transpose_solver is None
                                      else transpose_solver(At, r, params)),
            symmetric=symmetric,
        )
        if isinstance(out, Solution):
            return out, jax.tree_util.tree_map(jax.numpy.zeros_like, out)._replace(x=dx)
        return out, dx

    return _diagnostics_restored(solve(b, A, params))


def krylov_solve(matvec, b, solve, *, x0, precond, rtol, atol, ip, symmetric: bool):
    """`solve(A, b, x0=, precond=, rtol=, atol=, ip=)` (a Krylov iteration, its
    static options bound) under `implicit_solve`, every traced value it reads
    an explicit parameter; the transposed solve starts from zero."""
    A = closed_operator(matvec, b)
    if precond is not None:
        precond = close(precond, b)
        _checks.check_operator("precond", precond, b)
    params = dict(x0=x0, precond=precond, rtol=rtol, atol=atol, ip=ip.closed(b))
    same = symmetric and x0 is None  # the transposed solve is the primal one
    return implicit_solve(A, b, lambda A, r, p: solve(A, r, **p),
                          None if same else lambda At, r, p: solve(At, r, **dict(p, x0=None)),
                          params, symmetric)


def closed_operator(matvec, b) -> Closed:
    """`matvec` as a `Closed`, its output checked against `b` (on the converted
    function: the user's function is traced once)."""
    A = close(matvec, b)
    _checks.check_operator("matvec", A, b)
    return A


def linear_solve(
    matvec: Callable[[PyTree], PyTree],
    b: PyTree,
    *,
    solver: Solver,
    transpose_solver: Solver | None = None,
    symmetric: bool = False,
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
            Hermitian). Then `matvec` is used as its own transpose.

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
    _checks.check_vector("b", b)
    _checks.check_callable("matvec", matvec)
    for name, fn in (("solver", solver), ("transpose_solver", transpose_solver)):
        if (fn is not None or name == "solver") and not callable(fn):
            raise TypeError(f"`{name}` must be a function `(matvec, b) -> x`; got {fn!r}.")
    A = closed_operator(matvec, b)
    # The user's solvers may close over anything: closing them makes those values
    # explicit (traced now, a distinct transposed solver included).
    primal = close(lambda r, A: solver(A, r), b, A)
    if symmetric and transpose_solver in (None, solver):
        return implicit_solve(A, b, lambda A, r, p: p(r, A), None, primal, symmetric)
    dual = close(lambda r, At: _solution_of((transpose_solver or solver)(At, r)), b,
                 A if symmetric else transposed(A))
    return implicit_solve(A, b, lambda A, r, p: p[0](r, A), lambda At, r, p: p[1](r, At),
                          (primal, dual), symmetric)
