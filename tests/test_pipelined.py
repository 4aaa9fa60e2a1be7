"""What is particular to pipelined CG (`pcg(method="pipelined")`): its
confirmed stopping test on the true residual. The generic behaviour is tested
for every entry of `helpers.SOLVERS`."""

import jax
import jax.numpy as jnp
from helpers import poisson_2d, rhs

import solvax as sx
from solvax import Status


def true_rel_residual(matvec, b, x):
    return float(jnp.linalg.norm(b - matvec(x)) / jnp.linalg.norm(b))


def test_pipelined_default_meets_the_tolerance_on_poisson_512():
    """Measured before: stopped at a true relative residual of 4.7e-7 (asked
    1e-8). The confirmed stopping test restarts from x when its own residual
    meets the tolerance and stops on the true one."""
    b = jnp.ones((512, 512))
    sol = jax.jit(lambda b: sx.pcg(poisson_2d, b, rtol=1e-8, method="pipelined"))(b)
    assert bool(sol.converged), sol.message
    assert true_rel_residual(poisson_2d, b, sol.x) <= 1e-8


def test_pipelined_below_its_attainable_accuracy_stops_honestly():
    """Asked for 1e-15 (below what the recurrences attain in float64): it
    stops early, not converged, as STAGNATION (a restart that no longer
    lowers the true residual) or INDEFINITE (the recurrence's curvature
    rounded to <= 0; its message says so), never claiming success."""
    b = rhs((32, 32), seed=15)
    sol = sx.pcg(poisson_2d, b, rtol=1e-15, method="pipelined", max_steps=5000)
    assert Status(int(sol.status)) in (Status.STAGNATION, Status.INDEFINITE), sol.message
    assert int(sol.iterations) < 5000 and not bool(sol.converged)
