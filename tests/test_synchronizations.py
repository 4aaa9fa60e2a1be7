"""Synchronizations per step, executed: every preconditioned Krylov method with
Jacobi and with multigrid, under `jit` and inside `shard_map`, pinned.

`CollectiveReport.per_step` counts what one pass of a solve's innermost
loop *executes*: each array of a variadic all-reduce (XLA:CPU synchronizes
once per array; the combiner of jax >= 0.7 merges separate all-reduces into
one such instruction) and, of a conditional, its busiest branch. The
problem: variable-coefficient diffusion on a 16 x 16 grid, rows split over 8
devices (`P('i', None)`); under `jit` the hierarchy is built outside the
solve and passed in, inside `shard_map` it is built from each block.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import mesh, put
from jax.sharding import PartitionSpec as P
from matrix import sample

import solvax as sx

SHAPE = (16, 16)
# method: (solver, options, matvecs and preconditioner applications per step)
METHODS = {
    "standard": (sx.pcg, {}, 1),
    "single_reduction": (sx.pcg, {"method": "single_reduction"}, 1),
    "pipelined": (sx.pcg, {"method": "pipelined"}, 1),
    "s_step": (sx.pcg, {"method": "s_step", "s": 4}, 4),
    "gmres": (sx.gmres, {"restart": 8}, 1),
    "bicgstab": (sx.bicgstab, {}, 2),
    "idrs": (sx.idrs, {"s": 2}, 3),
    "minres": (sx.minres, {}, 1),
}
# all-reduces (arrays) one step executes: the recurrence's synchronizations
ALL_REDUCES = {"standard": 2, "single_reduction": 1, "pipelined": 1, "s_step": 1,
               "gmres": 1, "bicgstab": 2, "idrs": 3, "minres": 1}


def _problem():
    rng = np.random.default_rng(3)
    m = mesh(8)
    k = put(jnp.asarray(np.exp(rng.standard_normal(SHAPE))), m, "i", None)
    b = put(jnp.asarray(rng.standard_normal(SHAPE)), m, "i", None)
    return m, k, b


def _precond(kind, A):
    if kind == "jacobi":
        return sx.jacobi(A.diagonal())
    return sx.multigrid(A, coarse="chebyshev" if kind == "chebyshev" else "direct")


@functools.cache
def _report(method, kind, mode):
    solver, options, _ = METHODS[method]
    m, k, b = _problem()
    if mode == "jit":
        A = sx.diffusion_operator(k)
        M = _precond(kind, A)
        return sx.count_collectives(
            lambda A, M, b: solver(A, b, precond=M, **options).x, A, M, b)

    def local(k, b):
        A = sx.diffusion_operator(k, axis_names=("i", None))
        return solver(A, b, precond=_precond(kind, A), axis_name="i", **options).x

    spec = P("i", None)
    return sx.count_collectives(sx.shard_map(local, mesh=m, in_specs=(spec, spec),
                                             out_specs=spec), k, b)


@functools.cache
def _halos(kind, mode):
    """Collective-permutes of one matvec and of one preconditioner application."""
    m, k, b = _problem()
    spec = P("i", None)

    def apply(which):
        def fn(k, r):
            A = sx.diffusion_operator(k, axis_names=("i", None) if mode == "shard_map" else
                                      (None, None))
            M = _precond(kind, A)
            # one application, in a loop of two trips (the counter's step loop)
            return jax.lax.fori_loop(0, 2, lambda _, r: (A if which == "A" else M)(r), r)
        if mode == "jit":
            return sx.count_collectives(fn, k, b)
        return sx.count_collectives(sx.shard_map(fn, mesh=m, in_specs=(spec, spec),
                                                 out_specs=spec), k, b)

    return (apply("A").step_count("collective-permute"),
            apply("M").step_count("collective-permute"))


# every pair of method x preconditioner x nesting (SOLVAX_TEST_MATRIX=full: all 32)
@pytest.mark.parametrize("method, kind, mode", sample(
    "test_executed_collectives_per_step", method=list(METHODS), kind=["jacobi", "multigrid"],
    mode=["jit", "shard_map"]))
def test_executed_collectives_per_step(method, kind, mode):
    """All-reduces: the recurrence's own (a cycle adds none); all-gathers: the
    coarsest grid once per cycle (none with Jacobi); collective-permutes: the
    halos of the step's matvecs and cycles, nothing else."""
    report = _report(method, kind, mode)
    applications = METHODS[method][2]
    assert report.step_count("all-reduce") == ALL_REDUCES[method], str(report)
    gathers = applications if kind == "multigrid" else 0
    assert report.step_count("all-gather") == gathers, str(report)
    matvec, cycle = _halos(kind, mode)
    assert report.step_count("collective-permute") == applications * (matvec + cycle), (
        str(report), matvec, cycle)
    assert set(report.per_step) <= {"all-reduce", "all-gather", "collective-permute"}


@pytest.mark.parametrize("method", ["standard", "single_reduction"])
def test_a_chebyshev_coarsest_level_gathers_nothing(method):
    """`coarse="chebyshev"`: the coarsest grid (8 x 8, one row per device) is
    smoothed, not gathered and solved: a step synchronizes only for the
    recurrence, its cycle adds halos alone."""
    report = _report(method, "chebyshev", "jit")
    assert report.count("all-gather") == 0, str(report)
    assert report.step_count("all-reduce") == ALL_REDUCES[method], str(report)


def test_the_static_all_reduces_of_a_multigrid_solve_are_set_up():
    """MG-PCG with its hierarchy built inside the program (as `python -m solvax`
    does): besides the CG loop's own 2 all-reduces, every all-reduce inside a
    `while` body belongs to a set-up Lanczos loop (10 trips, once per solve,
    2 per step: one per level between the finest, which takes Gershgorin's
    bound, and the coarsest, which is solved), none to the iteration. (At
    64^2 and 256^2: 2 + 2 x 2 and 2 + 4 x 2 all-reduces inside loops.)"""
    m, k, b = _problem()
    k32, b32 = (put(jnp.asarray(np.resize(np.asarray(v), (32, 32))), m, "i", None)
                for v in (k, b))

    def solve(k, b):
        A = sx.diffusion_operator(k)
        return sx.pcg(A, b, precond=sx.multigrid(A)).x

    report = sx.count_collectives(solve, k32, b32)
    assert report.step_count("all-reduce") == 2 and report.step_count("all-gather") == 1
    others = [loop for loop in report.loops if loop.name != report.step_loop]
    levels = len(sx.multigrid(sx.diffusion_operator(k32)).shapes)
    assert levels == 3 and len(others) == levels - 2, str(report)
    for loop in others:
        assert loop.trip_count == 10 and loop.depth == 0, str(report)
        assert report.loop_count(loop.name, "all-reduce") == 2, str(report)
        assert report.loop_count(loop.name, "all-gather") == 0


def test_minres_synchronizes_once_per_lanczos_step_on_a_sharded_indefinite_operator():
    """n = 4096 on 8 devices, a symmetric indefinite diagonal-plus-roll operator:
    one all-reduce per Lanczos step (the step loop); the round loop around it
    adds one per true-residual check (a round ends only when the QR's
    estimate meets its target). Counting the round loop as the step (the
    outermost loop, with the inner one once) reads 2."""
    m = mesh(8)
    n = 4096
    d = put(jnp.asarray(np.linspace(-2.0, 2.0, n) + 0.01), m, "i")
    b = put(jnp.asarray(np.random.default_rng(5).standard_normal(n)), m, "i")

    def matvec(d):
        return lambda x: d * x + 0.3 * (jnp.roll(x, 1) + jnp.roll(x, -1))

    report = sx.count_collectives(lambda d, b: sx.minres(matvec(d), b).x, d, b)
    assert report.step_count("all-reduce") == 1, str(report)
    rounds = [loop for loop in report.loops if loop.depth == 0]
    assert [report.loop_count(loop.name, "all-reduce") for loop in rounds] == [1]
    assert report.count("all-gather") == 0
