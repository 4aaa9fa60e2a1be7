"""The default multigrid configuration read from the coefficients
(`_grid/multigrid/rule.py`): which operators get lines at a spacing of 4
cells, which the plain configuration, what the user's explicit options
override, and that the chosen hierarchy converges on rough coefficients
where the plain one does not."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from matrix import examples

import solvax as sx
from solvax._grid.multigrid import rule


def blocks(shape, size, contrast=1e4, seed=0):
    """Cell coefficients: blocks of `size` cells per axis, 1 or `contrast` at random."""
    rng = np.random.default_rng(seed)
    k = np.where(rng.random(tuple(n // size for n in shape)) < 0.5, contrast, 1.0)
    for axis in range(len(shape)):
        k = np.repeat(k, size, axis=axis)
    return jnp.asarray(k)


def test_feature_size_is_the_least_distance_between_jumps():
    for size in (4, 8):
        w = np.asarray(sx.diffusion_operator(blocks((64, 64), size)).diagonal())
        assert float(rule.feature_size(w)) == size
    # one interface: no line has two jumps; a smooth field: no jump at all
    half = np.where(np.arange(64)[:, None] < 32, 1e4, 1.0) * np.ones((64, 64))
    assert float(rule.feature_size(half)) == np.inf
    smooth = np.exp(np.linspace(0, 5, 64))[:, None] * np.ones((1, 64))
    assert float(rule.feature_size(smooth)) == np.inf


@pytest.mark.parametrize("shape, size, interpolation", [((64, 64), 4, "collapsed"),
                                                         ((128, 128), 8, "collapsed"),
                                                         ((32, 32, 32), 4, "full")])
def test_blocks_get_lines_at_a_spacing_of_four_cells(shape, size, interpolation):
    op = sx.diffusion_operator(blocks(shape, size))
    choice = rule.choose(op, True)
    points = int(np.prod(shape))
    assert choice[:3] == (interpolation, "lines", points // 4 ** len(shape)), choice.reason
    mg = sx.multigrid(op)
    assert mg.coarse == "lines" and mg.shapes[-1] == tuple(n // 4 for n in shape)


@pytest.mark.parametrize("case", ["poisson", "smooth", "anisotropic", "cells", "interface",
                                  "shifted", "neumann", "one axis", "large"])
def test_the_plain_configuration_where_lines_do_not_pay(case):
    n = 64
    ops = {
        "poisson": lambda: sx.diffusion_operator(1.0, shape=(n, n)),
        "smooth": lambda: sx.diffusion_operator(jnp.exp(jnp.linspace(0, 7, n))[:, None]
                                                * jnp.ones((n, n))),
        "anisotropic": lambda: sx.diffusion_operator((1e-3, 1.0), shape=(n, n)),
        "cells": lambda: sx.diffusion_operator(blocks((n, n), 1)),        # features of 1 cell
        # blocks beyond the plain hierarchy's reach
        "interface": lambda: sx.diffusion_operator(blocks((n, n), n // 2)),
        # a backward-Euler step with a large 1/dt: the shift dominates the blocks
        "shifted": lambda: sx.diffusion_operator(blocks((n, n), 8, 1e3), spacing=1 / n,
                                                 shift=1e7),
        "neumann": lambda: sx.diffusion_operator(blocks((n, n), 8), boundary="neumann"),
        "one axis": lambda: sx.diffusion_operator(blocks((4096,), 8)),
        # blocks of 4 at 1024^2: a coarsest level at their spacing would
        # have 65536 points, over what the rule factors
        "large": lambda: sx.diffusion_operator(blocks((1024, 1024), 4)),
    }
    choice = rule.choose(ops[case](), True)
    assert choice[:3] == ("collapsed", "direct", 64), choice.reason


def test_the_nearest_choices_of_lines():
    """Just inside each boundary of the rule: features of 4 cells (1 and 2
    are plain), a shift just below `SHIFTED`'s weight (2-D and 3-D), 512^2 at spacing 4
    (16384 points, the most the rule factors), and 1024^2 on blocks of 8
    (spacing 8 keeps the level at 16384 points)."""
    assert rule.shift_weight(0.5, 8) == 32
    # per dimension: 2-D at 128^2 on blocks of 8, 3-D at 32^3 on blocks of 4
    for shape, size in (((128, 128), 8), ((32, 32, 32), 4)):
        n = shape[0]
        k = blocks(shape, size, 1e3)
        w = np.asarray(sx.stencil_operator(sx.diffusion_operator(k, spacing=1 / n).entries,
                                           boundary="neumann").diagonal())   # couplings' sum
        scale = float(w.max()) / float(rule.feature_size(w)) ** 2
        threshold = rule.SHIFTED[len(shape)]
        for weight, coarse in ((0.5, "lines"), (2.0, "direct")):     # times the threshold
            shifted = sx.diffusion_operator(k, spacing=1 / n, shift=weight * threshold * scale)
            assert rule.choose(shifted, True).coarse == coarse, (shape, weight)
    assert rule.choose(sx.diffusion_operator(blocks((512, 512), 4)), True).coarse_size == 16384
    large = rule.choose(sx.diffusion_operator(blocks((1024, 1024), 8)), True)
    assert (large.coarse, large.coarse_size) == ("lines", 16384) and "spacing 8" in large.reason


def test_a_singular_float32_operator_is_singular():
    """Whether a point is shifted is judged against its row sum's rounding
    in the coefficients' dtype (`singular_level`): a float32 Neumann
    operator on blocks valued 1.1 and 3333.3 rounds to excesses of a few
    `eps` and was taken for shifted (lines, which cannot factor a singular
    level); now it is singular, as in float64. The nearest valid input:
    a float32 shift just above that level, still below `SHIFTED`, keeps the
    lines."""
    k = np.where(np.asarray(blocks((128, 128), 8)) > 2, 3333.3, 1.1)
    for dtype in (jnp.float32, jnp.float64):
        op = sx.diffusion_operator(jnp.asarray(k, dtype), boundary="neumann")
        assert "singular" in rule.choose(op, True).reason, dtype
    w = np.asarray(sx.diffusion_operator(jnp.asarray(k), boundary="neumann").diagonal())
    level = rule.singular_level(jnp.float32)
    assert level < 1e-3 and level * 8 ** 2 < rule.SHIFTED[2]
    shift = 4 * level * float(w.min())       # an excess of about 4x the level at every point
    op = sx.diffusion_operator(jnp.asarray(k, jnp.float32), boundary="neumann", shift=shift)
    assert rule.choose(op, True).coarse == "lines"


def test_traced_coefficients_keep_the_plain_configuration():
    k = blocks((64, 64), 4)

    @jax.jit
    def shapes_of(k):
        mg = sx.multigrid(sx.diffusion_operator(k))
        assert mg.coarse == "direct"
        return mg(jnp.ones((64, 64)))

    shapes_of(k)
    assert sx.multigrid(sx.diffusion_operator(k)).coarse == "lines"   # concrete: chosen


def test_explicit_options_override_the_rule():
    op = sx.diffusion_operator(blocks((64, 64), 4))
    plain = sx.multigrid(op, interpolation="collapsed", coarse="direct")
    assert plain.coarse == "direct" and np.prod(plain.shapes[-1]) <= 64
    # a given coarse size picks what can treat it; the interpolation is still chosen
    assert sx.multigrid(op, coarse_size=16).coarse == "direct"
    full = sx.multigrid(op, interpolation="full")
    assert full.coarse == "lines" and full.levels[0].transfer.full
    with pytest.raises(ValueError, match="`interpolation`.*auto"):
        sx.multigrid(op, interpolation="rule")
    with pytest.raises(ValueError, match="`coarse`.*auto"):
        sx.multigrid(op, coarse="rule")


def test_default_converges_on_blocks_where_the_plain_one_crawls():
    """Random blocks of 4^2 cells, contrast 1e4, 128^2: CG with the default
    in a handful of iterations, the plain configuration in many more; the
    true residual meets the tolerance."""
    op = sx.diffusion_operator(blocks((128, 128), 4))
    b = jnp.asarray(np.random.default_rng(1).standard_normal((128, 128)))
    solve = jax.jit(lambda m, b: sx.pcg(op, b, precond=m, rtol=1e-8, atol=0.0))
    chosen = solve(sx.multigrid(op), b)
    plain = solve(sx.multigrid(op, interpolation="collapsed", coarse="direct"), b)
    assert chosen.converged and int(chosen.iterations) <= 10
    assert int(plain.iterations) >= 4 * int(chosen.iterations)
    assert float(jnp.linalg.norm(b - op(chosen.x)) / jnp.linalg.norm(b)) <= 1e-8


@settings(max_examples=examples(4), deadline=None)
@given(size=st.sampled_from([2, 4, 8, 16]), contrast=st.sampled_from([1e1, 1e2, 1e4]),
       shift=st.sampled_from([0.0, 1e2, 1e4]), seed=st.integers(0, 2**16))
def test_default_converged_means_the_true_residual_meets_the_tolerance(size, contrast, shift,
                                                                        seed):
    """Whatever the rule picks on random blocks (lines or plain), CG with the
    default multigrid converges, and its true residual meets the tolerance."""
    n = 64
    op = sx.diffusion_operator(blocks((n, n), size, contrast, seed), spacing=1 / n, shift=shift)
    b = jnp.asarray(np.random.default_rng(seed).standard_normal((n, n)))
    sol = sx.pcg(op, b, precond=sx.multigrid(op), rtol=1e-8, atol=0.0)
    assert sol.converged
    assert float(jnp.linalg.norm(b - op(sol.x)) / jnp.linalg.norm(b)) <= 1.01e-8


def test_on_a_mesh_the_chosen_cycle_adds_no_all_reduce():
    """Blocks on a grid split by rows over 8 devices: the rule reads the
    sharded coefficients, chooses lines, and a cycle communicates halos and
    one all-gather of the coarsest grid, no all-reduce."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    sharding = NamedSharding(Mesh(np.array(jax.devices()), ("i",)), P("i", None))
    k = jax.device_put(blocks((64, 64), 4), sharding)
    mg = sx.multigrid(sx.diffusion_operator(k))
    assert mg.coarse == "lines" and mg.shapes[-1] == (16, 16)
    r = jax.device_put(jnp.ones((64, 64)), sharding)
    cycle = sx.count_collectives(lambda m, r: m(r), mg, r)
    assert set(cycle.by_kind) <= {"all-gather", "collective-permute"}, str(cycle)
    assert cycle.count("all-gather") == 1
