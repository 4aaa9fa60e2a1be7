"""Preconditioned conjugate gradients on pytrees: `pcg`, its methods
(standard, single reduction, pipelined, s-step, deflated), `pcg_linear_solve`."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from .._core import checks, contract, driver, reduce, target, tree
from .._core.contract import Outcome, Problem
from .._core.options import documented
from .._core.registry import Row, Variant, register_solver
from .._core.solution import Solution
from . import recycling, sstep, steps
from .cg_steps import (
    Context,
    PyTree,
    Scalars,
    Single,
    Standard,
    closed,
    closing_step,
    finished,
    opened,
    single_step,
    standard_step,
    start,
)
from .deflated import DIRECTIONS_PER_SLOT, run_deflated
from .pipelined import (
    Pipelined,
    pipelined_rounds,
    pipelined_step,
    pipelined_with_replacement,
    replaced_blocks,
)


def _initial_state(method: str, ctx: Context, x, r, sc: Scalars):
    """The state of `method` before its first step (directions zero)."""
    zeros = tree.zeros_like(r)
    if method == "standard":
        return Standard(x=x, r=r, p=zeros, sc=sc)
    if method == "single_reduction":
        return Single(x=x, r=r, p=zeros, s=zeros, sc=sc)
    with jax.named_scope("solvax.pcg.setup"):
        u = ctx.M(r)
        return Pipelined(x=x, r=r, p=zeros, s=zeros, w=ctx.A(u), z=zeros,
                          u=None if ctx.identity else u, q=None if ctx.identity else zeros,
                          sc=sc, checks=steps.Confirmation.start(sc.rr.dtype, x))


def _run(problem: Problem, *, method: str, max_steps: int | None, residual_replacement: int | None,
         record_history: bool, recycle_size: int = 0) -> Outcome:
    """The PCG iteration of `method` (not differentiated itself; see `pcg`)."""
    real = problem.real_dtype()
    max_steps = problem.step_limit(max_steps)
    identity = problem.precond is None
    rtol, atol = problem.tolerances()
    # one device: standard CG reduces <r, r> at the close of each step (the
    # first before the loop), the others take ||b||^2 before the loop
    ahead = reduce.reduces_before_loop()
    closing = ahead and method == "standard"
    ctx = Context(A=problem.A, M=(lambda v: v) if identity else problem.precond,
                   identity=identity, ip=problem.ip, rtol=rtol, atol=atol,
                   tol_from_rr=problem.x0 is None and (closing or not ahead),
                   max_steps=max_steps)
    if method == "deflated":
        ell = min(DIRECTIONS_PER_SLOT * recycle_size, problem.size())
        return run_deflated(problem, ctx, real, record_history, recycle_size, ell)
    x, r, sc = start(problem, ctx, real, max_steps, record_history)
    state = _initial_state(method, ctx, x, r, sc)
    if method == "pipelined" and residual_replacement:
        step = functools.partial(pipelined_with_replacement, b=problem.b,
                                 every=residual_replacement)
    elif closing:
        state, step = opened(state, ctx), closing_step
    else:
        step = _STEPS[method]
    # Up to max_steps steps, then one that only checks the residual it reduces
    # anyway (no update): at the limit, the loop's own test still says whether
    # x converged, with no reduction after the loop. Every step's `go` holds
    # the step limit (`top_of_step`): the loop tests `go` alone.
    confirmed = method == "pipelined" and not residual_replacement
    if confirmed:
        state = pipelined_rounds(state, ctx, problem.b)
    elif method == "pipelined" and residual_replacement and not target.branches_on_device():
        state = replaced_blocks(state, ctx, problem.b, residual_replacement, problem.ip,
                                problem.b)
    else:
        state = steps.while_loop(problem.ip, problem.b, lambda st: st.sc.go,
                                   functools.partial(step, ctx=ctx), state)
    if confirmed:
        return finished(state.sc, state.checks.returned(state.x), max_steps,
                         state.checks.stalled)
    return finished(closed(state.sc, identity) if closing else state.sc, state.x, max_steps)


_STEPS = {"standard": standard_step, "single_reduction": single_step,
          "pipelined": pipelined_step}


METHOD_NAMES = (*_STEPS, "s_step")


CG = driver.register(contract.Method("pcg", _run))


@documented
def pcg(
    matvec: Callable[[PyTree], PyTree],
    b: PyTree,
    *,
    x0: PyTree | None = None,
    precond: Callable[[PyTree], PyTree] | None = None,
    rtol: float | None = None,
    atol: float = 0.0,
    max_steps: int | None = None,
    single_reduction: bool = False,
    method: str | None = None,
    residual_replacement: int | None = None,
    s: int = 4,
    basis: str = "chebyshev",
    spectrum: tuple | None = None,
    record_history: bool = False,
    inner_product=None,
    axis_name: str | tuple[str, ...] | None = None,
    failed_derivative: str = "nan",
    recycle: recycling.RecycleSpace | tuple | None = None,
    recycle_size: int | None = None,
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
    applications each time, no reduction), restoring accuracy. Without it,
    pipelined CG confirms its stopping test: when its own residual meets the
    tolerance it restarts from `x` (the true residual: 2 matvecs, no
    reduction) and stops only when the next step's reduction finds the true
    residual within the tolerance (a restart that no longer lowers it stops
    as `STAGNATION`).

    **Recycling** (`recycle_size=k` or `recycle=`, standard method only):
    deflated CG for sequences of systems. A recycled space `(C, U)` (`C = A
    U`, `U` A-orthonormal; pytrees like `b` with `k` rows per leaf, sharding
    kept) is deflated from the solve: the start is projected on it (`x += U
    U^H r`) and every direction is made A-conjugate to it (`p = z - U C^H z +
    beta p`, the `k` projections riding in the step's second reduction:
    still two reductions per step, `2 k` more vectors read). After the solve
    the space becomes the `k` Ritz vectors of smallest Ritz value on the old
    space plus the solve's first `6 k` directions (one more reduction; no
    eigen-solver beyond a replicated `eigh` of `7 k x 7 k`), returned as
    `Solution.recycle`; passing it to the next solve (a changed operator and
    right-hand side) costs `k` matvecs and one reduction to make it
    A-orthonormal for the new operator. From `recycle_size=k` alone the
    space starts empty (no deflation in that first solve). Derivatives hand
    the space to the transposed solve. (Saad, Yeung, Erhel, Guyomarc'h,
    SIAM J. Sci. Comput. 21, 2000.) Memory: `14 k + 2` vectors more.

    `method="s_step"` is s-step (communication-avoiding) CG: each outer step
    builds `s` Krylov vectors with a polynomial basis (`basis`: Chebyshev or
    Newton on the interval `spectrum = (lmin, lmax)` of `M A`'s eigenvalues,
    or, by default, from the Ritz values of each block; monomial only for
    comparison), gets all their inner products with the previous block in
    **one** reduction and takes s CG steps at once on the small coordinates.
    One reduction per `s` iterations and as many matvecs as CG (s per outer
    step); the price is `4 s + 2` stored vectors, more local arithmetic and a
    basis whose conditioning limits `s` (directions it loses are dropped; see
    `docs/krylov.md`). `iterations` counts CG iterations (a multiple of `s`),
    `history` has a value every `s` entries.

    Differs from the textbook / `jax.scipy.sparse.linalg.cg`:
      1. `converged` is decided on the true residual `||b - A x||` (one extra
         matvec after the loop), never on the recursively updated one.
      2. With `x0=None`, `||b||` is the first step's `<r, r>`: no setup
         reduction on a mesh (on one device, where a reduction before the
         loop synchronizes nothing, standard CG tests `<r, r>` at the close
         of each step and applies `M` only to go on: `reduce.reduces_before_loop`).
      3. Non-positive curvature, a non-positive-definite preconditioner and
         non-finite values stop the loop with their own `Status`.
      4. Differentiable with `jax.grad`/`jax.jvp` by implicit differentiation:
         one more CG solve (the transposed system), never through the loop.

    Args:
        matvec: `x -> A x` on pytrees shaped like `b`.
        b: right-hand side, an array or any pytree of arrays (leaves keep
            their sharding; no leaf is ever flattened).
        x0, rtol, atol, inner_product, axis_name, failed_derivative: the common options.
        precond: `r -> M r`, an HPD approximation of `A^{-1}` (default identity).
        max_steps: iteration limit (default `10 * size(b)`).
        single_reduction: use the one-reduction-per-step recurrence (the same
            as `method="single_reduction"`).
        method: `"standard"` (default), `"single_reduction"`, `"pipelined"` or
            `"s_step"`.
        residual_replacement: pipelined: recompute the recursively updated
            vectors every this many steps; s-step: recompute `r = b - A x`
            every this many outer steps (default never: pipelined then
            confirms its stopping test instead).
        s: s-step only: CG iterations per outer step (default 4).
        basis: s-step only: `"chebyshev"` (default), `"newton"` or `"monomial"`.
        spectrum: s-step only: `(lmin, lmax)`, bounds of the eigenvalues of
            `M A` (e.g. from `estimate_spectrum`; traced values are fine);
            default: `[0, 1.1 lmax]` with `lmax` the largest Ritz value seen.
        record_history: store the recursive residual norm of every step in
            `Solution.history` (length `max_steps + 1`, NaN after the end).
        recycle: the space of a previous solve (`Solution.recycle` of `pcg`
            or `gcrot`): deflated CG with it (its size is `k`).
        recycle_size: `k`, the recycled space's size (>= 1): deflated CG from
            an empty space (or checked against `recycle`'s).

    Returns:
        A `Solution` with `x`, `status`, `converged`, `iterations` and the true
        `residual_norm`; with recycling, `recycle`: the space for the next
        solve (the `k` refresh matvecs are not in `iterations`).

    Raises:
        TypeError, ValueError: at trace time, for a `b`, `x0`, `matvec(b)` or
            `precond(b)` whose structure, shapes or dtypes disagree, negative
            tolerances, a negative `max_steps`, an unknown `method` or
            `basis`, `s < 1`, a `spectrum` that is not `0 <= lmin < lmax`, or
            `residual_replacement`, `s`, `basis`, `spectrum` with a method
            that does not take them; a `matvec` or `precond` that can tell it
            is not symmetric (`is_symmetric()`: a `StencilOperator` with
            concrete coefficients, a multigrid cycle of a nonsymmetric
            stencil or an F-cycle).

    References: A. T. Chronopoulos and C. W. Gear, "s-step iterative methods
    for symmetric linear systems", J. Comput. Appl. Math. 25 (1989);
    P. Ghysels and W. Vanroose, "Hiding global synchronization latency in the
    preconditioned conjugate gradient algorithm", Parallel Comput. 40 (2014);
    M. Hoemmen, "Communication-avoiding Krylov subspace methods", PhD thesis,
    UC Berkeley (2010); E. Carson and J. Demmel, "A residual replacement
    strategy for improving the maximum attainable accuracy of s-step Krylov
    subspace methods", SIAM J. Matrix Anal. Appl. 35 (2014).
    """
    checks.check_flag("single_reduction", single_reduction)
    checks.check_symmetric("pcg", matvec, precond)
    if method is None:
        method = "single_reduction" if single_reduction else "standard"
    checks.check_choice("method", method, METHOD_NAMES)
    if single_reduction and method != "single_reduction":
        raise ValueError(f"`single_reduction=True` contradicts `method={method!r}`; pass one.")
    if residual_replacement is not None:
        checks.check_int("residual_replacement", residual_replacement, 1)
        if method not in ("pipelined", "s_step"):
            raise ValueError("`residual_replacement` applies to `method='pipelined'` and "
                             f"`method='s_step'` only; got method={method!r}.")
    if method == "s_step":
        return sstep.solve(matvec, b, x0=x0, precond=precond, rtol=rtol, atol=atol,
                            max_steps=max_steps, s=s, basis=basis, spectrum=spectrum,
                            residual_replacement=residual_replacement,
                            record_history=record_history, inner_product=inner_product,
                            axis_name=axis_name, failed_derivative=failed_derivative)
    if recycle is not None or recycle_size is not None:
        return _recycled(matvec, b, method=method, recycle=recycle, recycle_size=recycle_size,
                         x0=x0, precond=precond, rtol=rtol, atol=atol, max_steps=max_steps,
                         record_history=record_history, inner_product=inner_product,
                         axis_name=axis_name, failed_derivative=failed_derivative)
    if (s, basis, spectrum) != (4, "chebyshev", None):
        raise ValueError("`s`, `basis` and `spectrum` apply to `method='s_step'` only; "
                         f"got method={method!r}.")
    # A^T = conj(A) is HPD too (symmetric for real b): see `driver.solve`.
    return driver.solve(CG, matvec, b, x0=x0, precond=precond, rtol=rtol, atol=atol,
                         inner_product=inner_product, axis_name=axis_name,
                         failed_derivative=failed_derivative, method=method,
                         max_steps=max_steps, residual_replacement=residual_replacement,
                         record_history=record_history)


def _recycled(matvec, b, *, method, recycle, recycle_size, **options) -> Solution:
    """`pcg` with a recycled space: deflated CG (validated here)."""
    if method != "standard":
        raise ValueError(f"`recycle`/`recycle_size` apply to the standard method only (deflated "
                         f"CG); got method={method!r}.")
    checks.check_vector("b", b)
    if recycle_size is not None:
        recycle_size = checks.check_int("recycle_size", recycle_size, 1)
    if recycle is not None:
        leaves = jax.tree_util.tree_leaves(recycle[1] if isinstance(recycle, tuple) and
                                           len(recycle) == 2 else recycle)
        k = recycle_size or (jnp.shape(leaves[0])[0] if leaves and jnp.ndim(leaves[0]) else 0)
        recycle = recycling.checked(recycle, b, k)
        recycle_size = k
    return driver.solve(CG, matvec, b, data=recycle,
                         adjoint_data=lambda out: out.recycle, method="deflated",
                         residual_replacement=None, recycle_size=recycle_size, **options)


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


# Counts (the tests' variants): every solve takes one max |b_i| before the loop
# (the power-of-two scale that keeps its norms in range; `driver._scaled`).
# PCG: <p, Ap> and the fused [<r, z>, <r, r>]; with x0=None ||b|| is the first
# step's <r, r>. Single reduction and pipelined: one stacked reduction per step
# (residual replacement adds matvecs, no reduction; every 10 steps: in single
# precision on the condition-660 1-D Poisson test, every 20 steps breaks down on
# jax 0.4.38, docs/krylov.md). Deflated CG from an empty space of 4: the scale,
# the start's [U^H r, ||b||^2] and two per step (the projections C^H z in the
# second); the next space's Gram matrix after the loop is dropped when only x is
# used. s-step: one stacked Gram reduction per outer step of s CG steps (s = 3:
# an odd block and a Chebyshev recurrence with both terms; the table pins 4, 8).
_S4 = {"method": "s_step", "s": 4}
register_solver(pcg, nonsymmetric=False, newton=True, variants=(
    Variant("pcg", {}, "pcg", (3, 6, 2)),
    Variant("pcg_single_reduction", {"single_reduction": True}, "pcg", (2, 4, 1)),
    Variant("pcg_pipelined", {"method": "pipelined"}, "pcg", (2, 4, 1)),
    Variant("pcg_pipelined_replacement", {"method": "pipelined", "residual_replacement": 10},
            "pcg", (2, 4, 1)),
    Variant("pcg_recycled", {"recycle_size": 4}, "pcg", (4, 10, 2)),
    Variant("pcg_s_step", {"method": "s_step", "s": 3}, "pcg_s_step", (2, 4, 1)),
), rows=(
    Row("PCG"),
    Row("PCG, single_reduction=True", {"single_reduction": True}),
    Row("PCG, pipelined", {"method": "pipelined"}),
    Row("PCG, s_step s=4 (a step = 4 CG iterations)", _S4),
    Row("PCG, s_step s=8 (a step = 8 CG iterations)", {"method": "s_step", "s": 8}),
    Row("PCG + Jacobi", {}, "jacobi"),
    Row("PCG, single_reduction + Jacobi", {"method": "single_reduction"}, "jacobi"),
    Row("PCG, pipelined + Jacobi", {"method": "pipelined"}, "jacobi"),
    Row("PCG, s_step s=4 + Jacobi", _S4, "jacobi"),
    Row("shard_map: PCG, single_reduction (axis_name)", {"single_reduction": True}, "shard_map"),
    Row("shard_map: PCG, pipelined (axis_name)", {"method": "pipelined"}, "shard_map"),
    Row("shard_map: PCG, s_step s=4 (axis_name)", _S4, "shard_map"),
    Row("pytree PCG, P('i') + P(None,'i') leaves", {}, "pytree"),
    Row("pytree PCG single_reduction, P('i') + P(None,'i')", {"single_reduction": True},
        "pytree"),
    Row("pytree PCG s_step s=4, P('i') + P(None,'i')", _S4, "pytree"),
))
register_solver(pcg_linear_solve, nonsymmetric=False,
                variants=(Variant("pcg_linear_solve", {}, "pcg", (3, 6, 2)),))
