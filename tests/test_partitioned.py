"""Tridiagonal systems split across devices along the solve axis, and cyclic systems."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import mesh, put, rel_err, solve_dense_tridiagonal
from jax.sharding import PartitionSpec as P

import solvax as sx
from solvax._structured.tridiagonal import lax_supports


def system(n, band_tail=(), rhs_tail=(), dtype=np.float64, seed=0):
    """A diagonally dominant system with bands (n, *band_tail), rhs (n, *band_tail, *rhs_tail)."""
    rng = np.random.default_rng(seed)

    def draw(shape):
        v = rng.standard_normal(shape)
        if np.issubdtype(dtype, np.complexfloating):
            v = v + 1j * rng.standard_normal(shape)
        return v.astype(dtype)

    lower, upper = draw((n, *band_tail)), draw((n, *band_tail))
    diag = (2.5 + np.abs(lower) + np.abs(upper)).astype(dtype) + 0.1 * draw((n, *band_tail))
    return lower, diag, upper, draw((n, *band_tail, *rhs_tail))


def sharded(m, arrays):
    return [put(jnp.asarray(a), m, "i") for a in arrays]


@pytest.mark.parametrize("ndev", [2, 4, 8])
@pytest.mark.parametrize("band_tail,rhs_tail", [((), ()), ((), (1,)), ((), (64,)), ((64,), ()),
                                                ((3,), (2,))])
def test_matches_single_device_thomas(ndev, band_tail, rhs_tail):
    m = mesh(ndev)
    n = 37 * ndev  # 37 rows per device: nothing convenient
    args = system(n, band_tail, rhs_tail)
    x = jax.jit(lambda *a: sx.partitioned_tridiagonal_solve(*a, axis_name="i", mesh=m))(
        *sharded(m, args))
    ref = sx.tridiagonal_solve(*(jnp.asarray(a) for a in args), method="thomas")
    assert rel_err(x, ref) < 1e-12
    assert x.sharding.is_equivalent_to(jax.sharding.NamedSharding(m, P("i")), x.ndim)


@pytest.mark.parametrize("dtype", [np.float32, np.complex128])
def test_dtypes(dtype):
    m = mesh(4)
    args = system(4 * 21, (), (5,), dtype=dtype)
    x = sx.partitioned_tridiagonal_solve(*sharded(m, args), axis_name="i", mesh=m)
    assert x.dtype == dtype
    ref = sx.tridiagonal_solve(*(jnp.asarray(a) for a in args), method="thomas")
    assert rel_err(x, ref) < (1e-5 if dtype == np.float32 else 1e-12)


@pytest.mark.parametrize("ndev", [2, 8])
def test_grad_and_jvp_match_single_device(ndev):
    m = mesh(ndev)
    args = system(13 * ndev, (2,), (3,), seed=1)
    glob = [jnp.asarray(a) for a in args]

    def loss_part(*a):
        return jnp.sum(jnp.sin(sx.partitioned_tridiagonal_solve(*a, axis_name="i", mesh=m)))

    def loss_ref(*a):
        return jnp.sum(jnp.sin(sx.tridiagonal_solve(*a, method="thomas")))

    g = jax.jit(jax.grad(loss_part, argnums=(0, 1, 2, 3)))(*sharded(m, args))
    g_ref = jax.jit(jax.grad(loss_ref, argnums=(0, 1, 2, 3)))(*glob)
    for a, b in zip(g, g_ref):
        assert rel_err(a, b) < 1e-12
    tangents = [jnp.asarray(t) for t in system(13 * ndev, (2,), (3,), seed=2)]
    _, t = jax.jit(lambda a, t: jax.jvp(loss_part, a, t))(tuple(sharded(m, args)),
                                                          tuple(sharded(m, tangents)))
    _, t_ref = jax.jit(lambda a, t: jax.jvp(loss_ref, a, t))(tuple(glob), tuple(tangents))
    assert abs(float(t) - float(t_ref)) < 1e-11 * max(1.0, abs(float(t_ref)))


@pytest.mark.parametrize("method", ["thomas", "lax"])
def test_inside_shard_map(method):
    m = mesh(8)
    args = system(8 * 10, (), (4,), seed=3)

    def local(*a):
        return sx.partitioned_tridiagonal_solve(*a, axis_name="i", method=method)

    f = jax.jit(sx.shard_map(local, mesh=m, in_specs=(P("i"),) * 4, out_specs=P("i")))
    x = f(*sharded(m, args))
    ref = sx.tridiagonal_solve(*(jnp.asarray(a) for a in args), method="thomas")
    assert rel_err(x, ref) < 1e-12
    assert sx.count_collectives(f, *sharded(m, args)).total == 1


def test_bad_input():
    m = mesh(8)
    lo, d, up, r = system(8 * 4)
    with pytest.raises(ValueError, match="at least 2 rows per device"):
        sx.partitioned_tridiagonal_solve(*sharded(m, system(8)), axis_name="i", mesh=m)
    with pytest.raises(ValueError, match="not divisible by the 8 devices"):
        sx.partitioned_tridiagonal_solve(*(jnp.asarray(a) for a in system(30)), axis_name="i",
                                         mesh=m)
    with pytest.raises(ValueError, match="`lower`, `diag` and `upper` must have the same"):
        sx.partitioned_tridiagonal_solve(jnp.asarray(lo[:-1]), jnp.asarray(d), jnp.asarray(up),
                                         jnp.asarray(r), axis_name="i", mesh=m)
    lo2, d2, up2, r2 = system(4, (16,))
    wrong = [put(jnp.asarray(a), m, None, "i") for a in (lo2, d2, up2, r2)]
    with pytest.raises(ValueError, match="sharded over 'i' on axis 1"):
        sx.partitioned_tridiagonal_solve(*wrong, axis_name="i", mesh=m)
    with pytest.raises(ValueError, match="`axis_name` 'j' is not an axis"):
        sx.partitioned_tridiagonal_solve(*sharded(m, (lo, d, up, r)), axis_name="j", mesh=m)


# ----------------------------------------------------------------- cyclic
@pytest.mark.parametrize("method", ["thomas", "lax"])
@pytest.mark.parametrize("dtype", [np.float64, np.complex128])
def test_cyclic_matches_dense(method, dtype):
    if method == "lax" and not lax_supports(np.dtype(dtype), 30):
        method = "auto"
    lo, d, up, r = system(30, (), (2,), dtype=dtype, seed=4)
    x = sx.cyclic_tridiagonal_solve(*(jnp.asarray(a) for a in (lo, d, up, r)), method=method)
    assert rel_err(x, solve_dense_tridiagonal(lo, d, up, r, cyclic=True)) < 1e-12


def test_cyclic_batched_grad():
    lo, d, up, r = system(12, (3,), (), seed=5)

    def dense_solve(lo, d, up, r):
        return solve_dense_tridiagonal(lo, d, up, r, cyclic=True)

    args = [jnp.asarray(a) for a in (lo, d, up, r)]
    x = sx.cyclic_tridiagonal_solve(*args)
    assert rel_err(x, dense_solve(*args)) < 1e-12
    g = jax.grad(lambda *a: jnp.sum(sx.cyclic_tridiagonal_solve(*a) ** 2),
                 argnums=(0, 1, 2, 3))(*args)
    g_ref = jax.grad(lambda *a: jnp.sum(dense_solve(*a) ** 2), argnums=(0, 1, 2, 3))(*args)
    for a, b in zip(g, g_ref):
        assert rel_err(a, b) < 1e-10


def test_cyclic_bad_input():
    o = jnp.ones(2)
    with pytest.raises(ValueError, match="needs n >= 3"):
        sx.cyclic_tridiagonal_solve(o, 4 * o, o, o)
