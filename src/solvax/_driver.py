"""The Krylov driver: one contract for every iterative method.

A *method* is one private module (`_cg.py`, `_gmres.py`, ...) that registers a
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
   `jax.linear_transpose`), started from zero.
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
- `Method.symmetric`: for real `b` the transposed solve may use `A` itself
  (`A^T = A`); then, with `x0=None`, it is the primal solve.

Adding a method: write `run`, register `Method(name, run, symmetric)`, call
`solve(method, ...)` from the public function, export it in `__init__.py`,
and add one entry to `tests/helpers.py::SOLVERS`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import _checks, _reduce
from . import _tree as tree
from ._closure import Closed, close, transposed
from ._solution import Solution, make_solution

PyTree = Any


class Problem(NamedTuple):
    """Everything a method reads: a pytree, every traced value a leaf.

    `A` and `b` are differentiated; the rest does not change the solution.
    Fields a method has no use for may be None.
    """

    A: Closed  # x -> A x
    b: PyTree
    x0: PyTree | None = None  # None: start from zero
    precond: Closed | None = None  # r -> M r; None: the identity
    rtol: Any = 0.0  # as given (a Python float stays one: no array to type inside
    atol: Any = 0.0  # shard_map); `tolerances()` casts them
    ip: _reduce.Reduction | None = None
    data: PyTree = None  # a method's own traced arguments (linear_solve: the user's solvers)

    def real_dtype(self):
        """The real dtype of the iteration (of `b`'s common dtype, at least float32)."""
        return jnp.finfo(tree.result_dtype(self.b)).dtype

    def tolerances(self) -> tuple[jax.Array, jax.Array]:
        """`(rtol, atol)` in `real_dtype()`."""
        return (jnp.asarray(self.rtol, self.real_dtype()),
                jnp.asarray(self.atol, self.real_dtype()))


class Outcome(NamedTuple):
    """What a method returns; `finish` makes it a `Solution`."""

    x: PyTree
    status: jax.Array  # RUNNING, CONVERGED (by the method's own test) or a breakdown
    iterations: jax.Array
    history: jax.Array | None = None
    # (||b - A x||, max(atol, rtol ||b||)) when the method measured them itself
    residual: tuple[jax.Array, jax.Array] | None = None


class Method(NamedTuple):
    name: str
    run: Callable[..., Outcome]  # run(problem, **static options)
    symmetric: bool  # A^T = A may be assumed for real b (the transposed solve uses A)


METHODS: dict[str, Method] = {}


def register(method: Method) -> Method:
    METHODS[method.name] = method
    return method


def make_problem(matvec, b, *, x0=None, precond=None, rtol=0.0, atol=0.0, inner_product=None,
                 axis_name=None) -> Problem:
    """The validated, closure-converted problem (see the module docstring, 1-2)."""
    _checks.check_vector("b", b)
    _checks.check_callable("matvec", matvec)
    if x0 is not None:
        _checks.check_like("x0", x0, "b", b)
    _checks.check_tolerance("rtol", rtol)
    _checks.check_tolerance("atol", atol)
    ip = _reduce.resolve(inner_product, axis_name)
    return Problem(A=closed_operator("matvec", matvec, b), b=b, x0=x0,
                   precond=None if precond is None else closed_operator("precond", precond, b),
                   rtol=rtol, atol=atol, ip=ip.closed(b))


def closed_operator(name: str, fn, b) -> Closed:
    """`fn` as a `Closed`, its output checked against `b` (on the converted
    function: the user's function is traced once)."""
    _checks.check_callable(name, fn)
    A = close(fn, b)
    _checks.check_like(f"{name}(b)", jax.eval_shape(A, b), "b", b)
    return A


def solve(method: Method, matvec, b, /, *, x0, precond, rtol, atol, inner_product, axis_name,
          **options) -> Solution:
    """`method` on `A x = b`, validated, differentiable and finished (1-4 above)."""
    problem = make_problem(matvec, b, x0=x0, precond=precond, rtol=rtol, atol=atol,
                           inner_product=inner_product, axis_name=axis_name)
    run = functools.partial(_run_and_finish, method, options)
    symmetric = method.symmetric and _checks.is_real(b)
    # The transposed solve starts from zero; with x0=None and A^T = A it is the primal one.
    run_transposed = None if symmetric and x0 is None else (
        lambda p: run(p._replace(x0=None)))
    return implicit_solve(problem, run, run_transposed, symmetric)


def _run_and_finish(method: Method, options: dict, problem: Problem) -> Solution:
    return finish(problem, method.run(problem, **options), method.name)


def finish(problem: Problem, outcome: Outcome, name: str) -> Solution:
    """The `Solution`: the true residual decides `converged` (module docstring, 4)."""
    if outcome.residual is None:
        with jax.named_scope(f"solvax.{name}.true_residual"):
            r = tree.sub(problem.b, problem.A(outcome.x))
            # ||b|| rides along in the same reduction.
            rr, bb = jnp.real(problem.ip.multi_dot([(r, r), (problem.b, problem.b)]))
        norm = _reduce.real_sqrt(rr)
        rtol, atol = problem.tolerances()
        tol = jnp.maximum(atol, rtol * _reduce.real_sqrt(bb))
    else:
        norm, tol = outcome.residual
    return make_solution(outcome.x, outcome.status, outcome.iterations, norm, tol,
                         history=outcome.history)


# ----------------------------------------------------------- differentiation
def solution_of(out) -> PyTree:
    return out.x if isinstance(out, Solution) else out


def _diagnostics_as_reals(out):
    """Integer and boolean diagnostics cast to the residual's real dtype (exact
    for statuses, and for iteration counts up to 2^24 in float32, 2^53 in
    float64), so every output of the custom derivative has a plain zero
    tangent. Integer outputs would need `float0` tangents, whose avals jax 0.6
    compares with the primal's sharding included (a sharded solve's gradient
    then fails its shape/dtype check)."""
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


def implicit_solve(problem: Problem, run, run_transposed, symmetric: bool):
    """`run(problem)` with derivatives defined implicitly.

    `run(problem)` returns a `Solution` (diagnostics kept) or the solution
    pytree; `run_transposed(problem with A^T and another b)` solves the
    transposed system (None: `A` is symmetric and the solve the same as the
    primal one). Both read every traced value from their argument, so the
    primal solve is traced once and the transposed solve only when a
    derivative asks for it. `A` and `b` are differentiated; the rest of the
    problem (initial guess, preconditioner, weights) is not: the solution does
    not depend on it. Diagnostics stay outside `custom_linear_solve`, so inside
    `shard_map` they keep their own (invariant) type.
    """

    @jax.custom_jvp
    def solve_(A, b, rest):
        return _diagnostics_as_reals(run(Problem(A, b, *rest)))

    @solve_.defjvp
    def solve_jvp(primals, tangents):
        A, b, rest = primals
        dA, db, _ = tangents
        # The primal solve, traced once and used for the tangent solve too; as a call
        # of `solve_` itself, so higher derivatives use this rule again instead of
        # differentiating through the iteration.
        primal = close(lambda r: solve_(A, r, rest), b)
        out = primal(b)
        x = solution_of(out)
        _, dA_x = jax.jvp(lambda A: A(x), (A,), (dA,))
        At = A if symmetric else transposed(A)

        def transposed_solve(_, r):
            if run_transposed is None:
                return solution_of(primal(r))
            return solution_of(run_transposed(Problem(At, r, *rest)))

        dx = jax.lax.custom_linear_solve(A, tree.sub(db, dA_x),
                                         lambda _, r: solution_of(primal(r)),
                                         transposed_solve, symmetric=symmetric)
        if isinstance(out, Solution):
            return out, jax.tree_util.tree_map(jnp.zeros_like, out)._replace(x=dx)
        return out, dx

    return _diagnostics_restored(solve_(problem.A, problem.b, tuple(problem[2:])))
