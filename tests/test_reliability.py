"""Never lie: answers, statuses and derivatives that are true for every input a
user can write (dtypes, scales, failing solves, transformations, bad input).

The property tests draw the dtype, the scale of `b`, the problem class and the
solver; the rest pins one case of each class that once went wrong.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    DISTINCT,
    REPRESENTATIVE,
    SOLVERS,
    halo_laplacian,
    mesh,
    random_nonsymmetric,
    random_spd,
    rel_err,
    rhs,
    step_limit,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P
from matrix import FULL, examples, levels, sample

import solvax as sx
from solvax import Status

N = 24
HYPOTHESIS = settings(max_examples=examples(30), deadline=None,
                      suppress_health_check=[HealthCheck.too_slow])


# ------------------------------------------------------------------ problems
def _indefinite(n, dtype=np.float64):
    d = np.linspace(-1.0, 2.0, n)
    d[np.abs(d) < 0.2] = 0.7
    return (np.diag(d) + 0.1 * (np.eye(n, k=1) + np.eye(n, k=-1))).astype(dtype)


def _singular(n, dtype=np.float64):
    return np.diag(np.r_[np.linspace(1.0, 3.0, n - 1), 0.0]).astype(dtype)


PROBLEMS = {  # name -> dense matrix builder; the solvers that take each class
    "spd": lambda dtype: random_spd(N, seed=3, dtype=dtype),
    "nonsymmetric": lambda dtype: random_nonsymmetric(N, seed=4, dtype=dtype),
    "indefinite": lambda dtype: _indefinite(N, dtype),
    "singular": lambda dtype: _singular(N, dtype),
    "complex": lambda dtype: random_spd(
        N, seed=5, dtype=np.complex64 if dtype == np.float32 else np.complex128),
}
REAL_DTYPES = [np.float32, np.float64]


@functools.cache
def _jitted(name, problem, dtype):
    """The jitted solve of one (solver, problem class, dtype): `b` is its argument,
    so every drawn scale reuses one compilation."""
    A = jnp.asarray(PROBLEMS[problem](dtype))
    solve = SOLVERS[name].solve
    return A, jax.jit(lambda b: solve(lambda x: A @ x, b))


def _true_relative_residual(A, x, b, scale):
    """`||b - A x|| / ||b||` in float64 on the rescaled quantities (no overflow)."""
    A64 = np.asarray(A).astype(np.complex128)
    x64 = np.asarray(x).astype(np.complex128) / scale
    b64 = np.asarray(b).astype(np.complex128) / scale
    return np.linalg.norm(b64 - A64 @ x64) / np.linalg.norm(b64), \
        np.linalg.norm(A64 @ x64) / np.linalg.norm(b64)


@functools.cache
def _one_device_cg(method, problem, dtype):
    """As `_jitted`, CG of `method` as one device runs it
    (`reduce.reduces_before_loop`, these tests have 8): traced under the rule
    at its first call (`_check_truthful`), a function of its own."""
    A = jnp.asarray(PROBLEMS[problem](dtype))
    return A, jax.jit(lambda b: sx.pcg(lambda x: A @ x, b, method=method))


def _check_truthful(name, problem, dtype, exponent, seed, jitted=_jitted):
    A, solve = jitted(name, problem, dtype)
    scale = 2.0 ** exponent
    v = rhs(N, seed=seed, dtype=np.complex128 if problem == "complex" else np.float64)
    b = (v * scale).astype(A.dtype)
    sol = solve(b)
    assert sol.x.dtype == b.dtype
    true, ax = _true_relative_residual(A, sol.x, b, scale)
    rtol = sx._core.validation.default_rtol(b)
    # the solver evaluates the residual in its own precision: allow that rounding
    rounding = 30 * float(jnp.finfo(dtype).eps) * (1 + ax)
    status = Status(int(sol.status))
    if status == Status.NONFINITE:
        # only where no solution exists: a singular, inconsistent system, where
        # CG's step (or x times the scale of b at the top of the range) overflows
        assert problem == "singular", (name, problem, exponent)
        if np.all(np.isfinite(np.asarray(sol.x))):
            assert true > rtol - rounding, (name, problem, exponent, true)
        return
    if status == Status.CONVERGED:
        assert true <= rtol + rounding, (name, problem, exponent, true, rtol)
    else:
        # not converged: either the true residual is above the tolerance, or it is
        # within rounding of it and the solver's own evaluation said no
        assert true > rtol - rounding, (name, problem, exponent, status, true)
    assert np.isfinite(float(sol.residual_norm) / scale)


# --------------------------------------------------------------- properties
@HYPOTHESIS
@given(name=st.sampled_from(DISTINCT), problem=st.sampled_from(list(PROBLEMS)),
       dtype=st.sampled_from(REAL_DTYPES), data=st.data(), seed=st.integers(0, 5))
def test_converged_means_the_true_residual_meets_the_tolerance(name, problem, dtype, data,
                                                               seed):
    """For every scale of b from 1e-30 to 1e30 (float32) and 1e-300 to 1e300
    (float64), every solver and problem class: CONVERGED if and only if the
    true relative residual meets the tolerance (up to its rounding)."""
    if problem == "nonsymmetric" and not SOLVERS[name].nonsymmetric:
        problem = "spd"
    limit = 99 if dtype == np.float32 else 996  # 2^99 ~ 6e29, 2^996 ~ 7e299
    exponent = data.draw(st.integers(-limit, limit), label="log2 scale of b")
    _check_truthful(name, problem, dtype, exponent, seed)


@settings(max_examples=examples(15), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(method=st.sampled_from(["standard", "single_reduction", "pipelined"]),
       problem=st.sampled_from(["spd", "indefinite", "singular", "complex"]),
       dtype=st.sampled_from(REAL_DTYPES), data=st.data(), seed=st.integers(0, 5))
def test_one_device_cg_converged_means_the_true_residual_meets_it(method, problem, dtype, data,
                                                                  seed):
    """The same property for CG as one device runs it (`reduce.reduces_before_loop`:
    standard CG tests `<r, r>` at each step's close, the others take `||b||^2`
    before the loop), at every scale of `b`."""
    from solvax._core import reduce

    limit = 99 if dtype == np.float32 else 996
    exponent = data.draw(st.integers(-limit, limit), label="log2 scale of b")
    rule = reduce.reduces_before_loop
    reduce.reduces_before_loop = lambda *a, **k: True
    try:
        _check_truthful(method, problem, dtype, exponent, seed, jitted=_one_device_cg)
    finally:
        reduce.reduces_before_loop = rule


@settings(max_examples=examples(15), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(DISTINCT), dtype=st.sampled_from(REAL_DTYPES),
       exponent=st.integers(-60, 60))
def test_strict_dtype_promotion(name, dtype, exponent):
    """The same under `jax_numpy_dtype_promotion='strict'` (JAX's own test
    harness for `jax.scipy.sparse.linalg` turns it on)."""
    with jax.numpy_dtype_promotion("strict"):
        _jitted.cache_clear()
        _check_truthful(name, "spd", dtype, exponent, seed=1)
    _jitted.cache_clear()


@settings(max_examples=examples(12), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(DISTINCT), problem=st.sampled_from(["spd", "nonsymmetric",
                                                                 "indefinite", "singular"]),
       seed=st.integers(0, 5), max_steps=st.sampled_from([1, 3, None]))
def test_a_finite_derivative_is_the_dense_derivative(name, problem, seed, max_steps):
    """Whatever the problem (indefinite, singular, out of steps): the gradient
    is NaN or it matches the dense one."""
    if problem == "nonsymmetric" and not SOLVERS[name].nonsymmetric:
        problem = "spd"
    A = jnp.asarray(PROBLEMS[problem](np.float64))
    limit = {} if max_steps is None else step_limit(name, max_steps)
    solve = SOLVERS[name].solve
    weights = jnp.asarray(np.random.default_rng(seed).standard_normal(N))

    def loss(b):
        return jnp.sum(weights * solve(lambda x: A @ x, b, rtol=1e-10, **limit).x)

    b = rhs(N, seed=seed)
    g = np.asarray(jax.grad(loss)(b))
    if np.all(np.isfinite(g)):
        dense = np.linalg.solve(np.asarray(A).T, np.asarray(weights))
        assert rel_err(g, dense) < 1e-6, (name, problem)
    else:
        assert np.all(np.isnan(g))


# --------------------------------------------------------------------- dtypes
WEAK = {"full": lambda: jnp.full(N, 1.0).at[3].set(0.5),
        "scalar_array": lambda: jnp.broadcast_to(jnp.asarray(2.0), (N,)).at[0].set(1.0),
        "python_scalar": lambda: jnp.full(N, 1.0).at[5].set(3.0) * jnp.asarray(2.0)}


@pytest.mark.parametrize("name, make", sample("weak", strength=1, name=DISTINCT, make=list(WEAK)))
def test_weakly_typed_rhs(name, make):
    b = WEAK[make]()
    assert b.weak_type
    A = jnp.asarray(random_spd(N, seed=2))
    sol = SOLVERS[name].solve(lambda x: A @ x, b)
    assert bool(sol.converged) and sol.x.dtype == jnp.float64 and not sol.x.weak_type
    assert rel_err(sol.x, np.linalg.solve(np.asarray(A), np.asarray(b))) < 1e-6


@pytest.mark.parametrize("name", levels(DISTINCT, REPRESENTATIVE))
def test_mixed_precision_pytree_under_strict_promotion(name):
    b = {"a": jnp.linspace(1.0, 2.0, 8).astype(jnp.float32), "b": jnp.linspace(-1.0, 1.0, 8)}

    def matvec(x):
        return jax.tree_util.tree_map(lambda v: 3 * v - jnp.roll(v, 1) - jnp.roll(v, -1), x)

    with jax.numpy_dtype_promotion("strict"):
        sol, g = jax.jit(lambda b: (SOLVERS[name].solve(matvec, b), jax.grad(
            lambda b: jnp.sum(SOLVERS[name].solve(matvec, b).x["b"] ** 2))(b)))(b)
    assert bool(sol.converged)
    assert sol.x["a"].dtype == jnp.float32 and sol.x["b"].dtype == jnp.float64
    assert g["a"].dtype == jnp.float32 and np.all(np.isfinite(np.asarray(g["b"])))


@pytest.mark.parametrize("name", DISTINCT)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_is_refused_clearly(name, dtype):
    with pytest.raises(TypeError, match=r"float32 or wider.*astype\(jnp.float32\)"):
        SOLVERS[name].solve(lambda x: 2 * x, jnp.ones(8, dtype))


def test_integer_rhs_is_refused_clearly():
    with pytest.raises(TypeError, match="`b` must have floating-point"):
        sx.pcg(lambda x: 2 * x, jnp.arange(8))


# ---------------------------------------------------------------------- scale
@pytest.mark.parametrize("name", DISTINCT)
@pytest.mark.parametrize("dtype,scale", [(np.float32, 1e-30), (np.float32, 1e-19),
                                         (np.float32, 1e-16), (np.float32, 1e20),
                                         (np.float32, 1e30), (np.float64, 1e-300),
                                         (np.float64, 1e-160), (np.float64, 1e300)])
def test_every_scale_of_b(name, dtype, scale):
    """Once: x = 0 after 0 steps reported converged below 1e-19 (float32) and
    1e-154 (float64), NONFINITE above 1e19 (float32); and, under `jit` only,
    a NaN stopping threshold below 1e-154 (float64) and 1e-19 (float32): XLA
    rewrote (atol / s)^2 as atol^2 / s^2, with 1 / s^2 infinite."""
    A, solve = _jitted(name, "spd", dtype)  # one compilation for every scale
    v = np.asarray(rhs(N, seed=2))
    b = jnp.asarray((v * scale).astype(dtype))
    sol = solve(b)
    assert int(sol.status) == Status.CONVERGED, sol.message
    x = np.asarray(sol.x, np.float64) / scale
    assert rel_err(x, np.linalg.solve(np.asarray(A, np.float64), v)) < 100 * float(
        sx._core.validation.default_rtol(b))


def test_tiny_atol_alone_is_not_a_converged_zero():
    b = jnp.full(N, 1e-20, jnp.float32)
    sol = sx.pcg(lambda x: 2 * x, b, rtol=0.0, atol=1e-40)
    assert bool(sol.converged) and rel_err(sol.x, b / 2) < 1e-6 and int(sol.iterations) >= 1


# ---------------------------------------------------------------- derivatives
EIGEN = jnp.diag(jnp.arange(1.0, N + 1.0))


def _eigenvector_loss(solve):
    """`b` an eigenvector: the primal converges in one step, the transposed
    system (right-hand side `w`, not one) needs more."""
    w = rhs(N, seed=9)
    return lambda b: jnp.sum(w * solve(lambda x: EIGEN @ x, b).x)


ONE_STEP = {
    "pcg": lambda mv, b, **kw: sx.pcg(mv, b, max_steps=1, **kw),
    "gmres": lambda mv, b, **kw: sx.gmres(mv, b, restart=1, max_restarts=1, **kw),
    "linear_solve": lambda mv, b, **kw: sx.linear_solve(
        mv, b, solver=lambda A, r: sx.pcg(A, r, max_steps=1), **kw),
}


@pytest.mark.parametrize("name", list(ONE_STEP))
def test_a_derivative_whose_solve_failed_is_nan(name):
    e = jnp.zeros(N).at[4].set(1.0)
    solve = ONE_STEP[name]
    assert bool(solve(lambda x: EIGEN @ x, e).converged)
    assert np.all(np.isnan(np.asarray(jax.grad(_eigenvector_loss(solve))(e))))
    tangent = jax.jvp(_eigenvector_loss(solve), (e,), (rhs(N, seed=3),))[1]
    assert np.isnan(float(tangent))
    kept = jax.grad(_eigenvector_loss(functools.partial(solve, failed_derivative="keep")))(e)
    assert np.all(np.isfinite(np.asarray(kept)))  # as computed (45-53 % wrong here)


@pytest.mark.parametrize("name", ["pcg", "pcg_single_reduction", "pcg_pipelined"])
def test_the_gradient_through_an_indefinite_cg_solve_is_nan(name):
    A = jnp.asarray(_indefinite(N))
    sol = SOLVERS[name].solve(lambda x: A @ x, rhs(N))
    assert int(sol.status) != Status.CONVERGED
    g = jax.grad(lambda b: jnp.sum(SOLVERS[name].solve(lambda x: A @ x, b).x ** 2))(rhs(N))
    assert np.all(np.isnan(np.asarray(g)))  # once exactly 0


SECOND_ORDER = {
    "pcg": lambda M, b: sx.pcg(lambda x: M @ x, b, rtol=1e-13).x,
    "gmres": lambda M, b: sx.gmres(lambda x: M @ x, b, rtol=1e-13).x,
    "linear_solve": lambda M, b: sx.linear_solve(
        lambda x: M @ x, b, solver=lambda A, r: sx.pcg(A, r, rtol=1e-13)).x,
}


@pytest.mark.parametrize("name", list(SECOND_ORDER))
def test_hessian_with_respect_to_a_dense_matrix(name):
    """Along perturbations of a symmetric matrix that are not symmetric, the
    transposed solve must use the real transpose (once 91-97 % wrong)."""
    M = jnp.asarray(random_spd(6, seed=7))
    b = rhs(6, seed=8)

    def loss(M):
        return jnp.sum(SECOND_ORDER[name](M, b) ** 3)

    def dense(M):
        return jnp.sum(jnp.linalg.solve(M, b) ** 3)

    want = jax.hessian(dense)(M)
    # forward over reverse (`jax.hessian`) for each; reverse over reverse (the
    # same rules in another order) for pcg, and for each with the full matrix
    assert rel_err(jax.jit(jax.hessian(loss))(M), want) < 1e-8
    if FULL or name == "pcg":
        assert rel_err(jax.jit(jax.jacrev(jax.jacrev(loss)))(M), want) < 1e-8


# ------------------------------------------------------------- transformations

def _nestings(f, sm, loss):
    return {
        "grad(jit(shard_map))": lambda b: jax.grad(loss(jax.jit(sm)))(b),
        "jit(grad(shard_map))": lambda b: jax.jit(jax.grad(loss(sm)))(b),
        "shard_map(grad)": lambda b: sx.shard_map(
            jax.grad(lambda b: jnp.sum(f(b) ** 2)), mesh=mesh(8), in_specs=P("i"),
            out_specs=P("i"))(b),
        "jvp(jit(shard_map))": lambda b: jax.jvp(jax.jit(sm), (b,), (b,))[1],
        "vmap(jit(shard_map))": lambda b: jax.vmap(jax.jit(sm))(jnp.stack([b, 2 * b])),
        "vmap(grad(shard_map))": lambda b: jax.vmap(jax.grad(loss(sm)))(jnp.stack([b, 2 * b])),
    }


# Every nesting for one variant per method module, sampled: each of them in
# one nesting and each nesting at least once (every variant in every nesting
# with SOLVAX_TEST_MATRIX=full); the nesting that once failed, for every
# variant, is test_sharding.py's shard_map grad check.
NESTING_CASES = sample("nesting", strength=1, name=levels(DISTINCT, REPRESENTATIVE),
                       nesting=list(_nestings(None, None, lambda g: g)))
@pytest.mark.parametrize("name, nesting", NESTING_CASES)
def test_every_nesting_of_transformations(name, nesting):
    """`jit`, `grad`, `jvp`, `vmap` and `shard_map` in any order around a solve
    with `axis_name` and a halo-exchange matvec (grad(jit(shard_map)) once
    failed inside JAX: "mul requires varying manual axes to match")."""
    n = 64
    dense = 2.1 * np.eye(n) - np.eye(n, k=1) - np.eye(n, k=-1)

    def f(b):
        return SOLVERS[name].solve(halo_laplacian, b, axis_name="i", rtol=1e-10).x

    sm = sx.shard_map(f, mesh=mesh(8), in_specs=P("i"), out_specs=P("i"))

    def loss(g):
        return lambda b: jnp.sum(g(b) ** 2)

    b = rhs(n)
    out = np.asarray(_nestings(f, sm, loss)[nesting](b))
    inv = np.linalg.inv(dense)
    x = inv @ np.asarray(b)
    want = {"jvp(jit(shard_map))": x, "vmap(jit(shard_map))": np.stack([x, 2 * x])}.get(
        nesting, 2 * inv.T @ x)
    if nesting == "vmap(grad(shard_map))":
        want = np.stack([2 * inv.T @ x, 4 * inv.T @ x])
    assert rel_err(out, want) < 1e-7, nesting


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize("weight", [jnp.zeros(N), -jnp.ones(N), jnp.full(N, jnp.nan)])
def test_bad_weights_are_refused(weight):
    with pytest.raises(ValueError, match=r"`inner_product.weight` must hold finite real"):
        sx.pcg(lambda x: 2 * x, jnp.ones(N), inner_product=sx.InnerProduct(weight=weight))


def test_weights_of_the_wrong_shape_are_refused():
    with pytest.raises(ValueError, match=r"`inner_product.weight` must have the structure"):
        sx.gmres(lambda x: 2 * x, jnp.ones(N), inner_product=sx.InnerProduct(weight=jnp.ones(3)))


@pytest.mark.parametrize("option", ["max_steps", "max_restarts"])
def test_iteration_limits_beyond_int32_are_refused(option):
    solve = sx.pcg if option == "max_steps" else sx.gmres
    with pytest.raises(ValueError, match=f"`{option}` must be <="):
        solve(lambda x: 2 * x, jnp.ones(N), **{option: 2**31})


def test_linear_solve_checks_what_its_solver_returns():
    for bad, match in ((lambda A, r: r[:-1], "must match `b`"),
                       (lambda A, r: r.astype(jnp.int32), "must match `b`")):
        with pytest.raises(ValueError, match=r"`solver\(matvec, b\)` " + match):
            sx.linear_solve(lambda x: 2 * x, jnp.ones(N), solver=bad)


def test_a_callable_inner_product_must_return_a_scalar():
    with pytest.raises(ValueError, match=r"`inner_product\(x, y\)` must return a scalar"):
        sx.pcg(lambda x: 2 * x, jnp.ones(N), inner_product=lambda x, y: x * y)


def test_a_preconditioner_that_fails_on_b_is_named():
    with pytest.raises(TypeError, match="calling `precond` on arguments shaped like `b`"):
        sx.pcg(lambda x: 2 * x, jnp.ones(N), precond=sx.jacobi(jnp.ones(N + 1)))


def test_an_axis_name_that_is_not_a_mesh_axis_is_named():
    f = sx.shard_map(lambda b: sx.pcg(lambda x: 2 * x, b, axis_name="j").x, mesh=mesh(8),
                     in_specs=P("i"), out_specs=P("i"))
    with pytest.raises(ValueError, match="`axis_name` 'j' is not an axis"):
        f(jnp.ones(16))


def test_partitioned_solve_without_mesh_outside_shard_map_is_named():
    o = jnp.ones(16)
    with pytest.raises(ValueError, match="pass `mesh=`"):
        sx.partitioned_tridiagonal_solve(o, 4 * o, o, o, axis_name="i")


def test_an_empty_rhs_is_refused():
    with pytest.raises(ValueError, match="`b` has no entries"):
        sx.gmres(lambda x: x, jnp.ones(0))


def test_shard_batch_names_the_batch_axis_option():
    with pytest.raises(ValueError, match="`output_batch_axis` = 1 is out of range"):
        sx.shard_batch(lambda a: a, mesh=mesh(8), input_rank=1, output_rank=1,
                       output_batch_axis=1)


# -------------------------------------------------------------------- statuses
def test_gmres_stagnation_is_detected():
    """GMRES(1) on a skew-symmetric operator makes no progress: once it ran all
    40,960 default cycles; now it stops after two and says why."""
    S = np.triu(np.random.default_rng(0).standard_normal((64, 64)), 1)
    S = jnp.asarray(S - S.T)
    sol = sx.gmres(lambda x: S @ x, rhs(64), restart=1)
    assert int(sol.status) == Status.STAGNATION and int(sol.iterations) <= 3


def test_rounding_limited_solves_say_floor_or_stagnation():
    """A tolerance out of the precision's reach is named as such: the floor
    (the method's own test met, or CG's breakdown at rounding level) or a
    stagnation, never a breakdown or the operator (once BREAKDOWN, INDEFINITE
    for CG with `rtol=0`, MAX_STEPS); a float64 stop never suggests x64."""
    rounding = (Status.FLOOR, Status.STAGNATION)
    A = jnp.asarray(np.diag(np.linspace(1.0, 100.0, 64)))
    for sol in (sx.gmres(lambda x: A @ x, rhs(64), rtol=0.0, atol=0.0),
                sx.pcg(lambda x: A @ x, rhs(64), rtol=0.0, atol=0.0)):
        assert int(sol.status) in rounding, sol.message
        assert "x64" not in sol.message
    A32 = jnp.asarray(np.diag(np.linspace(1.0, 1e4, 64)), jnp.float32)
    sol = sx.gmres(lambda x: A32 @ x, rhs(64, dtype=np.float32), rtol=1e-9)
    assert int(sol.status) in rounding, sol.message
    assert "x64" in sol.message


def test_gmres_stalls_on_a_residual_that_sets_no_new_least():
    """Restarted GMRES at float32's floor: a backward-Euler system's true
    residual alternated between two values at every restart (measured, as
    fractions of the start: 1.1934e-5 and 1.2104e-5), never failing to fall
    twice in a row, and GMRES ran all its restarts (MAX_STEPS after 3276
    matvecs). A restart is a stall unless it lowers the least true residual
    so far; two in a row stagnate (`gmres._stagnated`)."""
    from types import SimpleNamespace

    from solvax._krylov import gmres as _gmres

    count, least, stalls = jnp.int32(0), jnp.float32(jnp.inf), []
    for restarts, beta in enumerate([1.0, 0.2, 1.2104e-5, 1.1934e-5, 1.2104e-5, 1.1934e-5]):
        state = SimpleNamespace(restarts=restarts, stalls=count, least=least)
        count, least = _gmres._stalls(state, jnp.float32(beta))
        stalls.append(int(count))
    assert stalls == [0, 0, 0, 0, 1, 2]  # against the last restart only: 0 0 0 0 1 0
    assert float(least) == np.float32(1.1934e-5)


def test_an_invariant_krylov_space_is_a_breakdown():
    d = jnp.asarray(np.r_[np.arange(1.0, 30.0), 0.0])
    b = jnp.zeros(30).at[0].set(1.0).at[-1].set(1.0)
    for orthogonalization in ("one_sync", "cgs2"):
        sol = sx.gmres(lambda x: d * x, b, orthogonalization=orthogonalization)
        assert int(sol.status) == Status.BREAKDOWN


@pytest.mark.parametrize("x64", [False, True])
def test_default_tolerance_fits_the_precision(x64):
    """The README's quickstart with a right-hand side that is not an
    eigenvector converges in float32 and in float64 with default options."""
    dtype = jnp.float64 if x64 else jnp.float32
    b = jnp.asarray(np.random.default_rng(0).standard_normal(64), dtype)

    def matvec(x):
        return 3.0 * x - 0.5 * jnp.roll(x, 1) - 0.5 * jnp.roll(x, -1)

    for method in ("standard", "single_reduction", "pipelined"):
        assert bool(sx.pcg(matvec, b, method=method).converged)
    assert bool(sx.gmres(matvec, b).converged)


def test_bicgstab_breakdown_is_reported():
    """A skew-symmetric operator: <r0, A r0> = 0, so the first step's
    <r0, v> vanishes (BiCGStab's classic breakdown), reported as such."""
    S = np.triu(np.random.default_rng(1).standard_normal((16, 16)), 1)
    S = jnp.asarray(S - S.T)
    sol = sx.bicgstab(lambda x: S @ x, rhs(16))
    assert int(sol.status) == Status.BREAKDOWN and int(sol.iterations) == 0
    assert "BiCGStab" in sol.message


def test_a_coupled_solve_inside_shard_map_needs_axis_name():
    """The matvec exchanges halos over 'i' but no `axis_name` was given: the
    reductions would be local, each shard solving its own piece."""
    f = sx.shard_map(lambda b: sx.pcg(halo_laplacian, b).x, mesh=mesh(8), in_specs=P("i"),
                     out_specs=P("i"))
    with pytest.raises(ValueError, match=r"`matvec` communicates over the mesh axes \['i'\]"):
        f(jnp.ones(64))
    # a local operator per shard (independent systems, e.g. `shard_batch`) is fine
    g = sx.shard_map(lambda b: sx.pcg(lambda x: 2 * x, b).x, mesh=mesh(8), in_specs=P("i"),
                     out_specs=P("i"))
    assert rel_err(g(jnp.ones(64)), np.full(64, 0.5)) < 1e-12


BROKEN = jnp.asarray(np.r_[np.arange(1.0, N), 0.0])  # singular: a zero eigenvalue


@pytest.mark.parametrize("name", ["gmres", "linear_solve_gmres", "bicgstab"])
def test_a_derivative_through_a_breakdown_is_nan(name):
    """An invariant Krylov space of a singular operator (BREAKDOWN, or for
    BiCGStab the residual stuck at the null-space part): the gradient's
    transposed solve fails too, and the gradient says so."""
    b = jnp.zeros(N).at[0].set(1.0).at[-1].set(1.0)
    sol = SOLVERS[name].solve(lambda x: BROKEN * x, b)
    assert not bool(sol.converged)
    g = jax.grad(lambda b: jnp.sum(SOLVERS[name].solve(lambda x: BROKEN * x, b).x ** 2))(b)
    assert np.all(np.isnan(np.asarray(g)))


def test_a_solution_too_large_for_the_dtype_is_nonfinite():
    """A singular operator at the top of float64's range: the system has no
    solution, the scaled solve diverges and x times the scale overflows; an
    infinite x is reported NONFINITE (it said INDEFINITE with an infinite x).
    CG may instead stop earlier on a curvature <p, A p> <= 0, finite x: also
    true of a semidefinite operator (single-reduction CG does, on jax 0.4.38,
    after 14 steps), or on its divergence stop (the residual of an
    inconsistent system grows), so INDEFINITE and DIVERGED are accepted for
    CG with a finite x only."""
    A = jnp.asarray(_singular(N))
    cg = (sx.pcg, functools.partial(sx.pcg, method="single_reduction"))
    for solve in (*cg, sx.gmres):
        sol = solve(lambda x: A @ x, rhs(N) * 2.0**972)
        status = Status(int(sol.status))
        assert not bool(sol.converged), sol.message
        if np.all(np.isfinite(np.asarray(sol.x))) and solve in cg:
            assert status in (Status.NONFINITE, Status.INDEFINITE, Status.DIVERGED), sol.message
        else:
            assert status == Status.NONFINITE, sol.message
