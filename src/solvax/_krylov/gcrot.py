"""GCRO-DR: restarted flexible GMRES that deflates a recycled space and carries
it from one solve to the next (`gcrot`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from .._core import checks, contract, driver, tree
from .._core.contract import Outcome, Problem
from .._core.options import documented
from .._core.registry import Row, Variant, register_solver
from .._core.solution import Solution
from . import gmres, recycling
from .arnoldi import make_arnoldi
from .recycling import RecycleSpace

PyTree = Any


#: `gcrot`'s default cycle length and space size (`newton_krylov` sizes its
#: first, empty space with them).
M, K = 30, 10


def space_size(size: int, m: int = M, k: int = K) -> int:
    """The rows of the space a solve of `size` unknowns makes: `k`, at most
    the cycle length `min(m, size)`."""
    return min(k, m, size)


def _run(problem: Problem, *, m: int, k: int, max_restarts: int | None,
         record_history: bool) -> Outcome:
    """The GCRO-DR iteration: `gmres.restarted` with a recycled space ahead
    of each cycle's basis, renewed from each cycle's harmonic Ritz vectors.
    A handed-on space is refreshed for the operator only where its ledger
    says recycling has paid (`recycling.worth_refreshing`); otherwise the
    solve runs cold, from an empty space, without the refresh's matvecs."""
    b = problem.b
    k = space_size(problem.size(), m, k)
    m, max_restarts = gmres.cycle_sizes(problem.size(), m, max_restarts)
    given = problem.data
    if given is None:
        space, used, ledger = recycling.empty(b, k), jnp.bool_(False), None
    else:
        used = jnp.asarray(recycling.worth_refreshing(given.ledger))
        space = lax.cond(used, lambda: recycling.refreshed(
            problem.A, problem.ip, RecycleSpace(given.C, given.U)),
            lambda: recycling.empty(b, k))
        ledger = given.ledger
    arnoldi = make_arnoldi(problem.A, b, precond=problem.precond, ip=problem.ip, m=m,
                            orthogonalization="one_sync", offset=k)

    def renew(V, Z, H, est, old, go, E, D):
        return recycling.harmonic_space(problem.ip, V, Z, H, est.j, k, old, go, E, D)

    outcome, start = gmres.restarted(problem, arnoldi, m=m, max_restarts=max_restarts,
                                     record_history=record_history, space=space, renew=renew)
    C, U = outcome.recycle
    if given is not None and given.ledger is None:
        return outcome._replace(recycle=RecycleSpace(C, U))  # a space given by hand
    return outcome._replace(recycle=RecycleSpace(C, U, _entered(
        ledger, used, outcome.iterations + jnp.where(used, k, 0), start, outcome.residual[0])))


def _entered(ledger, used, matvecs, start, final) -> jax.Array:
    """The ledger after a solve: its cost per decade in the recycled entry
    where it ran with a handed-on space (`used`; one more solve since the
    cold cost), else in the cold one (the age back to 0). A solve of less
    than a decade records no cost."""
    real = jnp.result_type(start)
    ledger = recycling.empty_ledger(real) if ledger is None else ledger.astype(real)
    cost = recycling.cost_per_decade(matvecs.astype(real), start, final)
    cold, recycled, age = ledger[0], ledger[1], ledger[2]
    as_recycled = jnp.stack([cold, jnp.where(jnp.isnan(cost), recycled, cost), age + 1])
    as_cold = jnp.stack([jnp.where(jnp.isnan(cost), cold, cost), recycled,
                         jnp.where(jnp.isnan(cost), age, 0)])
    return lax.stop_gradient(jnp.where(used, as_recycled, as_cold))


GCROT = driver.register(contract.Method("gcrot", _run))


@documented
def gcrot(
    matvec: Callable[[PyTree], PyTree],
    b: PyTree,
    *,
    x0: PyTree | None = None,
    precond: Callable[[PyTree], PyTree] | None = None,
    m: int = M,
    k: int = K,
    recycle: RecycleSpace | tuple | None = None,
    max_restarts: int | None = None,
    rtol: float | None = None,
    atol: float = 0.0,
    record_history: bool = False,
    inner_product=None,
    axis_name: str | tuple[str, ...] | None = None,
    failed_derivative: str = "nan",
    adjoint_recycle: bool = True,
) -> Solution:
    """GCRO-DR(m, k): restarted flexible GMRES that deflates a recycled space,
    carried from one solve of a sequence to the next.

    A recycled space is a pair `(C, U)` with `A U = C` and `C` orthonormal,
    each a pytree like `b` with a leading axis of length `k` per leaf (every
    leaf keeps its sharding). Each restart takes the residual's part in
    `span(C)` exactly (`x += U C^H r`, `r -= C C^H r`, its projections
    riding in the residual's reduction) and runs a one-sync Arnoldi cycle of
    `m` steps with `C` ahead of its basis: every step orthogonalizes against
    `C` and the basis in its one reduction, and the least squares minimizes
    over `span(U) + span(Z)`. After each cycle the space becomes the `k`
    harmonic Ritz vectors of smallest harmonic Ritz value of that augmented
    space (the slowest modes: Parks et al. 2006); one more reduction per
    cycle. The final space is `Solution.recycle`.

    Passing it to the next solve (`recycle=sol.recycle`, a changed operator
    and right-hand side) costs `k` matvecs and two reductions at the start:
    `C = A U` for the new operator, orthonormalized (`U` follows). From
    `recycle=None` the space starts empty and fills after the first cycle,
    so a first solve already deflates across its restarts.

    A space is handed on only while it pays. `Solution.recycle.ledger`
    records `[cold, recycled, age]`: the matvecs per decade of residual
    reduction of the last solve that ran without a handed-on space and of
    the last that ran with one (its `k` refresh matvecs included; a solve
    of less than a decade records nothing), and the recycled solves since
    the cold cost was measured. A solve handed a space whose ledger says
    recycling cost more than running cold skips the refresh and runs cold,
    handing its own space on; recycling is tried again once cold solves
    cost more. A narrow win (recycled above 0.8 of cold) against a cold
    cost four recycled solves old runs cold once, to measure it again
    (`recycling.worth_refreshing`). A space given without a ledger (`(C,
    U)` or `RecycleSpace(C, U)`) is always used, and the space such a solve
    returns has none either: a chain of spaces started from `recycle=None`
    keeps the ledger. Measured on backward-Euler
    sequences of convection-diffusion (`benchmarks/benchmark_recycling.py
    --only family`, 64^2-128^2): where handing the space on made every
    solve slower (strong convection: 1.73-1.81x the matvecs of the same
    gcrot cold), the ledger drops it after one solve (1.02-1.04x); where it
    pays it is kept (0.85-0.94x cold).

    Derivatives are implicit, as for every solver: `jax.grad` runs one
    `gcrot` on the transposed system, handed this solve's final space (for
    a symmetric operator its own slow modes; otherwise it is refreshed for
    `A^T` like any new operator: `k` matvecs and two reductions). Measured
    (`tests/test_gcrot.py`, a 24 x 24 convection-diffusion): it saves
    matvecs for symmetric and mildly nonsymmetric operators (87 against 90
    at convection 0.05) and costs more than it saves for strongly
    nonsymmetric ones (118 against 86 at 0.4), whose transposed slow modes
    are the left, not the right, eigenvectors: `adjoint_recycle=False`
    solves the transposed system from an empty space. The space itself is
    not differentiated: it changes how fast a solve converges, not its
    solution.

    Args:
        matvec: `x -> A x` on pytrees shaped like `b`.
        b: right-hand side, an array or any pytree of arrays.
        x0, rtol, atol, inner_product, axis_name, failed_derivative: the common options.
        precond: `v -> M v`, a right preconditioner (may vary between calls).
        m: Arnoldi steps per cycle.
        k: size of the recycled space, `1 <= k < m`.
        recycle: the space of a previous solve (`Solution.recycle`), or None.
        max_restarts: cycle limit (default `ceil(10 * size(b) / m)`).
        record_history: store the residual norm per accepted step (as `gmres`).
        adjoint_recycle: hand this solve's final space to the transposed
            solve of a derivative (default), or start that from an empty one.

    Returns:
        A `Solution` whose `recycle` is the space for the next solve;
        `iterations` counts accepted Arnoldi steps (the `k` matvecs that
        refresh a given space are not among them).

    Memory: per leaf `2 m + 2 k + 3` vectors (basis, directions and space).
    Communication per Arnoldi step: one all-reduce (as `gmres`); per cycle one
    more (the `(m + k + 1) x (m + k)` Gram matrix of the harmonic problem);
    per solve with a given space two (its orthonormalization); no gather.

    Raises:
        TypeError, ValueError: at trace time, as `gmres`, and for `k >= m`,
            `k < 1` or a `recycle` of another structure, shape (another grid,
            another `k`) or dtype.

    Reference: M. L. Parks, E. de Sturler, G. Mackey, D. D. Johnson, S.
    Maiti, "Recycling Krylov subspaces for sequences of linear systems",
    SIAM J. Sci. Comput. 28 (2006).
    """
    checks.check_int("m", m, 2)
    checks.check_int("k", k, 1)
    if k >= m:
        raise ValueError(f"`k` ({k}) must be smaller than `m` ({m}): the recycled space is "
                         "deflated from cycles of `m` new steps (e.g. m=30, k=10).")
    if max_restarts is not None:
        checks.check_int("max_restarts", max_restarts, 0, checks.INT32_MAX // m)
    adjoint_recycle = checks.check_flag("adjoint_recycle", adjoint_recycle)
    checks.check_vector("b", b)
    if recycle is not None:
        recycle = recycling.checked(recycle, b, space_size(tree.size(b), m, k))
    return driver.solve(GCROT, matvec, b, x0=x0, precond=precond, rtol=rtol, atol=atol,
                         inner_product=inner_product, axis_name=axis_name,
                         failed_derivative=failed_derivative, data=recycle,
                         adjoint_data=_for_the_transpose if adjoint_recycle else None,
                         m=int(m), k=int(k),
                         max_restarts=max_restarts, record_history=record_history)


def _for_the_transpose(outcome: Outcome) -> RecycleSpace:
    """The forward space for the transposed solve of a derivative, without
    the ledger (its costs are the forward operator's): always refreshed."""
    return RecycleSpace(outcome.recycle.C, outcome.recycle.U)


# Counts: as GMRES (the restart's reduction carries C^H r), plus the harmonic
# update's Gram matrix per cycle (in a conditional of the restart loop: 3 in
# loops, 1 per Arnoldi step); the adjoint refreshes the forward space for A^T
# (2 more); from recycle=None no refresh of a given space.
register_solver(gcrot, nonsymmetric=True, newton=True, limit="max_restarts", cycle="m",
                variants=(Variant("gcrot", {"m": 12, "k": 4}, "gcrot", (4, 10, 3)),), rows=(
    Row("GCRO-DR gcrot(m=16, k=4) (recycled space)", {"m": 16, "k": 4}),
    Row("shard_map: gcrot(m=16, k=4) (axis_name)", {"m": 16, "k": 4}, "shard_map"),
))
