"""The sparse-matrix guide (`docs/sparse.md`) holds: a BCOO matrix on the
device, a SciPy matrix through a host callback, and a pyamg hierarchy as the
preconditioner under `jit` and `grad`."""

import jax
import jax.numpy as jnp
import numpy as np
import pyamg
from jax.experimental import sparse as jsparse

import solvax as sx

N = 64


def _host(fn):
    """`fn` (NumPy in, NumPy out) on the host through a callback."""
    def apply(x):
        return jax.pure_callback(lambda v: np.asarray(fn(np.asarray(v)), v.dtype),
                                 jax.ShapeDtypeStruct(x.shape, x.dtype), x,
                                 vmap_method="sequential")
    return apply


def test_bcoo_scipy_and_pyamg_as_the_guide_writes_them():
    A_sp = pyamg.gallery.poisson((N, N), format="csr")
    A = jsparse.BCOO.from_scipy_sparse(A_sp)
    b = jnp.ones(N * N)
    exact = np.linalg.solve(A_sp.toarray(), np.ones(N * N))
    plain = jax.jit(lambda b: sx.pcg(lambda x: A @ x, b))(b)
    host = jax.jit(lambda b: sx.pcg(_host(lambda v: A_sp @ v), b))(b)
    M = pyamg.ruge_stuben_solver(A_sp).aspreconditioner(cycle="V")
    amg = jax.jit(lambda b: sx.pcg(lambda x: A @ x, b, precond=_host(lambda v: M @ v)))(b)
    for sol in (plain, host, amg):
        assert bool(sol.converged), sol.message
        assert np.linalg.norm(sol.x - exact) <= 1e-6 * np.linalg.norm(exact)
    assert int(plain.iterations) == int(host.iterations) == 119
    assert int(amg.iterations) <= 8
    loss = lambda b: jnp.sum(sx.pcg(lambda x: A @ x, b, precond=_host(lambda v: M @ v)).x ** 2)  # noqa: E731
    grad = jax.jit(jax.grad(loss))(b)
    expected = 2 * np.linalg.solve(A_sp.toarray().T, exact)
    assert np.max(np.abs(grad - expected)) <= 1e-8 * np.max(np.abs(expected))
