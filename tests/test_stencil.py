"""Structured-grid operators: the stencil against an independent dense
reference, the finite-volume diffusion operator, solves with them sharded
over one and two mesh axes (halos only, no gather), traced coefficients,
derivatives with respect to the coefficient field, bad input."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import rel_err
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import solvax as sx


def dense_stencil(entries, shape, boundary):
    """The operator's matrix, entry by entry from its definition (loops over
    the grid; the boundary applied to each out-of-grid index)."""
    n = int(np.prod(shape))
    M = np.zeros((n, n))
    for i in itertools.product(*(range(s) for s in shape)):
        row = np.ravel_multi_index(i, shape)
        for offset, c in entries.items():
            j = []
            for a, (ia, o) in enumerate(zip(i, offset)):
                ja = ia + o
                if 0 <= ja < shape[a]:
                    j.append(ja)
                elif boundary[a] == "periodic":
                    j.append(ja % shape[a])
                elif boundary[a] == "neumann":
                    j.append(min(max(ja, 0), shape[a] - 1))
                else:
                    j = None
                    break
            if j is not None:
                coefficient = c[i] if np.ndim(c) else c
                M[row, np.ravel_multi_index(tuple(j), shape)] += coefficient
    return M


def matrix_of(op):
    n = int(np.prod(op.shape))
    eye = jnp.eye(n).reshape(n, *op.shape)
    return np.asarray(jax.vmap(op)(eye)).reshape(n, n).T


CASES = [((7,), ("dirichlet",)), ((7,), ("periodic",)), ((5, 6), ("neumann", "periodic")),
         ((4, 3, 5), ("dirichlet", "neumann", "periodic"))]


@pytest.mark.parametrize("shape, boundary", CASES)
def test_stencil_matches_its_definition(shape, boundary):
    rng = np.random.default_rng(len(shape))
    offsets = [o for o in itertools.product(*[(-1, 0, 1)] * len(shape))
               if sum(map(abs, o)) <= 1] + [tuple([2] + [0] * (len(shape) - 1))]
    entries = {o: rng.standard_normal(shape) for o in offsets}
    entries[offsets[0]] = 1.5  # a constant entry beside the variable ones
    op = sx.stencil_operator({o: jnp.asarray(c) if np.ndim(c) else c
                              for o, c in entries.items()}, boundary=boundary)
    assert rel_err(matrix_of(op), dense_stencil(entries, shape, boundary)) < 1e-14
    centre = entries[(0,) * len(shape)]
    assert rel_err(op.diagonal(), np.broadcast_to(centre, shape)) < 1e-15


@pytest.mark.parametrize("shape, boundary", CASES)
def test_half_stored_operators_are_their_whole_stencils(shape, boundary):
    """A diffusion operator and every level of its multigrid hierarchy (9- and
    27-point Galerkin stencils) are stored by half; each product is the one
    of the whole stencil its `entries` give."""
    rng = np.random.default_rng(3)
    A = sx.diffusion_operator(jnp.asarray(np.exp(rng.standard_normal(shape))), boundary=boundary)
    for op in [A] + [level.op for level in sx.multigrid(A, coarse_size=1).levels]:
        whole = sx.StencilOperator(op.entries, op.shape, op.boundary)
        assert op.symmetric and (len(op.stored) < len(op.entries) or len(op.entries) == 1)
        x = jnp.asarray(rng.standard_normal(op.shape))
        assert rel_err(op(x), whole(x)) < 1e-14, (op, shape, boundary)


def test_complex_and_float32_fields():
    op = sx.stencil_operator({(0,): 2.0, (1,): -1.0, (-1,): -1j}, shape=(6,),
                             boundary="periodic")
    x = jnp.arange(6.0) * (1 + 2j)
    want = 2 * x - jnp.roll(x, -1) - 1j * jnp.roll(x, 1)
    assert op(x).dtype == jnp.complex128 and rel_err(op(x), want) < 1e-15
    A = sx.diffusion_operator(jnp.ones((8, 8), jnp.float32))
    sol = sx.pcg(A, jnp.ones((8, 8), jnp.float32))
    assert sol.x.dtype == jnp.float32 and bool(sol.converged)


def test_diffusion_operator_is_the_finite_volume_matrix():
    """1-D, harmonic face means, Dirichlet faces half a cell out, Neumann
    faces closed, and a shift, written out by hand."""
    k = np.array([1.0, 2.0, 4.0, 8.0])
    A = matrix_of(sx.diffusion_operator(jnp.asarray(k), boundary="dirichlet", spacing=0.5))
    faces = 2 * k[:-1] * k[1:] / (k[:-1] + k[1:])
    want = np.diag(np.r_[2 * k[0], 0, 0, 0] + np.r_[0, 0, 0, 2 * k[-1]]
                   + np.r_[faces, 0] + np.r_[0, faces]) - np.diag(faces, 1) - np.diag(faces, -1)
    assert rel_err(A, want / 0.25) < 1e-15
    B = matrix_of(sx.diffusion_operator(jnp.asarray(k), boundary="neumann", shift=0.5))
    assert rel_err(B, want - np.diag(np.r_[2 * k[0], 0, 0, 2 * k[-1]]) + 0.5 * np.eye(4)) < 1e-15


@pytest.mark.parametrize("boundary", ["dirichlet", "neumann", "periodic"])
def test_diffusion_operator_is_symmetric_positive_definite(boundary):
    rng = np.random.default_rng(2)
    k = jnp.asarray(np.exp(3 * rng.standard_normal((6, 5))))  # contrast ~1e4
    shift = 0.0 if boundary == "dirichlet" else 1e-2
    A = sx.diffusion_operator((k, 1e-3 * k), boundary=boundary, shift=shift)
    M = matrix_of(A)
    assert np.array_equal(M, M.T) and np.linalg.eigvalsh(M).min() > 0
    # stored by half (the centre and one face per axis); `entries`, the
    # whole stencil, is the same matrix by the stencil's definition
    assert A.symmetric and sorted(A.stored) == [(0, 0), (0, 1), (1, 0)]
    assert len(A.entries) == 5
    full = dense_stencil({o: np.asarray(c) for o, c in A.entries.items()}, A.shape, A.boundary)
    assert rel_err(M, full) < 1e-15
    # constant k = 1 and unit spacing, interior rows: the 5-point Laplacian
    P5 = matrix_of(sx.diffusion_operator(1.0, shape=(6, 5), boundary=boundary))
    row = np.ravel_multi_index((2, 2), (6, 5))
    assert P5[row, row] == 4 and sorted(P5[row][P5[row] != 0]) == [-1, -1, -1, -1, 4]


def _sharded_solve(mesh_shape, spec):
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(mesh_shape), ("i", "j")[:len(mesh_shape)])
    put = lambda x: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    rng = np.random.default_rng(5)
    k = put(jnp.asarray(np.exp(rng.standard_normal((16, 12)))))
    f = put(jnp.asarray(rng.standard_normal((16, 12))))

    def solve(k, f):
        A = sx.diffusion_operator(k, spacing=1 / 16)
        return sx.pcg(A, f, precond=sx.jacobi(A.diagonal()), rtol=1e-10)

    return solve, k, f


@pytest.mark.parametrize("mesh_shape, spec", [((8,), P("i", None)), ((2, 4), P("i", "j"))])
def test_sharded_diffusion_solve_exchanges_halos_only(mesh_shape, spec):
    """Under `jit` with the grid sharded over one or two mesh axes: the
    operator's shifts are collective-permutes, the solve's only all-reduces
    are its inner products, nothing is gathered, and the answer is the
    one-device answer; the coefficient field is traced (built inside jit)."""
    solve, k, f = _sharded_solve(mesh_shape, spec)
    # one halo per direction of each sharded axis: the shifts are one convolution
    A = sx.diffusion_operator(np.asarray(k))
    entries = jax.device_put(A.entries, k.sharding)
    apply = sx.count_collectives(lambda e, x: sx.StencilOperator(e, A.shape, A.boundary)(x),
                                 entries, f)
    assert apply.by_kind == {"collective-permute": 2 * len(mesh_shape)}, str(apply)
    report = sx.count_collectives(lambda k, f: solve(k, f).x, k, f)
    assert report.count("all-gather") == 0 and report.count("all-to-all") == 0, str(report)
    # a step: pcg's reductions (as with a diagonal operator) and the halos
    diagonal = sx.count_collectives(lambda k, f: sx.pcg(lambda x: k * x, f).x, k, f)
    in_loop = [c for c in report.collectives if c.loops]
    assert sum(c.kind == "collective-permute" for c in in_loop) == 2 * len(mesh_shape)
    assert report.per_iteration == diagonal.per_iteration + 2 * len(mesh_shape), str(report)
    sol = jax.jit(solve)(k, f)
    assert bool(sol.converged) and sol.x.sharding.is_equivalent_to(f.sharding, 2)
    one = jax.jit(solve)(np.asarray(k), np.asarray(f))
    assert rel_err(sol.x, one.x) < 1e-8
    assert abs(int(sol.iterations) - int(one.iterations)) <= 1


def test_gradient_with_respect_to_the_coefficient_field():
    """`d/dk` of a functional of `pcg(diffusion_operator(k), f)` against the
    dense derivative `-(A^-T w)^T (dA/dk) x`, through the implicit adjoint."""
    rng = np.random.default_rng(7)
    k0 = jnp.asarray(np.exp(rng.standard_normal((5, 4))))
    f, w = (jnp.asarray(rng.standard_normal((5, 4))) for _ in range(2))

    def loss(k):
        A = sx.diffusion_operator(k)
        return jnp.sum(w * sx.pcg(A, f, rtol=1e-12).x)

    def dense_loss(k):
        A = jnp.asarray(matrix_of(sx.diffusion_operator(k)))
        return jnp.sum(w.ravel() * jnp.linalg.solve(A, f.ravel()))

    g = jax.jit(jax.grad(loss))(k0)
    step = 1e-6
    fd = np.array([(dense_loss(k0.ravel().at[i].add(step).reshape(k0.shape))
                    - dense_loss(k0.ravel().at[i].add(-step).reshape(k0.shape))) / (2 * step)
                   for i in range(k0.size)]).reshape(k0.shape)
    assert rel_err(g, fd) < 1e-7


def test_bad_input_names_the_argument():
    ok = sx.stencil_operator({(0,): 2.0, (1,): -1.0, (-1,): -1.0}, shape=(8,))
    assert rel_err(ok(jnp.ones(8)), np.r_[1.0, np.zeros(6), 1.0]) < 1e-15
    with pytest.raises(TypeError, match="`entries` must be a non-empty mapping"):
        sx.stencil_operator([(0,), 2.0], shape=(8,))
    with pytest.raises(ValueError, match="pass the grid's `shape`"):
        sx.stencil_operator({(0,): 2.0})
    with pytest.raises(ValueError, match="tuples of 1 ints"):
        sx.stencil_operator({(0, 0): 2.0}, shape=(8,))
    with pytest.raises(ValueError, match="the grid's shape \\(8,\\)"):
        sx.stencil_operator({(0,): jnp.ones(7)}, shape=(8,))
    with pytest.raises(ValueError, match="`boundary` must be one of"):
        sx.stencil_operator({(0,): 2.0}, shape=(8,), boundary="robin")
    with pytest.raises(ValueError, match="one name or 2"):
        sx.stencil_operator({(0, 0): 2.0}, shape=(4, 4), boundary=("periodic",))
    with pytest.raises(ValueError, match="acts on arrays of shape \\(8,\\)"):
        ok(jnp.ones(9))
    good = sx.diffusion_operator((1e-3, 1.0), shape=(4, 4))
    assert good.diagonal().shape == (4, 4)
    with pytest.raises(ValueError, match="one coefficient per axis"):
        sx.diffusion_operator((1e-3, 1.0, 1.0), shape=(4, 4))
    with pytest.raises(ValueError, match="`k` must be positive"):
        sx.diffusion_operator(jnp.zeros((4, 4)))
    with pytest.raises(ValueError, match="`k` must be finite .* 1 NaN and 0 infinite"):
        sx.diffusion_operator(jnp.ones((4, 4)).at[1, 2].set(jnp.nan))
    assert sx.diffusion_operator(jnp.full((4, 4), 1e-30)).diagonal().shape == (4, 4)  # nearest
    with pytest.raises(ValueError, match="`k` and `shift` arrays must have the grid's shape"):
        sx.diffusion_operator(jnp.ones((4, 4)), shift=jnp.ones((4, 3)))
    with pytest.raises(ValueError, match="`spacing` must be positive"):
        sx.diffusion_operator(1.0, shape=(4, 4), spacing=0.0)
