"""The reduction layer: k products of one step are one reduction, by construction."""

import ast
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import all_equations, count_primitives, mesh, put, rel_err, rhs, traced_with_rule
from jax.sharding import PartitionSpec as P

import solvax as sx
from solvax._core import reduce as _reduce
from solvax._core import tree as _tree

SRC = pathlib.Path(sx.__file__).parent


def three_pairs(x, y):
    return [(x, y), (y, y), (x, x)]


def test_multi_dot_values():
    rng = np.random.default_rng(0)
    x = {"a": jnp.asarray(rng.standard_normal(5) + 1j * rng.standard_normal(5)),
         "b": jnp.asarray(rng.standard_normal((2, 3)) + 0j)}
    y = jax.tree_util.tree_map(lambda v: 2 * v + 1j, x)
    got = sx.InnerProduct().multi_dot(three_pairs(x, y))

    def flat(t):
        return np.concatenate([np.asarray(v).reshape(-1) for v in jax.tree_util.tree_leaves(t)])

    fx, fy = flat(x), flat(y)
    ref = [np.vdot(fx, fy), np.vdot(fy, fy), np.vdot(fx, fx)]
    assert rel_err(got, ref) < 1e-14


def test_weighted_inner_product_and_norm():
    x = jnp.arange(1.0, 5.0)
    w = jnp.array([1.0, 2.0, 3.0, 4.0])
    ip = sx.InnerProduct(weight=w)
    assert float(ip.dot(x, x)) == float(jnp.sum(w * x * x))
    assert np.isclose(float(ip.norm(x)), float(jnp.sqrt(jnp.sum(w * x * x))))


def test_projections_match_numpy():
    rng = np.random.default_rng(1)
    V = jnp.asarray(rng.standard_normal((4, 7)) + 1j * rng.standard_normal((4, 7)))
    w = jnp.asarray(rng.standard_normal(7) + 1j * rng.standard_normal(7))
    u = 2 * w + 1
    ip = sx.InnerProduct()
    Vc = np.conj(np.asarray(V))
    assert rel_err(ip.project(V, w), Vc @ w) < 1e-14
    projections, products = ip.project_many(V, [u, w], [(u, w)])
    assert rel_err(projections, np.stack([Vc @ u, Vc @ w])) < 1e-14
    assert rel_err(products, [np.vdot(u, w)]) < 1e-14
    coeffs, ww = ip.project_with_norm(V, w)
    assert rel_err(coeffs, Vc @ w) < 1e-14 and rel_err(ww, np.vdot(w, w)) < 1e-14


def test_projection_is_one_all_reduce_without_gather():
    m = mesh(8)
    V = put(jnp.ones((5, 3, 64)), m, None, None, "i")
    x = put(jnp.ones((3, 64)), m, None, "i")
    ip = sx.InnerProduct()
    for f in (lambda V, x: ip.project_many(V, [x, 2 * x]),
              lambda V, x: ip.project_many(V, [x, 2 * x], [(x, x), (x, 2 * x)]),
              lambda V, x: ip.project_with_norm(V, x)):
        report = sx.count_collectives(f, V, x)
        assert report.total == 1 and report.count("all-reduce") == 1, str(report)


def test_k_products_one_all_reduce_of_a_k_vector_under_jit():
    m = mesh(8)
    for spec, shape in (((("i",)), (64,)), ((None, "i"), (3, 64)), (("i", None), (64, 3))):
        x = put(jnp.ones(shape), m, *spec)
        y = put(2 * jnp.ones(shape), m, *spec)
        report = sx.count_collectives(lambda x, y: sx.InnerProduct().multi_dot(three_pairs(x, y)),
                                      x, y)
        assert report.total == 1 and report.count("all-reduce") == 1, str(report)
        assert report.bytes_by_kind["all-reduce"] == 3 * 8  # one f64[3]
        assert report.count("all-gather") == 0


def test_k_products_one_psum_inside_shard_map():
    m = mesh(8)
    ip = sx.InnerProduct(axis_name="i")
    f = sx.shard_map(lambda x, y: ip.multi_dot(three_pairs(x, y)), mesh=m,
                     in_specs=(P("i"), P("i")), out_specs=P())
    x = put(jnp.arange(64.0), m, "i")
    y = put(jnp.ones(64), m, "i")
    assert count_primitives(jax.make_jaxpr(f)(x, y), "psum") == 1
    assert rel_err(f(x, y), [jnp.sum(x), 64.0, jnp.sum(x * x)]) < 1e-14
    assert sx.count_collectives(f, x, y).total == 1


def _stacked_shapes(jaxpr, shape):
    """Shapes `(k, *shape)`, k > 1, that any equation of `jaxpr` (nested too) makes."""
    return {tuple(v.aval.shape) for eqn in all_equations(jaxpr) for v in eqn.outvars
            if getattr(v.aval, "shape", ())[1:] == shape and v.aval.shape[0] > 1}


@pytest.mark.parametrize("stacks", [True, False])
def test_one_device_products_are_separate_sums(stacks, monkeypatch):
    """The pattern `stacks_products` rules: stacked, a step's products form a
    `(k, n, n)` array before one sum (what an XLA:CPU mesh runs); separate
    (one device, a GPU or TPU mesh), no vector-sized stack is made, which
    XLA:CPU would write and read again (measured 2.8x a one-sync BiCGStab
    step). Same answer either way."""
    A = lambda x: x * jnp.linspace(1.0, 3.0, 32)[None, :]  # noqa: E731
    b = jnp.ones((32, 32))
    jaxpr, solution = traced_with_rule(
        monkeypatch, _reduce, "stacks_products", stacks,
        lambda b: sx.pcg(A, b, single_reduction=True, rtol=1e-10), b)
    assert bool(_stacked_shapes(jaxpr, (32, 32))) == stacks
    assert bool(solution.converged)
    assert rel_err(A(solution.x), b) < 1e-9


def _dot_outputs(jaxpr, shape):
    """Output shapes `(s, *shape)` of the `dot_general`s of `jaxpr` (nested too)."""
    return {tuple(v.aval.shape) for eqn in all_equations(jaxpr)
            if eqn.primitive.name == "dot_general" for v in eqn.outvars
            if v.aval.shape[1:] == shape}


def test_basis_combination_rule():
    """A TPU combines a basis by an elementwise sum (a `dot` there interleaves
    the basis rows: 1.75x GMRES's step on the chip); CPU and GPU by a GEMM."""
    assert not _tree.combines_by_gemm("tpu")
    assert _tree.combines_by_gemm("cpu") and _tree.combines_by_gemm("gpu")


@pytest.mark.parametrize("gemm", [True, False])
@pytest.mark.parametrize("solver", ["gmres", "gcrot"])
def test_basis_combinations_follow_the_rule(gemm, solver, monkeypatch):
    """GMRES's and GCRO-DR's basis combinations are `dot_general`s only where
    `combines_by_gemm` says so (what a TPU compiles is pinned here on the
    CPU); the answer is the same either way."""
    A = lambda x: x * jnp.linspace(1.0, 3.0, 32)[None, :] + 0.1 * jnp.roll(x, 1, 0)  # noqa: E731
    b = jnp.ones((32, 32))
    jaxpr, solution = traced_with_rule(monkeypatch, _tree, "combines_by_gemm", gemm,
                                       lambda b: getattr(sx, solver)(A, b, rtol=1e-10), b)
    assert bool(_dot_outputs(jaxpr, (32, 32))) == gemm
    assert bool(solution.converged)
    assert rel_err(A(solution.x), b) < 1e-9


def test_callable_inner_product():
    ip = _reduce.resolve(lambda a, b: jnp.sum(a * b) * 2.0)
    assert float(ip.dot(jnp.ones(3), jnp.ones(3))) == 6.0
    sol = sx.pcg(lambda x: 2 * x, jnp.ones(5), inner_product=lambda a, b: jnp.sum(a * b))
    assert bool(sol.converged)


def _calls(path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            yield name, node


# The direct structured solves work on arrays with named block axes (they
# stack spike columns and corner blocks of one system), and the grid
# operators join a block's halo to it and multigrid's transfers interleave
# and split the points of a grid axis (their collectives pinned in
# test_stencil and test_multigrid); the rule below is about the Krylov
# vectors, which are pytrees whose leaves keep their own sharding.
STRUCTURED = {"_structured", "_grid"}
REDUCTION_LAYER = ("_core/reduce.py", "_core/tree.py")


def _modules():
    """`(path, its name relative to the package)` for every module."""
    return [(path, path.relative_to(SRC).as_posix()) for path in sorted(SRC.rglob("*.py"))]


def test_no_flattening_in_the_library():
    """No vector is raveled, reshaped to 1-D, `vdot`-ed or concatenated; on the
    Krylov side `concatenate` only joins along the small leading axis: partial
    products in `_reduce`, bases along their basis axis in `_tree`."""
    for path, module in _modules():
        for name, call in _calls(path):
            where = f"{module}:{call.lineno}"
            assert name not in {"vdot", "ravel", "ravel_pytree", "flatten"}, where
            if name == "reshape":
                assert not any(isinstance(a, ast.UnaryOp) or getattr(a, "value", None) == -1
                               for a in call.args), where
            if name == "concatenate" and module.split("/")[0] not in STRUCTURED:
                axis = [ast.literal_eval(k.value) for k in call.keywords if k.arg == "axis"]
                assert module in REDUCTION_LAYER and axis == [0], where


def test_the_flattening_rule_sees_every_module():
    """The exemption names packages that exist, so it cannot silently widen."""
    names = {module.split("/")[0] for _, module in _modules()}
    assert STRUCTURED | {"_core"} <= names


def test_inner_products_defined_in_one_module():
    for path, module in _modules():
        if module != "_core/reduce.py":
            assert not re.search(r"def _?(tree_)?(dot|inner|norm)\b", path.read_text()), module


def _products_of_every_kind():
    """(name, inner product, its dense weight) for every kind the layer has."""
    w = jnp.linspace(0.5, 2.0, 48)
    return [("euclidean", sx.InnerProduct(), jnp.ones(48)),
            ("weighted", sx.InnerProduct(weight=w), w),
            ("callable", lambda x, y: jnp.sum(jnp.conj(x) * w * y), w),
            ("axis_name", sx.InnerProduct(axis_name="i"), jnp.ones(48))]


@pytest.mark.parametrize("orthogonalization", ["cgs2", "one_sync"])
@pytest.mark.parametrize("kind", range(4))
def test_every_inner_product_kind_gives_an_orthonormal_basis(orthogonalization, kind):
    """Every orthogonalization with every kind of inner product builds a basis
    orthonormal in *that* product: ||I - V^H W V|| <= 1e-12. (A callable
    product once fell back to the Euclidean one in CGS2's second pass: 13.6.)"""
    from helpers import convection_diffusion

    from solvax._krylov.gmres import arnoldi_basis

    name, ip, weight = _products_of_every_kind()[kind]
    op = convection_diffusion(10.0)
    b = rhs(48)

    def matvec(x):
        return op(x.reshape(6, 8)).reshape(48)

    def basis(b):
        return arnoldi_basis(matvec, b, restart=12, orthogonalization=orthogonalization,
                             inner_product=ip)

    if name == "axis_name":  # one device's shard_map: the product's psum is over one shard
        basis = sx.shard_map(basis, mesh=mesh(1), in_specs=P("i"), out_specs=(P(None, "i"), P()))
    V, j = basis(b)
    Q = np.asarray(V[: int(j) + 1])
    gram = Q.conj() @ (np.asarray(weight)[:, None] * Q.T)
    assert int(j) == 12
    assert np.linalg.norm(np.eye(int(j) + 1) - gram) <= 1e-12, name
