"""`iterative_refinement` and `mixed_precision`: float64 answers from float32
corrections, truthful statuses across condition numbers, the operator narrowed
from its jaxpr (or given), implicit derivatives, communication on a mesh, bad
input and the valid input nearest to each refusal. (The generic checks run it
too: it is in the test registry.)"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import mesh, put

import solvax as sx
from solvax._core.closure import close
from solvax._precision.narrowing import lowered

N = 64


def laplacian(x):
    """The 1-D Dirichlet Laplacian (eigenvalues in (0, 4))."""
    return 2 * x - jnp.pad(x[1:], (0, 1)) - jnp.pad(x[:-1], (1, 0))


def family(kappa):
    """Diagonal plus a weak Laplacian coupling: condition number about `kappa`."""
    d = jnp.logspace(0, np.log10(kappa), N)
    return lambda x: d * x + 1e-3 * laplacian(x)


@pytest.mark.parametrize("kappa", [1e2, 1e4, 1e6, 1e8, 1e10, 1e12])
def test_refinement_converges_exactly_where_the_inner_precision_resolves_the_system(kappa):
    """Reaches 1e-12 in float64 with float32 corrections where kappa * 6e-8 <
    0.5, and says it did not (STAGNATION, not CONVERGED) everywhere else."""
    A = family(kappa)
    b = jnp.asarray(np.random.default_rng(0).standard_normal(N))
    sol = sx.iterative_refinement(A, b, solver=functools.partial(sx.gmres, restart=N),
                                  rtol=1e-12)
    true = float(jnp.linalg.norm(b - A(sol.x)) / jnp.linalg.norm(b))
    if kappa * 6e-8 < 0.5:
        assert bool(sol.converged) and true <= 1e-12, (sx.Status(int(sol.status)).name, true)
        assert sol.x.dtype == jnp.float64
    else:
        assert not bool(sol.converged)
        assert sx.Status(int(sol.status)) in (sx.Status.STAGNATION, sx.Status.MAX_STEPS)
        assert true > 1e-12


def test_refinement_with_a_float32_multigrid_reaches_float64_accuracy():
    """A log-normal diffusion problem: MG-CG corrections in float32, the true
    residual in float64 below 1e-12 in a few steps."""
    k = jnp.asarray(np.exp(np.random.default_rng(0).standard_normal((32, 32))))
    A = sx.diffusion_operator(k)
    b = jnp.asarray(np.random.default_rng(1).standard_normal((32, 32)))
    sol = jax.jit(lambda b: sx.iterative_refinement(
        A, b, precond=sx.multigrid(A, dtype=jnp.float32), rtol=1e-12, record_history=True))(b)
    assert bool(sol.converged) and int(sol.iterations) <= 5
    assert float(jnp.linalg.norm(b - A(sol.x)) / jnp.linalg.norm(b)) <= 1e-12
    h = np.asarray(sol.history)[: int(sol.iterations) + 1]
    assert np.all(h[1:] <= 0.5 * h[:-1])   # every step at least halved it


def test_inner_solves_stopped_at_their_float32_floor_still_refine():
    """Measured on a TPU at 4096^2 (and here at 64^2): float32 MG-CG's floor
    lies above `inner_rtol`, so every inner solve ends at its FLOOR; its
    correction still halves the float64 residual, so refinement takes it and
    reaches 1e-12 in three steps (never a stop on the inner status)."""
    k = jnp.asarray(np.exp(np.random.default_rng(0).standard_normal((64, 64))))
    b = jnp.asarray(np.random.default_rng(1).standard_normal((64, 64)))
    A = sx.diffusion_operator(k)
    M = sx.multigrid(A, dtype=jnp.float32)
    first = sx.pcg(sx.diffusion_operator(k.astype(jnp.float32)),
                   (b / jnp.linalg.norm(b)).astype(jnp.float32), precond=M, rtol=1e-6, atol=0.0)
    assert sx.Status(int(first.status)) == sx.Status.FLOOR   # the floor is above 1e-6
    sol = sx.iterative_refinement(A, b, precond=M, inner_rtol=1e-6, rtol=1e-12,
                                  record_history=True)
    assert bool(sol.converged) and int(sol.iterations) <= 4
    assert float(jnp.linalg.norm(b - A(sol.x)) / jnp.linalg.norm(b)) <= 1e-12
    h = np.asarray(sol.history)[: int(sol.iterations) + 1]
    assert np.all(h[1:] <= 0.5 * h[:-1])


def test_refinement_gradient_matches_a_float64_solve():
    k = jnp.asarray(np.exp(np.random.default_rng(2).standard_normal((16, 16))))
    b = jnp.asarray(np.random.default_rng(3).standard_normal((16, 16)))

    def loss(solve, k):
        return jnp.sum(solve(sx.diffusion_operator(k), b, rtol=1e-12).x ** 2)

    g = jax.grad(functools.partial(loss, sx.iterative_refinement))(k)
    ref = jax.grad(functools.partial(loss, sx.pcg))(k)
    np.testing.assert_allclose(g, ref, rtol=1e-8, atol=1e-12 * float(jnp.max(jnp.abs(ref))))


def test_inner_matvec_is_used_and_transposed_for_the_gradient():
    """A nonsymmetric operator given in float32 as well: the solve converges and
    the gradient (a transposed refinement: the transpose of `inner_matvec`)
    matches the dense one."""
    rng = np.random.default_rng(4)
    M = jnp.asarray(np.eye(N) * 4 + 0.3 * rng.standard_normal((N, N)))
    b = jnp.asarray(rng.standard_normal(N))
    calls = []

    def inner(d):
        calls.append(d.dtype)
        return M.astype(jnp.float32) @ d

    def loss(b):
        return jnp.sum(sx.iterative_refinement(lambda x: M @ x, b, inner_matvec=inner,
                                               solver=sx.gmres, rtol=1e-12).x ** 3)

    g = jax.grad(loss)(b)
    x = jnp.linalg.solve(M, b)
    np.testing.assert_allclose(g, jnp.linalg.solve(M.T, 3 * x ** 2), rtol=1e-9)
    assert calls and all(dtype == jnp.float32 for dtype in calls)


def test_lowered_operator_runs_in_the_narrow_precision():
    """Closed-over float64 arrays, a float64 literal and an explicit cast to
    float64, all narrowed: float32 out, equal to the float64 operator up to
    float32 rounding."""
    C = jnp.asarray(np.random.default_rng(5).standard_normal((8, 8)))
    x = jnp.asarray(np.random.default_rng(6).standard_normal(8))

    def f(v):
        return C @ v + jnp.float64(2.0) * v.astype(jnp.float64) + jnp.pad(v, (0, 1))[1:]

    narrow = lowered(close(f, x), x, jnp.float32)
    y = narrow(x.astype(jnp.float32))
    assert y.dtype == jnp.float32
    np.testing.assert_allclose(y, f(x), rtol=1e-5, atol=1e-5)


def test_an_operator_with_a_loop_is_refused_and_inner_matvec_is_the_way():
    d = jnp.linspace(1.0, 2.0, N)

    def looped(x):
        return jax.lax.fori_loop(0, 2, lambda i, v: v * jnp.sqrt(d), x)

    b = jnp.ones(N)
    with pytest.raises(TypeError, match="inner_matvec"):
        sx.iterative_refinement(looped, b)
    sol = sx.iterative_refinement(looped, b, inner_matvec=lambda v: d.astype(jnp.float32) * v,
                                  rtol=1e-12)
    assert bool(sol.converged)


def test_mixed_precision_preconditioners():
    """A pytree preconditioner (multigrid) and a plain function (Jacobi by
    hand), applied in float32 inside float64 CG: still 1e-11."""
    k = jnp.asarray(np.exp(np.random.default_rng(7).standard_normal((32, 32))))
    A = sx.diffusion_operator(k)
    b = jnp.asarray(np.random.default_rng(8).standard_normal((32, 32)))
    diagonal = A.diagonal()
    for precond in (sx.mixed_precision(sx.multigrid(A)),
                    sx.mixed_precision(lambda r: r / diagonal, jnp.float32)):
        z = precond(b)
        assert z.dtype == jnp.float64
        sol = sx.pcg(A, b, precond=precond, rtol=1e-11, atol=0.0)
        assert bool(sol.converged)
        assert float(jnp.linalg.norm(b - A(sol.x)) / jnp.linalg.norm(b)) <= 1e-11


def test_refinement_on_a_mesh_keeps_the_sharding_and_gathers_nothing():
    """A grid split over 8 devices: x keeps its sharding; the refinement loop
    adds one all-reduce per step to its inner solves' (pinned) and no gather."""
    m = mesh()
    A = sx.diffusion_operator(put(jnp.ones((64, 16)), m, "i", None))
    b = put(jnp.asarray(np.random.default_rng(9).standard_normal((64, 16))), m, "i", None)

    def solve(A, b):
        return sx.iterative_refinement(A, b, rtol=1e-12)

    sol = jax.jit(solve)(A, b)
    assert bool(sol.converged) and sol.x.sharding.is_equivalent_to(b.sharding, 2)
    report = sx.count_collectives(solve, A, b)
    assert report.count("all-gather") == 0
    loop = next(lp.name for lp in report.loops if lp.depth == 0)
    # the step's [||r||^2, ||x||^2] and the inner pcg's scale (from zero its
    # ||b||^2 is its first step's)
    assert report.loop_count(loop, "all-reduce") == 2, str(report)
    assert report.step_count("all-reduce") == 2   # the inner pcg's step


def test_bad_input_and_the_valid_input_nearest():
    b = jnp.ones(N)
    A = family(1e2)
    with pytest.raises(TypeError, match="inner_dtype"):
        sx.iterative_refinement(A, b, inner_dtype=jnp.bfloat16)
    with pytest.raises(TypeError, match="inner_dtype"):
        sx.iterative_refinement(A, b, inner_dtype=jnp.int32)
    assert bool(sx.iterative_refinement(A, b, inner_dtype=jnp.float32).converged)
    with pytest.raises(ValueError, match="inner_rtol"):
        sx.iterative_refinement(A, b, inner_rtol=1.0)
    assert bool(sx.iterative_refinement(A, b, inner_rtol=0.5).converged)
    with pytest.raises(TypeError, match="inner_product"):
        sx.iterative_refinement(A, b, inner_product=lambda x, y: jnp.sum(x * y))
    assert bool(sx.iterative_refinement(A, b, inner_product=sx.InnerProduct()).converged)
    with pytest.raises(TypeError, match="solver"):
        sx.iterative_refinement(A, b, solver="pcg")
    with pytest.raises(TypeError, match="dtype"):
        sx.mixed_precision(lambda r: r, jnp.float16)
    assert sx.mixed_precision(lambda r: r, jnp.float32)(b).dtype == b.dtype
