"""One result type and one status enum for every iterative solver."""

from __future__ import annotations

import enum
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

PyTree = Any


class Status(enum.IntEnum):
    """Why a solve stopped. `solution.message` says it for that solve (its
    dtype decides the advice); `Status(code).message` is the general text.

    `FLOOR` is not a failure of the method: its own residual met the
    tolerance and `x` is as accurate as the precision allows for this
    system, but `b - A x` evaluated in that precision rounds to more than
    the tolerance (`converged` stays False: it means the true residual met
    the test; `Solution.check` accepts `FLOOR`).
    """

    CONVERGED = 0
    MAX_STEPS = 1
    INDEFINITE = 2
    BREAKDOWN = 3
    NONFINITE = 4
    STAGNATION = 5
    INVALID_TOLERANCE = 6
    LINE_SEARCH = 7
    LINEAR_SOLVE = 8
    DIVERGED = 9
    INCONSISTENT = 10
    FLOOR = 11

    @property
    def message(self) -> str:
        return message(self)


#: Each status's cause and its one fix (at most about 300 characters; the
#: docs say more: `docs/troubleshooting.md`). `{dtype}`, `{floor}` and
#: `{stagnation}` are filled in by `message` from the solve's dtype.
_MESSAGES = {
    Status.CONVERGED: "converged: the true residual meets max(atol, rtol * ||b||)",
    Status.MAX_STEPS: "not converged: the iteration limit was reached first; precondition, "
    "raise `max_steps`/`max_restarts` or loosen the tolerance",
    Status.INDEFINITE: "breakdown: <p, A p> <= 0 or <r, M r> <= 0 well above the rounding "
    "floor: the operator (CG) or the preconditioner (CG, MINRES) is not symmetric positive "
    "definite; for an indefinite symmetric A use `minres`, else `gmres`",
    Status.BREAKDOWN: "breakdown: the Krylov space became invariant (GMRES, MINRES: a "
    "singular operator and an inconsistent system; MINRES returns a least-squares solution) "
    "or a BiCGStab or IDR(s) denominator vanished; restart from x, change `key` (IDR(s)) "
    "or use `gmres`",
    Status.NONFINITE: "non-finite values (NaN or Inf) in b, the operator, the preconditioner "
    "or the iterates",
    Status.STAGNATION: "not converged: the iteration stopped making progress well above the "
    "tolerance (so does a singular operator with an inconsistent system); {stagnation}",
    Status.INVALID_TOLERANCE: "not solved: a traced `rtol` or `atol` was negative or NaN "
    "(both must be finite and >= 0)",
    Status.LINE_SEARCH: "not converged (`newton_krylov`): no step along the Newton direction "
    "reduced ||F|| enough; near the tolerance ||F|| is at its rounding level (loosen it), "
    "far from it precondition or start closer to a root",
    Status.LINEAR_SOLVE: "not converged (`newton_krylov`): the linear solve for the Newton "
    "step failed; `linear_status` says how",
    Status.DIVERGED: "diverged: the residual grew to 1000x its start, which a symmetric "
    "positive definite system does not do in CG: the operator or preconditioner is likely "
    "nonsymmetric or indefinite; use `gmres` or `bicgstab` (`minres` if symmetric)",
    Status.INCONSISTENT: "no solution: the operator is singular (e.g. periodic or pure "
    "Neumann boundaries) and b has a component in its null space larger than the "
    "tolerance; remove it (for those grids: b - mean(b))",
    Status.FLOOR: "at the precision floor: x is as accurate as {dtype} allows for this "
    "system (the method's own residual went below the tolerance, or broke down at "
    "rounding level), but b - A x rounded in {dtype} stays above it; {floor}",
}

#: The advice that depends on the precision: (float32 or narrower, float64,
#: unknown).
_ADVICE = {
    "floor": ("for a smaller residual solve in float64 (x64) or use `iterative_refinement`",
              "the tolerance is below eps * cond(A): loosen `rtol` or precondition",
              "float64 or `iterative_refinement` lower it in float32; in float64 loosen "
              "`rtol`"),
    "stagnation": ("float32 reaches about eps * cond(A): use float64 (x64) or "
                   "`iterative_refinement`, or precondition",
                   "precondition, raise `restart` (GMRES) or loosen `rtol`",
                   "precondition, raise `restart` (GMRES), or use float64"),
}


def message(status, dtype=None) -> str:
    """The message of one status; `dtype`: the solve's (real) dtype, which
    picks the advice (float64 never suggests enabling x64)."""
    pick = 2 if dtype is None else 1 if np.finfo(dtype).bits >= 64 else 0
    text = _MESSAGES[Status(int(status))]
    return text.format(dtype="the precision" if dtype is None else np.dtype(dtype).name,
                       **{key: advice[pick] for key, advice in _ADVICE.items()})


#: Loop-internal marker: the iteration has not decided yet (never returned).
RUNNING = -1


def code(status) -> np.int32:
    """A status (or `RUNNING`) as an int32 scalar: a NumPy constant, so tracing
    does not create (and later fold) a device array for each use."""
    return np.int32(int(status))


def first_status(cases, default):
    """The status of the first `(condition, status)` case whose condition holds,
    else `default`: the one way solvers turn scalar tests into a status code.

    Statuses are `Status` members, `RUNNING` or int32 scalars (traced ones too).
    Built from `lax.select` (no dtype promotion or broadcasting to trace: a chain
    runs in every solve, so its tracing cost is paid by every compile).
    """
    def as_code(status):
        return status if isinstance(status, jax.Array) else code(status)

    out = as_code(default)
    for condition, status in reversed(cases):
        out = lax.select(condition, as_code(status), out)
    return out


class Solution(NamedTuple):
    """The result of an iterative solve (a pytree: usable under `jit`/`vmap`).

    Attributes:
        x: the approximate solution, with the structure and shardings of `b`.
        status: a `Status` code (int32 array; one per batch element under `vmap`).
        converged: `status == Status.CONVERGED`; true only if the *true* residual
            `||b - A x||` meets `max(atol, rtol * ||b||)`.
        iterations: Krylov iterations taken (CG steps; Arnoldi steps for GMRES).
        residual_norm: the true residual norm `||b - A x||` at return.
        history: with `record_history=True`, the solver's own residual norm
            per iteration (NaN-padded to a static length); else `None`.
        recycle: with recycling (`gcrot`, or `pcg` with `recycle_size=` or
            `recycle=`): the recycled space `RecycleSpace(C, U)` for the next
            solve of a sequence (`gcrot(..., recycle=sol.recycle)`); else
            `None`.
    """

    x: PyTree
    status: Any
    converged: Any
    iterations: Any
    residual_norm: Any
    history: Any = None
    recycle: Any = None

    @property
    def message(self) -> str:
        """Host-side, human-readable status (concrete values only)."""
        return describe(self.status, dtype=_real_dtype(self.residual_norm))

    def check(self) -> Solution:
        """Host-side: return `self` if every solve converged (or stopped at
        its precision's `FLOOR`), else raise `RuntimeError`."""
        return checked(self)


def describe(status, messages=None, dtype=None) -> str:
    """Host-side: the messages of the (concrete, possibly batched) status codes
    (`messages`: replacements for some statuses' messages; `dtype`: the
    solve's, which picks the advice)."""
    codes = np.atleast_1d(np.asarray(status))
    messages = messages or {}
    return "; ".join(sorted({messages.get(Status(int(c)), message(c, dtype))
                             for c in codes}))


def _real_dtype(value):
    dtype = getattr(value, "dtype", None)
    return None if dtype is None else np.finfo(dtype).dtype


def checked(result):
    """Host-side: `result` if every solve in it converged or stopped at the
    precision's floor (`Status.FLOOR`), else `RuntimeError`."""
    ok = np.asarray(result.converged) | (np.asarray(result.status) == int(Status.FLOOR))
    if not bool(np.all(ok)):
        raise RuntimeError(f"solvax: solve did not converge: {result.message}")
    return result


def final_status(loop_status, true_ok, true_norm, inconsistent=False):
    """The one rule turning a loop's state and the true residual into a `Status`.

    Args:
        loop_status: what the iteration ended on (`CONVERGED` if its own
            residual test passed, a breakdown code, or `RUNNING` if it ran out
            of steps).
        true_ok: the true residual meets the tolerance.
        true_norm: the true residual norm.
        inconsistent: no `x` can meet the tolerance: `b`'s component in the
            null space of a singular operator exceeds it (`null_component`).

    A loop whose own test passed while the true residual does not meet the
    tolerance stopped at the precision's `FLOOR` (the two residuals differ by
    rounding alone).
    """
    nonfinite = (loop_status == code(Status.NONFINITE)) | ~jnp.isfinite(true_norm)
    return first_status([(nonfinite, Status.NONFINITE), (true_ok, Status.CONVERGED),
                         (inconsistent, Status.INCONSISTENT),
                         (loop_status == code(Status.CONVERGED), Status.FLOOR),
                         (loop_status == RUNNING, Status.MAX_STEPS)], loop_status)


def make_solution(x, loop_status, iterations, true_norm, tol, history=None,
                  recycle=None, inconsistent=False) -> Solution:
    """Assemble a `Solution` from the true residual norm and the tolerance."""
    true_ok = jnp.isfinite(true_norm) & (true_norm <= tol)
    status = final_status(loop_status, true_ok, true_norm, inconsistent)
    return Solution(
        x=x,
        status=status,
        converged=status == int(Status.CONVERGED),
        iterations=jnp.asarray(iterations, jnp.int32),
        residual_norm=true_norm,
        history=history,
        recycle=recycle,
    )
