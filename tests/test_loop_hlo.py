"""Compiler facts about the solver loops that their speed depends on.

The optimized HLO of a loop body must not copy a whole vector or basis each
iteration (docs/krylov.md, "Speed on one CPU"): single-reduction and pipelined
CG order their in-place updates (`_tree.after`), GMRES writes basis rows
without reading the basis (`_tree.basis_fill`). And the integer diagnostics
keep their dtypes through the implicit-differentiation wrapper.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import all_equations, convection_diffusion, poisson_2d

import solvax as sx

N = 48
laplacian = poisson_2d
convection = convection_diffusion()


def loop_body_copies(fn, b, shape):
    """Copies of an array of `shape` inside the step loops (`while` bodies
    with no loop nested in them) of `fn`'s optimized HLO. (The rounds of
    pipelined CG copy a few vectors per round, at its restart.)"""
    text = jax.jit(fn).lower(b).compile().as_text()
    bodies = set(re.findall(r"body=%?([\w.\-]+)", text))
    computations = re.split(r"\n(?=\S)", text)
    dims = ",".join(str(d) for d in shape)
    copy = re.compile(rf"= f64\[{dims}\]\{{[\d,]*\}} copy\(")
    count = 0
    for computation in computations:
        name = re.match(r"%?([\w.\-]+)", computation.strip())
        if name and name.group(1) in bodies and " while(" not in computation:
            count += len(copy.findall(computation))
    return count


@pytest.mark.parametrize("method", ["standard", "single_reduction", "pipelined"])
def test_cg_loop_copies_no_vector(method):
    b = jnp.ones((N, N))
    assert loop_body_copies(lambda b: sx.pcg(laplacian, b, method=method).x, b, (N, N)) == 0


@pytest.mark.parametrize("orthogonalization", ["one_sync", "cgs2"])
def test_gmres_loop_copies_no_basis(orthogonalization):
    b = jnp.ones((N, N))
    restart = 12
    rows = restart + 2 if orthogonalization == "one_sync" else restart + 1

    def solve(b):
        return sx.gmres(convection, b, restart=restart,
                        orthogonalization=orthogonalization).x

    assert loop_body_copies(solve, b, (rows, N, N)) == 0


@pytest.mark.parametrize("solver", ["pcg", "gmres", "linear_solve"])
def test_diagnostics_keep_their_dtypes(solver):
    b = jnp.ones((N, N))
    if solver == "pcg":
        run = lambda b: sx.pcg(laplacian, b)  # noqa: E731
    elif solver == "gmres":
        run = lambda b: sx.gmres(convection, b)  # noqa: E731
    else:
        run = lambda b: sx.linear_solve(convection, b, solver=sx.gmres)  # noqa: E731
    for sol in (run(b), jax.jit(run)(b), jax.jvp(run, (b,), (b,))[0]):
        assert sol.status.dtype == jnp.int32
        assert sol.converged.dtype == jnp.bool_
        assert sol.iterations.dtype == jnp.int32
        assert bool(sol.converged) and int(sol.status) == int(sx.Status.CONVERGED)
        assert np.isfinite(float(sol.residual_norm))


def _vector_conds(jaxpr, shape):
    """`cond`s of `jaxpr` (nested too) with an operand of `shape`."""
    return sum(eqn.primitive.name == "cond"
               and any(getattr(v.aval, "shape", None) == shape for v in eqn.invars)
               for eqn in all_equations(jaxpr))


@pytest.mark.parametrize("solve", [
    lambda b: sx.pcg(laplacian, b, method="pipelined"),
    lambda b: sx.pcg(laplacian, b, method="s_step"),
    lambda b: sx.bicgstab(convection, b),
    lambda b: sx.bicgstab(convection, b, method="one_sync"),
], ids=["pipelined", "s_step", "bicgstab", "bicgstab_one_sync"])
def test_rounds_have_no_conditional_over_vectors(solve):
    """The methods that confirm their stopping test in rounds restart without
    a `cond` over the vectors (`steps.confirmed_rounds`): on a TPU one made
    XLA keep pipelined CG's vectors in HBM (6.8x jax.scipy's CG step at
    2048^2; 1.08x without). What the chip compiles is pinned on the CPU."""
    b = jnp.ones((N, N))
    assert _vector_conds(jax.make_jaxpr(lambda b: solve(b).x)(b), (N, N)) == 0
