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
    """Why a solve stopped. `Status(int(solution.status)).message` explains it."""

    CONVERGED = 0
    MAX_STEPS = 1
    INDEFINITE = 2
    BREAKDOWN = 3
    NONFINITE = 4
    STAGNATION = 5
    INVALID_TOLERANCE = 6
    LINE_SEARCH = 7
    LINEAR_SOLVE = 8

    @property
    def message(self) -> str:
        return _MESSAGES[self]


_MESSAGES = {
    Status.CONVERGED: "converged: the true residual meets max(atol, rtol * ||b||)",
    Status.MAX_STEPS: "not converged: the iteration limit was reached first; "
    "raise `max_steps`/`max_restarts`, loosen the tolerance or precondition",
    Status.INDEFINITE: "breakdown: non-positive curvature <p, A p> <= 0 or <r, M r> <= 0; "
    "the operator (CG) or the preconditioner (CG, MINRES) is not Hermitian positive definite "
    "(or, for the single-reduction and pipelined CG recurrences, rounding at their attainable "
    "accuracy)",
    Status.BREAKDOWN: "breakdown: the Krylov space became invariant before the tolerance was "
    "met (GMRES, MINRES: a singular operator and an inconsistent system; MINRES returns "
    "a least-squares solution), or a denominator of the short recurrences vanished "
    "(BiCGStab: rho = <r0, r>, <r0, A M p>, omega or <t, t>; IDR(s): a pivot P_k^H G_k or "
    "<t, r>); restart from x, change the shadow vectors (IDR(s) `key`) or use GMRES",
    Status.NONFINITE: "non-finite values (NaN or Inf) appeared in the right-hand side, "
    "the operator, the preconditioner or the iterates",
    Status.STAGNATION: "not converged: the iteration stopped making progress before the true "
    "residual b - A x met the tolerance (its own residual met it while the true one did not, "
    "restarts stopped decreasing it, or it reached its rounding level). Most often that is "
    "the precision: no method gets the true relative residual much below eps * cond(A), "
    "about 1e-3 for a 256^2 Laplacian with a smooth b in float32 (JAX's default, and an "
    "accelerator's); for more, enable x64 (`jax.config.update('jax_enable_x64', True)`) or "
    "use `iterative_refinement` (float64 answers from float32 solves), or loosen "
    "`rtol`/`atol`. Otherwise precondition or (GMRES) raise `restart`; a residual that stays "
    "well above the tolerance can also mean a singular operator and an inconsistent system",
    Status.INVALID_TOLERANCE: "not solved: a tolerance passed as a traced value was negative "
    "or NaN (`rtol` and `atol` must be finite and >= 0; concrete ones are refused when the "
    "solve is traced)",
    Status.LINE_SEARCH: "not converged (`newton_krylov`): no step along the Newton direction "
    "reduced ||F|| enough (Armijo) within `max_backtracks` reductions (a non-finite F counts as "
    "no reduction); the iterate before that step is returned. Near the tolerance, ||F|| "
    "has reached its rounding level (loosen `rtol`/`atol`, e.g. in float32); far from it, "
    "precondition or tighten the linear solves (`forcing`, `max_inner`), or start closer "
    "to a root (there may be none)",
    Status.LINEAR_SOLVE: "not converged (`newton_krylov`): the linear solve for the Newton step "
    "failed (non-finite, or a breakdown that gave no usable direction); "
    "`linear_status` says how",
}


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
        recycle: `gcrot` only: the recycled space `RecycleSpace(C, U)` for the
            next solve of a sequence (`gcrot(..., recycle=sol.recycle)`); else
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
        return describe(self.status)

    def check(self) -> Solution:
        """Host-side: return `self` if every solve converged, else raise `RuntimeError`."""
        return checked(self)


def describe(status, messages=None) -> str:
    """Host-side: the messages of the (concrete, possibly batched) status codes
    (`messages`: replacements for some statuses' messages)."""
    codes = np.atleast_1d(np.asarray(status))
    messages = messages or {}
    return "; ".join(sorted({messages.get(Status(int(c)), Status(int(c)).message)
                             for c in codes}))


def checked(result):
    """Host-side: `result` if every solve in it converged, else `RuntimeError`."""
    if not bool(np.all(np.asarray(result.converged))):
        raise RuntimeError(f"solvax: solve did not converge: {result.message}")
    return result


def final_status(loop_status, true_ok, true_norm):
    """The one rule turning a loop's state and the true residual into a `Status`.

    Args:
        loop_status: what the iteration ended on (`CONVERGED` if its own
            residual test passed, a breakdown code, or `RUNNING` if it ran out
            of steps).
        true_ok: the true residual meets the tolerance.
        true_norm: the true residual norm.
    """
    nonfinite = (loop_status == code(Status.NONFINITE)) | ~jnp.isfinite(true_norm)
    return first_status([(nonfinite, Status.NONFINITE), (true_ok, Status.CONVERGED),
                         (loop_status == code(Status.CONVERGED), Status.STAGNATION),
                         (loop_status == RUNNING, Status.MAX_STEPS)], loop_status)


def make_solution(x, loop_status, iterations, true_norm, tol, history=None,
                  recycle=None) -> Solution:
    """Assemble a `Solution` from the true residual norm and the tolerance."""
    true_ok = jnp.isfinite(true_norm) & (true_norm <= tol)
    status = final_status(loop_status, true_ok, true_norm)
    return Solution(
        x=x,
        status=status,
        converged=status == int(Status.CONVERGED),
        iterations=jnp.asarray(iterations, jnp.int32),
        residual_norm=true_norm,
        history=history,
        recycle=recycle,
    )
