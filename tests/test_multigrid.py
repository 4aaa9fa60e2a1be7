"""Geometric multigrid: the hierarchy against dense references (restriction
the transpose of prolongation, coarse operators the Galerkin products), the
cycle symmetric positive definite, iteration counts that do not grow with the
grid, every Krylov method preconditioned by it, sharded grids (halos and the
coarsest grid only, no all-reduce in a cycle), derivatives, batches, float32,
bad input."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import all_equations
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from matrix import sample

import solvax as sx
from solvax._accounting.counter import analyze_hlo
from solvax._grid import multigrid as mg_package
from solvax._grid.multigrid.cycle import Multigrid


def matrix_of(fn, shape):
    n = int(np.prod(shape))
    eye = jnp.eye(n).reshape(n, *shape)
    return np.asarray(jax.jit(jax.vmap(fn))(eye)).reshape(n, -1).T   # one program, not op by op


def field(shape, seed=0):
    return jnp.asarray(np.exp(np.random.default_rng(seed).standard_normal(shape)))


def assert_galerkin(mg):
    """Level by level, the coarse operator is `P^T A P` with `P` the level's
    prolongation and `P^T` its restriction (as dense matrices)."""
    for fine, coarse in zip(mg.levels, mg.levels[1:]):
        Pm = matrix_of(fine.transfer.prolong, coarse.op.shape)
        Rm = matrix_of(fine.transfer.restrict, fine.op.shape)
        np.testing.assert_allclose(Rm, Pm.T, atol=1e-14)
        galerkin = Pm.T @ matrix_of(fine.op, fine.op.shape) @ Pm
        np.testing.assert_allclose(matrix_of(coarse.op, coarse.op.shape), galerkin, atol=1e-12)


@pytest.mark.parametrize("shape, boundary, one_device", [
    ((9, 6), ("neumann", "periodic"), False),
    ((4, 7, 3), ("periodic", "neumann", "dirichlet"), False),
    ((9, 6), ("neumann", "periodic"), True),
])
def test_galerkin_of_a_general_stencil(shape, boundary, one_device):
    """A nonsymmetric 9- or 27-point stencil with entries pointing out of the
    grid at every edge (a Neumann edge folds them in; a Dirichlet one drops
    them), odd sizes, and a periodic axis of 2 coarse points (where the
    offsets -1 and +1 are the same neighbour); on one device too (`shards`
    all 1: each axis product's inputs computed into memory first)."""
    rng = np.random.default_rng(3)
    entries = {o: jnp.asarray(rng.standard_normal(shape))
               for o in itertools.product((-1, 0, 1), repeat=len(shape))}
    entries[(0,) * len(shape)] = entries[(0,) * len(shape)] + 30.0
    A = sx.stencil_operator(entries, boundary=boundary)
    shards = (1,) * len(shape) if one_device else None
    mg = sx.multigrid(A, coarse_size=2, semicoarsening=1e-12, shards=shards)
    assert 2 in [lv.op.shape[0] for lv in mg.levels]
    assert_galerkin(mg)


@pytest.mark.parametrize("shape, boundary", [
    ((9, 6), ("dirichlet", "periodic")),
    ((7, 5, 4), ("neumann", "dirichlet", "dirichlet")),
])
def test_hierarchy_is_galerkin_and_the_cycle_is_spd(shape, boundary):
    """Level by level, the coarse operator is `P^T A P` with `P` the level's
    prolongation (as dense matrices), and the whole cycle is a symmetric
    positive-definite matrix: odd and even sizes, every boundary kind."""
    A = sx.diffusion_operator(field(shape), boundary=boundary, shift=0.05)
    mg = sx.multigrid(A, coarse_size=4)
    assert len(mg.levels) >= 3
    assert_galerkin(mg)
    M = matrix_of(mg, shape)
    np.testing.assert_allclose(M, M.T, atol=1e-12)
    assert np.linalg.eigvalsh(M).min() > 0


@pytest.mark.parametrize("smoother, cycle", [("jacobi", "V"), ("chebyshev", "W")])
def test_iterations_do_not_grow_with_the_grid(smoother, cycle):
    counts = []
    for shape in [(16, 16), (64, 64), (97, 60)]:
        A = sx.diffusion_operator(1.0, shape=shape)
        b = jnp.asarray(np.random.default_rng(1).standard_normal(shape))
        mg = sx.multigrid(A, smoother=smoother, cycle=cycle)
        sol = jax.jit(lambda m, b, A=A: sx.pcg(A, b, precond=m, rtol=1e-8))(mg, b)
        assert int(sol.status) == sx.Status.CONVERGED
        assert float(jnp.linalg.norm(b - A(sol.x)) / jnp.linalg.norm(b)) < 1e-8
        counts.append(int(sol.iterations))
    assert max(counts) <= 10 and max(counts) - min(counts) <= 2, counts


@pytest.mark.parametrize("smoother, cycle, coarse", sample(
    "test_every_registered_smoother_cycle_and_coarse_treatment",
    smoother=list(mg_package.SMOOTHERS), cycle=list(mg_package.CYCLES),
    coarse=list(mg_package.COARSE)))
def test_every_registered_smoother_cycle_and_coarse_treatment(smoother, cycle, coarse):
    """Every combination the registries offer (pairwise sampled): a symmetric
    cycle is SPD and preconditions CG, an F-cycle GMRES, in a handful of
    iterations on a jumping coefficient field."""
    shape = (16, 16)
    A = sx.diffusion_operator(field(shape))
    b = jnp.asarray(np.random.default_rng(3).standard_normal(shape))
    mg = sx.multigrid(A, smoother=smoother, cycle=cycle, coarse=coarse, coarse_size=16)
    assert mg.coarse == coarse and mg.smoother == smoother
    if cycle != "F":
        M = matrix_of(mg, shape)
        np.testing.assert_allclose(M, M.T, atol=1e-10 * np.abs(M).max())
        assert np.linalg.eigvalsh(M).min() > 0
    solve = sx.gmres if cycle == "F" else sx.pcg
    sol = jax.jit(lambda m: solve(A, b, precond=m, rtol=1e-8))(mg)
    assert int(sol.status) == sx.Status.CONVERGED and int(sol.iterations) <= 14
    assert float(jnp.linalg.norm(b - A(sol.x)) / jnp.linalg.norm(b)) < 1e-8


def test_a_registered_smoother_is_one_function(monkeypatch):
    """A smoother is one function plus its registry entry: `multigrid` accepts
    the new name and the cycle runs it (here Richardson's iteration damped by
    `1 / lambda_max`, every step of it counted)."""
    calls = []

    def richardson(level, x, r, *, steps, lower, post):
        calls.append(post)
        omega = 1 / level.lmax.astype(jnp.abs(r).dtype)
        for _ in range(steps):
            x = omega * mg_package.levels.dinv(level.op, r) if x is None else (
                x + omega * mg_package.levels.dinv(level.op, r - level.op(x)))
        return x

    monkeypatch.setitem(mg_package.SMOOTHERS, "richardson", richardson)
    A = sx.diffusion_operator(field((32, 32)))
    b = jnp.asarray(np.random.default_rng(4).standard_normal((32, 32)))
    mg = sx.multigrid(A, smoother="richardson", steps=3)
    sol = sx.pcg(A, b, precond=mg, rtol=1e-8)
    assert int(sol.status) == sx.Status.CONVERGED and int(sol.iterations) <= 30
    assert calls and calls.count(False) == calls.count(True)   # pre- and post-smoothing
    with pytest.raises(ValueError, match="smoother"):
        sx.multigrid(A, smoother="sor")


def test_jumps_and_anisotropy():
    """Coefficients jumping by 1e4 (operator-dependent interpolation) and
    k = (1e-3, 1) (semicoarsening: the weak axis is kept until the strong one
    has been coarsened enough)."""
    shape = (48, 40)
    g = np.meshgrid(*[np.arange(n) / n for n in shape], indexing="ij")
    jumps = jnp.asarray(np.where((np.floor(4 * g[0]) + np.floor(4 * g[1])) % 2, 1e4, 1.0))
    b = jnp.asarray(np.random.default_rng(2).standard_normal(shape))
    for A, limit in [(sx.diffusion_operator(jumps), 12), (sx.diffusion_operator((1e-3, 1.0),
                                                                               shape=shape), 10)]:
        mg = sx.multigrid(A)        # concrete coefficients: semicoarsening where anisotropic
        sol = jax.jit(lambda m, A=A: sx.pcg(A, b, precond=m, rtol=1e-8))(mg)
        assert int(sol.status) == sx.Status.CONVERGED and int(sol.iterations) <= limit
    assert mg.shapes[1] == (48, 20)                  # only the strong axis coarsened first


def upwind(n, strength):
    ch = strength / (n + 1)
    return sx.stencil_operator({(0, 0): 4.0 + ch, (-1, 0): -1.0 - ch, (1, 0): -1.0,
                                (0, 1): -1.0, (0, -1): -1.0}, shape=(n, n))


@pytest.mark.parametrize("solver", [sx.gmres, sx.bicgstab, sx.idrs, sx.minres])
def test_preconditions_every_krylov_method(solver):
    """Nonsymmetric upwind convection-diffusion for GMRES, BiCGStab and
    IDR(s); the symmetric Poisson problem for MINRES."""
    n = 40
    A = upwind(n, 10.0) if solver is not sx.minres else sx.diffusion_operator(1.0, shape=(n, n))
    b = jnp.asarray(np.random.default_rng(3).standard_normal((n, n)))
    sol = jax.jit(lambda b: solver(A, b, precond=sx.multigrid(A), rtol=1e-8))(b)
    assert int(sol.status) == sx.Status.CONVERGED
    assert int(sol.iterations) <= 30
    assert float(jnp.linalg.norm(b - A(sol.x)) / jnp.linalg.norm(b)) < 1e-7


@pytest.mark.parametrize("mesh_shape, spec", [((8,), P("i", None)), ((2, 4), P("i", "j"))])
def test_sharded_cycle_communicates_halos_and_the_coarsest_grid(mesh_shape, spec):
    """On a grid sharded over one or two mesh axes: a cycle has no all-reduce,
    its all-gathers move at most the coarsest grid once per mesh axis, the
    MG-preconditioned CG iteration has the same all-reduces as Jacobi-CG, the
    solution keeps the sharding, and the iterations match one device."""
    mesh = Mesh(np.array(jax.devices()).reshape(mesh_shape), ("i", "j")[:len(mesh_shape)])
    shape = (64, 64)
    sharding = NamedSharding(mesh, spec)
    k = jax.device_put(field(shape), sharding)
    b = jax.device_put(jnp.asarray(np.random.default_rng(4).standard_normal(shape)), sharding)
    mg = sx.multigrid(sx.diffusion_operator(k))
    cycle = sx.count_collectives(lambda m, r: m(r), mg, b)
    assert cycle.count("all-reduce") == 0, str(cycle)
    coarsest = int(np.prod(mg.shapes[-1])) * 8
    gathers = [c for c in cycle.collectives if c.kind == "all-gather"]
    assert len(gathers) <= len(mesh_shape)
    assert all(c.bytes <= coarsest for c in gathers), str(cycle)
    assert set(cycle.by_kind) <= {"all-gather", "collective-permute"}

    def solve(k, b, precond):
        A = sx.diffusion_operator(k)
        return sx.pcg(A, b, precond=precond(A), rtol=1e-8)

    def in_loop(report, kind):
        return sum(c.kind == kind for c in report.collectives if c.loops)

    with_mg = sx.count_collectives(lambda k, b, m: solve(k, b, lambda A: m).x, k, b, mg)
    with_jacobi = sx.count_collectives(
        lambda k, b: solve(k, b, lambda A: sx.jacobi(A.diagonal())).x, k, b)
    assert in_loop(with_mg, "all-reduce") == in_loop(with_jacobi, "all-reduce")
    # the whole solve, set-up included: beyond halos and scalars, it moves the
    # coarsest grid (per cycle) and the coarsest operator's matrix (once, in
    # the set-up's dense inverse); no level's arrays (a strided slice in the
    # set-up all-reduced whole coarse grids on JAX 0.4.38)
    compiled = jax.jit(lambda k, b: solve(k, b, sx.multigrid)).lower(k, b).compile()
    text = compiled.as_text()
    whole = analyze_hlo(text)
    matrix = int(np.prod(mg.shapes[-1])) ** 2 * 8
    for c in whole.collectives:
        if c.kind != "collective-permute" and c.bytes > 64:
            where = next(line for line in text.splitlines() if f"%{c.name} = " in line)
            assert (c.bytes <= coarsest if c.loops else
                    c.bytes <= matrix and "dense_inverse" in where), (c, str(whole))
    assert set(whole.by_kind) <= {"all-gather", "all-reduce", "collective-permute"}
    sol = compiled(k, b)
    assert sol.x.sharding.is_equivalent_to(sharding, 2)
    one = jax.jit(lambda k, b: solve(k, b, sx.multigrid))(jnp.asarray(np.asarray(k)),
                                                          jnp.asarray(np.asarray(b)))
    assert abs(int(sol.iterations) - int(one.iterations)) <= 1


def test_gradients_batches_and_traced_set_up():
    """grad of a loss of `pcg(A(k), b, precond=multigrid(A(k)))` with respect
    to `b` and to `k` against a dense solve (set-up inside the traced
    function), and `vmap` over right-hand sides."""
    shape = (10, 9)
    k0, b0 = field(shape, 5), jnp.asarray(np.random.default_rng(6).standard_normal(shape))
    w = jnp.asarray(np.random.default_rng(7).standard_normal(shape))

    def loss(k, b):
        A = sx.diffusion_operator(k)
        return jnp.sum(w * sx.pcg(A, b, precond=sx.multigrid(A, coarse_size=4), rtol=1e-13).x)

    def reference(k, b):
        n = b.size
        M = jax.vmap(sx.diffusion_operator(k))(jnp.eye(n).reshape(n, *shape)).reshape(n, n).T
        return jnp.sum(w.ravel() * jnp.linalg.solve(M, b.ravel()))

    got = jax.jit(jax.grad(loss, argnums=(0, 1)))(k0, b0)
    want = jax.grad(reference, argnums=(0, 1))(k0, b0)
    for g, r in zip(got, want):
        assert float(jnp.max(jnp.abs(g - r)) / jnp.max(jnp.abs(r))) < 1e-8
    A = sx.diffusion_operator(k0)
    mg = sx.multigrid(A)
    B = jnp.asarray(np.random.default_rng(8).standard_normal((3, *shape)))
    X = jax.jit(jax.vmap(lambda b: sx.pcg(A, b, precond=mg, rtol=1e-10).x))(B)
    assert float(jnp.max(jnp.abs(jax.vmap(A)(X) - B))) < 1e-8


def test_float32_default_tolerance():
    A = sx.diffusion_operator(jnp.float32(1.0), shape=(40, 33))
    b = jnp.asarray(np.random.default_rng(9).standard_normal((40, 33)), jnp.float32)
    sol = jax.jit(lambda b: sx.pcg(A, b, precond=sx.multigrid(A)))(b)
    assert sol.x.dtype == jnp.float32 and int(sol.status) == sx.Status.CONVERGED
    assert int(sol.iterations) <= 8


def test_a_float32_cycle_preconditions_a_float64_solve():
    """`dtype=float32`: the hierarchy and cycle in single precision, the solve
    and its convergence test in double; CG and GMRES reach double-precision
    tolerances (far below float32's) in at most one more iteration than
    with the float64 cycle, and the true residual meets them."""
    k = jnp.asarray(np.exp(2 * np.random.default_rng(12).standard_normal((21, 32))))
    A = sx.diffusion_operator(k, boundary=("dirichlet", "neumann"), shift=1e-3)
    b = jnp.asarray(np.random.default_rng(13).standard_normal((21, 32)))
    single, double = sx.multigrid(A, dtype=jnp.float32), sx.multigrid(A)
    assert single.levels[-1].op.entries[(0, 0)].dtype == jnp.float32
    for solver, rtol in ((sx.pcg, 1e-11), (sx.gmres, 1e-10)):
        solve = jax.jit(lambda mg, solver=solver, rtol=rtol: solver(A, b, precond=mg, rtol=rtol,
                                                                     atol=0.0))
        sol, ref = solve(single), solve(double)
        assert int(sol.status) == sx.Status.CONVERGED and sol.x.dtype == jnp.float64
        assert float(jnp.linalg.norm(b - A(sol.x)) / jnp.linalg.norm(b)) <= 1.5 * rtol
        assert int(sol.iterations) <= int(ref.iterations) + 1


def test_a_float32_coarsest_level_keeps_its_smooth_modes():
    """The dense coarsest level's pseudo-inverse cuts singular values below
    `CUTOFF eps` times the largest, whatever its size. With NumPy's `10 n
    eps` a float32 coarsest level of 1024 points lost its smoothest modes,
    the ones a coarse correction is for: float32 MG-CG on a log-normal field
    took 59 iterations where the float64 hierarchy takes 7. Off the
    multigrid, at the nearest sizes: a float32 matrix of 256 points with
    singular values from 1 to 1e-4 is inverted to float32's accuracy, and a
    singular one (rank 255) keeps its null space out."""
    from solvax._core import dense

    rng = np.random.default_rng(1)
    k, b = np.exp(2 * rng.standard_normal((64, 64))), rng.standard_normal((64, 64))
    its = {}
    for dtype in (jnp.float32, jnp.float64):
        A = sx.diffusion_operator(jnp.asarray(k, dtype))
        sol = sx.pcg(A, jnp.asarray(b, dtype), rtol=1e-4,
                     precond=sx.multigrid(A, coarse="direct", coarse_size=1024))
        assert sol.converged, sol.message
        its[dtype] = int(sol.iterations)
    assert its[jnp.float32] <= its[jnp.float64] + 1, its
    q = np.linalg.qr(rng.standard_normal((256, 256)))[0]
    for values in (np.logspace(0, -4, 256), np.r_[np.logspace(0, -3, 255), 0]):
        a = (q * values) @ q.T
        x = np.asarray(dense.pinv(jnp.asarray(a, jnp.float32)), np.float64)
        kept = values > 0
        want = (q[:, kept] / values[kept]) @ q[:, kept].T
        assert np.linalg.norm(x - want) / np.linalg.norm(want) < 1e-3


def test_a_hierarchy_stored_in_half_precision():
    """`storage_dtype`: every level's coefficients and weights stored in
    bfloat16 or float16, the cycle computing in float32 and staying SPD (CG
    converges to double-precision tolerances in at most one more iteration
    than with float32 storage); a float64 storage wider than the float32
    cycle is refused, and float32 (the nearest valid) accepted. A
    bfloat16-stored operator applied to float32 vectors computes in float32."""
    k = jnp.asarray(10.0 ** (3 * np.random.default_rng(14).random((12, 12, 12))))
    A = sx.diffusion_operator(k)
    b = jnp.asarray(np.random.default_rng(15).standard_normal((12, 12, 12)))
    solve = jax.jit(lambda mg: sx.pcg(A, b, precond=mg, rtol=1e-10, atol=0.0))
    ref = solve(sx.multigrid(A, dtype=jnp.float32, storage_dtype=jnp.float32))
    for storage in (jnp.bfloat16, jnp.float16):
        mg = sx.multigrid(A, dtype=jnp.float32, storage_dtype=storage)
        assert all(c.dtype == storage for lv in mg.levels for c in lv.op.stored.values())
        assert mg(b.astype(jnp.float32)).dtype == jnp.float32
        sol = solve(mg)
        assert int(sol.status) == sx.Status.CONVERGED, sx.Status(int(sol.status)).name
        assert float(jnp.linalg.norm(b - A(sol.x)) / jnp.linalg.norm(b)) <= 1e-10
        assert int(sol.iterations) <= int(ref.iterations) + 1
    with pytest.raises(TypeError, match="storage_dtype"):
        sx.multigrid(A, dtype=jnp.float32, storage_dtype=jnp.float64)
    with pytest.raises(TypeError, match="storage_dtype"):
        sx.multigrid(A, storage_dtype=jnp.int8)
    # float16 cannot hold coefficients past 65504; bfloat16 (float32's range) can
    steep = sx.diffusion_operator(k, spacing=1e-3)
    with pytest.raises(ValueError, match="cannot hold.*bfloat16"):
        sx.multigrid(steep, dtype=jnp.float32, storage_dtype=jnp.float16)
    assert sx.multigrid(steep, dtype=jnp.float32, storage_dtype=jnp.bfloat16)
    half = A.astype(jnp.bfloat16)
    x = b.astype(jnp.float32)
    assert half(x).dtype == jnp.float32
    assert float(jnp.max(jnp.abs(half(x) - A(b))) / jnp.max(jnp.abs(A(b)))) < 1e-2


def test_an_indefinite_operator_is_not_reported_solved():
    """A shift that makes the operator indefinite: CG with the cycle never
    returns CONVERGED with a residual that misses the tolerance."""
    A = sx.diffusion_operator(1.0, shape=(24, 24), shift=-0.5)
    b = jnp.asarray(np.random.default_rng(10).standard_normal((24, 24)))
    sol = jax.jit(lambda b: sx.pcg(A, b, precond=sx.multigrid(A), rtol=1e-8))(b)
    residual = float(jnp.linalg.norm(b - A(sol.x)) / jnp.linalg.norm(b))
    assert int(sol.status) != sx.Status.CONVERGED or residual <= 1.1e-8


def test_bad_input_names_the_argument():
    A = sx.diffusion_operator(1.0, shape=(8, 8))
    with pytest.raises(TypeError, match="`operator` must be a StencilOperator"):
        sx.multigrid(lambda x: 2 * x)
    wide = sx.stencil_operator({(0,): 2.0, (2,): -1.0}, shape=(9,))
    with pytest.raises(ValueError, match="within one point"):
        sx.multigrid(wide)
    with pytest.raises(ValueError, match="`cycle`"):
        sx.multigrid(A, cycle="K")
    with pytest.raises(ValueError, match="`smoother`"):
        sx.multigrid(A, smoother="gauss-seidel")
    with pytest.raises(ValueError, match="`steps`"):
        sx.multigrid(A, steps=0)
    with pytest.raises(ValueError, match="`semicoarsening`"):
        sx.multigrid(A, semicoarsening=0.0)
    with pytest.raises(ValueError, match="`chebyshev_lower`"):
        sx.multigrid(A, chebyshev_lower=1.0)
    with pytest.raises(ValueError, match="`shards`"):
        sx.multigrid(A, shards=(8,))
    with pytest.raises(TypeError, match="float32 or wider.*storage_dtype=jnp.bfloat16"):
        sx.multigrid(sx.diffusion_operator(jnp.ones((8, 8), jnp.bfloat16)))
    for bad in (jnp.int32, jnp.float16, jnp.complex64, "fp32"):
        with pytest.raises(TypeError, match="`dtype` must be None"):
            sx.multigrid(A, dtype=bad)
    with pytest.raises(ValueError, match="grid's shape"):
        sx.multigrid(A)(jnp.ones((8, 9)))
    with pytest.raises(ValueError, match="`coarse`"):
        sx.multigrid(A, coarse="gather")
    with pytest.raises(ValueError, match="`interpolation`"):
        sx.multigrid(A, interpolation="bilinear")
    with pytest.raises(ValueError, match="`coarse_degree`"):
        sx.multigrid(A, coarse="chebyshev", coarse_degree=0)
    # the valid inputs nearest to those: a 1-D three-point stencil, one
    # smoothing step, every axis coarsened, a W-cycle
    one_d = sx.stencil_operator({(0,): 2.0, (1,): -1.0, (-1,): -1.0}, shape=(33,))
    mg = sx.multigrid(one_d, steps=1, semicoarsening=1.0, cycle="W", smoother="chebyshev",
                      shards=(4,), dtype="float32")
    assert min(n for (n,) in mg.shapes) >= 4
    assert mg.levels[0].op.diagonal().dtype == jnp.float32 and mg(jnp.ones(33)).dtype == jnp.float64
    sol = sx.pcg(one_d, jnp.ones(33), precond=mg, rtol=1e-10)
    assert int(sol.status) == sx.Status.CONVERGED
    # and a coarsest level smoothed by a polynomial of the least degree
    smoothed = sx.multigrid(one_d, coarse="chebyshev", coarse_degree=1)
    assert smoothed.coarse == "chebyshev" and smoothed.coarse_inverse is None
    sol = sx.pcg(one_d, jnp.ones(33), precond=smoothed, rtol=1e-10)
    assert int(sol.status) == sx.Status.CONVERGED


def test_a_chebyshev_coarsest_level_keeps_the_cycle_spd():
    """`coarse="chebyshev"`: the coarsest level smoothed by a fixed polynomial
    instead of solved; the cycle is still a symmetric positive-definite
    matrix, and CG converges in at most two more iterations than with the
    direct coarse solve (a coefficient field jumping by 1e4 on blocks)."""
    shape = (6, 5, 4)
    k = jnp.where(jnp.asarray(np.indices(shape).sum(0) // 3 % 2 == 0), 1e4, 1.0)
    A = sx.diffusion_operator(k, shift=0.01)
    smoothed = sx.multigrid(A, coarse="chebyshev", coarse_size=16)
    assert smoothed.shapes[-1] != shape and smoothed.coarse == "chebyshev"
    M = matrix_of(smoothed, shape)
    np.testing.assert_allclose(M, M.T, atol=1e-10 * np.abs(M).max())
    assert np.linalg.eigvalsh(M).min() > 0
    b = jnp.asarray(np.random.default_rng(4).standard_normal(shape))
    solve = jax.jit(lambda m, b: sx.pcg(A, b, precond=m, rtol=1e-10))
    direct, chebyshev = (solve(m, b) for m in (sx.multigrid(A, coarse_size=16), smoothed))
    assert bool(chebyshev.converged) and bool(direct.converged)
    assert int(chebyshev.iterations) <= int(direct.iterations) + 2


def test_inside_shard_map_with_axis_names():
    """The operator and the hierarchy built from one block per device inside
    `shard_map` (halos by ppermute, the coarsest grid gathered), on a 2 x 4
    mesh with Neumann and periodic axes: the solve and its gradient with
    respect to `k` match the whole-grid solve, and a cycle has no all-reduce."""
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("i", "j"))
    spec, shape, boundary = P("i", "j"), (16, 24), ("neumann", "periodic")
    k, b = field(shape, 11), jnp.asarray(np.random.default_rng(12).standard_normal(shape))

    def local(k, b):
        A = sx.diffusion_operator(k, boundary=boundary, shift=0.1, axis_names=("i", "j"))
        mg = sx.multigrid(A)
        sol = sx.pcg(A, b, precond=mg, rtol=1e-10, axis_name=("i", "j"))
        return sol.x, sol.iterations

    run = jax.jit(sx.shard_map(local, mesh=mesh, in_specs=(spec, spec), out_specs=(spec, P())))
    x, iterations = run(k, b)
    A = sx.diffusion_operator(k, boundary=boundary, shift=0.1)
    whole = jax.jit(lambda mg: sx.pcg(A, b, precond=mg, rtol=1e-10))(
        sx.multigrid(A, shards=(2, 4)))
    assert float(jnp.max(jnp.abs(x - whole.x))) < 1e-8
    assert abs(int(iterations) - int(whole.iterations)) <= 1
    grad = jax.jit(jax.grad(lambda k: jnp.sum(run(k, b)[0] ** 2)))(k)
    want = jax.jit(jax.grad(lambda k: jnp.sum(sx.pcg(sx.diffusion_operator(
        k, boundary=boundary, shift=0.1), b, rtol=1e-12).x ** 2)))(k)
    assert float(jnp.max(jnp.abs(grad - want)) / jnp.max(jnp.abs(want))) < 1e-8

    def set_up_and(apply):
        def fn(k, r):
            A = sx.diffusion_operator(k, boundary=boundary, shift=0.1, axis_names=("i", "j"))
            mg = sx.multigrid(A)
            # without the cycle: every level's set-up kept live (its bounds)
            bounds = functools.reduce(jnp.multiply, [lv.lmax for lv in mg.levels])
            return mg(r) if apply else r * bounds * mg.coarse_inverse[0, 0]
        mapped = sx.shard_map(fn, mesh=mesh, in_specs=(spec, spec), out_specs=spec)
        return sx.count_collectives(mapped, k, b)

    # the cycle adds halos and the coarsest grid's gathers, and no all-reduce
    with_cycle, set_up = set_up_and(True), set_up_and(False)
    assert with_cycle.count("all-reduce") <= set_up.count("all-reduce"), str(with_cycle)
    assert with_cycle.count("all-gather") > set_up.count("all-gather"), str(with_cycle)
    assert set(with_cycle.by_kind) <= {"all-reduce", "all-gather", "collective-permute"}


def test_shard_map_axis_names_are_checked():
    with pytest.raises(ValueError, match="`axis_names`"):
        sx.diffusion_operator(1.0, shape=(8, 8), axis_names=("i",))
    assert sx.diffusion_operator(1.0, shape=(8, 8), axis_names=(None, None)).axis_names == (
        None, None)


def test_full_interpolation_is_galerkin_and_spd():
    """`interpolation="full"` (black-box: the points inside a coarse cell from
    the whole stencil) with `R A P` by probing: every coarse operator is the
    dense Galerkin product, the cycle (with multicolour Gauss-Seidel
    smoothing) is SPD: a periodic and a Neumann axis. The same hierarchy
    built for one device (each class's weights computed into memory first)."""
    shape, boundary = (12, 12), ("periodic", "neumann")
    A = sx.diffusion_operator(field(shape), boundary=boundary, shift=0.05)
    options = dict(coarse_size=36, interpolation="full", smoother="gauss_seidel", steps=1)
    mg = sx.multigrid(A, **options)
    assert mg.levels[0].transfer.full
    assert_galerkin(mg)
    alone = sx.multigrid(A, shards=(1, 1), **options)
    for a, b in zip(jax.tree_util.tree_leaves(mg), jax.tree_util.tree_leaves(alone)):
        np.testing.assert_allclose(a, b, rtol=1e-14, atol=0)
    M = matrix_of(mg, shape)
    np.testing.assert_allclose(M, M.T, atol=1e-12)
    assert np.linalg.eigvalsh(M).min() > 0


@pytest.mark.parametrize("shape, boundary", [((9, 7), ("dirichlet", "neumann")),
                                             ((5, 7, 3), ("neumann", "dirichlet", "dirichlet"))])
def test_full_interpolation_on_odd_grids_is_galerkin(shape, boundary):
    """The full interpolation's classes (computed at their own points and
    placed back) on odd axes, whose last point is even: `R = P^T` and the
    coarse operator is `P^T A P`, 2-D and 3-D (one level)."""
    A = sx.diffusion_operator(field(shape), boundary=boundary, shift=0.05)
    mg = sx.multigrid(A, max_levels=2, interpolation="full", coarse_size=4)
    assert mg.levels[0].transfer.full
    assert_galerkin(mg)


def test_full_interpolation_on_small_blocks():
    """On random blocks of 4 x 4 cells jumping by 1e4, CG takes fewer
    iterations with the full interpolation than with the collapsed one
    (both down to a 64-point coarsest level)."""
    rng = np.random.default_rng(0)
    k = jnp.asarray(np.kron(np.where(rng.random((16, 16)) < 0.5, 1e4, 1.0), np.ones((4, 4))))
    A = sx.diffusion_operator(k)
    b = jnp.asarray(rng.standard_normal(k.shape))
    solve = jax.jit(lambda m, b: sx.pcg(A, b, precond=m, rtol=1e-8))
    counts = {}
    for interpolation in ("collapsed", "full"):
        sol = solve(sx.multigrid(A, interpolation=interpolation, coarse="direct"), b)
        assert bool(sol.converged)
        counts[interpolation] = int(sol.iterations)
    assert counts["full"] < counts["collapsed"], counts


def _convection(shape, boundary):
    """A nonsymmetric 3^d-point stencil (diffusion plus upwind convection)."""
    A = sx.diffusion_operator(field(shape, 3), boundary=boundary, shift=0.1)
    entries = dict(A.entries)
    entries[(0,) * len(shape)] = entries[(0,) * len(shape)] + 0.5
    entries[(-1,) + (0,) * (len(shape) - 1)] = entries[(-1,) + (0,) * (len(shape) - 1)] - 0.5
    return sx.stencil_operator(entries, boundary=boundary)


@pytest.mark.parametrize("shape, boundary", [
    ((16, 12), "dirichlet"), ((12, 16), ("periodic", "neumann")),
    ((7, 6, 10), ("dirichlet", "periodic", "neumann"))])
def test_a_coarsest_level_solved_by_lines_is_exact(shape, boundary):
    """`coarse="lines"`: block LU along the longest non-periodic axis solves
    the coarsest level exactly (one level: the operator itself, a
    nonsymmetric one too), and inside a hierarchy the cycle is the one with
    the dense inverse (so SPD for an SPD operator)."""
    rng = np.random.default_rng(5)
    r = jnp.asarray(rng.standard_normal(shape))
    size = int(np.prod(shape))
    for op in (sx.diffusion_operator(field(shape), boundary=boundary, shift=0.1),
               _convection(shape, boundary)):
        lines = sx.multigrid(op, coarse="lines", coarse_size=size, max_levels=1)
        assert lines.coarse == "lines" and lines.shapes == [shape]
        z = lines(r)
        assert float(jnp.max(jnp.abs(op(z) - r))) < 1e-11 * float(jnp.max(jnp.abs(r)))
    A = sx.diffusion_operator(field(shape), boundary=boundary, shift=0.1)
    direct, lines = (sx.multigrid(A, coarse=c, coarse_size=24) for c in ("direct", "lines"))
    assert len(lines.shapes) > 1 and lines.shapes == direct.shapes
    np.testing.assert_allclose(lines(r), direct(r), rtol=1e-10, atol=1e-12)


def test_lines_stop_the_hierarchy_before_the_blocks_and_keep_it_robust():
    """Random blocks of 4 x 4 cells jumping by 1e4 on a 64^2 grid: with the
    coarsest level 32^2 solved by lines, CG needs at most half the
    iterations of the plain hierarchy down to 8^2 (which the default was
    before it read the coefficients, `test_multigrid_rule.py`). A singular coarsest
    level (pure Neumann) has no exact factorization: the solve either still
    meets its tolerance on the true residual or says it did not."""
    rng = np.random.default_rng(0)
    k = jnp.asarray(np.kron(np.where(rng.random((16, 16)) < 0.5, 1e4, 1.0), np.ones((4, 4))))
    A = sx.diffusion_operator(k)
    b = jnp.asarray(rng.standard_normal(k.shape))
    solve = jax.jit(lambda m, b: sx.pcg(A, b, precond=m, rtol=1e-8))
    plain, lines = (solve(m, b) for m in (
        sx.multigrid(A, interpolation="collapsed", coarse="direct"),
        sx.multigrid(A, coarse="lines", coarse_size=1024)))
    assert bool(plain.converged) and bool(lines.converged)
    assert 2 * int(lines.iterations) <= int(plain.iterations), (lines.iterations,
                                                                plain.iterations)
    neumann = sx.diffusion_operator(k, boundary="neumann")
    consistent = b - jnp.mean(b)
    sol = sx.pcg(neumann, consistent,
                 precond=sx.multigrid(neumann, coarse="lines", coarse_size=1024), rtol=1e-8)
    residual = float(jnp.linalg.norm(neumann(sol.x) - consistent) / jnp.linalg.norm(consistent))
    assert residual <= 1e-8 if bool(sol.converged) else int(sol.status) != sx.Status.CONVERGED


def test_a_sharded_grid_gathers_its_line_solved_coarsest_level_once_per_cycle():
    """On 8 devices (rows split): a cycle with a 32^2 coarsest level solved by
    lines has no all-reduce, one all-gather of the coarsest grid, the solve
    keeps the sharding and takes the iterations of one device; inside
    `shard_map` the solve matches the whole grid's."""
    mesh = Mesh(np.array(jax.devices()), ("i",))
    shape, sharding = (64, 64), NamedSharding(mesh, P("i", None))
    k = jax.device_put(field(shape), sharding)
    b = jax.device_put(jnp.asarray(np.random.default_rng(4).standard_normal(shape)), sharding)
    mg = sx.multigrid(sx.diffusion_operator(k), coarse="lines", coarse_size=1024)
    assert mg.shapes[-1] == (32, 32)
    cycle = sx.count_collectives(lambda m, r: m(r), mg, b)
    assert set(cycle.by_kind) <= {"all-gather", "collective-permute"}, str(cycle)
    assert cycle.count("all-gather") == 1

    def solve(k, b):
        A = sx.diffusion_operator(k)
        return sx.pcg(A, b, precond=sx.multigrid(A, coarse="lines", coarse_size=1024),
                      rtol=1e-10)

    # set-up inside the program: an iteration gathers the coarsest grid once
    # (never the factors) and all-reduces as Jacobi-CG does
    report = sx.count_collectives(lambda k, b: solve(k, b).x, k, b)
    assert report.step_count("all-gather") == 1 and report.step_count("all-reduce") == 2, (
        str(report))
    sol = jax.jit(solve)(k, b)
    assert bool(sol.converged) and sol.x.sharding.is_equivalent_to(sharding, 2)
    one = jax.jit(solve)(jnp.asarray(np.asarray(k)), jnp.asarray(np.asarray(b)))
    assert abs(int(sol.iterations) - int(one.iterations)) <= 1

    def local(k, b):
        A = sx.diffusion_operator(k, axis_names=("i", None))
        mg = sx.multigrid(A, coarse="lines", coarse_size=1024)
        return sx.pcg(A, b, precond=mg, rtol=1e-10, axis_name="i").x

    x = jax.jit(sx.shard_map(local, mesh=mesh, in_specs=(P("i", None),) * 2,
                             out_specs=P("i", None)))(k, b)
    assert float(jnp.max(jnp.abs(x - one.x))) < 1e-8


def test_coarse_lines_input_is_checked():
    periodic = sx.diffusion_operator(1.0, shape=(8, 8), boundary="periodic", shift=1.0)
    with pytest.raises(ValueError, match='every axis of this operator is periodic.*"direct"'):
        sx.multigrid(periodic, coarse="lines")
    A = sx.diffusion_operator(1.0, shape=(80, 80))
    with pytest.raises(ValueError, match='at most 4096 with `coarse="direct"`.*"lines"'):
        sx.multigrid(A, coarse="direct", coarse_size=5000)
    with pytest.raises(ValueError, match="at most 65536"):
        sx.multigrid(A, coarse="lines", coarse_size=70000)
    # the nearest valid inputs: one periodic axis, a large line-solved level,
    # the largest coarse size a dense inverse takes
    assert sx.multigrid(sx.diffusion_operator(1.0, shape=(8, 8), boundary=(
        "periodic", "dirichlet"), shift=1.0), coarse="lines").coarse == "lines"
    assert sx.multigrid(A, coarse="lines", coarse_size=6400).shapes == [(80, 80)]
    # `coarse="auto"` (the default): a size beyond a dense inverse asks for lines
    assert sx.multigrid(A, coarse_size=5000).coarse == "lines"
    assert sx.multigrid(sx.diffusion_operator(1.0, shape=(8, 8)), coarse_size=4096).shapes == [
        (8, 8)]


def _stencils_close(a, b):
    return all(np.allclose(np.broadcast_to(a.op.stored[o], a.op.shape),
                           np.broadcast_to(b.op.stored[o], b.op.shape), rtol=1e-12, atol=1e-12)
               for o in a.op.stored)


@pytest.mark.parametrize("options", [dict(smoother="gauss_seidel"), dict(cycle="F"),
                                     dict(dtype=jnp.float32, storage_dtype=jnp.bfloat16)])
def test_padded_coarse_levels_are_the_same_hierarchy(monkeypatch, options):
    # the coarse levels written once (a scanned body on padded grids) hold the
    # same operators as levels built one by one, and the cycle stays SPD;
    # small grids take the tail here by lowering its threshold
    from solvax._grid.multigrid import hierarchy as _multigrid
    k, b = field((64, 64)), jnp.asarray(np.random.default_rng(1).standard_normal((64, 64)))
    A = sx.diffusion_operator(k, boundary="neumann", shift=0.1)

    def build(fraction):
        monkeypatch.setattr(_multigrid, "_TAIL_FRACTION", fraction)
        make = jax.jit(lambda k: sx.multigrid(sx.diffusion_operator(k, boundary="neumann",
                                                                      shift=0.1),
                                              coarse_size=16, shards=(1, 1), **options))
        return make(k)

    padded, explicit = build(1), build(10 ** 9)
    assert padded.tail is not None and explicit.tail is None
    assert padded.tail.shapes == ((16, 16), (8, 8))    # 32^2 down to 8^2, cut after 32^2
    assert padded.shapes == explicit.shapes == [(64 // 2 ** j,) * 2 for j in range(5)]
    assert all(_stencils_close(p, e) for p, e in zip(padded.levels, explicit.levels))
    x, y = (jnp.asarray(np.random.default_rng(s).standard_normal((64, 64))) for s in (2, 3))
    apply = jax.jit(lambda mg, v: mg(v))
    tol = 1e-5 if "dtype" in options else 1e-12
    # the cycle on the tail (scans, or a loop over an F-cycle's moves) is the
    # recursion over the same levels cut out of the padding (which a W-cycle
    # runs)
    recursion = Multigrid(padded.levels, padded.coarse_solve, padded.cycle, padded.smoother,
                          padded.steps, padded.lower, padded.dtype)
    want = apply(recursion, x)
    np.testing.assert_allclose(apply(padded, x), want, atol=tol * float(jnp.abs(want).max()))
    if options.get("cycle") == "F":   # not symmetric: GMRES
        sol = jax.jit(lambda mg: sx.gmres(A, b, precond=mg, rtol=1e-10))(padded)
        assert int(sol.status) == 0 and int(sol.iterations) <= 12
        # a W-cycle on the same hierarchy (its levels cut out of the padding)
        # is symmetric and positive
        padded = Multigrid(padded.explicit, padded.coarse_solve, "W", padded.smoother,
                           padded.steps, padded.lower, padded.dtype, padded.tail)
    lhs, rhs = jnp.vdot(x, apply(padded, y)), jnp.vdot(apply(padded, x), y)
    assert abs(float(lhs - rhs)) <= tol * abs(float(lhs))
    assert float(jnp.vdot(x, apply(padded, x))) > 0
    if options.get("cycle") == "F":
        return
    solve = jax.jit(lambda mg: sx.pcg(A, b, precond=mg, rtol=1e-10))
    got, want = solve(padded), solve(explicit)
    assert int(got.status) == 0 and abs(int(got.iterations) - int(want.iterations)) <= 1
    assert float(jnp.linalg.norm(b - A(got.x)) / jnp.linalg.norm(b)) <= 1e-10


def _program_size(n: int, cycle: str) -> tuple:
    """`(levels, jaxpr equations of the cycle)` for Poisson at n x n (one
    device: a `Tail`; traced, not compiled)."""
    k = jax.ShapeDtypeStruct((n, n), jnp.float64)
    mg = jax.eval_shape(lambda k: sx.multigrid(sx.diffusion_operator(k), cycle=cycle,
                                               shards=(1, 1)), k)
    jaxpr = jax.make_jaxpr(lambda mg, r: mg(r))(mg, k)
    return len(mg.explicit) + (len(mg.tail.shapes) if mg.tail else 0), len(
        list(all_equations(jaxpr)))


@pytest.mark.parametrize("cycle", ["V", "F"])
def test_a_cycles_program_does_not_grow_with_the_levels(cycle):
    """V- and F-cycles: the `Tail`'s levels are loops (an F-cycle's moves
    over them one loop), so one more level leaves the cycle's jaxpr as it
    was. (Unrolled, a 4096^2 MG-CG's first call took 75 s on a TPU.)"""
    (few, small), (more, large) = _program_size(512, cycle), _program_size(1024, cycle)
    assert more == few + 1 and large == small


def test_an_f_cycle_holds_each_level_once_and_is_the_recursion(monkeypatch):
    """An F-cycle's two visits of a level are a loop with a runtime F/V flag
    where loops are wanted (CPU, TPU): its jaxpr at 1024^2 is under twice a
    V-cycle's (the tail's F moves and V scans are both in it), where the
    recursion, a GPU's form, held the explicit levels once per F and V path
    above them (3.7x; the CPU's form before: 6517 equations, now 3203), and
    it computes what the recursion computes."""
    from solvax._grid.multigrid import cycle as _cycle

    (_, v), (_, f) = _program_size(1024, "V"), _program_size(1024, "F")
    assert f < 2 * v, (f, v)
    k = field((64, 64))
    mg = jax.jit(lambda k: sx.multigrid(sx.diffusion_operator(k), cycle="F", shards=(1, 1),
                                        coarse_size=16))(k)
    x = jnp.asarray(np.random.default_rng(4).standard_normal((64, 64)))
    looped = jax.jit(lambda mg, v: mg(v))(mg, x)
    monkeypatch.setattr(_cycle, "scan_unroll", lambda length, backend=None: length)  # a GPU's
    recursion = jax.jit(lambda mg, v: mg(v))(mg, x)
    (_, unrolled) = _program_size(1024, "F")
    assert unrolled > 3 * v, (unrolled, v)
    np.testing.assert_allclose(looped, recursion, rtol=1e-12, atol=1e-12 * float(
        jnp.abs(recursion).max()))


def test_a_w_cycles_program_grows_by_one_level_per_level():
    """A W-cycle runs every level on its own grid, its two visits of a level
    a two-step loop: one more level adds about the same code each time (as
    recursion it doubled: a 2048^2 W-cycle compiled for 157 s on a TPU)."""
    sizes = [_program_size(n, "W") for n in (256, 512, 1024)]
    assert [levels for levels, _ in sizes] == [6, 7, 8]
    steps = [b - a for (_, a), (_, b) in zip(sizes, sizes[1:])]
    assert steps[0] > 0 and abs(steps[1] - steps[0]) <= 0.1 * steps[0], sizes


@pytest.mark.parametrize("smoother", ["jacobi", "chebyshev", "gauss_seidel"])
def test_a_cycles_program_does_not_grow_with_the_smoothing_steps(smoother):
    """On one device each smoother's repeated step is a loop
    (`Level.repeated`; unrolled on a GPU): from 3 steps on (a first step
    from zero, then a loop before and one after) more steps leave the
    cycle's jaxpr as it was. A grid that may be split across devices (no
    `shards` given, 8 devices) keeps them unrolled, so a solve's step loop
    stays the innermost loop with collectives; the two cycles agree to
    rounding."""
    k = jax.ShapeDtypeStruct((32, 32), jnp.float64)

    def size(steps, shards):
        mg = jax.eval_shape(lambda k: sx.multigrid(sx.diffusion_operator(k), steps=steps,
                                                   smoother=smoother, shards=shards), k)
        return len(list(all_equations(jax.make_jaxpr(lambda mg, r: mg(r))(mg, k))))

    assert size(3, (1, 1)) == size(6, (1, 1))
    assert size(3, None) < size(4, None)
    field_k, x = field((24, 24)), jnp.asarray(np.random.default_rng(5).standard_normal((24, 24)))
    looped, unrolled = (jax.jit(lambda k, v, shards=shards: sx.multigrid(
        sx.diffusion_operator(k), steps=3, smoother=smoother, shards=shards)(v))(field_k, x)
        for shards in ((1, 1), None))
    np.testing.assert_allclose(looped, unrolled, rtol=1e-12,
                               atol=1e-12 * float(jnp.abs(unrolled).max()))


def test_the_moves_of_a_cycle_on_the_tail():
    """An F-cycle over m levels above the coarsest solves it m times, a
    V-cycle once; each level's down move has its up move."""
    from solvax._grid.multigrid.cycle import _AGAIN, _DOWN, _SOLVE, _UP, _moves

    for m in (1, 2, 4):
        for kind, solves in (("V", 1), ("F", m)):
            moves = _moves(m, kind)
            assert [w for w, _ in moves].count(_SOLVE) == solves
            assert [w for w, _ in moves].count(_AGAIN) == (m - 1 if kind == "F" else 0)
            depth = 0
            for what, j in moves:
                depth += {_DOWN: 1, _UP: -1}.get(what, 0)
                assert (what != _AGAIN or j + 1 < m) and depth >= 0
            assert depth == 0 and moves[0] == (_DOWN, 0) and moves[-1] == (_UP, 0)


def test_loops_on_every_target():
    """The tail's scans and a W-cycle's visits are loops on every target: a
    loop with a known trip count runs on the device, a GPU's too (unrolled
    there, a W-cycle grew exponentially with its levels: tests/test_target.py)."""
    from solvax._core import target
    from solvax._grid.multigrid.fusion import scan_unroll

    for platform in target.PLATFORMS:
        with target.forced(platform):
            assert scan_unroll(5) == 1, platform


def test_which_levels_are_padded(monkeypatch):
    # only where the levels are alike at trace time (traced coefficients, one
    # device, no periodic axis, even sizes, collapsed interpolation); the
    # default takes levels of at most 1/64 of the finest grid (eval_shape:
    # traced, not compiled). One device: the process has one, or `shards`
    # says so (these tests run on 8)
    from solvax._grid.multigrid import hierarchy as _multigrid

    def tail(shape, **options):
        k = jax.ShapeDtypeStruct(shape, jnp.float64)
        boundary = options.pop("boundary", "dirichlet")
        mg = jax.eval_shape(lambda k: sx.multigrid(sx.diffusion_operator(k, boundary=boundary),
                                                   **options), k)
        return mg.tail and mg.tail.shapes

    one = dict(shards=(1, 1))
    assert tail((1024, 1024), **one) == ((64, 64), (32, 32), (16, 16))
    assert tail((1024, 1024)) is None      # 8 devices: the grid may be split
    assert tail((256, 256), **one) is None        # 32^2 and 16^2 only: too few to pay
    monkeypatch.setattr(_multigrid, "_TAIL_FRACTION", 1)
    assert tail((64, 64), coarse_size=4, **one) == ((16, 16), (8, 8), (4, 4))
    assert tail((64, 64), coarse_size=4, boundary="periodic", **one) is None
    assert tail((64, 64), coarse_size=4, shards=(2, 1)) is None
    assert tail((60, 60), coarse_size=4, **one) is None          # 15 points: odd
    assert tail((64, 64), coarse_size=4, interpolation="full", **one) is None
    assert sx.multigrid(sx.diffusion_operator(field((64, 64))), coarse_size=4, **one).tail is None


def compiled_count(instruction: str, fn, *args) -> int:
    """How many `instruction`s (`conditional`, `fusion`) `jax.jit(fn)`'s
    compiled program on `args` holds."""
    return jax.jit(fn).lower(*args).compile().as_text().count(f" {instruction}(")


def compiled_conditionals(fn, *args) -> int:
    """The conditionals in `jax.jit(fn)`'s compiled program on `args` (on the
    CPU, the cycle's and the set-up's fusion barriers: `_computed`)."""
    return compiled_count("conditional", fn, *args)


def test_a_hierarchy_closed_over_keeps_its_fusion_barriers():
    # built once and closed over by a jitted solve, the hierarchy is a
    # constant there: XLA once folded `lambda_max == lambda_max` and dropped
    # most of the cycle's conditionals (fusion barriers on the CPU), a 1024^2
    # cycle 3x slower than with the hierarchy passed as an argument
    A = sx.diffusion_operator(field((32, 32)))
    mg = sx.multigrid(A, coarse_size=16)
    b = jnp.ones((32, 32))
    given = compiled_conditionals(lambda mg, b: mg(b), mg, b)
    assert given >= 2 * (len(mg.levels) - 1)
    assert compiled_conditionals(lambda b: mg(b), b) == given


@pytest.mark.parametrize("shape, bound", [((32, 32), 24), ((16, 16, 16), 90)])
def test_a_one_device_galerkin_product_is_a_kernel_per_coarse_entry(shape, bound):
    # each axis product inside one fusion barrier: its coarse entries one
    # kernel each, reading the fine rows and shifted weights from its inputs.
    # Computing those rows and weights into memory first cost a kernel each
    # (beyond the transfer's: 2-D 65 kernels against 19 now, 3-D 225 against
    # 72): the program's compile and a pass over memory per kernel
    from solvax._grid.multigrid.galerkin import galerkin_operator
    from solvax._grid.multigrid.smoothers import smoothing_data
    from solvax._grid.multigrid.transfer import make_transfer

    axes = tuple(range(len(shape)))

    def transfer(k):
        op = sx.diffusion_operator(k)
        lmax = smoothing_data(op, False)
        return op, make_transfer(op, axes, False, lmax), lmax

    def product(k):
        return galerkin_operator(*transfer(k), split=True)

    k = field(shape)
    assert compiled_count("fusion", product, k) - compiled_count("fusion", transfer, k) <= bound
    # the same product as without the barriers (a sharded grid's form)
    unsplit = galerkin_operator(*transfer(k), split=False)
    for o, c in product(k).stored.items():
        np.testing.assert_allclose(c, unsplit.stored[o], rtol=1e-13, atol=1e-13)


def test_a_narrowed_one_device_set_up_computes_each_galerkin_level_once():
    # XLA:CPU fused each Galerkin product into the next level's set-up and
    # its narrowed copy, and computed it again there: a narrowed hierarchy
    # (float32 from float64, or a narrower storage) on one device computes
    # each explicit level's operator into memory (a conditional); one in the
    # operator's own precision (slower so, measured) does not. On one device
    # each axis product of a level computes its shared inputs into memory (a
    # conditional per coarsened axis: `galerkin_operator`'s `split`). On a
    # grid that may be split none of these (the halo exchanges of the steps
    # stay shared)
    k = field((32, 32))

    def conditionals(shards, **options):
        return compiled_conditionals(lambda k: jax.tree_util.tree_leaves(sx.multigrid(
            sx.diffusion_operator(k), coarse_size=16, shards=shards, **options)), k)

    levels = len(sx.multigrid(sx.diffusion_operator(k), coarse_size=16).levels)
    assert levels >= 3 and k.dtype == jnp.float64
    split = 2 * (levels - 1)   # two coarsened axes per explicit level
    for options in (dict(dtype=jnp.float32), dict(storage_dtype=jnp.bfloat16)):
        assert conditionals((1, 1), **options) == levels - 1 + split
        assert conditionals((2, 1), **options) == 0
    assert conditionals((1, 1)) == split
