"""The nonlinear test problems of `benchmark_newton.py` (and its tests): 2-D
cell-centred grids on the unit square, zero Dirichlet boundary, spacing
`h = 1 / (n + 1)`."""

import jax.numpy as jnp
import numpy as np


def laplacian(u, h, xp=jnp):
    """`-Δu` (5-point)."""
    up = xp.pad(u, 1)
    return (4 * u - up[2:, 1:-1] - up[:-2, 1:-1] - up[1:-1, 2:] - up[1:-1, :-2]) / h**2


def bratu(n, lam=6.0, xp=jnp):
    """`F(u) = -Δu - λ e^u` (Bratu; no solution past λ* ≈ 6.81)."""
    h = 1.0 / (n + 1)
    return lambda u: laplacian(u, h, xp) - lam * xp.exp(u)


def bratu_jacobian(n, lam=6.0):
    """`u -> (k, shift)` of the Jacobian `-Δ - λ e^u` as a diffusion operator."""
    return lambda u: (1.0, -lam * jnp.exp(u))


def nonlinear_convection(n, c=20.0, f=100.0, xp=jnp):
    """`F(u) = -div((1 + u^2) grad u) + c ∂u/∂x - f` (upwind convection along
    axis 0, face coefficients the mean of the two cells): nonsymmetric; from
    `u = 0` the full Newton step overshoots (the line search shortens it)."""
    h = 1.0 / (n + 1)

    def F(u):
        up = xp.pad(u, 1)
        k = 1 + up**2
        kx = 0.5 * (k[1:, 1:-1] + k[:-1, 1:-1])
        ky = 0.5 * (k[1:-1, 1:] + k[1:-1, :-1])
        gx = (up[1:, 1:-1] - up[:-1, 1:-1]) / h
        gy = (up[1:-1, 1:] - up[1:-1, :-1]) / h
        div = (kx[1:] * gx[1:] - kx[:-1] * gx[:-1] + ky[:, 1:] * gy[:, 1:]
               - ky[:, :-1] * gy[:, :-1]) / h
        return -div + c * (u - up[:-2, 1:-1]) / h - f

    return F


def start(n):
    return np.zeros((n, n))


def bratu_multigrid(n, lam=6.0):
    """`u -> multigrid of the Bratu Jacobian -Δ - λ e^u at u` (a `precond_builder`)."""
    import solvax as sx

    h = 1.0 / (n + 1)
    return lambda u: sx.multigrid(sx.diffusion_operator(1.0, shape=u.shape, spacing=h,
                                                        shift=-lam * jnp.exp(u)))
