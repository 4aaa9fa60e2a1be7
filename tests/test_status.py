"""Honest diagnostics: every way a solve can end has its own status."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    KRYLOV,
    SPD_SOLVERS,
    WITH_WRAPPERS,
    poisson_1d,
    rhs,
    step_limit,
)
from matrix import levels, sample

import solvax as sx
from solvax import Status

ALL = list(KRYLOV)


def true_residual(matvec, sol, b):
    return float(jnp.linalg.norm(b - matvec(sol.x)))


@pytest.mark.parametrize("name", levels(ALL, WITH_WRAPPERS))
def test_zero_rhs(name):
    b = jnp.zeros(12)
    for x0 in (None, jnp.ones(12)):
        sol = KRYLOV[name](poisson_1d, b, x0=x0)
        assert bool(sol.converged) and int(sol.iterations) == 0
        assert np.all(np.asarray(sol.x) == 0)


@pytest.mark.parametrize("name", SPD_SOLVERS)
def test_max_steps_reports_true_residual(name):
    n = 60
    b = rhs(n)
    # five steps of a Krylov method; one outer step of a restarted method
    kw = step_limit(name, 5) if "max_steps" in step_limit(name, 5) else step_limit(name, 1)
    sol = KRYLOV[name](poisson_1d, b, rtol=1e-10, **kw)
    assert int(sol.status) == Status.MAX_STEPS and not bool(sol.converged)
    assert np.isclose(float(sol.residual_norm), true_residual(poisson_1d, sol, b), rtol=1e-8)
    assert "iteration limit" in sol.message
    with pytest.raises(RuntimeError, match="did not converge"):
        sol.check()


@pytest.mark.parametrize("name", SPD_SOLVERS)
def test_converged_means_true_residual(name):
    b = rhs(30)
    sol = KRYLOV[name](poisson_1d, b, rtol=1e-9)
    assert bool(sol.converged)
    assert true_residual(poisson_1d, sol, b) <= 1e-9 * float(jnp.linalg.norm(b)) * (1 + 1e-6)
    assert sol.check() is sol


@pytest.mark.parametrize("single_reduction", [False, True])
def test_pcg_indefinite_operator(single_reduction):
    d = jnp.asarray(np.r_[np.ones(5), -np.ones(5)])
    sol = sx.pcg(lambda x: d * x, jnp.ones(10), single_reduction=single_reduction)
    assert int(sol.status) == Status.INDEFINITE and not bool(sol.converged)
    assert np.all(np.isfinite(np.asarray(sol.x)))


@pytest.mark.parametrize("single_reduction", [False, True])
def test_pcg_indefinite_preconditioner(single_reduction):
    sol = sx.pcg(poisson_1d, rhs(10), precond=lambda r: -r, single_reduction=single_reduction)
    assert int(sol.status) == Status.INDEFINITE
    assert "positive definite" in sol.message


def test_pcg_loss_of_accuracy_is_not_converged():
    """float32 CG asked for 1e-12: the recursive residual gets there, the true one cannot."""
    n = 64
    b = rhs(n, dtype=np.float32)
    for sr in (False, True):
        sol = sx.pcg(poisson_1d, b, rtol=1e-12, single_reduction=sr, max_steps=2000)
        assert not bool(sol.converged)
        assert int(sol.status) in (Status.FLOOR, Status.STAGNATION, Status.MAX_STEPS)
    sol = sx.pcg(poisson_1d, b, rtol=1e-12)
    assert int(sol.status) == Status.FLOOR, sol.message


@pytest.mark.parametrize("name, where", sample("nonfinite", strength=1, name=ALL,
                                                where=["rhs", "operator"]))
def test_nonfinite(name, where):
    b = rhs(10)
    mv = poisson_1d
    if where == "rhs":
        b = b.at[3].set(jnp.nan)
    else:
        mv = lambda x: poisson_1d(x) * jnp.where(jnp.arange(10) == 4, jnp.inf, 1.0)  # noqa: E731
    sol = KRYLOV[name](mv, b)
    assert int(sol.status) == Status.NONFINITE and not bool(sol.converged)


def test_gmres_singular_inconsistent_system():
    """The residual converges to the null-space component and restarts stop
    decreasing it: STAGNATION after two such cycles (once it took 10 cycles to
    meet a breakdown; an invariant Krylov space still is one, see
    test_reliability.py), with a message that names the possible cause."""
    n = 30
    d = jnp.asarray(np.r_[np.arange(1.0, n), 0.0])
    sol = sx.gmres(lambda x: d * x, jnp.ones(n), restart=10)
    assert int(sol.status) == Status.STAGNATION and not bool(sol.converged)
    assert "inconsistent system" in sol.message
    x = np.asarray(sol.x)
    assert np.all(np.isfinite(x)) and np.abs(x).max() < 1e3  # no blow-up
    # the least-squares part is solved: the residual is the null-space component
    assert abs(float(sol.residual_norm) - 1.0) < 1e-6


def test_gmres_singular_consistent_system_converges():
    n = 30
    d = jnp.asarray(np.r_[np.arange(1.0, n), 0.0])
    b = jnp.ones(n).at[-1].set(0.0)
    sol = sx.gmres(lambda x: d * x, b, restart=40)
    assert bool(sol.converged), sol.message


def test_gmres_happy_breakdown():
    """b spans a 3-dimensional invariant subspace: exact after 3 steps."""
    d = jnp.asarray(np.r_[np.full(10, 2.0), np.full(10, 3.0), np.full(10, 5.0)])
    sol = sx.gmres(lambda x: d * x, jnp.ones(30), restart=20, rtol=1e-14)
    assert bool(sol.converged) and int(sol.iterations) == 3


def test_status_messages_and_codes():
    for s in Status:
        assert isinstance(s.message, str) and s.message
    assert Status.CONVERGED == 0
    sols = jax.vmap(lambda b: sx.pcg(poisson_1d, b, max_steps=3))(jnp.stack([rhs(20), 0 * rhs(20)]))
    assert list(np.asarray(sols.status)) == [Status.MAX_STEPS, Status.CONVERGED]
    assert "converged" in sols.message and "iteration limit" in sols.message


@pytest.mark.parametrize("rr, gamma, curvature, expected", [
    (1.0, 1.0, 2.0, -1),                          # the step goes on (RUNNING)
    (1e-20, 1.0, -1.0, Status.CONVERGED),         # converged before the curvature matters
    (np.nan, 1.0, 2.0, Status.NONFINITE),
    (np.inf, 1.0, 2.0, Status.NONFINITE),
    (1.0, np.inf, 2.0, Status.NONFINITE),
    (1.0, -1.0, np.nan, Status.INDEFINITE),       # M not positive definite comes first
    (1.0, 1.0, -2.0, Status.INDEFINITE),
    (1e-20, 1.0, -1.0, Status.CONVERGED),         # the floor test comes after convergence
    (1e-30, 1.0, -1.0, Status.CONVERGED),
    (2e6, 2e6, 1.0, Status.DIVERGED),            # <r, r> at DIVERGENCE^2 x its start (1)
    (1.0, 1.0, 0.0, Status.INDEFINITE),
    (1.0, 1.0, 0.0, Status.INDEFINITE),
    (1.0, 1.0, -np.inf, Status.NONFINITE),
    (1.0, 1.0, np.inf, Status.NONFINITE),
    (1.0, 1.0, np.nan, Status.NONFINITE),
])
def test_cg_step_status_order(rr, gamma, curvature, expected):
    """The CG step's predicate (comparisons only) and the stop reason evaluated
    after the loop agree, in the documented order: non-finite, converged,
    diverged, the floor, indefinite (the first step's <r, r> is 1 here)."""
    from solvax._krylov import cg_steps as _cg
    from solvax._krylov.steps import DIVERGENCE
    tol2, cap2 = jnp.float64(1e-16), jnp.float64(DIVERGENCE**2)
    rr, gamma, curvature = (jnp.float64(v) for v in (rr, gamma, curvature))
    go = _cg.goes(_cg.may_go(rr, gamma, tol2, cap2), curvature)
    assert bool(go) == (int(expected) == -1)
    if not bool(go):
        scalars = _cg.Scalars(gamma=gamma, alpha=None, tol2=tol2, k=None, go=go, rr=rr,
                               curvature=curvature, history=None, cap2=cap2)
        assert int(_cg.stop_reason(scalars)) == int(expected)


def test_a_breakdown_at_the_rounding_floor_is_the_floor():
    """<p, A p> <= 0 once <r, r> fell by eps from its start is rounding, not an
    indefinite operator (multigrid-CG with `rtol=0` said INDEFINITE); the
    same breakdown well above it is INDEFINITE (the nearest case)."""
    from solvax._krylov import cg_steps as _cg
    from solvax._krylov.steps import DIVERGENCE
    cap2, tol2 = jnp.float64(DIVERGENCE**2), jnp.float64(0.0)
    for rr, expected in ((1e-17, Status.FLOOR), (1e-12, Status.INDEFINITE)):
        scalars = _cg.Scalars(gamma=jnp.float64(rr), alpha=None, tol2=tol2, k=None,
                               go=jnp.bool_(False), rr=jnp.float64(rr),
                               curvature=jnp.float64(-1.0), history=None, cap2=cap2)
        assert int(_cg.stop_reason(scalars)) == int(expected), rr


@pytest.mark.parametrize("method", ["standard", "single_reduction", "pipelined"])
def test_pcg_exact_steps(method):
    """Three distinct eigenvalues: CG is exact after 3 steps, and `iterations`
    counts the steps that updated x (the one that found convergence did not)."""
    d = jnp.asarray(np.r_[np.full(10, 2.0), np.full(10, 3.0), np.full(10, 5.0)])
    sol = sx.pcg(lambda x: d * x, jnp.ones(30), rtol=1e-12, method=method)
    assert bool(sol.converged) and int(sol.iterations) == 3, (method, int(sol.iterations))
    sol = sx.pcg(lambda x: d * x, jnp.ones(30), rtol=1e-12, method=method, max_steps=2)
    assert int(sol.status) == Status.MAX_STEPS and int(sol.iterations) == 2


def test_a_traced_invalid_tolerance_is_its_own_status():
    """A traced negative or NaN `rtol` (concrete ones are refused at trace
    time) stopped the iteration at once, reported as STAGNATION."""
    solve = jax.jit(lambda rtol, atol: sx.pcg(poisson_1d, jnp.ones(8), rtol=rtol, atol=atol))
    for rtol, atol in ((-1.0, 0.0), (jnp.nan, 0.0), (1e-8, -1.0), (1e-8, jnp.nan)):
        sol = solve(rtol, atol)
        assert int(sol.status) == Status.INVALID_TOLERANCE, (rtol, atol, sol.message)
        assert not bool(sol.converged)
    sol = solve(1e-8, 0.0)  # the valid neighbour, the same program
    assert int(sol.status) == Status.CONVERGED and bool(sol.converged)


def test_float32_precision_floor_names_precision():
    """A new user's first solve (issue 48): float32 multigrid-CG on a 64^2
    diffusion problem with a smooth b cannot reach the default rtol; the
    status says FLOOR (not a failure: `check()` accepts it), its message
    names float32 and the two ways out (x64, iterative_refinement) in at
    most 300 characters, and x is as accurate as float32 allows. Nearest
    valid input: a random b, which float32 does solve there."""
    n = 64
    A = sx.diffusion_operator(jnp.ones((n, n), jnp.float32), spacing=1 / n)
    sol = sx.pcg(A, jnp.ones((n, n), jnp.float32), precond=sx.multigrid(A))
    assert sol.status == Status.FLOOR and sol.check() is sol
    for words in ("precision", "float32", "x64", "iterative_refinement"):
        assert words in sol.message
    assert len(sol.message) <= 300
    A64 = sx.diffusion_operator(jnp.ones((n, n)), spacing=1 / n)
    exact = np.asarray(sx.pcg(A64, jnp.ones((n, n)), precond=sx.multigrid(A64), rtol=1e-13).x)
    error = np.linalg.norm(np.asarray(sol.x, np.float64) - exact) / np.linalg.norm(exact)
    assert error < 1e-4, error
    b = jnp.asarray(np.random.default_rng(0).standard_normal((n, n)), jnp.float32)
    assert sx.pcg(A, b, precond=sx.multigrid(A)).converged
