"""`multigrid_solve`: multigrid cycles as the solver (the stationary iteration
`x <- x + M (b - A x)`), and the F-cycle. The solve against a direct one,
truthful statuses, one reduction per cycle on a sharded grid (under `jit`
and inside `shard_map`), implicit derivatives, `vmap`, bad input."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import mesh, put
from jax.sharding import PartitionSpec as P

import solvax as sx

SHAPE = (32, 32)


def field(shape=SHAPE, seed=0):
    return jnp.asarray(np.exp(np.random.default_rng(seed).standard_normal(shape)))


def rhs(shape=SHAPE, seed=1):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape))


def dense_solve(A, b):
    n = int(np.prod(A.shape))
    matrix = jax.vmap(A)(jnp.eye(n).reshape(n, *A.shape)).reshape(n, n).T
    return jnp.linalg.solve(matrix, b.reshape(-1)).reshape(A.shape)


@pytest.mark.parametrize("cycle", ["V", "F"])
def test_cycles_solve_to_the_tolerance(cycle):
    """V- and F-cycles converge on a log-normal diffusion problem to the true
    residual asked for (measured: V 18 cycles, F 17; W, whose recursion the
    F-cycle's first half is, 17)."""
    A = sx.diffusion_operator(field())
    b = rhs()
    sol = jax.jit(lambda b: sx.multigrid_solve(A, b, cycle=cycle, rtol=1e-10,
                                               record_history=True))(b)
    assert int(sol.status) == sx.Status.CONVERGED, sx.Status(int(sol.status)).message
    assert float(jnp.linalg.norm(b - A(sol.x)) / jnp.linalg.norm(b)) <= 1e-10
    assert float(jnp.max(jnp.abs(sol.x - dense_solve(A, b)))) < 1e-8
    assert int(sol.iterations) <= {"V": 20, "W": 18, "F": 18}[cycle]
    history = np.asarray(sol.history)[: int(sol.iterations) + 1]
    assert np.all(history[1:] < history[:-1])  # a contraction every cycle


def test_a_cycle_that_does_not_contract_is_stagnation_not_convergence():
    """A strongly indefinite shifted operator: Jacobi smoothing amplifies, the
    residual grows; after 3 cycles without progress the status says so."""
    A = sx.stencil_operator({(0, 0): 4.0 - 7.0, (1, 0): -1.0, (-1, 0): -1.0,
                             (0, 1): -1.0, (0, -1): -1.0}, shape=(16, 16))
    sol = sx.multigrid_solve(A, rhs((16, 16)), rtol=1e-8)
    assert int(sol.status) == sx.Status.STAGNATION and not bool(sol.converged)
    assert int(sol.iterations) <= 10


def test_x0_and_a_prebuilt_hierarchy_and_the_cycle_limit():
    A = sx.diffusion_operator(field())
    b = rhs()
    mg = sx.multigrid(A, smoother="chebyshev", coarse="chebyshev")
    exact = dense_solve(A, b)
    warm = sx.multigrid_solve(A, b, x0=exact * (1 + 1e-3), precond=mg, rtol=1e-10)
    cold = sx.multigrid_solve(A, b, precond=mg, rtol=1e-10)
    assert bool(warm.converged) and bool(cold.converged)
    assert int(warm.iterations) < int(cold.iterations)
    # the nearest valid input to a negative limit: none at all
    none = sx.multigrid_solve(A, b, precond=mg, max_cycles=0)
    assert int(none.status) == sx.Status.MAX_STEPS and float(jnp.max(jnp.abs(none.x))) == 0


@functools.cache
def _sharded():
    m = mesh(8)
    k, b = (put(v, m, "i", None) for v in (field(), rhs()))
    return m, k, b


@pytest.mark.parametrize("coarse", ["direct", "chebyshev"])
def test_one_reduction_per_cycle_on_a_sharded_grid(coarse):
    """Rows over 8 devices under `jit`: a cycle executes one all-reduce (the
    residual norm), halos, and the coarsest grid's gather unless smoothed;
    the answer is the one-device answer."""
    _, k, b = _sharded()

    def solve(k, b):
        A = sx.diffusion_operator(k)
        return sx.multigrid_solve(A, b, precond=sx.multigrid(A, coarse=coarse, shards=(8, 1)),
                                  rtol=1e-10)

    report = sx.count_collectives(lambda k, b: solve(k, b).x, k, b)
    assert report.step_count("all-reduce") == 1, str(report)
    assert report.step_count("all-gather") == (1 if coarse == "direct" else 0), str(report)
    sol = jax.jit(solve)(k, b)
    one = jax.jit(solve)(field(), rhs())
    assert bool(sol.converged) and int(sol.iterations) == int(one.iterations)
    assert float(jnp.max(jnp.abs(sol.x - one.x))) < 1e-10


def test_inside_shard_map():
    m, k, b = _sharded()
    spec = P("i", None)

    def local(k, b):
        A = sx.diffusion_operator(k, axis_names=("i", None))
        return sx.multigrid_solve(A, b, rtol=1e-10, axis_name="i").x

    run = sx.shard_map(local, mesh=m, in_specs=(spec, spec), out_specs=spec)
    report = sx.count_collectives(run, k, b)
    assert report.step_count("all-reduce") == 1, str(report)
    x = jax.jit(run)(k, b)
    A = sx.diffusion_operator(field())
    assert float(jnp.max(jnp.abs(x - dense_solve(A, rhs())))) < 1e-8


def test_derivatives_and_vmap():
    """The gradient with respect to the coefficients (implicit: one transposed
    solve by the same cycles) matches the one through a tight CG solve; a
    batch of right-hand sides under `vmap` matches one at a time."""
    k, b = field((16, 16)), rhs((16, 16))

    def loss(solve, k):
        return jnp.sum(solve(sx.diffusion_operator(k), b) ** 2)

    grad = jax.jit(jax.grad(functools.partial(
        loss, lambda A, b: sx.multigrid_solve(A, b, rtol=1e-12).x)))(k)
    want = jax.jit(jax.grad(functools.partial(
        loss, lambda A, b: sx.pcg(A, b, rtol=1e-13).x)))(k)
    assert float(jnp.max(jnp.abs(grad - want)) / jnp.max(jnp.abs(want))) < 1e-8
    A = sx.diffusion_operator(k)
    bs = jnp.stack([b, 2 * b + 1])
    batch = jax.jit(jax.vmap(lambda b: sx.multigrid_solve(A, b, rtol=1e-10).x))(bs)
    for i in range(2):
        assert float(jnp.max(jnp.abs(batch[i] - dense_solve(A, bs[i])))) < 1e-8


def test_an_f_cycle_preconditions_gmres():
    A = sx.diffusion_operator(field())
    b = rhs()
    sol = sx.gmres(A, b, precond=sx.multigrid(A, cycle="F"), rtol=1e-10)
    assert bool(sol.converged) and int(sol.iterations) <= 12


def test_bad_input_names_the_argument():
    A = sx.diffusion_operator(1.0, shape=(8, 8))
    b = jnp.ones((8, 8))
    with pytest.raises(TypeError, match="`operator` must be a StencilOperator"):
        sx.multigrid_solve(lambda x: 2 * x, b)
    with pytest.raises(TypeError, match="`precond` must be a `Multigrid`"):
        sx.multigrid_solve(A, b, precond=lambda r: r)
    with pytest.raises(ValueError, match="`max_cycles`"):
        sx.multigrid_solve(A, b, max_cycles=-1)
    with pytest.raises(ValueError, match="`cycle`"):
        sx.multigrid_solve(A, b, cycle="X")
    with pytest.raises(ValueError, match="`rtol`"):
        sx.multigrid_solve(A, b, rtol=-1.0)
    # the nearest valid: one cycle, an F-cycle, a zero tolerance
    sol = sx.multigrid_solve(A, b, cycle="F", max_cycles=1, rtol=0.0)
    assert int(sol.status) == sx.Status.MAX_STEPS and int(sol.iterations) == 1
