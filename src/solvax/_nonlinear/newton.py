"""Jacobian-free Newton–Krylov for `F(u) = 0` on pytrees: inexact Newton steps
from .._core import implicit
from solvax's Krylov solvers, Eisenstat–Walker forcing, a backtracking line
search on `||F||`, and roots differentiated by the implicit function theorem."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from .._core import checks, reduce, tree
from .._core.closure import Closed, close, transposed
from .._core.contract import Problem, as_option, invalid_tolerances, option_value
from .._core.implicit import solution_checked, solved_ok
from .._core.options import SET_BY_NEWTON, checked_failed_derivative
from .._core.registry import SOLVERS, newton_solvers
from .._core.solution import RUNNING, Status, checked, code, describe, first_status
from .._core.validation import (
    check_reduced_over,
    checked_tolerances,
    closed_operator,
    resolved_inner_product,
)
from .._krylov import recycling
from .._krylov.gcrot import K as GCROT_K
from .._krylov.gcrot import M as GCROT_M
from .._krylov.gcrot import space_size

PyTree = Any

#: The inner solvers by name (`solver=`): the registered solvers marked `newton`.
LINEAR_SOLVERS = newton_solvers()
EISENSTAT_WALKER = "eisenstat_walker"
#: Eisenstat–Walker choice 2, `eta_k = GAMMA (||F_k|| / ||F_k-1||)^2`, at most ETA_MAX
#: (the first step's forcing term), with Kelley's safeguards (`_forcing`).
GAMMA, ETA_MAX = 0.9, 0.9
#: Sufficient decrease: `||F(u + t d)|| <= (1 - ARMIJO t (1 - eta)) ||F(u)||`.
ARMIJO = 1e-4


_MESSAGES = {
    Status.CONVERGED: "converged: ||F(u)|| <= max(atol, rtol ||F(u0)||), measured on F",
    Status.MAX_STEPS: "not converged: `max_steps` Newton steps were taken first; raise it, "
    "precondition the linear solves or start closer to a root",
}


class NewtonSolution(NamedTuple):
    """The result of `newton_krylov` (a pytree: usable under `jit`/`vmap`).

    Attributes:
        u: the last iterate (the root when converged), with `u0`'s structure
            and shardings.
        status: a `Status` code: `CONVERGED` (`||F(u)|| <= max(atol, rtol
            ||F(u0)||)`, measured on `F`), `MAX_STEPS`, `LINE_SEARCH`,
            `LINEAR_SOLVE`, `NONFINITE` or `INVALID_TOLERANCE`.
        converged: `status == Status.CONVERGED`.
        iterations: Newton steps taken (accepted steps).
        linear_iterations: the inner solver's iterations over all steps.
        residual_norm: `||F(u)||`.
        history: `||F||` at `u0` and after each step (NaN-padded to
            `max_steps + 1`).
        linear_status: the last linear solve's `Status` (`CONVERGED` when no
            linear solve ran); with the inner work capped (`max_inner`)
            `MAX_STEPS` there is normal.
    """

    u: PyTree
    status: Any
    converged: Any
    iterations: Any
    linear_iterations: Any
    residual_norm: Any
    history: Any
    linear_status: Any

    @property
    def message(self) -> str:
        """Host-side, human-readable status (concrete values only)."""
        return describe(self.status, _MESSAGES)

    def check(self) -> NewtonSolution:
        """Host-side: return `self` if every solve converged, else raise `RuntimeError`."""
        return checked(self)


class _Options(NamedTuple):
    """The static options (Python values)."""

    solver: str
    solver_options: tuple  # (name, value) pairs passed to the inner solver
    forcing: Any  # EISENSTAT_WALKER or a float
    max_inner: int | None
    max_steps: int
    line_search: bool
    max_backtracks: int
    preconditioner: str | None  # None, "fixed" or "builder"
    refresh: int
    failed_derivative: str


class _State(NamedTuple):
    u: PyTree
    fnorm: jax.Array  # ||F(u)||
    fprev: jax.Array  # ||F|| before the last step
    eta: jax.Array  # the last forcing term
    k: jax.Array  # Newton steps taken
    status: jax.Array
    linear_iterations: jax.Array
    linear_status: jax.Array
    history: jax.Array
    M: PyTree  # the preconditioner carried between refreshes (`refresh > 1`), else None
    recycle: PyTree = None  # solver="gcrot": the recycled space carried between steps


class _Trial(NamedTuple):
    t: jax.Array  # the step length tried
    u: PyTree  # u + t d
    f: jax.Array  # ||F(u + t d)||
    n: jax.Array  # step lengths tried
    ok: jax.Array  # accepted


def _linear(opt: _Options, A, rhs, M, rtol, ip, capped=True, recycle=None):
    """The inner solve `A d = rhs` (a `Solution`); `capped`: at most
    `max_inner` iterations (GMRES, GCRO-DR: cycles of `min(restart,
    max_inner)` steps); `recycle`: gcrot's space from the last step."""
    options = dict(opt.solver_options)
    if recycle is not None:
        options["recycle"] = recycle
    if capped and opt.max_inner is not None:
        solver = SOLVERS[opt.solver]
        if solver.cycle is not None:    # the cycle's length: given, or the solver's default
            key = solver.cycle
            default = inspect.signature(solver.function).parameters[key].default
            restart = min(options.get(key, default), opt.max_inner)
            if opt.solver == "gcrot":
                restart = max(restart, options.get("k", GCROT_K) + 1)
            options.update({key: restart, "max_restarts": -(-opt.max_inner // restart)})
        else:
            options["max_steps"] = opt.max_inner
    product = ip if isinstance(ip, reduce.InnerProduct) else ip.fn
    return LINEAR_SOLVERS[opt.solver](A, rhs, precond=M, rtol=rtol, atol=0.0,
                                      inner_product=product, **options)


def _forcing(opt: _Options, st: _State, tol):
    """The relative tolerance of the next linear solve: a constant, or
    Eisenstat–Walker choice 2 with the safeguards of Kelley (1995, §6.3): not
    far below `GAMMA eta_prev^2` while that is above 0.1 (no sudden
    oversolve), and not below `tol / (2 ||F||)` (no oversolve of the last
    step)."""
    real = st.fnorm.dtype
    if opt.forcing != EISENSTAT_WALKER:
        return jnp.asarray(opt.forcing, real)
    eta = GAMMA * (st.fnorm / st.fprev) ** 2
    floor = GAMMA * st.eta ** 2
    eta = jnp.minimum(ETA_MAX, jnp.where(floor > 0.1, jnp.maximum(eta, floor), eta))
    eta = jnp.minimum(ETA_MAX, jnp.maximum(eta, 0.5 * tol / st.fnorm))
    return jnp.where(st.k == 0, jnp.asarray(ETA_MAX, real), eta)


def _shorter(t, f, f0):
    """The next step length after `t` failed: the minimizer of the quadratic
    through `||F(u)||^2`, its Newton slope `-2 ||F(u)||^2` and `||F(u + t d)||^2`,
    kept in `[t / 10, t / 2]` (`t / 2` when `F` was not finite)."""
    g0 = f0 * f0
    quadratic = g0 * t * t / (f * f - g0 + 2 * g0 * t)
    quadratic = jnp.where(jnp.isfinite(quadratic) & (quadratic > 0), quadratic, 0.5 * t)
    return jnp.clip(quadratic, 0.1 * t, 0.5 * t)


def _line_search(opt: _Options, F, ip, st: _State, d, eta, usable):
    """Step lengths 1, then shorter (`_shorter`), until `||F||` decreases
    enough (Armijo) or `max_backtracks` reductions failed; one `F` and one
    norm per length. Without the line search the full step is taken if `F`
    is finite there."""
    one = jnp.ones((), st.fnorm.dtype)
    tries = 1 + opt.max_backtracks if opt.line_search else 1

    def attempt(trial: _Trial) -> _Trial:
        t = jnp.where(trial.n == 0, one, _shorter(trial.t, trial.f, st.fnorm))
        u = tree.axpy(t, d, st.u)
        with jax.named_scope("solvax.newton_krylov.norm"):
            f = ip.norm(F(u))
        ok = jnp.isfinite(f)
        if opt.line_search:
            # strictly lower as well: for small t the factor rounds to 1 (float32:
            # t < 1e-3), and steps that left ||F|| at its rounding level unchanged
            # were accepted until `max_steps`
            ok &= (f <= (1 - ARMIJO * t * (1 - eta)) * st.fnorm) & (f < st.fnorm)
        return _Trial(t=t, u=u, f=f, n=trial.n + 1, ok=ok)

    start = _Trial(t=one, u=st.u, f=st.fnorm, n=jnp.int32(0), ok=jnp.bool_(False))
    return lax.while_loop(lambda tr: usable & ~tr.ok & (tr.n < tries), attempt, start)


def _preconditioner(opt: _Options, pre, st: _State):
    """`(M, carried)`: the preconditioner of this step and the one to carry."""
    if opt.preconditioner != "builder":
        return pre, None
    if opt.refresh == 1:
        return pre(st.u), None
    M = lax.cond(st.k % opt.refresh == 0, lambda: pre(st.u), lambda: st.M)
    return M, M


def _step(opt: _Options, F, pre, ip, tol, st: _State) -> _State:
    """One Newton step: linearize at `u`, solve `J d = -F(u)` to the forcing
    term, search along `d`."""
    Fu, J = jax.linearize(F, st.u)
    M, carried = _preconditioner(opt, pre, st)
    eta = _forcing(opt, st, tol)
    with jax.named_scope("solvax.newton_krylov.linear_solve"):
        sol = _linear(opt, J, tree.scale(-1, Fu), M, eta, ip, recycle=st.recycle)
    unusable = (sol.status == code(Status.NONFINITE)) | (
        sol.status == code(Status.INVALID_TOLERANCE))
    failed = unusable | (sol.status == code(Status.BREAKDOWN)) | (
        sol.status == code(Status.INDEFINITE)) | (sol.status == code(Status.DIVERGED))
    trial = _line_search(opt, F, ip, st, sol.x, eta, ~unusable)
    accepted = trial.ok
    k = st.k + accepted.astype(jnp.int32)
    fnorm = jnp.where(accepted, trial.f, st.fnorm)
    status = first_status([
        (~accepted & failed, Status.LINEAR_SOLVE),
        (~accepted & ~jnp.isfinite(trial.f), Status.NONFINITE if not opt.line_search
         else Status.LINE_SEARCH),
        (~accepted, Status.LINE_SEARCH),
        (fnorm <= tol, Status.CONVERGED),
        (k >= opt.max_steps, Status.MAX_STEPS)], RUNNING)
    return _State(u=tree.where(accepted, trial.u, st.u), fnorm=fnorm,
                  fprev=jnp.where(accepted, st.fnorm, st.fprev), eta=eta, k=k, status=status,
                  linear_iterations=st.linear_iterations + sol.iterations,
                  linear_status=sol.status, history=st.history.at[k].set(fnorm), M=carried,
                  recycle=sol.recycle)


def _first_space(opt: _Options, u0):
    """solver="gcrot": an empty recycled space for the first Newton step (the
    steps then hand theirs on), of the size the inner solve makes, with an
    empty ledger (no costs yet)."""
    if opt.solver != "gcrot":
        return None
    options = dict(opt.solver_options)
    space = recycling.empty(u0, space_size(tree.size(u0), options.get("m", GCROT_M),
                                                options.get("k", GCROT_K)))
    return recycling.RecycleSpace(space.C, space.U,
                                  recycling.empty_ledger(tree.result_dtype(u0)))


def _iterate(opt: _Options, F: Closed, u0, rest) -> NewtonSolution:
    pre, rtol, atol, ip = rest
    real = jnp.finfo(tree.result_dtype(u0)).dtype
    rtol, atol = option_value(rtol, real), option_value(atol, real)
    with jax.named_scope("solvax.newton_krylov.norm"):
        f0 = ip.norm(F(u0))
    tol = jnp.maximum(atol, rtol * f0)
    status = first_status([(invalid_tolerances(rtol, atol), Status.INVALID_TOLERANCE),
                           (~jnp.isfinite(f0), Status.NONFINITE), (f0 <= tol, Status.CONVERGED),
                           (opt.max_steps == 0, Status.MAX_STEPS)], RUNNING)
    carried = None
    if opt.preconditioner == "builder" and opt.refresh > 1:  # rebuilt at step 0
        carried = tree.zeros_like(jax.eval_shape(pre, u0))
    state = _State(u=u0, fnorm=f0, fprev=f0, eta=jnp.asarray(ETA_MAX, real), k=jnp.int32(0),
                   status=status, linear_iterations=jnp.int32(0),
                   linear_status=code(Status.CONVERGED),
                   history=jnp.full((opt.max_steps + 1,), jnp.nan, real).at[0].set(f0),
                   M=carried, recycle=_first_space(opt, u0))
    state = lax.while_loop(lambda st: st.status == RUNNING,
                           lambda st: _step(opt, F, pre, ip, tol, st), state)
    return NewtonSolution(u=state.u, status=state.status,
                          converged=state.status == code(Status.CONVERGED),
                          iterations=state.k, linear_iterations=state.linear_iterations,
                          residual_norm=state.fnorm, history=state.history,
                          linear_status=state.linear_status)


_COUNTS = ("status", "converged", "iterations", "linear_iterations", "linear_status")


def _as_reals(sol: NewtonSolution) -> NewtonSolution:
    """Integer and boolean diagnostics as reals: every output of the custom
    derivative then has a plain zero tangent (as `implicit.diagnostics_as_reals`)."""
    real = sol.residual_norm.dtype
    return sol._replace(**{name: getattr(sol, name).astype(real) for name in _COUNTS})


def _restored(sol: NewtonSolution) -> NewtonSolution:
    counts = {name: getattr(sol, name).astype(jnp.int32) for name in _COUNTS}
    return sol._replace(**counts)._replace(converged=sol.converged != 0)


def _solve(opt: _Options, F: Closed, u0, rest) -> NewtonSolution:
    """The Newton iteration, its root differentiated implicitly: with
    `F(u*, p) = 0`, `du* = -J^-1 dF_p` (`J = dF/du` at the root), one linear
    solve (transposed in reverse mode) with the same inner solver and
    preconditioner, to the inner solver's default tolerance."""

    @jax.custom_jvp
    def root(F, u0, rest):
        return _as_reals(_iterate(opt, F, u0, rest))

    @root.defjvp
    def root_jvp(primals, tangents):
        F, u0, rest = primals
        out = root(F, u0, rest)
        u = out.u
        _, dF_u = jax.jvp(lambda F: F(u), (F,), (tangents[0],))
        pre, _, _, ip = rest
        M = pre(u) if opt.preconditioner == "builder" else pre
        J = close(lambda v: jax.jvp(F, (u,), (v,))[1], u)
        Mt = None if M is None else transposed(close(M, u))

        def solve(A, M, r):
            return solution_checked(solved_ok(_linear(opt, A, r, M, None, ip, capped=False)),
                                    opt.failed_derivative)

        du = lax.custom_linear_solve(J, tree.scale(-1, dF_u), lambda _, r: solve(J, M, r),
                                     lambda _, r: solve(transposed(J), Mt, r))
        if opt.failed_derivative == "nan":
            du = tree.scale(jnp.where(out.converged != 0, 1.0, jnp.nan), du)
        return out, jax.tree_util.tree_map(jnp.zeros_like, out)._replace(u=du)

    return _restored(root(F, u0, rest))


def newton_krylov(
    F: Callable[[PyTree], PyTree],
    u0: PyTree,
    *,
    solver: str = "bicgstab",
    solver_options: dict | None = None,
    precond: Callable[[PyTree], PyTree] | None = None,
    precond_builder: Callable[[PyTree], Callable[[PyTree], PyTree]] | None = None,
    refresh: int = 1,
    forcing: str | float = EISENSTAT_WALKER,
    max_inner: int | None = 100,
    rtol: float | None = None,
    atol: float = 0.0,
    max_steps: int = 50,
    line_search: bool = True,
    max_backtracks: int = 10,
    inner_product=None,
    axis_name: str | tuple[str, ...] | None = None,
    failed_derivative: str = "nan",
) -> NewtonSolution:
    """Solve `F(u) = 0` by Jacobian-free Newton–Krylov.

    Each step linearizes `F` at `u` (`jax.linearize`: exact Jacobian
    products, no finite differences), solves `J d = -F(u)` with a solvax
    Krylov method to the relative tolerance `eta` (the forcing term), and
    searches along `d`: the step length 1, then shorter ones (a safeguarded
    quadratic model, each in `[t/10, t/2]`), until `||F(u + t d)|| <= (1 -
    1e-4 t (1 - eta)) ||F(u)||`. A step that overshoots is shortened; when no
    length passes, the solve stops with `Status.LINE_SEARCH` and the iterate
    before the step (never a step that did not reduce `||F||`).

    Without a preconditioner the inner solves are capped (`max_inner`) so
    that a hard linear system does not stall the Newton loop; a good
    preconditioner (e.g. `solvax.multigrid` of the Jacobian, through
    `precond_builder`) is what makes Newton–Krylov fast (`docs/newton.md`).

    Args:
        F: `u -> F(u)`, a function of pytrees with `F(u)` shaped like `u`; it
            may close over (differentiable) parameters.
        u0: the starting point, a pytree of float arrays (leaves keep their
            sharding, as in the linear solvers).
        solver: the inner Krylov method: `"bicgstab"` (default), `"gmres"`,
            `"idrs"`, `"gcrot"` (GCRO-DR; its recycled space is handed from
            each Newton step's solve to the next), `"pcg"` or `"minres"`
            (the last two for symmetric Jacobians).
        solver_options: further options of that solver (e.g. `{"restart":
            20}` for GMRES); the tolerances, limits, preconditioner and inner
            product are set here.
        precond: a fixed right preconditioner `r -> z` for every step.
        precond_builder: `u -> preconditioner`, evaluated at the current
            iterate; it returns a pytree callable (e.g. `solvax.multigrid(...)`,
            `solvax.jacobi(...)` or a `jax.tree_util.Partial`), so it can be
            kept between rebuilds.
        refresh: rebuild the preconditioner every `refresh` Newton steps.
        forcing: `"eisenstat_walker"` (default: choice 2, `eta_0 = 0.9`, with
            the usual safeguards) or a constant relative tolerance in (0, 1).
        max_inner: at most this many inner iterations per Newton step (None:
            the inner solver's own limit).
        rtol, atol: converged when `||F(u)|| <= max(atol, rtol ||F(u0)||)`
            (default `rtol` as the linear solvers: 1e-8 in float64).
        max_steps: Newton steps at most.
        line_search: backtrack on `||F||` (default); False takes full steps.
        max_backtracks: step-length reductions per Newton step at most.
        inner_product: a `solvax.InnerProduct` (or `(x, y) -> scalar`) for the
            norms of `F` and the inner solves.
        axis_name: inside `shard_map`, the mesh axis `u` is split over.
        failed_derivative: `"nan"` (default): the derivative of a root that
            did not converge, or whose linear solve did not, is NaN; `"keep"`.

    Returns:
        A `NewtonSolution`. Under `jax.grad`/`jax.jvp`, `u` is differentiated
        with respect to what `F` closes over by the implicit function theorem
        (one linear solve with the Jacobian at the root, transposed in
        reverse mode; the preconditioner, transposed by `jax.linear_transpose`,
        must then be linear); `u0` has no derivative.

    Raises:
        TypeError, ValueError: at trace time, if `u0` is not a pytree of
            float arrays, `F(u0)` differs from `u0` in structure, shapes or
            dtypes, or an option is invalid.

    Reference: S. C. Eisenstat and H. F. Walker, "Choosing the forcing terms
    in an inexact Newton method", SIAM J. Sci. Comput. 17 (1996); C. T.
    Kelley, "Iterative Methods for Linear and Nonlinear Equations", SIAM
    (1995); D. A. Knoll and D. E. Keyes, "Jacobian-free Newton–Krylov
    methods", J. Comput. Phys. 193 (2004).
    """
    checks.check_callable("F", F)
    checks.check_vector("u0", u0)
    checks.check_precision("u0", u0)
    u0 = checks.strong(u0)
    Fc = closed_operator("F", F, u0, "u0")
    opt = _options(solver, solver_options, precond, precond_builder, refresh, forcing,
                   max_inner, max_steps, line_search, max_backtracks, failed_derivative)
    pre = _closed_preconditioner(precond, precond_builder, u0)
    rtol = checked_tolerances(rtol, atol, u0)
    ip = resolved_inner_product(inner_product, axis_name, u0)
    check_reduced_over("F", Fc, Problem(A=Fc, b=u0, ip=ip))
    return _solve(opt, Fc, u0, (pre, as_option(rtol), as_option(atol), ip))


def _options(solver, solver_options, precond, precond_builder, refresh, forcing, max_inner,
             max_steps, line_search, max_backtracks, failed_derivative) -> _Options:
    checks.check_choice("solver", solver, tuple(LINEAR_SOLVERS))
    solver_options = {} if solver_options is None else solver_options
    if not isinstance(solver_options, dict):
        raise TypeError(f"`solver_options` must be a dict of options of `{solver}`; "
                        f"got {type(solver_options).__name__}.")
    reserved = sorted(set(solver_options) & set(SET_BY_NEWTON))
    if reserved:
        raise ValueError(f"`solver_options` may not set {reserved}: `newton_krylov` sets them "
                         "(use its `precond`, `max_inner`, `forcing`, `inner_product`, "
                         "`axis_name` and `failed_derivative`).")
    if precond is not None and precond_builder is not None:
        raise ValueError("Pass either `precond` (fixed) or `precond_builder` (rebuilt from the "
                         "iterate), not both.")
    checks.check_int("refresh", refresh, 1)
    if forcing != EISENSTAT_WALKER:
        if isinstance(forcing, bool) or not isinstance(forcing, int | float) or not (
                0 < forcing < 1):
            raise ValueError(f"`forcing` must be {EISENSTAT_WALKER!r} or a number in (0, 1) "
                             f"(the linear solves' relative tolerance); got {forcing!r}.")
        forcing = float(forcing)
    if max_inner is not None:
        checks.check_int("max_inner", max_inner, 1)
    checks.check_int("max_steps", max_steps, 0)
    checks.check_int("max_backtracks", max_backtracks, 0)
    checked_failed_derivative(failed_derivative)
    kind = "fixed" if precond is not None else "builder" if precond_builder is not None else None
    return _Options(solver=solver, solver_options=tuple(sorted(solver_options.items())),
                    forcing=forcing, max_inner=max_inner, max_steps=max_steps,
                    line_search=checks.check_flag("line_search", line_search),
                    max_backtracks=max_backtracks, preconditioner=kind, refresh=refresh,
                    failed_derivative=failed_derivative)


def _closed_preconditioner(precond, builder, u0) -> Closed | None:
    """The preconditioner (`r -> z`), or its builder (`u -> preconditioner`),
    with what it closes over made explicit."""
    if precond is not None:
        return closed_operator("precond", precond, u0, "u0")
    if builder is None:
        return None
    checks.check_callable("precond_builder", builder)
    with checks.failures_named("precond_builder"):
        built = jax.eval_shape(builder, u0)
    if not callable(built) or not all(isinstance(leaf, jax.ShapeDtypeStruct)
                                      for leaf in jax.tree_util.tree_leaves(built)):
        raise TypeError(
            "`precond_builder(u)` must return a preconditioner that is a pytree of arrays "
            "and callable (`solvax.multigrid(...)`, `solvax.jacobi(...)`, or "
            f"`jax.tree_util.Partial(apply, *arrays)`); got {type(built).__name__}.")
    with checks.failures_named("precond_builder"):
        B = close(builder, u0)
        checks.check_like("precond_builder(u0)(u0)",
                           jax.eval_shape(lambda u: B(u)(u), u0), "u0", u0)
    return B
