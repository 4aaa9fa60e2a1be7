"""Solves run both by the multi-process workers and by the single-process test,
so their results and collective counts can be compared."""

import jax
import jax.numpy as jnp
import numpy as np
from helpers import dense_tridiagonal, solve_dense_tridiagonal

import solvax as sx

N = 256  # vector length (divisible by 8 devices)
NB, BATCH = 24, 32  # tridiagonal: rows and batch (batch axis sharded)


def periodic(d, left, right):
    """x -> d x - left roll(x, 1) - right roll(x, -1): GSPMD exchanges halos."""
    return lambda x: d * x - left * jnp.roll(x, 1) - right * jnp.roll(x, -1)


def dense_periodic(d, left, right):
    minus = -np.ones_like(d)
    return np.asarray(dense_tridiagonal(left * minus, d, right * minus, cyclic=True))


def gmres_solver(matvec, b):
    return sx.gmres(matvec, b, restart=16, rtol=1e-12)


def cases():
    """name -> (function of global arrays, input specs, NumPy inputs, NumPy reference)."""
    rng = np.random.default_rng(0)
    d = 2.5 + rng.random(N)
    b = rng.standard_normal(N)
    spd = dense_periodic(d, 0.5, 0.5)
    ns = dense_periodic(d, 0.7, 0.3)
    x_ns = np.linalg.solve(ns, b)
    lam = np.linalg.solve(ns.T, 2 * x_ns)
    lower, upper, rhs = rng.standard_normal((3, NB, BATCH))
    diag = 2.5 + np.abs(lower) + np.abs(upper)
    x_batch = np.asarray(solve_dense_tridiagonal(lower, diag, upper, rhs))
    pl, pu = rng.standard_normal((2, N))
    pd = 2.5 + np.abs(pl) + np.abs(pu)
    pr = rng.standard_normal((N, 3))
    A_p = np.asarray(dense_tridiagonal(pl, pd, pu))
    vec, col = ("i",), (None, "i")
    return {
        "pcg": (lambda d, b: sx.pcg(periodic(d, 0.5, 0.5), b, rtol=1e-12).x,
                (vec, vec), (d, b), np.linalg.solve(spd, b)),
        "pcg_single_reduction": (
            lambda d, b: sx.pcg(periodic(d, 0.5, 0.5), b, rtol=1e-12, single_reduction=True).x,
            (vec, vec), (d, b), np.linalg.solve(spd, b)),
        "gmres_linear_solve": (
            lambda d, b: sx.linear_solve(periodic(d, 0.7, 0.3), b, solver=gmres_solver).x,
            (vec, vec), (d, b), x_ns),
        "gmres_gradient": (
            jax.grad(lambda d, b: jnp.sum(sx.linear_solve(periodic(d, 0.7, 0.3), b,
                                                          solver=gmres_solver).x ** 2),
                     argnums=(0, 1)),
            (vec, vec), (d, b), (-lam * x_ns, lam)),
        "tridiagonal_batch_sharded": (
            lambda lo, di, up, r: sx.tridiagonal_solve(lo, di, up, r),
            (col,) * 4, (lower, diag, upper, rhs), x_batch),
        "tridiagonal_partitioned": (
            lambda lo, di, up, r, mesh=None: sx.partitioned_tridiagonal_solve(
                lo, di, up, r, axis_name="i", mesh=mesh),
            (vec,) * 4, (pl, pd, pu, pr), np.linalg.solve(A_p, pr)),
    }
