"""Batched tridiagonal solves against dense solves, with derivatives."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import dense_tridiagonal, rel_err, solve_dense_tridiagonal

import solvax as sx
from solvax._structured.tridiagonal import lax_supports

METHODS = ["thomas", "lax", "auto"]


def bands(shape, dtype=np.float64, seed=0):
    rng = np.random.default_rng(seed)

    def draw(scale=1.0):
        v = rng.standard_normal(shape) * scale
        if np.issubdtype(dtype, np.complexfloating):
            v = v + 1j * rng.standard_normal(shape) * scale
        return v.astype(dtype)

    lower, upper = draw(), draw()
    diag = draw(0.3) + 4.0  # diagonally dominant
    return jnp.asarray(lower), jnp.asarray(diag), jnp.asarray(upper)


def reference(lower, diag, upper, rhs):
    return np.asarray(solve_dense_tridiagonal(lower, diag, upper, rhs))


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.complex64, np.complex128])
@pytest.mark.parametrize("band_shape,rhs_shape", [
    ((17,), (17,)), ((17,), (17, 5)), ((17, 4), (17, 4)), ((17, 4), (17, 4, 3)), ((1,), (1, 2))])
def test_solve(method, dtype, band_shape, rhs_shape):
    lower, diag, upper = bands(band_shape, dtype)
    rhs = jnp.asarray(np.random.default_rng(1).standard_normal(rhs_shape).astype(dtype))
    if method == "lax" and not lax_supports(np.dtype(dtype), band_shape[0]):  # JAX 0.4.x
        with pytest.raises(ValueError, match="does not support dtype"):
            sx.tridiagonal_solve(lower, diag, upper, rhs, method=method)
        return
    x = jax.jit(lambda *a: sx.tridiagonal_solve(*a, method=method))(lower, diag, upper, rhs)
    assert x.shape == rhs.shape and x.dtype == dtype
    tol = 1e-4 if dtype in (np.float32, np.complex64) else 1e-12
    assert rel_err(x, reference(lower, diag, upper, rhs)) < tol


def test_corner_entries_ignored():
    lower, diag, upper = bands((9,))
    rhs = jnp.ones(9)
    x1 = sx.tridiagonal_solve(lower, diag, upper, rhs)
    x2 = sx.tridiagonal_solve(lower.at[0].set(1e3), diag, upper.at[-1].set(-7.0), rhs)
    assert rel_err(x1, x2) < 1e-15


@pytest.mark.parametrize("method", ["thomas", "lax"])
@pytest.mark.parametrize("dtype", [np.float64, np.complex128])
def test_grad_all_inputs(method, dtype):
    if method == "lax" and not lax_supports(np.dtype(dtype), 11):
        method = "auto"  # JAX 0.4.x has no complex lax solve; auto falls back to Thomas
    lower, diag, upper = bands((11, 3), dtype)
    rhs = jnp.asarray(np.random.default_rng(2).standard_normal((11, 3)).astype(dtype))

    def loss(solve, *args):
        return jnp.sum(jnp.abs(solve(*args)) ** 2)

    ours = jax.grad(lambda *a: loss(lambda *b: sx.tridiagonal_solve(*b, method=method), *a),
                    argnums=(0, 1, 2, 3))(lower, diag, upper, rhs)
    ref = jax.grad(lambda *a: loss(solve_dense_tridiagonal, *a),
                   argnums=(0, 1, 2, 3))(lower, diag, upper, rhs)
    for g, r in zip(ours, ref):
        assert rel_err(g, r) < 1e-10
    assert float(jnp.abs(ours[0][0]).max()) == 0.0  # lower[0] unused
    assert float(jnp.abs(ours[2][-1]).max()) == 0.0  # upper[-1] unused


@pytest.mark.parametrize("method", ["thomas", "lax"])
def test_jvp_and_vmap(method):
    lower, diag, upper = bands((13,))
    rhs = jnp.asarray(np.random.default_rng(3).standard_normal(13))
    tangents = bands((13,), seed=5) + (jnp.ones(13),)

    def f(*a):
        return sx.tridiagonal_solve(*a, method=method)

    _, t = jax.jvp(f, (lower, diag, upper, rhs), tangents)
    _, t_ref = jax.jvp(solve_dense_tridiagonal, (lower, diag, upper, rhs), tangents)
    assert rel_err(t, t_ref) < 1e-12
    R = jnp.stack([rhs, 2 * rhs, -rhs])
    xs = jax.vmap(lambda r: f(lower, diag, upper, r))(R)
    ref = jax.vmap(lambda r: solve_dense_tridiagonal(lower, diag, upper, r))(R)
    assert rel_err(xs, ref) < 1e-12


def test_adjoint_is_transposed_tridiagonal_solve():
    lower, diag, upper = bands((10,))
    rhs = jnp.ones(10)
    ct = jnp.asarray(np.random.default_rng(4).standard_normal(10))
    _, vjp = jax.vjp(lambda r: sx.tridiagonal_solve(lower, diag, upper, r), rhs)
    (rbar,) = vjp(ct)
    A = np.asarray(dense_tridiagonal(lower, diag, upper))
    assert rel_err(rbar, np.linalg.solve(A.T, ct)) < 1e-12


@pytest.mark.parametrize("method", ["thomas", "lax"])
def test_cyclic_solve_with_a_zero_first_diagonal(method):
    rng = np.random.default_rng(1)
    lower, upper = rng.standard_normal((2, 12))
    diag = 4.0 + rng.random(12)
    diag[0] = 0.0
    r = rng.standard_normal(12)
    x = sx.cyclic_tridiagonal_solve(*map(jnp.asarray, (lower, diag, upper, r)), method=method)
    assert rel_err(x, solve_dense_tridiagonal(lower, diag, upper, r, cyclic=True)) < 1e-10


@pytest.mark.parametrize("method", ["thomas", "lax", "auto"])
def test_unused_band_entries_are_unused(method):
    rng = np.random.default_rng(2)
    lower, upper = rng.standard_normal((2, 10))
    diag = 4.0 + rng.random(10)
    r = rng.standard_normal(10)
    x = sx.tridiagonal_solve(*map(jnp.asarray, (lower, diag, upper, r)), method=method)
    lower[0], upper[-1] = np.nan, np.inf
    y = sx.tridiagonal_solve(*map(jnp.asarray, (lower, diag, upper, r)), method=method)
    assert np.array_equal(np.asarray(x), np.asarray(y))
