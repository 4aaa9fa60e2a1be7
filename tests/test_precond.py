"""Collective-free preconditioners and the spectrum estimate."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import dense_of, dense_tridiagonal, mesh, poisson_2d, put, rel_err, rhs

import solvax as sx

JAX_VERSION = tuple(int(p) for p in jax.__version__.split(".")[:3])

N = 120


def tridiag(n=N):
    d = 2.0 + jnp.arange(n) / 10
    A = dense_tridiagonal(-jnp.ones(n), d, -jnp.ones(n))
    return A, d


def test_jacobi_pytree_and_fewer_iterations():
    A, d = tridiag()
    b = {"a": rhs(N), "b": rhs(7, seed=3)}
    e = 1.0 + jnp.arange(7.0) ** 2

    def mv(x):
        return {"a": A @ x["a"], "b": e * x["b"]}

    plain = sx.pcg(mv, b, rtol=1e-10)
    pre = sx.pcg(mv, b, rtol=1e-10, precond=sx.jacobi({"a": d, "b": e}))
    assert bool(pre.converged) and int(pre.iterations) < int(plain.iterations)
    assert rel_err(pre.x["a"], np.linalg.solve(A, b["a"])) < 1e-8


def test_jacobi_of_a_stencil_operator_is_jacobi_of_its_diagonal():
    # an operator is a pytree of coefficients too: read as a "diagonal" its
    # reciprocals made a nonsense preconditioner that failed inside pcg
    k = jnp.asarray(np.exp(np.random.default_rng(0).standard_normal((24, 24))))
    A = sx.diffusion_operator(k)
    b = rhs((24, 24))
    given = sx.pcg(A, b, precond=sx.jacobi(A), rtol=1e-10)
    nearest = sx.pcg(A, b, precond=sx.jacobi(A.diagonal()), rtol=1e-10)
    assert bool(given.converged) and int(given.iterations) == int(nearest.iterations)
    np.testing.assert_array_equal(given.x, nearest.x)


def test_block_jacobi_applies_inverse_blocks():
    A, _ = tridiag()
    blocks = jnp.stack([A[i:i + 10, i:i + 10] for i in range(0, N, 10)])
    M = sx.block_jacobi(blocks)
    r = rhs(N)
    expected = np.concatenate([np.linalg.solve(blocks[i], r[10 * i:10 * i + 10])
                               for i in range(N // 10)])
    assert rel_err(M(r), expected) < 1e-12
    assert rel_err(M(jnp.stack([r, 2 * r], 1)), np.stack([expected, 2 * expected], 1)) < 1e-12
    sol = sx.pcg(lambda x: A @ x, r, precond=M, rtol=1e-10)
    assert bool(sol.converged) and int(sol.iterations) < int(sx.pcg(lambda x: A @ x, r).iterations)


def test_block_jacobi_sharded_is_local():
    m = mesh(8)
    n, bs = 256, 8
    d = put(2.0 + jnp.arange(n) / n, m, "i")
    b = put(rhs(n), m, "i")
    blocks = put(jnp.broadcast_to(jnp.eye(bs), (n // bs, bs, bs)) * 2.5, m, "i")

    def solve(d, b, blocks):
        return sx.pcg(lambda x: d * x, b, precond=sx.block_jacobi(blocks)).x

    report = sx.count_collectives(solve, d, b, blocks)
    assert report.per_iteration == 2  # applying it adds nothing to CG's two reductions
    in_loop = [c.kind for c in report.collectives if c.loops]
    assert in_loop == ["all-reduce", "all-reduce"], str(report)
    # Version gate, measured: the one-time block inversion (LAPACK getrf) is
    # partitioned along the batch axis on jax 0.10.2; the 0.4-era partitioner
    # gathers the blocks for it once, before the loop.
    setup_gathers = report.count("all-gather")
    assert setup_gathers == (0 if JAX_VERSION >= (0, 5, 0) else 1), str(report)
    x = jax.jit(solve)(d, b, blocks)
    assert x.sharding.is_equivalent_to(b.sharding, 1)


def test_estimate_spectrum_and_chebyshev():
    b = rhs((16, 16))
    A = dense_of(poisson_2d, b.shape)
    ev = np.linalg.eigvalsh(A)
    lo, hi = sx.estimate_spectrum(poisson_2d, b, steps=30)
    assert ev[0] <= float(lo) < 1.2 * ev[0]
    assert 0.99 * ev[-1] < float(hi) <= ev[-1] * (1 + 1e-12)
    plain = sx.pcg(poisson_2d, b, rtol=1e-10)
    for degree in (1, 3, 6):
        M = sx.chebyshev(poisson_2d, float(hi) / 30, 1.1 * float(hi), degree=degree)
        # a fixed polynomial in A: linear and symmetric
        P = dense_of(M, b.shape)
        assert np.allclose(P, P.T, atol=1e-12)
        assert np.all(np.linalg.eigvalsh(P) > 0)
        sol = sx.pcg(poisson_2d, b, rtol=1e-10, precond=M)
        assert bool(sol.converged)
        if degree > 1:
            assert int(sol.iterations) < int(plain.iterations)


def test_estimate_spectrum_early_invariant_subspace():
    d = jnp.array([1.0, 1.0, 4.0, 4.0, 9.0])
    lo, hi = sx.estimate_spectrum(lambda x: d * x, jnp.ones(5), steps=10)
    assert abs(float(lo) - 1.0) < 1e-12 and abs(float(hi) - 9.0) < 1e-12


def test_bad_input():
    with pytest.raises(ValueError, match="`blocks` must have shape"):
        sx.block_jacobi(jnp.ones((4, 2, 3)))
    with pytest.raises(ValueError, match="leading axis must be nb \\* bs"):
        sx.block_jacobi(jnp.ones((4, 2, 2)) + jnp.eye(2))(jnp.ones(7))
    with pytest.raises(ValueError, match="0 < lmin < lmax"):
        sx.chebyshev(lambda x: x, 3.0, 2.0)
    with pytest.raises(ValueError, match="`degree` must be >= 1"):
        sx.chebyshev(lambda x: x, 1.0, 2.0, degree=0)
    with pytest.raises(ValueError, match="`steps` must be >= 1"):
        sx.estimate_spectrum(lambda x: x, jnp.ones(3), steps=0)
    with pytest.raises(TypeError, match="`diagonal` must have floating-point"):
        sx.jacobi(jnp.ones(3, jnp.int32))
