"""Block-tridiagonal and banded solves against dense and SciPy references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.linalg as sl
from helpers import mesh, put, rel_err
from jax.sharding import PartitionSpec as P

import solvax as sx

# The solves jitted once per shape: called eagerly, their elimination runs op
# by op (each op compiled on first use), which cost most of this file's time.
block_solve = jax.jit(sx.block_tridiagonal_solve)
banded = jax.jit(sx.banded_solve, static_argnames=("lower_bandwidth", "upper_bandwidth",
                                                   "periodic"))


def blocks(n, m, seed=0, dtype=np.float64, dominance=3.0):
    """Random block-diagonally dominant blocks `(lower, diag, upper)` of `(n, m, m)`."""
    rng = np.random.default_rng(seed)

    def draw():
        a = rng.standard_normal((n, m, m))
        if np.issubdtype(dtype, np.complexfloating):
            a = a + 1j * rng.standard_normal((n, m, m))
        return a.astype(dtype)

    lower, diag, upper = draw(), draw(), draw()
    diag = diag + dominance * m * np.eye(m, dtype=dtype)
    return lower, diag, upper


def dense(lower, diag, upper):
    """The dense matrix (differentiable); `lower[0]` and `upper[-1]` unused."""
    n, m = diag.shape[:2]
    below = jnp.eye(n, k=-1, dtype=diag.dtype)
    above = jnp.eye(n, k=1, dtype=diag.dtype)
    A = (jnp.einsum("ij,iab->iajb", below, lower) + jnp.einsum("ij,iab->iajb",
                                                               jnp.eye(n, dtype=diag.dtype),
                                                               diag)
         + jnp.einsum("ij,iab->iajb", above, upper))
    return A.reshape(n * m, n * m)


def dense_solve(lower, diag, upper, rhs):
    n, m = diag.shape[:2]
    r = rhs.reshape(n * m, -1)
    return jnp.linalg.solve(dense(lower, diag, upper), r).reshape(rhs.shape)


@pytest.mark.parametrize("dtype,m,rhs_tail", [
    (np.float64, 1, (3,)), (np.float64, 5, (2, 2)), (np.complex128, 2, ()),
    (np.complex128, 5, (3,)), (np.float32, 2, (2,)), (np.complex64, 3, ())])
def test_matches_dense(dtype, m, rhs_tail):
    n = 9
    lower, diag, upper = blocks(n, m, dtype=dtype)
    rhs = np.random.default_rng(1).standard_normal((n, m, *rhs_tail)).astype(dtype)
    x = block_solve(lower, diag, upper, rhs)
    assert x.shape == rhs.shape and x.dtype == dtype
    single = np.dtype(dtype) in (np.float32, np.complex64)
    ref = dense_solve(*(a.astype(np.complex128) for a in (lower, diag, upper, rhs)))
    assert rel_err(x, ref) < (1e-5 if single else 1e-13)


def test_unused_blocks_are_unused():
    lower, diag, upper = blocks(6, 3)
    rhs = np.ones((6, 3))
    x = block_solve(lower, diag, upper, rhs)
    lower[0], upper[-1] = np.nan, np.inf
    y = block_solve(lower, diag, upper, rhs)
    assert np.array_equal(np.asarray(x), np.asarray(y))
    g = jax.grad(lambda lo, up: jnp.sum(block_solve(lo, diag, up, rhs) ** 2),
                 argnums=(0, 1))(*blocks(6, 3)[::2])
    assert np.all(np.asarray(g[0][0]) == 0) and np.all(np.asarray(g[1][-1]) == 0)


def test_needs_pivoting_within_a_block():
    """A pivot block with a zero (1, 1) entry: partial pivoting inside the block."""
    lower, diag, upper = blocks(5, 2, dominance=0.0)
    diag[:] = [[0.0, 4.0], [4.0, 1.0]]
    lower *= 0.1
    upper *= 0.1
    rhs = np.arange(10.0).reshape(5, 2)
    x = block_solve(lower, diag, upper, rhs)
    assert rel_err(x, dense_solve(lower, diag, upper, rhs)) < 1e-12


@pytest.mark.parametrize("dtype", [np.float64, np.complex128])
def test_gradients_match_dense(dtype):
    """Reverse mode (one solve with A^T from the same factors) and forward mode
    for all four inputs, against differentiating a dense solve."""
    n, m = 6, 3
    args = tuple(jnp.asarray(a) for a in blocks(n, m, seed=2, dtype=dtype)) + (
        jnp.asarray(np.random.default_rng(3).standard_normal((n, m, 2)).astype(dtype)),)

    def loss(solve):
        return lambda *a: jnp.sum(jnp.abs(solve(*a)) ** 2)

    g = jax.jit(jax.grad(loss(sx.block_tridiagonal_solve), argnums=(0, 1, 2, 3)))(*args)
    ref = jax.jit(jax.grad(loss(dense_solve), argnums=(0, 1, 2, 3)))(*args)
    for a, b in zip(g, ref):
        assert float(jnp.max(jnp.abs(a - b))) < 1e-10 * max(1.0, float(jnp.max(jnp.abs(b))))
    tangents = tuple(jnp.ones_like(a) for a in args)
    _, t = jax.jit(lambda a, t: jax.jvp(sx.block_tridiagonal_solve, a, t))(args, tangents)
    _, t_ref = jax.jvp(dense_solve, args, tangents)
    assert rel_err(t, t_ref) < 1e-10


def test_factor_once_solve_many():
    lower, diag, upper = blocks(8, 4, seed=4)
    f = sx.block_tridiagonal_factor(lower, diag, upper)
    assert isinstance(f, sx.BlockTridiagonalFactors)
    solve = jax.jit(sx.block_tridiagonal_solve_factored)
    for seed in range(3):
        rhs = np.random.default_rng(seed).standard_normal((8, 4))
        assert rel_err(solve(f, rhs), dense_solve(lower, diag, upper, rhs)) < 1e-13
    # differentiable through the factors to the blocks
    g = jax.jit(jax.grad(lambda d: jnp.sum(sx.block_tridiagonal_solve_factored(
        sx.block_tridiagonal_factor(lower, d, upper), jnp.ones((8, 4))))))(jnp.asarray(diag))
    g_ref = jax.grad(lambda d: jnp.sum(dense_solve(lower, d, upper, jnp.ones((8, 4)))))(
        jnp.asarray(diag))
    assert rel_err(g, g_ref) < 1e-10


def test_vmap_over_systems_and_jit():
    batch = [blocks(5, 2, seed=s) for s in range(4)]
    L, D, U = (jnp.stack([b[k] for b in batch]) for k in range(3))
    R = jnp.asarray(np.random.default_rng(5).standard_normal((4, 5, 2)))
    x = jax.jit(jax.vmap(sx.block_tridiagonal_solve))(L, D, U, R)
    ref = jnp.stack([dense_solve(L[i], D[i], U[i], R[i]) for i in range(4)])
    assert rel_err(x, ref) < 1e-13


def test_singular_pivot_block_gives_nonfinite():
    """What comes back for a singular pivot block (documented): Inf/NaN from
    that block on."""
    lower, diag, upper = blocks(4, 2)
    diag[2] = 0.0
    lower[2] = 0.0
    x = np.asarray(block_solve(lower, diag, upper, np.ones((4, 2))))
    assert not np.all(np.isfinite(x))


def test_bad_input():
    lower, diag, upper = blocks(4, 2)
    with pytest.raises(ValueError, match="same shape"):
        sx.block_tridiagonal_solve(lower[:3], diag, upper, np.ones((4, 2)))
    with pytest.raises(ValueError, match=r"shape \(n, m, m\)"):
        sx.block_tridiagonal_solve(lower[:, :, :1], diag[:, :, :1], upper[:, :, :1],
                                   np.ones((4, 2)))
    with pytest.raises(ValueError, match="`rhs` must have shape"):
        sx.block_tridiagonal_solve(lower, diag, upper, np.ones((3, 2)))
    with pytest.raises(TypeError):
        sx.block_tridiagonal_solve(lower, diag, upper, np.ones((4, 2), np.int32))
    with pytest.raises(TypeError, match="`factors` must come from"):
        sx.block_tridiagonal_solve_factored((lower, diag, upper), np.ones((4, 2)))


# ------------------------------------------------------------------- banded
@pytest.mark.parametrize("l,u,n", [(0, 0, 7), (1, 1, 1), (2, 3, 24), (3, 1, 7), (4, 0, 24)])
def test_banded_matches_scipy(l, u, n):
    rng = np.random.default_rng(l * 10 + u)
    ab = rng.standard_normal((l + u + 1, n))
    ab[u] += 3.0 * (l + u + 1)  # diagonally dominant
    b = rng.standard_normal((n, 2))
    x = banded(ab, b, lower_bandwidth=l, upper_bandwidth=u)
    assert rel_err(x, sl.solve_banded((l, u), ab, b)) < 1e-12


def test_banded_complex_and_gradient():
    rng = np.random.default_rng(9)
    n, l, u = 10, 2, 1
    ab = (rng.standard_normal((l + u + 1, n)) + 1j * rng.standard_normal((l + u + 1, n)))
    ab[u] += 8.0
    b = rng.standard_normal(n) + 0j
    x = banded(ab, b, lower_bandwidth=l, upper_bandwidth=u)
    assert rel_err(x, sl.solve_banded((l, u), ab, b)) < 1e-12

    def dense_of(ab):
        A = jnp.zeros((n, n), ab.dtype)
        for i in range(n):
            for j in range(max(0, i - l), min(n, i + u + 1)):
                A = A.at[i, j].set(ab[u + i - j, j])
        return A

    loss = lambda ab: jnp.sum(jnp.abs(banded(  # noqa: E731
        ab, b, lower_bandwidth=l, upper_bandwidth=u)) ** 2)
    ref = lambda ab: jnp.sum(jnp.abs(jnp.linalg.solve(dense_of(ab), b)) ** 2)  # noqa: E731
    g, g_ref = jax.jit(jax.grad(loss))(jnp.asarray(ab)), jax.grad(ref)(jnp.asarray(ab))
    # entries outside the matrix (ab[u + i - j, j] with i out of range) are unused: 0
    assert float(jnp.max(jnp.abs(g - g_ref))) < 1e-10


def test_banded_bad_input():
    with pytest.raises(ValueError, match=r"\(lower_bandwidth \+ upper_bandwidth \+ 1, n\)"):
        sx.banded_solve(np.ones((3, 5)), np.ones(5), lower_bandwidth=1, upper_bandwidth=2)
    with pytest.raises(ValueError, match="`rhs` must have shape"):
        sx.banded_solve(np.ones((3, 5)), np.ones(4), lower_bandwidth=1, upper_bandwidth=1)
    with pytest.raises(TypeError, match="`lower_bandwidth` must be a Python int"):
        sx.banded_solve(np.ones((3, 5)), np.ones(5), lower_bandwidth=1.0, upper_bandwidth=1)


def dense_cyclic(lower, diag, upper):
    n, m = diag.shape[:2]
    A = dense(lower, diag, upper)
    A = A.at[:m, (n - 1) * m:].set(lower[0])
    return A.at[(n - 1) * m:, :m].set(upper[-1])


@pytest.mark.parametrize("dtype", [np.float64, np.complex128])
def test_cyclic_matches_dense_and_differentiates(dtype):
    n, m = 7, 3
    lower, diag, upper = (jnp.asarray(a) for a in blocks(n, m, seed=8, dtype=dtype))
    rhs = jnp.asarray(np.random.default_rng(8).standard_normal((n, m, 2)).astype(dtype))
    x = jax.jit(sx.cyclic_block_tridiagonal_solve)(lower, diag, upper, rhs)
    ref = jnp.linalg.solve(dense_cyclic(lower, diag, upper), rhs.reshape(n * m, 2))
    assert rel_err(x, ref.reshape(n, m, 2)) < 1e-13

    def loss(solve):
        return lambda *a: jnp.sum(jnp.abs(solve(*a)) ** 2)

    def dense_solve_cyclic(lo, d, up, r):
        return jnp.linalg.solve(dense_cyclic(lo, d, up), r.reshape(n * m, -1))

    g = jax.jit(jax.grad(loss(sx.cyclic_block_tridiagonal_solve), argnums=(0, 1, 2, 3)))(
        lower, diag, upper, rhs)
    g_ref = jax.jit(jax.grad(loss(dense_solve_cyclic), argnums=(0, 1, 2, 3)))(
        lower, diag, upper, rhs)
    for a, b in zip(g, g_ref):
        assert rel_err(a, b) < 1e-10


def test_cyclic_needs_three_block_rows():
    with pytest.raises(ValueError, match="n >= 3"):
        sx.cyclic_block_tridiagonal_solve(*blocks(2, 2), np.ones((2, 2)))


# ----------------------------------------------- solve axis sharded (SPIKE)
@pytest.mark.parametrize("ndev,rhs_tail", [(2, ()), (8, (2,))])
def test_partitioned_matches_single_device(ndev, rhs_tail):
    """Accurate to 1e-12 against the single-device solve, gradients to 1e-10;
    one all-gather for the solve, two for its gradient (the counts for
    P = 2, 4, 8: tests/test_sharding.py)."""
    m8 = mesh(ndev)
    L, D, U = (jnp.asarray(a) for a in blocks(8 * ndev, 3, seed=ndev))
    r = jnp.asarray(np.random.default_rng(ndev).standard_normal((8 * ndev, 3, *rhs_tail)))
    args = [put(a, m8, "i") for a in (L, D, U, r)]

    def solve(*a):
        return sx.partitioned_block_tridiagonal_solve(*a, axis_name="i", mesh=m8)

    x = jax.jit(solve)(*args)
    assert x.shape == r.shape and x.sharding.spec[0] == "i"
    assert rel_err(x, jax.jit(sx.block_tridiagonal_solve)(L, D, U, r)) < 1e-12
    loss = lambda *a: jnp.sum(solve(*a) ** 2)  # noqa: E731
    assert sx.count_collectives(solve, *args).by_kind == {"all-gather": 1}
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
    assert sx.count_collectives(grad, *args).by_kind == {"all-gather": 2}
    g = grad(*args)
    g_ref = jax.jit(jax.grad(lambda *a: jnp.sum(block_solve(*a) ** 2),
                             argnums=(0, 1, 2, 3)))(L, D, U, r)
    for a, b in zip(g, g_ref):
        assert rel_err(a, b) < 1e-10


def test_partitioned_bytes_do_not_grow_with_n():
    m8 = mesh(4)
    sizes = {}
    for n in (16, 64):
        L, D, U = (put(jnp.asarray(a), m8, "i") for a in blocks(n, 2))
        r = put(jnp.ones((n, 2)), m8, "i")
        report = sx.count_collectives(lambda *a: sx.partitioned_block_tridiagonal_solve(
            *a, axis_name="i", mesh=m8), L, D, U, r)
        sizes[n] = report.bytes_by_kind["all-gather"]
    assert sizes[16] == sizes[64]


def test_partitioned_inside_shard_map_and_complex():
    m8 = mesh(4)
    L, D, U = (jnp.asarray(a) for a in blocks(16, 2, seed=3, dtype=np.complex128))
    r = jnp.asarray(np.random.default_rng(3).standard_normal((16, 2)) + 0j)
    f = sx.shard_map(lambda *a: sx.partitioned_block_tridiagonal_solve(*a, axis_name="i"),
                     mesh=m8, in_specs=(P("i"),) * 4, out_specs=P("i"))
    x = jax.jit(f)(L, D, U, r)
    assert rel_err(x, dense_solve(L, D, U, r)) < 1e-12


def test_partitioned_bad_input():
    m8 = mesh(4)
    L, D, U = blocks(10, 2)
    with pytest.raises(ValueError, match="not divisible"):
        sx.partitioned_block_tridiagonal_solve(L, D, U, np.ones((10, 2)), axis_name="i",
                                               mesh=m8)
    L, D, U = blocks(4, 2)
    with pytest.raises(ValueError, match="at least 2 block rows"):
        sx.partitioned_block_tridiagonal_solve(L, D, U, np.ones((4, 2)), axis_name="i",
                                               mesh=m8)
    with pytest.raises(ValueError, match="not an axis of the mesh"):
        sx.partitioned_block_tridiagonal_solve(L, D, U, np.ones((4, 2)), axis_name="j",
                                               mesh=m8)
    with pytest.raises(ValueError, match="`rhs` must have shape"):
        sx.partitioned_block_tridiagonal_solve(L, D, U, np.ones((4, 3)), axis_name="i",
                                               mesh=m8)


@pytest.mark.parametrize("l,u,n", [(1, 1, 9), (2, 1, 12)])
def test_periodic_banded_matches_dense(l, u, n):
    rng = np.random.default_rng(n)
    ab = rng.standard_normal((l + u + 1, n))
    ab[u] += 3.0 * (l + u + 1)
    A = np.zeros((n, n))
    for i in range(n):
        for d in range(-l, u + 1):
            A[i, (i + d) % n] += ab[u - d, (i + d) % n]
    b = rng.standard_normal(n)
    def solve(ab):
        return banded(ab, b, lower_bandwidth=l, upper_bandwidth=u, periodic=True)

    x, g = jax.jit(lambda ab: (solve(ab), jax.grad(lambda ab: jnp.sum(solve(ab) ** 2))(ab)))(
        jnp.asarray(ab))
    assert rel_err(x, np.linalg.solve(A, b)) < 1e-12
    assert np.all(np.isfinite(np.asarray(g)))
    with pytest.raises(ValueError, match="multiple of"):
        banded(np.ones((5, 7)), np.ones(7), lower_bandwidth=2, upper_bandwidth=2,
                        periodic=True)
