"""Implicit differentiation of a black-box linear solve."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from . import _checks
from . import _tree as tree
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


def implicit_solve(matvec, b, solver: Solver, transpose_solver: Solver, symmetric: bool):
    """`solver(matvec, b)` with derivatives defined implicitly (the core of `linear_solve`).

    The primal runs `solver` once and returns whatever it returns (a
    `Solution` with its diagnostics, or the solution pytree); the tangent is
    one `lax.custom_linear_solve` of `A dx = db - dA x`, whose transpose
    (reverse mode) is one `transpose_solver` call on `A^T`.

    Everything the operator and the solvers close over is hoisted into
    explicit arguments (`jax.closure_convert`), so they may close over traced
    values: the operator's are differentiated, the solvers' (initial guess,
    preconditioner, weights) are not — the solution does not depend on them.
    Diagnostics stay outside `custom_linear_solve`, so inside `shard_map` they
    keep their own (invariant) type.
    """
    mv, mv_consts = jax.closure_convert(matvec, b)
    # Checked on the converted operator: the user's function is traced once.
    _checks.check_operator("matvec", mv, b, *mv_consts)

    def operator(consts):
        return lambda x: mv(x, *consts)

    def transposed(consts):
        if symmetric:
            return operator(consts)
        transpose = jax.linear_transpose(operator(consts), b)
        return lambda y: transpose(y)[0]

    sv, sv_consts = jax.closure_convert(lambda r, c: solver(operator(c), r), b, mv_consts)
    if symmetric and transpose_solver is solver:  # the same solve: trace it once
        tsv, tsv_consts = (lambda r, c, *consts: _solution_of(sv(r, c, *consts))), sv_consts
    else:
        tsv, tsv_consts = jax.closure_convert(
            lambda r, c: _solution_of(transpose_solver(transposed(c), r)), b, mv_consts)

    @jax.custom_jvp
    def solve(b, mv_consts, sv_consts, tsv_consts):
        return _diagnostics_as_reals(sv(b, mv_consts, *sv_consts))

    @solve.defjvp
    def solve_jvp(primals, tangents):
        b, mv_c, sv_c, tsv_c = primals
        db, dmv_c, _, _ = tangents
        out = solve(b, mv_c, sv_c, tsv_c)
        x = _solution_of(out)
        _, dA_x = jax.jvp(lambda c: mv(x, *c), (mv_c,), (dmv_c,))
        dx = jax.lax.custom_linear_solve(
            operator(mv_c),
            tree.sub(db, dA_x),
            lambda _, r: _solution_of(sv(r, mv_c, *sv_c)),
            lambda _, r: tsv(r, mv_c, *tsv_c),
            symmetric=symmetric,
        )
        if isinstance(out, Solution):
            return out, jax.tree_util.tree_map(jax.numpy.zeros_like, out)._replace(x=dx)
        return out, dx

    return _diagnostics_restored(solve(b, mv_consts, sv_consts, tsv_consts))


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
    return implicit_solve(matvec, b, solver, transpose_solver or solver, symmetric)
