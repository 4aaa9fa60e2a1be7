"""The driver's contract, checked for every registered solver at once.

A method reads every traced value from the `Problem` it is given; the primal,
tangent and transposed solves call it in traces of their own. Differentiating
`jit` of a function whose operator, preconditioner, inner-product weights and
initial guess are all traced values catches a method that captures one.
"""

import jax
import jax.numpy as jnp
import pytest
from helpers import SOLVERS, WITH_WRAPPERS, dense_tridiagonal, rel_err, rhs
from matrix import levels

import solvax as sx
from solvax._core import contract as _contract
from solvax._core import driver as _driver

N = 12


def test_every_driver_method_is_in_the_test_registry():
    registered = {solver.method for solver in SOLVERS.values()}
    assert set(_driver.REGISTRY) <= registered, set(_driver.REGISTRY) - registered


def spd(theta):
    minus = -jnp.ones_like(theta)
    return dense_tridiagonal(minus, 2.5 + theta, minus)


# one variant per method module and the `linear_solve` wrappers (every variant
# with SOLVAX_TEST_MATRIX=full)
@pytest.mark.parametrize("name", levels(list(SOLVERS), WITH_WRAPPERS))
def test_grad_of_jit_with_every_option_traced(name):
    solve = SOLVERS[name].solve

    def loss(theta, b, w, s):
        x = solve(lambda x: spd(theta) @ x, b, x0=b * s, precond=lambda r: r / (2.0 + s),
                  inner_product=sx.InnerProduct(weight=w), rtol=1e-10).x
        return jnp.sum(x**2) + jnp.sum(jnp.sin(x))

    def dense_loss(theta, b, w, s):
        x = jnp.linalg.solve(spd(theta), b)
        return jnp.sum(x**2) + jnp.sum(jnp.sin(x))

    args = (jnp.linspace(0.1, 0.3, N), rhs(N), jnp.linspace(1.0, 2.0, N), jnp.float64(0.5))
    got = jax.grad(jax.jit(loss), argnums=(0, 1))(*args)
    want = jax.grad(dense_loss, argnums=(0, 1))(*args)
    assert rel_err(got[0], want[0]) < 1e-8 and rel_err(got[1], want[1]) < 1e-8
    tangent = jax.jvp(jax.jit(lambda t: loss(t, *args[1:])), (args[0],), (jnp.ones(N),))[1]
    dense = jax.jvp(lambda t: dense_loss(t, *args[1:]), (args[0],), (jnp.ones(N),))[1]
    assert rel_err(tangent, dense) < 1e-8


def test_a_method_that_captures_a_traced_value_is_caught():
    """The contract's check can fail: a method whose `run` reads `b` from the
    enclosing trace instead of its problem breaks under `grad(jit(...))`."""
    captured = {}

    def run(problem):
        return _contract.Outcome(x=captured["b"] / 2.0, status=jnp.int32(0),
                               iterations=jnp.int32(0))

    bad = _contract.Method("captures_b", run)

    def loss(b):
        captured["b"] = b
        x = _driver.solve(bad, lambda x: 2.0 * x, b, x0=None, precond=None, rtol=0.0,
                          atol=0.0, inner_product=None, axis_name=None).x
        return jnp.sum(x**2)

    with pytest.raises(Exception, match="[Tt]racer"):
        jax.grad(jax.jit(loss))(rhs(N))
