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
   `jax.linear_transpose`), started from zero. A derivative whose solve did
   not converge is NaN (`failed_derivative="keep"` turns this off).
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
- The transposed solve (reverse mode) runs the same method on `A^T` (from
  `jax.linear_transpose`, exact for symmetric operators too), from zero: a
  method for Hermitian operators works on `A^T = conj(A)` as well.

- Options shared by several methods are checked here (`max_steps`,
  `record_history`); a method checks only its own.
- The small mechanisms of a step (safe division, the rounding-level test,
  the typed loop, confirmation on the true residual) are in `_method.py`;
  the start from `x0` and the stopping threshold are `Problem.start` /
  `Problem.residual` / `Problem.settled` and `threshold` here.

Adding a method: write `run`, register `Method(name, run)`, call
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

from . import _checks, _linearity, _reduce
from . import _tree as tree
from ._closure import Closed, close, transposed
from ._solution import Solution, Status, code, make_solution

PyTree = Any


@jax.tree_util.register_pytree_node_class
class Static:
    """A concrete option (a Python or NumPy number) kept out of the traced
    leaves: a tolerance given as a number stays a constant of every solve's
    trace. A traced leaf would be an input of `custom_linear_solve`, which
    inside `shard_map` under `grad(jit(...))` passes it on as a varying value
    where the traced solve expects an invariant one ("mul requires varying
    manual axes to match")."""

    def __init__(self, value):
        self.value = value

    def tree_flatten(self):
        return (), self.value

    @classmethod
    def tree_unflatten(cls, value, _):
        return cls(value)


def as_option(value):
    """`value` as a `Static` where it is a concrete number, else as it is."""
    return value if isinstance(value, jax.Array | jax.core.Tracer) else Static(value)


class Problem(NamedTuple):
    """Everything a method reads: a pytree, every traced value a leaf.

    `A` and `b` are differentiated; the rest does not change the solution.
    Fields a method has no use for may be None.
    """

    A: Closed  # x -> A x
    b: PyTree
    x0: PyTree | None = None  # None: start from zero
    precond: Closed | None = None  # r -> M r; None: the identity
    rtol: Any = 0.0  # a traced scalar, or a `Static` number; `tolerances()` reads them
    atol: Any = 0.0
    ip: _reduce.Reduction | None = None
    data: PyTree = None  # a method's own traced arguments (linear_solve: the user's solvers)

    def real_dtype(self):
        """The real dtype of the iteration (of `b`'s common dtype, at least float32)."""
        return jnp.finfo(tree.result_dtype(self.b)).dtype

    def size(self) -> int:
        """Entries of `b` in all (static): inside `shard_map` the local size times
        the devices along `axis_name`, so defaults that scale with the problem
        (iteration limits, GMRES's basis size) are the same as under `jit`."""
        return tree.size(self.b) * int(np.prod([jax.lax.psum(1, name)
                                                for name in self.ip.reduced_axes()]))

    def step_limit(self, max_steps: int | None) -> int:
        """`max_steps`, by default `10 * size()`."""
        return 10 * self.size() if max_steps is None else max_steps

    def history(self, length: int, record: bool) -> jax.Array | None:
        """A NaN-filled residual history of `length` (None unless recorded)."""
        return jnp.full((length,), jnp.nan, self.real_dtype()) if record else None

    def residual(self):
        """`(x, r)` before an iteration: `(0, b)`, or `(x0, b - A x0)` (one matvec)."""
        if self.x0 is None:
            return tree.zeros_like(self.b), self.b
        return self.x0, tree.sub(self.b, self.A(self.x0))

    def settled(self, x, r, bb):
        """`(x, r)` from `residual()`, with the answer exactly 0 where `b = 0`
        (`bb = ||b||^2 = 0`), whatever `x0` (from zero: unchanged)."""
        if self.x0 is None:
            return x, r
        zero_b = bb == 0
        return tree.where(zero_b, tree.zeros_like(self.b), x), tree.where(zero_b, self.b, r)

    def start(self, rtol, atol):
        """`(x, r, tol2)` before an iteration: from zero, with `tol2 = inf`
        (the first step's `<r, r>` is `||b||^2` and sets it, no reduction of
        its own), or from `x0`, with one setup reduction for `||b||^2`;
        `tol2 = max(atol, rtol ||b||)^2`."""
        x, r = self.residual()
        if self.x0 is None:
            return x, r, jnp.asarray(jnp.inf, self.real_dtype())
        bb = jnp.real(self.ip.dot(self.b, self.b))
        x, r = self.settled(x, r, bb)
        return x, r, squared_threshold(bb, rtol, atol)

    def tolerances(self) -> tuple[jax.Array, jax.Array]:
        """`(rtol, atol)` in `real_dtype()`."""
        return option_value(self.rtol, self.real_dtype()), option_value(self.atol,
                                                                        self.real_dtype())


def option_value(value, dtype) -> jax.Array:
    """A tolerance (a `Static` number or a traced scalar) as a `dtype` scalar."""
    return jnp.asarray(value.value if isinstance(value, Static) else value, dtype)


def invalid_tolerances(rtol, atol) -> jax.Array:
    """A traced `rtol` or `atol` that is negative, NaN or infinite (concrete
    ones are refused at trace time)."""
    return ~(rtol >= 0) | ~(atol >= 0) | (rtol == jnp.inf) | (atol == jnp.inf)


def threshold(bb, rtol, atol):
    """The stopping threshold `max(atol, rtol ||b||)` from `bb = ||b||^2`."""
    return jnp.maximum(atol, rtol * _reduce.real_sqrt(bb))


def squared_threshold(bb, rtol, atol):
    """`threshold(bb, rtol, atol)^2` (no square root)."""
    return jnp.maximum(atol * atol, rtol * rtol * bb)


class Outcome(NamedTuple):
    """What a method returns; `finish` makes it a `Solution`."""

    x: PyTree
    status: jax.Array  # RUNNING, CONVERGED (by the method's own test) or a breakdown
    iterations: jax.Array
    history: jax.Array | None = None
    # (||b - A x||, max(atol, rtol ||b||), ||x||) when the method measured them itself
    residual: tuple[jax.Array, jax.Array, jax.Array] | None = None
    recycle: PyTree = None  # gcrot: the space for the next solve (scale-free: A U = C)


class Method(NamedTuple):
    name: str
    run: Callable[..., Outcome]  # run(problem, **static options)


#: Every registered method by name (`tests/test_driver.py` checks each).
REGISTRY: dict[str, Method] = {}


def register(method: Method) -> Method:
    REGISTRY[method.name] = method
    return method


def default_rtol(b) -> float:
    """`max(1e-8, 100 eps)` for the least precise leaf of `b`: 1e-8 in float64,
    1.2e-5 in float32 (a float32 leaf limits the accuracy of the whole solve)."""
    return max([1e-8] + [100 * float(jnp.finfo(leaf.dtype).eps)
                         for leaf in jax.tree_util.tree_leaves(b)])


def make_problem(matvec, b, *, x0=None, precond=None, rtol=0.0, atol=0.0, inner_product=None,
                 axis_name=None) -> Problem:
    """The validated, closure-converted problem (see the module docstring, 1-2)."""
    _checks.check_vector("b", b)
    _checks.check_precision("b", b)
    _checks.check_callable("matvec", matvec)
    b = _checks.strong(b)
    if x0 is not None:
        _checks.check_like("x0", x0, "b", b)
        x0 = _checks.strong(x0)
    rtol = checked_tolerances(rtol, atol, b)
    ip = resolved_inner_product(inner_product, axis_name, b)
    return Problem(A=closed_operator("matvec", matvec, b, linear=True), b=b, x0=x0,
                   precond=None if precond is None else closed_operator("precond", precond, b),
                   rtol=as_option(rtol), atol=as_option(atol), ip=ip)


def checked_tolerances(rtol, atol, like):
    """`rtol` (its default for `like`'s precision when None), both tolerances
    checked where concrete."""
    rtol = default_rtol(like) if rtol is None else rtol
    _checks.check_tolerance("rtol", rtol)
    _checks.check_tolerance("atol", atol)
    return rtol


def resolved_inner_product(inner_product, axis_name, like) -> _reduce.Reduction:
    """The `inner_product=`/`axis_name=` options as a reduction, closed over
    vectors like `like` and checked (`check_inner_product`)."""
    ip = _reduce.resolve(inner_product, axis_name)
    with _checks.failures_named("inner_product"):
        ip = ip.closed(like)
    check_inner_product(ip, like)
    return ip


def closed_operator(name: str, fn, b, arg: str = "b", linear: bool = False) -> Closed:
    """`fn` as a `Closed`, its output checked against `b` and, with `linear`,
    its program checked linear in its argument (`_linearity`), both on one
    trace of the converted function (the user's function is traced once);
    `arg`: `b`'s name in errors."""
    _checks.check_callable(name, fn)
    with _checks.failures_named(name):
        A = close(fn, b)
    program, out = jax.make_jaxpr(A, return_shape=True)(b)
    _checks.check_like(f"{name}({arg})", out, arg, b)
    if linear:
        _linearity.check_linear(name, program)
    return A


def check_inner_product(ip: _reduce.Reduction, b) -> None:
    """Weights shaped like `b` and positive; a callable product (closed: its
    function is not traced again here) returns a scalar; `axis_name` names
    axes of the enclosing `shard_map`."""
    if isinstance(ip, _reduce.InnerProduct):
        if ip.weight is not None:
            _checks.check_shapes_like("inner_product.weight", ip.weight, "b", b)
            _checks.check_positive("inner_product.weight", ip.weight)
        _check_axes_bound(ip.reduced_axes())
        return
    out = jax.eval_shape(ip.fn, b, b)
    if jax.tree_util.tree_structure(out).num_leaves != 1 or jnp.shape(out) != ():
        raise ValueError("`inner_product(x, y)` must return a scalar; on vectors shaped like "
                         f"`b` it returns {jax.tree_util.tree_map(jnp.shape, out)}. Reduce "
                         "over every entry (e.g. `jnp.sum(jnp.conj(x) * w * y)`).")


def check_reduced_over(name: str, op, problem: Problem) -> None:
    """An operator that communicates over a mesh axis (a halo exchange inside
    `shard_map`) couples the shards, so the inner products must reduce over
    that axis too: otherwise every shard decides convergence on its own piece,
    the shards' loops run different numbers of steps and the operator's
    collectives never match (a hang)."""
    communicated = _reduce.axes_communicated(jax.make_jaxpr(op)(problem.b).jaxpr)
    missing = communicated - set(problem.ip.reduced_axes())
    if not missing:
        return
    axis = sorted(missing)[0]
    if isinstance(problem.ip, _reduce.InnerProduct):
        raise ValueError(
            f"`{name}` communicates over the mesh axes {sorted(missing)} (inside `shard_map`), "
            f"but the inner products do not reduce over them: every shard would solve its "
            f"own piece. Pass `axis_name={axis!r}` (or an `InnerProduct` with that "
            "`axis_name`).")
    raise ValueError(
        f"`{name}` communicates over the mesh axes {sorted(missing)} (inside `shard_map`), but "
        f"the callable `inner_product` does not reduce over them: each shard would decide "
        f"convergence on its own piece and the solve would hang. Sum over the axis in the "
        f"product, e.g. `lambda x, y: jax.lax.psum(jnp.sum(jnp.conj(x) * y), {axis!r})`, or "
        f"use the default product with `axis_name={axis!r}`.")


def _check_axes_bound(axes: tuple) -> None:
    """Each of `axes` is an axis of the `shard_map` this call runs in."""
    for name in axes:
        try:
            jax.eval_shape(lambda name=name: jax.lax.psum(1, name))
        except NameError as e:
            raise ValueError(
                f"`axis_name` {name!r} is not an axis of an enclosing `shard_map` ({e}). "
                "Pass the mesh axis the vectors are split over, from inside `shard_map`; "
                "under plain `jit` leave `axis_name` unset.") from e


def solve(method: Method, matvec, b, /, *, x0, precond, rtol, atol, inner_product, axis_name,
          failed_derivative="nan", data=None, adjoint_data=None, **options) -> Solution:
    """`method` on `A x = b`, validated, differentiable and finished (1-4 above);
    `data`: the method's own traced arguments (`Problem.data`); `adjoint_data`:
    `Solution -> data` of the transposed solve from the primal one (`gcrot`
    hands its recycled space on), else the transposed solve gets `data`."""
    _checks.check_choice("failed_derivative", failed_derivative, FAILED_DERIVATIVES)
    options = _common_options(options)
    problem = make_problem(matvec, b, x0=x0, precond=precond, rtol=rtol, atol=atol,
                           inner_product=inner_product, axis_name=axis_name)
    problem = problem._replace(data=data)
    for name, op in (("matvec", problem.A), ("precond", problem.precond)):
        if op is not None:
            check_reduced_over(name, op, problem)
    run = functools.partial(_run_and_finish, method, options)
    # The transposed solve: the same method on A^T, started from zero.
    return implicit_solve(problem, run, lambda p: run(p._replace(x0=None)), failed_derivative,
                          adjoint_data)


def _common_options(options: dict) -> dict:
    """The options several methods share, checked here once: `max_steps` a
    non-negative int (or None), `record_history` a bool."""
    if options.get("max_steps") is not None:
        _checks.check_int("max_steps", options["max_steps"], 0)
    if "record_history" in options:
        options = {**options, "record_history": _checks.check_flag(
            "record_history", options["record_history"])}
    return options


def _run_and_finish(method: Method, options: dict, problem: Problem):
    """`(Solution, ok)`: the method on the problem scaled by a power of two
    (`_scaled`), finished there, its solution and norms scaled back (exactly);
    `ok`: the method's own stopping test passed, which is what a derivative's
    solve is judged by (`implicit_solve`: no reduction beyond the iteration's)."""
    scale = problem.ip.power_of_two_scale(problem.b)
    if scale is None:  # a callable inner product: no rescaling
        outcome = method.run(problem, **options)
        sol = finish(problem, outcome, method.name)
    else:
        scaled = _scaled(problem, scale)
        outcome = method.run(scaled, **options)
        sol = finish(scaled, outcome, method.name, scale)
    return _judged_tolerances(problem, sol), _ok(outcome)


def _ok(outcome: Outcome) -> jax.Array:
    return outcome.status == code(Status.CONVERGED)


def _scaled(problem: Problem, scale) -> Problem:
    """`A (x / s) = b / s`: the problem with `b`, `x0` and `atol` divided by `s`.

    With `s` a power of two near `max |b_i|` the entries of every vector of
    the solve are near 1, so no squared norm under- or overflows for any
    finite scale of `b` (`||b||^2` of a float32 `b` of size 1e-20 is 0, of
    size 1e20 Inf), and the division is exact. Costs one reduction (a max)
    before the iteration; none in it.
    """
    inverse = 1 / scale
    real = problem.real_dtype()
    return problem._replace(
        b=tree.scale(inverse, problem.b),
        x0=None if problem.x0 is None else tree.scale(inverse, problem.x0),
        # behind a barrier: XLA's algebraic simplifier would rewrite the squared
        # threshold's (atol s^-1)^2 as atol^2 s^-2, where s^-2 overflows
        # (|b| ~ 1e-160 in float64): 0 * inf, a NaN threshold, and the solve
        # stopped after 0 steps (measured under `jit`; not eagerly)
        atol=jax.lax.optimization_barrier(problem.tolerances()[1] * inverse.astype(real)))


def finish(problem: Problem, outcome: Outcome, name: str, scale=None) -> Solution:
    """The `Solution`: the true residual decides `converged` (module docstring,
    4); with `scale`, the problem was `_scaled` by it and `x` and the norms are
    scaled back (exactly), a solution too large for the dtype being
    `NONFINITE` (`||x||` rides in the residual's reduction)."""
    if outcome.residual is None:
        with jax.named_scope(f"solvax.{name}.true_residual"):
            r = tree.sub(problem.b, problem.A(outcome.x))
            # ||b|| and ||x|| ride along in the same reduction.
            rr, bb, xx = jnp.real(problem.ip.multi_dot([(r, r), (problem.b, problem.b),
                                                         (outcome.x, outcome.x)]))
        norm, xnorm = _reduce.real_sqrt(rr), _reduce.real_sqrt(xx)
        tol = threshold(bb, *problem.tolerances())
    else:
        norm, tol, xnorm = outcome.residual
    if scale is None:
        return make_solution(outcome.x, outcome.status, outcome.iterations, norm, tol,
                             history=outcome.history, recycle=outcome.recycle)
    # decided in the scaled problem, where the norms neither under- nor overflow
    status = jnp.where(jnp.isfinite(scale * xnorm), outcome.status, code(Status.NONFINITE))
    sol = make_solution(tree.scale(scale, outcome.x), status, outcome.iterations, norm, tol,
                        history=None if outcome.history is None else scale * outcome.history,
                        recycle=outcome.recycle)
    return sol._replace(residual_norm=scale * norm)


def _judged_tolerances(problem: Problem, sol: Solution) -> Solution:
    """`INVALID_TOLERANCE` where a traced `rtol` or `atol` of the (unscaled)
    problem is negative or NaN (concrete ones are refused at trace time): the
    iteration stopped at once on its NaN or negative threshold, which is not a
    stagnation."""
    rtol, atol = problem.tolerances()
    status = jnp.where(invalid_tolerances(rtol, atol), code(Status.INVALID_TOLERANCE), sol.status)
    return sol._replace(status=status, converged=status == code(Status.CONVERGED))


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


FAILED_DERIVATIVES = ("nan", "keep")


def solved_ok(out):
    """`(out, ok)` for a solver that reports through a `Solution` (ok: converged)
    or returns a bare pytree (no status: ok)."""
    return out, (out.converged if isinstance(out, Solution) else jnp.bool_(True))


def solution_checked(out_ok, failed_derivative: str):
    """The solution of `(out, ok)`; NaN where its solve failed (`"nan"`), so a
    finite derivative is a correct one."""
    out, ok = out_ok
    x = solution_of(out)
    if failed_derivative == "keep":
        return x
    ok = ok.astype(jnp.bool_)
    return jax.tree_util.tree_map(lambda leaf: jnp.where(ok, leaf, jnp.nan), x)


def implicit_solve(problem: Problem, run, run_transposed, failed_derivative: str = "nan",
                   adjoint_data=None):
    """`run(problem)` with derivatives defined implicitly.

    `run(problem)` returns `(out, ok)`: a `Solution` (diagnostics kept) or the
    solution pytree, and whether the solve succeeded by its own test (for a
    Krylov method the iteration's test, so that judging a derivative's solve
    costs no reduction; see `_run_and_finish`);
    `run_transposed(problem with A^T and another b)` solves the
    transposed system. Both read every traced value from their argument, so
    the primal solve is traced once and the transposed solve only when a
    derivative asks for it. `A` and `b` are differentiated; the rest of the
    problem (initial guess, preconditioner, weights) is not: the solution does
    not depend on it. Diagnostics stay outside `custom_linear_solve`, so inside
    `shard_map` they keep their own (invariant) type.

    `A^T` is always `jax.linear_transpose(A)`, never `A` itself, even for a
    symmetric operator: a second derivative differentiates the transposed
    solve, and along a perturbation of `A`'s parameters that is not symmetric
    `d(A^T) = (dA)^T != dA` (with `A` standing for `A^T`, the Hessian of a
    solve with respect to the entries of a symmetric matrix is 91-97 % wrong:
    the Hessian tests in `tests/test_grad.py`). A primal, tangent
    or transposed solve that did not converge makes the derivative NaN unless
    `failed_derivative="keep"`. `adjoint_data(primal Solution)`, if given,
    replaces `Problem.data` in the transposed solve (what the primal solve
    learned about the operator, e.g. a recycled space).
    """

    @jax.custom_jvp
    def solve_(A, b, rest):
        out, ok = run(Problem(A, b, *rest))
        out = _diagnostics_as_reals(out)
        return out, ok.astype(jnp.finfo(tree.result_dtype(out)).dtype)

    @solve_.defjvp
    def solve_jvp(primals, tangents):
        A, b, rest = primals
        dA, db, _ = tangents
        # The primal solve, traced once and used for the tangent solve too; as a call
        # of `solve_` itself, so higher derivatives use this rule again instead of
        # differentiating through the iteration.
        primal = close(lambda r: solve_(A, r, rest), b)
        out, ok = primal(b)
        x = solution_of(out)
        _, dA_x = jax.jvp(lambda A: A(x), (A,), (dA,))
        At = transposed(A)
        rest_t = rest
        if adjoint_data is not None and isinstance(out, Solution):
            rest_t = Problem(A, b, *rest)._replace(data=adjoint_data(out))[2:]
        dx = jax.lax.custom_linear_solve(
            A, tree.sub(db, dA_x),
            lambda _, r: solution_checked(primal(r), failed_derivative),
            lambda _, r: solution_checked(run_transposed(Problem(At, r, *rest_t)),
                                           failed_derivative))
        if failed_derivative == "nan":  # nor of a primal that failed (its x may be 0)
            factor = jnp.where(ok > 0, 1, jnp.nan)
            dx = jax.tree_util.tree_map(lambda leaf: leaf * factor.astype(leaf.dtype), dx)
        if isinstance(out, Solution):
            dout = jax.tree_util.tree_map(jnp.zeros_like, out)._replace(x=dx)
        else:
            dout = dx
        return (out, ok), (dout, jnp.zeros_like(ok))

    out, _ = solve_(problem.A, problem.b, tuple(problem[2:]))
    return _diagnostics_restored(out)
