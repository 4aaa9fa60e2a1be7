"""Operators that communicate: when a solve must reduce over a mesh axis, and
when the operator's collectives are its own business.

A `matvec` that exchanges halos through its own `shard_map` (global arrays
in and out) is self-contained: a solve under plain `jit` around it is valid,
and its inner products reduce over the whole vectors as usual. A `matvec`
traced inside the solve's own `shard_map` couples the shards: the inner
products must reduce over that axis (`axis_name`, or a callable product that
sums over it), or each shard would stop on its own piece and the mesh hang.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import REPRESENTATIVE, SOLVERS, halo_laplacian, laplacian_1d, mesh, put, rel_err, rhs
from jax import lax
from jax.sharding import PartitionSpec as P
from matrix import levels

import solvax as sx

N = 64
DENSE = laplacian_1d(N) + 0.1 * np.eye(N)



def halo_operator(m):
    """Global arrays in and out; the halo exchange inside its own `shard_map`."""
    return sx.shard_map(halo_laplacian, mesh=m, in_specs=P("i"), out_specs=P("i"))


def sharded_rhs(m, seed=1):
    return put(rhs(N, seed=seed), m, "i")


# one variant per method module (every variant with SOLVAX_TEST_MATRIX=full):
# the check is the driver's, the same for every method
@pytest.mark.parametrize("name", levels(list(SOLVERS), REPRESENTATIVE))
def test_a_self_contained_halo_operator_is_accepted_under_jit(name):
    """Once refused ("`matvec` communicates over the mesh axes ['i']"): the
    collectives are bound by the operator's own `shard_map`."""
    m = mesh(8)
    b = sharded_rhs(m)
    sol = jax.jit(lambda b: SOLVERS[name].solve(halo_operator(m), b, rtol=1e-10))(b)
    assert bool(sol.converged), sol.message
    assert rel_err(sol.x, np.linalg.solve(DENSE, np.asarray(b))) < 1e-8


def test_a_halo_preconditioner_pytree_grad_and_vmap():
    """A preconditioner built the same way, a pytree of two such fields, the
    gradient (its transposed solve runs the same operator) and a batch."""
    m = mesh(8)
    A = halo_operator(m)
    precond = sx.shard_map(lambda r: r / 2.1, mesh=m, in_specs=P("i"), out_specs=P("i"))
    b = sharded_rhs(m)
    want = np.linalg.solve(DENSE, np.asarray(b))

    sol = jax.jit(lambda b: sx.pcg(A, b, precond=precond, rtol=1e-10))(b)
    assert bool(sol.converged) and rel_err(sol.x, want) < 1e-8

    tree_b = {"u": b, "v": 2 * b}
    tree = jax.jit(lambda b: sx.gmres(lambda x: jax.tree_util.tree_map(A, x), b,
                                      rtol=1e-10))(tree_b)
    assert bool(tree.converged) and rel_err(tree.x["v"], 2 * want) < 1e-8

    grad = jax.jit(jax.grad(lambda b: jnp.sum(sx.pcg(A, b, rtol=1e-12).x ** 2)))(b)
    assert rel_err(grad, 2 * np.linalg.solve(DENSE.T, want)) < 1e-7

    batch = jax.jit(jax.vmap(lambda b: sx.bicgstab(A, b, rtol=1e-10).x))(jnp.stack([b, -b]))
    assert rel_err(batch, np.stack([want, -want])) < 1e-8


def _inside_shard_map(m, solve):
    return jax.jit(sx.shard_map(solve, mesh=m, in_specs=P("i"), out_specs=P("i")))


def test_a_callable_product_that_does_not_reduce_is_refused_not_hung():
    """Inside `shard_map`, a halo matvec with a product that sums one shard
    only: each shard would stop on its own norms (it hung); refused at trace
    time. Summing over the axis inside the product is the valid neighbour."""
    m = mesh(8)
    b = sharded_rhs(m)

    def local_product(x, y):
        return jnp.sum(x * y)

    def global_product(x, y):
        return lax.psum(jnp.sum(x * y), "i")

    for name in ("pcg", "gmres"):
        def run(b, product, solve=SOLVERS[name].solve):
            return solve(halo_laplacian, b, rtol=1e-10, inner_product=product).x

        with pytest.raises(ValueError, match=r"callable `inner_product` does not reduce"):
            _inside_shard_map(m, lambda b, run=run: run(b, local_product))(b)
        good = _inside_shard_map(m, lambda b, run=run: run(b, global_product))
        assert rel_err(good(b), np.linalg.solve(DENSE, np.asarray(b))) < 1e-8
