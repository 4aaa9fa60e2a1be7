"""One place decides each target's form (`solvax._core.target`): its table is
the docs', forcing a target reaches every rule, and the GPU's form, traced and
run on this CPU, is the same solve in a program of loops without conditionals."""

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import SOLVERS

import solvax as sx
from solvax._core import dense, reduce, target, tree
from solvax._grid.multigrid.fusion import scan_unroll

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_docs_table_is_the_modules():
    assert target.table() in (ROOT / "docs" / "targets.md").read_text()


def test_forcing_a_target_reaches_every_rule():
    # a GPU or TPU mesh stacks a step's products only on a JAX without the
    # all-reduce combiner (0.4.38: `reduce.MERGES_ALL_REDUCES`)
    stacked = not reduce.MERGES_ALL_REDUCES
    expected = {"cpu": (True, True, False, True, 1, True),
                "gpu": (stacked, True, False, False, target.GPU_STEPS_PER_TEST, False),
                "tpu": (stacked, False, True, False, 1, True)}
    for platform, want in expected.items():
        with target.forced(platform, devices=8):
            got = (reduce.stacks_products(), tree.combines_by_gemm(),
                   dense.emulated(jnp.float64), target.fusion_barriers(),
                   target.steps_per_test(), target.branches_on_device())
            assert got == want, platform
            assert scan_unroll(5) == 1 and not reduce.reduces_before_loop()
        with target.forced(platform, devices=1):
            assert reduce.reduces_before_loop() and not reduce.stacks_products()
            assert reduce.reads_rows_in_use() == (platform == "tpu")
    assert target.platform() == "cpu"


def test_forced_checks_its_arguments():
    with pytest.raises(ValueError, match="`platform`"):
        with target.forced("npu"):
            pass
    with pytest.raises(ValueError, match="`devices`"):
        with target.forced("gpu", devices=0):
            pass
    with target.forced("cuda", devices=1):   # nearest valid: JAX's name for a GPU
        assert target.platform() == "gpu" and target.one_device()


def _operator(solver):
    """A periodic 1-D three-point operator: nonsymmetric for the solvers that
    take one, symmetric positive definite for the others."""
    left = 0.6 if solver.nonsymmetric else 0.5
    return lambda x: 2.2 * x - left * jnp.roll(x, 1) - (1 - left) * jnp.roll(x, -1)


def _solves(form, names, b):
    with target.forced(form):
        return {name: jax.jit(lambda b, s=SOLVERS[name]: s.solve(
            _operator(s), b, rtol=1e-10))(b) for name in names}


def test_the_gpu_form_is_the_same_solve():
    """Steps in counted inner loops of 8, frozen after the test fails: the
    same iterations, status and x as one test per step (every registered
    solver measured: bitwise but one-sync BiCGStab, 2e-15)."""
    names = ["pcg", "pcg_pipelined", "pcg_pipelined_replacement", "pcg_s_step", "gmres",
             "gcrot", "bicgstab", "idrs", "minres"]
    b = jnp.asarray(np.random.default_rng(0).standard_normal(64))
    cpu, gpu = _solves("cpu", names, b), _solves("gpu", names, b)
    for name in names:
        assert int(gpu[name].iterations) == int(cpu[name].iterations), name
        assert int(gpu[name].status) == int(cpu[name].status) == sx.Status.CONVERGED, name
        np.testing.assert_allclose(gpu[name].x, cpu[name].x, rtol=0, atol=1e-13)


def _program(fn, *args):
    text = jax.jit(fn).lower(*args).compile().as_text()
    instructions = sum(1 for line in text.splitlines()
                       if re.match(r"\s+(ROOT )?%?[\w.\-]+ = ", line))
    return text, instructions


def test_a_gpu_krylov_step_loop_has_a_known_trip_count_and_no_conditional():
    with target.forced("gpu"):
        text, _ = _program(lambda b: sx.pcg(lambda x: 2.0 * x - 0.5 * jnp.roll(x, 1)
                                            - 0.5 * jnp.roll(x, -1), b).x, jnp.ones(64))
    assert f'"known_trip_count":{{"n":"{target.GPU_STEPS_PER_TEST}"}}' in text
    assert "conditional(" not in text


def test_a_gpu_f_cycle_with_its_tail_is_the_same_cycle():
    """An F-cycle built inside `jit` (its coarse levels a padded tail, run by
    moves) in the GPU's form: no conditional, the CPU form's correction to
    rounding."""
    n = 256
    k = jnp.asarray(np.exp(np.random.default_rng(0).standard_normal((n, n))))
    r = jnp.asarray(np.random.default_rng(1).standard_normal((n, n)))
    out = {}
    for form in ("cpu", "gpu"):
        with target.forced(form, devices=1):
            fn = jax.jit(lambda k, r: sx.multigrid(sx.diffusion_operator(k), cycle="F")(r))
            if form == "gpu":
                assert "conditional(" not in fn.lower(k, r).compile().as_text()
            out[form] = np.asarray(fn(k, r))
    np.testing.assert_allclose(out["gpu"], out["cpu"], rtol=0,
                               atol=1e-13 * np.abs(out["cpu"]).max())


@pytest.mark.parametrize("name", ["pcg_pipelined_replacement", "pcg_s_step", "gcrot"])
def test_a_gpu_program_has_no_conditional(name):
    """The solvers whose loops held a conditional (residual replacement, the
    s-step Ritz estimate, the recycled space's update) select instead in the
    GPU's form; their CPU and TPU forms keep the conditional (measured
    there, unchanged)."""
    s = SOLVERS[name]
    with target.forced("gpu", devices=1):
        text, _ = _program(lambda b: s.solve(_operator(s), b).x, jnp.ones(64))
    assert "conditional(" not in text


def test_gpu_cycles_are_loops_without_conditionals_and_linear_in_the_levels():
    """V, W and F cycles in one GPU's form: no conditional (an F-cycle's
    skipped visits run on a zero residual, its tail's moves select), at most 1.3x the CPU
    form's instructions, a W-cycle's program growing by about the same code
    per level (unrolled, the GPU form was exponential: 62,472 instructions
    at 1024^2 against 3,326 for the CPU's)."""
    def cycle(n, kind):
        A = sx.diffusion_operator(jnp.ones((n, n)))
        mg = sx.multigrid(A, cycle=kind)
        return _program(lambda r: mg(r), jnp.ones((n, n)))

    with target.forced("cpu", devices=1):
        cpu = {kind: cycle(128, kind)[1] for kind in ("V", "W", "F")}
    with target.forced("gpu", devices=1):
        for kind in ("V", "W", "F"):
            text, size = cycle(128, kind)
            assert "conditional(" not in text and size <= 1.3 * cpu[kind], (kind, size, cpu)
        sizes = [cycle(n, "W")[1] for n in (64, 128, 256)]
    steps = np.diff(sizes)
    assert steps[0] > 0 and abs(steps[1] - steps[0]) <= 0.25 * steps[0], sizes
