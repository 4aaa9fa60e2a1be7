"""A stationary iteration `x <- x + M (b - A x)`: multigrid as a solver.

One matvec, one preconditioner application (a multigrid cycle) and **one
reduction** (`||b - A x||^2`) per cycle, and nothing else: where a Krylov
method's reductions are the cost (a latency-bound mesh), cycles that converge
fast on their own need a single norm each.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from .._core import checks, contract, driver, tree
from .._core.contract import Outcome, Problem
from .._core.solution import RUNNING, Solution, Status, first_status
from .._krylov import steps
from .multigrid import Multigrid, multigrid
from .stencil import StencilOperator

PyTree = Any


class _State(NamedTuple):
    x: PyTree
    r: PyTree  # b - A x, updated as r - A z (the driver confirms on the true residual)
    rr: jax.Array  # ||r||^2
    best: jax.Array  # the least ||r||^2 so far
    stalls: jax.Array  # consecutive cycles that did not lower `best` by `_PROGRESS`
    k: jax.Array
    status: jax.Array
    history: jax.Array | None


class _Context(NamedTuple):
    A: Callable
    M: Callable
    tol2: jax.Array
    max_steps: int
    patience: int


# a cycle that lowers the best residual by less than this factor is a stall;
# `patience` stalls in a row end the iteration (divergence, or the rounding level)
_PROGRESS = 0.99 ** 2


def _cycle(st: _State, ctx: _Context, ip) -> _State:
    with jax.named_scope("solvax.stationary.precond"):
        z = ctx.M(st.r)
    x = tree.add(st.x, z)
    with jax.named_scope("solvax.stationary.matvec"):
        r = tree.sub(st.r, ctx.A(z))
    with jax.named_scope("solvax.stationary.reduce"):
        rr = jnp.real(ip.dot(r, r))
    improved = rr < _PROGRESS * st.best
    stalls = jnp.where(improved, 0, st.stalls + 1)
    status = first_status([(~jnp.isfinite(rr), Status.NONFINITE),
                           (rr <= ctx.tol2, Status.CONVERGED),
                           (stalls >= ctx.patience, Status.STAGNATION)], RUNNING)
    history = None if st.history is None else st.history.at[st.k + 1].set(jnp.sqrt(rr))
    return _State(x=x, r=r, rr=rr, best=jnp.minimum(rr, st.best), stalls=stalls, k=st.k + 1,
                  status=status, history=history)


def _run(problem: Problem, *, max_steps: int | None, record_history: bool,
         patience: int = 3) -> Outcome:
    """Cycles until the residual meets the tolerance, the cycle limit, or
    `patience` cycles in a row without progress (not differentiated itself:
    the driver's implicit rule differentiates the solve)."""
    max_steps = problem.step_limit(max_steps)
    rtol, atol = problem.tolerances()
    ip = problem.ip
    M = problem.precond or (lambda v: v)
    with jax.named_scope("solvax.stationary.setup"):
        x, r = problem.residual()
        if problem.x0 is None:   # r = b
            bb = rr = jnp.real(ip.dot(r, r))
        else:
            bb, rr = jnp.real(ip.multi_dot([(problem.b, problem.b), (r, r)]))
            x, r = problem.settled(x, r, bb)
            rr = jnp.where(bb == 0, 0, rr)
    tol2 = contract.squared_threshold(bb, rtol, atol)
    history = problem.history(max_steps + 1, record_history)
    if history is not None:
        history = history.at[0].set(jnp.sqrt(rr))
    status = first_status([(~jnp.isfinite(rr), Status.NONFINITE), (rr <= tol2, Status.CONVERGED)],
                          RUNNING)
    st = _State(x=x, r=r, rr=rr, best=rr, stalls=jnp.int32(0), k=jnp.int32(0),
                status=status, history=history)
    ctx = _Context(A=problem.A, M=M, tol2=tol2, max_steps=max_steps, patience=patience)
    st = steps.while_loop(ip, problem.b,
                            lambda st: (st.status == RUNNING) & (st.k < ctx.max_steps),
                            functools.partial(_cycle, ctx=ctx, ip=ip), st)
    return Outcome(x=st.x, status=st.status, iterations=st.k, history=st.history)


# Not in the driver's registry, whose generic checks run every method on
# black-box operators without a preconditioner: the iteration needs a cycle
# that contracts (tests/test_multigrid_solve.py runs the same checks on
# stencil operators with their multigrid).
STATIONARY = contract.Method("stationary", _run)


def multigrid_solve(
    operator: StencilOperator,
    b: jax.Array,
    *,
    x0: jax.Array | None = None,
    precond: Multigrid | None = None,
    cycle: str = "V",
    rtol: float | None = None,
    atol: float = 0.0,
    max_cycles: int = 100,
    record_history: bool = False,
    inner_product=None,
    axis_name: str | tuple[str, ...] | None = None,
    failed_derivative: str = "nan",
) -> Solution:
    """Solve `A x = b` with multigrid cycles alone (no Krylov method around them).

    The stationary iteration `x <- x + M (b - A x)` with `M` one cycle of
    `precond` (default `sx.multigrid(operator, cycle=cycle)`): per cycle one
    matvec, the cycle and **one reduction** (`||b - A x||^2`, the stopping
    test), where preconditioned CG needs two (or one, single-reduction) and
    its own. It pays where the cycle alone contracts the error fast (Poisson,
    smooth coefficients: a V(2,2) cycle lowers the residual about 5x per
    cycle, 13 to 16 cycles to 1e-10 from 32^2 to 256^2, against 8 to 9 CG
    iterations) and reductions are what a solve waits for; on rough
    coefficients CG's acceleration is worth its reductions (a log-normal
    field at 256^2: 100 V-cycles do not reach 1e-10, 47 W-cycles do, CG 16
    iterations; `docs/multigrid.md`).

    Statuses: `CONVERGED` on the true residual (checked after the loop);
    `STAGNATION` when 3 cycles in a row lower the residual by less than 1 %
    (a cycle that does not contract the error for this operator, divergence,
    or the rounding level); `NONFINITE`; `MAX_STEPS` after `max_cycles`.

    Args:
        operator: a `StencilOperator` (`sx.diffusion_operator`,
            `sx.stencil_operator`), the matrix and the source of the hierarchy.
        b: right-hand side, an array of the grid's shape (any sharding).
        x0: initial guess (default zeros).
        precond: a `Multigrid` built from `operator` (to choose the smoother,
            levels, `dtype` or `coarse`, or to reuse a hierarchy); default
            `sx.multigrid(operator, cycle=cycle)`.
        cycle: `"V"`, `"W"` or `"F"` when `precond` is None.
        rtol, atol: stop when `||b - A x|| <= max(atol, rtol ||b||)`; the
            default `rtol` is `max(1e-8, 100 eps)` of `b`'s precision.
        max_cycles: the most cycles (>= 0).
        record_history: the residual norm before every cycle in
            `Solution.history` (length `max_cycles + 1`).
        inner_product, axis_name: as for the Krylov solvers (inside
            `shard_map`, `axis_name` and an operator built with `axis_names`).
        failed_derivative: `"nan"` (default) or `"keep"`, as for the solvers.

    Returns:
        A `Solution`; `iterations` counts cycles.

    Raises:
        TypeError, ValueError: at trace time, for an operator that is not a
            `StencilOperator`, a `precond` that is not a `Multigrid`, a bad
            cycle or `max_cycles`, and everything the solvers refuse.

    Differentiable by implicit differentiation, as the Krylov solvers: the
    transposed system is solved by the same cycles (for a symmetric operator
    the same iteration; for a nonsymmetric one, a gradient whose transposed
    iteration does not converge is NaN).
    """
    if precond is None:
        precond = multigrid(operator, cycle=cycle)
    elif not isinstance(precond, Multigrid):
        raise TypeError("`precond` must be a `Multigrid` (from `sx.multigrid(operator, ...)`) "
                        f"or None; got {type(precond).__name__}.")
    max_cycles = checks.check_int("max_cycles", max_cycles, 0)
    return driver.solve(STATIONARY, operator, b, x0=x0, precond=precond, rtol=rtol, atol=atol,
                         inner_product=inner_product, axis_name=axis_name,
                         failed_derivative=failed_derivative, max_steps=max_cycles,
                         record_history=record_history)
