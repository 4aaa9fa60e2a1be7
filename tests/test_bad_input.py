"""Bad input raises at trace time, naming the argument and the fix."""

import jax
import jax.numpy as jnp
import pytest
from helpers import KRYLOV, poisson_1d

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
    with pytest.raises(TypeError, match="`single_reduction` must be a bool"):
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
