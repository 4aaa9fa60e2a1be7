"""Derivatives: implicit adjoints against dense `jnp.linalg.solve` and finite differences."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    GENERAL_SOLVERS,
    KRYLOV,
    SPD_SOLVERS,
    WITH_WRAPPERS,
    dense_tridiagonal,
    random_nonsymmetric,
    rel_err,
    rhs,
)
from matrix import levels

import solvax as sx

N = 16


def spd_operator(theta):
    """A(theta) = tridiag(-1, 2 + theta, -1): SPD for theta > -0 and differentiable."""

    def matvec(x):
        xp = jnp.pad(x, 1)
        return (2.0 + theta) * x - xp[:-2] - xp[2:]

    return matvec


def spd_dense(theta):
    minus = -jnp.ones_like(theta)
    return dense_tridiagonal(minus, 2.0 + theta, minus)


def general_operator(theta):
    A0 = jnp.asarray(random_nonsymmetric(N))
    return lambda x: (A0 + jnp.diag(theta)) @ x


def general_dense(theta):
    return jnp.asarray(random_nonsymmetric(N)) + jnp.diag(theta)


# one variant per method module and the `linear_solve` wrappers (every
# variant with SOLVAX_TEST_MATRIX=full)
CASES = [(name, spd_operator, spd_dense) for name in levels(SPD_SOLVERS, WITH_WRAPPERS)] + [
    (name, general_operator, general_dense)
    for name in levels(GENERAL_SOLVERS, WITH_WRAPPERS)]


def loss_of(solve, op):
    def loss(theta, b):
        x = solve(op(theta), b, rtol=1e-12).x
        return jnp.sum(x**2) + jnp.sum(jnp.sin(x))

    return loss


def dense_loss_of(dense):
    def loss(theta, b):
        x = jnp.linalg.solve(dense(theta), b)
        return jnp.sum(x**2) + jnp.sum(jnp.sin(x))

    return loss


@pytest.mark.parametrize("name,op,dense", CASES)
def test_grad_matches_dense(name, op, dense):
    theta = jnp.linspace(0.5, 1.5, N)
    b = rhs(N)
    g = jax.jit(jax.grad(loss_of(KRYLOV[name], op), argnums=(0, 1)))(theta, b)
    g_ref = jax.grad(dense_loss_of(dense), argnums=(0, 1))(theta, b)
    assert rel_err(g[0], g_ref[0]) < 1e-8
    assert rel_err(g[1], g_ref[1]) < 1e-8


@pytest.mark.parametrize("name,op,dense", CASES)
def test_jvp_matches_dense(name, op, dense):
    theta = jnp.linspace(0.5, 1.5, N)
    b = rhs(N)
    dtheta, db = rhs(N, seed=7), rhs(N, seed=8)
    _, t = jax.jit(lambda p, t: jax.jvp(loss_of(KRYLOV[name], op), p, t))((theta, b),
                                                                          (dtheta, db))
    _, t_ref = jax.jvp(dense_loss_of(dense), (theta, b), (dtheta, db))
    assert abs(float(t) - float(t_ref)) < 1e-8 * max(1.0, abs(float(t_ref)))


@pytest.mark.parametrize("name", ["pcg", "pcg_single_reduction", "gmres"])
def test_grad_matches_finite_differences(name):
    op = spd_operator
    loss = jax.jit(loss_of(KRYLOV[name], op))
    theta = jnp.linspace(0.5, 1.5, N)
    b = rhs(N)
    g_theta, g_b = jax.grad(loss, argnums=(0, 1))(theta, b)
    direction = rhs(N, seed=11)
    eps = 1e-6
    for g, at in ((g_theta, 0), (g_b, 1)):
        args_p = [theta, b]
        args_m = [theta, b]
        args_p[at] = args_p[at] + eps * direction
        args_m[at] = args_m[at] - eps * direction
        fd = (loss(*args_p) - loss(*args_m)) / (2 * eps)
        assert abs(float(fd) - float(jnp.dot(g, direction))) < 1e-6 * max(1.0, abs(float(fd)))


def test_grad_complex_hermitian_pcg():
    """Real loss of a complex HPD solve; the operator depends on a real parameter."""
    rng = np.random.default_rng(3)
    H = rng.standard_normal((N, N)) + 1j * rng.standard_normal((N, N))
    H = jnp.asarray(H @ H.conj().T / N + np.eye(N))
    b = rhs(N, dtype=np.complex128)

    def loss(theta, solve):
        A = H + jnp.diag(theta).astype(H.dtype)
        x = solve(A, b)
        return jnp.sum(jnp.abs(x) ** 2)

    theta = jnp.linspace(0.5, 1.5, N)
    g = jax.grad(loss)(theta, lambda A, b: sx.pcg(lambda x: A @ x, b, rtol=1e-12).x)
    g_ref = jax.grad(loss)(theta, jnp.linalg.solve)
    assert rel_err(g, g_ref) < 1e-8


def test_grad_pytree_and_vmap():
    b = {"a": rhs(N), "b": rhs((3, 4), seed=5)}

    def loss(scale, b):
        def mv(x):
            return {"a": spd_operator(jnp.full(N, scale))(x["a"]), "b": (2.0 + scale) * x["b"]}

        x = sx.pcg(mv, b, rtol=1e-12).x
        return jnp.sum(x["a"] ** 2) + jnp.sum(x["b"] ** 3)

    scales = jnp.array([0.5, 1.0, 2.0])
    g = jax.jit(jax.vmap(jax.grad(loss), in_axes=(0, None)))(scales, b)
    eps, loss = 1e-6, jax.jit(loss)
    fd = jnp.array([(loss(s + eps, b) - loss(s - eps, b)) / (2 * eps) for s in scales])
    assert rel_err(g, fd) < 1e-6


def test_linear_solve_custom_solver_grad_costs_transposed_solve():
    A = jnp.asarray(random_nonsymmetric(N))
    b = rhs(N)
    calls = []

    def solver(matvec, b):
        calls.append(1)
        return sx.gmres(matvec, b, rtol=1e-12)

    def loss(b):
        return jnp.sum(sx.linear_solve(lambda x: A @ x, b, solver=solver).x ** 2)

    g = jax.grad(loss)(b)
    Ai = jnp.linalg.inv(A)
    assert rel_err(g, 2 * Ai.T @ (Ai @ b)) < 1e-8
    assert len(calls) == 2  # one primal, one transposed solve traced


@pytest.mark.parametrize("solve", [sx.pcg, sx.gmres])
def test_grad_of_jit_with_traced_options(solve):
    """Preconditioner, inner-product weights, a callable inner product and x0
    may all be traced values of the function being differentiated: the
    derivative rule, run after `jit` has finished tracing, reads them as
    explicit parameters (never as stale closures)."""
    A = spd_dense(jnp.linspace(0.5, 1.5, N))

    def loss(theta, b, w, s):
        M = lambda r: r / (2.0 + s)  # noqa: E731 (closes over a traced scalar)
        products = [sx.InnerProduct(weight=w), lambda x, y: jnp.sum(x * y) * s]
        xs = [solve(lambda x: (A + jnp.diag(theta)) @ x, b, x0=b * s, precond=M,
                    inner_product=ip, rtol=1e-12).x for ip in products]
        return sum(jnp.sum(x**2) for x in xs)

    def dense_loss(theta, b, w, s):
        return 2 * jnp.sum(jnp.linalg.solve(A + jnp.diag(theta), b) ** 2)

    args = (jnp.linspace(0.1, 0.2, N), rhs(N), jnp.linspace(1.0, 2.0, N), jnp.float64(0.5))
    g = jax.grad(jax.jit(loss), argnums=(0, 1))(*args)
    g_ref = jax.grad(dense_loss, argnums=(0, 1))(*args)
    assert rel_err(g[0], g_ref[0]) < 1e-8
    assert rel_err(g[1], g_ref[1]) < 1e-8


def test_transposed_solve_traced_only_for_derivatives(monkeypatch):
    """A solve that is not differentiated traces its iteration once; reverse
    mode traces the transposed solve as well."""
    from solvax._krylov import gmres as _gmres
    traced = []
    original = _gmres.make_arnoldi

    def counting(*args, **kwargs):
        traced.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(_gmres, "make_arnoldi", counting)
    A = jnp.asarray(random_nonsymmetric(N))
    b = rhs(N)
    jax.jit(lambda b: sx.gmres(lambda x: A @ x, b).x).trace(b)
    assert len(traced) == 1
    traced.clear()
    jax.grad(lambda b: jnp.sum(sx.gmres(lambda x: A @ x, b).x ** 2))(b)
    assert len(traced) == 2


@pytest.mark.parametrize("solve", [sx.pcg, sx.gmres])
def test_hessian_matches_dense(solve):
    """Second derivatives: the derivative rule is itself differentiable (with a
    preconditioner that depends on the parameters)."""
    A = spd_dense(jnp.zeros(8))

    def loss(theta, b):
        x = solve(lambda x: A @ x + theta * x, b, rtol=1e-12,
                  precond=lambda r: r / (2.0 + theta[0])).x
        return jnp.sum(x**3)

    def dense_loss(theta, b):
        return jnp.sum(jnp.linalg.solve(A + jnp.diag(theta), b) ** 3)

    theta, b = jnp.linspace(0.1, 0.2, 8), rhs(8)
    H = jax.jit(jax.hessian(loss))(theta, b)
    assert rel_err(H, jax.hessian(dense_loss)(theta, b)) < 1e-8


@pytest.mark.parametrize("solve", [sx.pcg, sx.gmres])
def test_vmap_grad_with_batched_options(solve):
    """`vmap` over a parameter that the operator, the preconditioner, the
    inner-product weights and x0 all depend on (batched explicit arguments)."""
    A = spd_dense(jnp.zeros(N))

    def f(s, b):
        return solve(lambda x: A @ x + s * x, b, rtol=1e-12, precond=lambda r: r / (2 + s),
                     inner_product=sx.InnerProduct(weight=jnp.full(N, 1 + s)), x0=b * s).x

    S, B = jnp.array([0.5, 1.0, 2.0]), jnp.stack([rhs(N, seed=i) for i in range(3)])
    X = jax.jit(jax.vmap(f))(S, B)
    for s, b, x in zip(S, B, X):
        assert rel_err(x, jnp.linalg.solve(A + s * jnp.eye(N), b)) < 1e-10
    g = jax.jit(jax.vmap(jax.grad(lambda s, b: jnp.sum(f(s, b) ** 2))))(S, B)
    eps, f = 1e-6, jax.jit(f)
    fd = jnp.array([(jnp.sum(f(s + eps, b) ** 2) - jnp.sum(f(s - eps, b) ** 2)) / (2 * eps)
                    for s, b in zip(S, B)])
    assert rel_err(g, fd) < 1e-6
