"""Bad input raises at trace time, naming the argument and the fix."""

import jax
import jax.numpy as jnp
import pytest
from helpers import KRYLOV, poisson_1d, poisson_2d

import solvax as sx

b = jnp.ones(8)
TREE = {"a": jnp.ones(4), "b": jnp.ones(3)}


def tree_mv(x):
    return x


@pytest.mark.parametrize("name", list(KRYLOV))
class TestKrylov:
    def call(self, name, *args, **kw):
        return jax.jit(lambda: KRYLOV[name](*args, **kw)).lower()  # errors at trace time

    def test_x0_structure(self, name):
        with pytest.raises(ValueError, match="`x0` must have the same pytree structure as `b`"):
            self.call(name, tree_mv, TREE, x0={"a": jnp.ones(4)})

    def test_x0_shape(self, name):
        with pytest.raises(ValueError, match="`x0` must match `b` leaf by leaf"):
            self.call(name, poisson_1d, b, x0=jnp.ones(7))

    def test_x0_dtype(self, name):
        with pytest.raises(ValueError, match="`x0` must match `b`"):
            self.call(name, poisson_1d, b, x0=jnp.ones(8, jnp.float32))

    def test_matvec_structure(self, name):
        with pytest.raises(ValueError, match=r"`matvec\(b\)` must have the same pytree structure"):
            self.call(name, lambda x: (x, x), b)

    def test_matvec_shape(self, name):
        with pytest.raises(ValueError, match=r"`matvec\(b\)` must match `b`"):
            self.call(name, lambda x: x[:-1], b)

    def test_precond_structure(self, name):
        with pytest.raises(ValueError, match=r"`precond\(b\)`"):
            self.call(name, tree_mv, TREE, precond=lambda r: r["a"])

    def test_precond_dtype(self, name):
        with pytest.raises(ValueError, match=r"`precond\(b\)` must match `b`"):
            self.call(name, poisson_1d, b, precond=lambda r: r.astype(jnp.float32))

    def test_negative_rtol(self, name):
        with pytest.raises(ValueError, match="`rtol` must be finite and >= 0"):
            self.call(name, poisson_1d, b, rtol=-1.0)

    def test_negative_atol(self, name):
        with pytest.raises(ValueError, match="`atol` must be finite and >= 0"):
            self.call(name, poisson_1d, b, atol=-1e-3)

    def test_integer_rhs(self, name):
        with pytest.raises(TypeError, match="`b` must have floating-point or complex leaves"):
            self.call(name, lambda x: x, jnp.ones(8, jnp.int32))

    def test_empty_rhs(self, name):
        with pytest.raises(ValueError, match="`b` must be an array or a pytree"):
            self.call(name, lambda x: x, {})

    def test_a_flag_takes_a_bool(self, name):
        """`record_history="no"` recorded a history (any truthy object was True)."""
        with pytest.raises(TypeError, match="`record_history` must be True or False; got 'no'"):
            self.call(name, poisson_1d, b, record_history="no")
        self.call(name, poisson_1d, b, record_history=True)  # the valid neighbour

    def test_axis_name_is_a_mesh_axis_name(self, name):
        """`axis_name=3` failed inside NumPy ("axis 3 is out of bounds")."""
        with pytest.raises(TypeError, match="`axis_name` must be the name of a mesh axis"):
            self.call(name, poisson_1d, b, axis_name=3)

    def test_both_inner_product_and_axis_name(self, name):
        with pytest.raises(ValueError, match="either `inner_product` or `axis_name`"):
            self.call(name, poisson_1d, b, inner_product=sx.InnerProduct(), axis_name="i")


def test_max_steps_negative():
    with pytest.raises(ValueError, match="`max_steps` must be >= 0"):
        sx.pcg(poisson_1d, b, max_steps=-1)


def test_max_steps_not_int():
    with pytest.raises(TypeError, match="`max_steps` must be a Python int"):
        sx.pcg(poisson_1d, b, max_steps=2.5)


def test_restart_too_small():
    with pytest.raises(ValueError, match="`restart` must be >= 1"):
        sx.gmres(poisson_1d, b, restart=0)


def test_max_restarts_negative():
    with pytest.raises(ValueError, match="`max_restarts` must be >= 0"):
        sx.gmres(poisson_1d, b, max_restarts=-2)


def test_single_reduction_not_bool():
    with pytest.raises(TypeError, match="`single_reduction` must be True or False"):
        sx.pcg(poisson_1d, b, single_reduction="yes")


def test_pcg_unknown_option():
    with pytest.raises(TypeError):
        sx.pcg_linear_solve(poisson_1d, b, tolerance=1e-3)


def test_inner_product_wrong_type():
    with pytest.raises(TypeError, match="`inner_product` must be None"):
        sx.pcg(poisson_1d, b, inner_product=3)


def test_linear_solve_solver_not_callable():
    with pytest.raises(TypeError, match="`solver` must be a function"):
        sx.linear_solve(poisson_1d, b, solver=None)


class TestTridiagonal:
    n = 6

    def test_unknown_method(self):
        o = jnp.ones(self.n)
        with pytest.raises(ValueError, match="`method` must be one of 'auto', 'thomas', 'lax'"):
            sx.tridiagonal_solve(o, o, o, o, method="cyclic")

    def test_band_shapes_disagree(self):
        o = jnp.ones(self.n)
        with pytest.raises(ValueError, match="`lower`, `diag` and `upper` must have the same"):
            sx.tridiagonal_solve(jnp.ones(self.n - 1), o, o, o)

    def test_rhs_shape_disagrees(self):
        o = jnp.ones(self.n)
        with pytest.raises(ValueError, match="`rhs` of shape .* must start with the bands' shape"):
            sx.tridiagonal_solve(o, o, o, jnp.ones((self.n + 1, 2)))

    def test_integer_band(self):
        o = jnp.ones(self.n)
        with pytest.raises(TypeError, match="`diag` must have floating-point"):
            sx.tridiagonal_solve(o, jnp.ones(self.n, jnp.int32), o, o)

    def test_scalar_bands(self):
        s = jnp.ones(())
        with pytest.raises(ValueError, match="leading system axis"):
            sx.tridiagonal_solve(s, s, s, s)


def test_a_zero_start_vector_for_the_spectrum_is_refused():
    """`estimate_spectrum(matvec, zeros)` returned (nan, nan) silently."""
    with pytest.raises(ValueError, match="`v` must be a nonzero start vector"):
        sx.estimate_spectrum(poisson_1d, jnp.zeros(8))
    lo, hi = sx.estimate_spectrum(poisson_1d, jnp.ones(8).at[0].set(2.0), steps=8)
    assert 0 < float(lo) <= float(hi) <= 4  # the 1-D Laplacian's spectrum lies in (0, 4)


def test_half_precision_bands_are_refused_clearly():
    """bfloat16 bands with method='auto' raised NotImplementedError inside XLA."""
    o = jnp.ones(6, jnp.bfloat16)
    with pytest.raises(TypeError, match="`lower` is bfloat16; .* float32 or wider"):
        sx.tridiagonal_solve(o, 4 * o, o, o)
    x = sx.tridiagonal_solve(*(jnp.asarray(a, jnp.float32) for a in (o, 4 * o, o, o)))
    assert x.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(x)))


def test_shard_batch_names_an_input_that_is_not_an_array():
    """A list of floats gave AttributeError: 'list' object has no attribute 'ndim'."""
    import numpy as np
    from jax.sharding import Mesh

    m = Mesh(np.array(jax.devices()[:2]), ("i",))
    f = sx.shard_batch(lambda x: 2 * x, mesh=m, input_rank=1, output_rank=1)
    with pytest.raises(TypeError, match="input 0 must be an array .* got a list"):
        f([1.0, 2.0])
    assert f(jnp.asarray([1.0, 2.0])).tolist() == [2.0, 4.0]


@pytest.mark.parametrize("nonlinear", [
    lambda x: poisson_2d(x) + x**3,              # a new user's "matvec" (issue 48)
    lambda x: poisson_2d(x) * x,
    lambda x: jnp.maximum(poisson_2d(x), 0),
    lambda x: poisson_2d(x) / (1 + x),
    lambda x: jnp.where(x > 0, poisson_2d(x), x),
])
def test_nonlinear_matvec_is_refused_at_trace_time(nonlinear):
    with pytest.raises(ValueError, match="`matvec` is not linear in its argument"):
        sx.pcg(nonlinear, jnp.ones((8, 8)))


def test_linear_matvecs_nearest_to_nonlinear_ones_are_accepted():
    """Products with constants, a constant mask, division by a constant, a
    jitted function and a preconditioner that is not linear (flexible GMRES
    accepts it; only `matvec` is checked)."""
    mask = jnp.arange(8)[:, None] > 3
    b = jnp.ones((8, 8))
    for linear in (lambda x: 2.0 * poisson_2d(x), lambda x: jnp.where(mask, poisson_2d(x), x),
                   lambda x: poisson_2d(x) / 3.0, jax.jit(poisson_2d)):
        assert sx.pcg(linear, b).converged
    assert sx.gmres(poisson_2d, b, precond=lambda r: r / (1 + 0.01 * jnp.abs(r))).converged


@pytest.mark.parametrize("solver", [sx.pcg, sx.gmres, sx.bicgstab, sx.iterative_refinement])
def test_an_operator_passed_as_a_vector_is_named(solver):
    # a StencilOperator is a pytree of floating arrays: before, it passed for a
    # vector and failed inside (`b`: "calling `matvec` ... failed", `x0`: a
    # pytree-structure mismatch); the nearest valid inputs (arrays of its
    # grid, the operator first) solve
    A = sx.diffusion_operator(jnp.ones((8, 8)))
    rhs = jnp.ones((8, 8))
    with pytest.raises(TypeError, match="`b` is a callable \\(StencilOperator\\): an operator"):
        jax.jit(lambda: solver(rhs, A)).lower()
    with pytest.raises(TypeError, match="`x0` is a callable \\(StencilOperator\\)"):
        jax.jit(lambda: solver(A, rhs, x0=A)).lower()
    sol = solver(A, A.diagonal(), x0=jnp.zeros((8, 8)))
    assert sx.Status(int(sol.status)) == sx.Status.CONVERGED
