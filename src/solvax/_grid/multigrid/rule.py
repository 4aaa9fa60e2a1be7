"""The default configuration read from the coefficients (`multigrid`'s
`interpolation="auto"`, `coarse="auto"`, `coarse_size=None`).

A geometric hierarchy coarsened by two everywhere is fast and robust while
its grids resolve the coefficients. Where they jump on blocks a few cells
wide, the levels coarser than the blocks no longer represent the islands of
high conductivity and the iterations grow with the grid (random 50/50
blocks of contrast 1e4, 512^2, 4^2 cells: 660 CG iterations). Stopping the
hierarchy at a grid spacing of 4 cells and solving that level by lines
(`coarse="lines"`) brings them to 8-11, ahead of Ruge-Stueben. The rule
takes that configuration exactly where it pays:

1. the coefficients are concrete (a traced set-up cannot choose shapes from
   them: it keeps the plain configuration), the grid has 2 or 3 axes and
   the operator is not singular (a pure Neumann operator has no exact
   factorization by lines: its plain coarsest level is pseudo-inverted);
2. they jump: two neighbours' total couplings (a point's off-diagonal
   entries, the shift left out) differ by more than `JUMP`;
3. the jumps are at least `SPACING` cells apart along every axis where they
   come in pairs (`feature_size`: features finer than that are below the
   coarsest grid the rule can afford to solve, and the lines cost more than
   they save: per-cell random fields took 277 iterations against 292) and
   closer than the plain hierarchy's coarsest spacing (whose last level
   then still resolves them);
4. the shift does not dominate at the features' scale (`shift_weight`
   below `SHIFTED`: a backward-Euler operator with a large `1/dt` is well
   served by the plain cycle, three times cheaper per iteration; in 3-D,
   where the lines' hierarchy pays in iterations but not in time, any
   time-stepping shift);
5. a coarsest level of at most `LINES_SIZE` points (its factorization
   costs `n m^3` for `n` planes of `m` points) has a spacing no coarser
   than the features: `SPACING`, or the least power of two above it that
   keeps the level that small (1024^2: 8 cells).

Then: `coarse="lines"` with `coarse_size = points // spacing^d`, the
collapsed interpolation on 2-D grids and the full one on 3-D grids (where
the collapsed one took 18 iterations against 13 on 4^3 blocks), the Jacobi
smoother (multicolour Gauss-Seidel saved no iteration here for 2^d times
the work). Otherwise the plain configuration: collapsed interpolation, a
dense coarsest level of at most 64 points. Measured in
`benchmarks/benchmark_multigrid.py`, parts `blocks` and `shifted`
(`docs/multigrid.md`, "The default, chosen from the coefficients").
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ..stencil import StencilOperator

#: Neighbouring total couplings differing by more than this factor: a jump.
JUMP = 10.0
#: The coarsest grid spacing (in cells) the rule solves by lines.
SPACING = 4
#: The largest coarsest level the rule factors by lines (128^2 points:
#: about 0.1 s to factor and 8 ms a solve on one CPU core, float64).
LINES_SIZE = 16384
#: The plain configuration's coarsest level (points).
PLAIN_SIZE = 64
#: `shift_weight` at least this, by grid dimension: the shift dominates at
#: the features' scale. In 2-D the lines pay down to 0.05 (backward Euler
#: at 256^2: 0.38-0.86x the plain time below it). In 3-D their hierarchy
#: (full interpolation, a 16^3 level solved by lines at 64^3) costs 2-3x
#: the plain one per iteration, so it pays in iterations only, never in
#: time on the 64^3 grids measured (random blocks of 4^3 and 8^3 cells,
#: contrast 1e3 and 1e4, hierarchy built once: 1.06-1.98x the plain solve
#: at every shift from 0 to 1e4); a time-stepping shift (weight 6.5e-6 and
#: up there) takes the plain hierarchy.
SHIFTED = {2: 0.05, 3: 1e-6}


class Choice(NamedTuple):
    """`multigrid`'s resolved `interpolation`, `coarse` and `coarse_size`,
    and in words why (for the tests and the benchmark's reader; the
    hierarchy does not keep it)."""

    interpolation: str
    coarse: str
    coarse_size: int
    reason: str


def feature_size(w):
    """The least distance (in cells) between two jumps of `w` along a grid
    line, over every axis (a jump: neighbours differing by more than
    `JUMP`); inf where no line has two jumps (none, or one interface)."""
    least = jnp.asarray(jnp.inf)
    for axis in range(w.ndim):
        jump = jnp.moveaxis(_jump_faces(jnp.asarray(w), axis), axis, -1)
        if not jump.size:
            continue
        index = jnp.arange(jump.shape[-1])
        latest = jax.lax.cummax(jnp.where(jump, index, -1), axis=jump.ndim - 1)
        before = jnp.concatenate([jnp.full(latest.shape[:-1] + (1,), -1), latest[..., :-1]], -1)
        gaps = jnp.where(jump & (before >= 0), index - before, jnp.inf)
        least = jnp.minimum(least, jnp.min(gaps))
    return least


@jax.jit
def _measures(op: StencilOperator) -> tuple:
    """`(feature size, least shift excess, singular)` of `op`, in one
    compiled pass on its device(s): per point `w` the sum of the
    off-diagonal entries' magnitudes, the shift excess `(|a_0| - w) / w`
    (the diagonal's part the couplings do not balance, relative to them),
    and whether no point has any (no Dirichlet edge, no shift)."""
    zero = (0,) * op.ndim
    entries = op.entries
    w = jnp.broadcast_to(sum(jnp.abs(c) for o, c in entries.items() if o != zero), op.shape)
    centre = jnp.broadcast_to(jnp.abs(entries.get(zero, jnp.zeros(()))), op.shape)
    coupled = w > 0
    excess = jnp.where(coupled, jnp.maximum(centre - w, 0) / jnp.where(coupled, w, 1), jnp.inf)
    # the gaps' cumulative scan only where something jumps (Poisson 1024^2:
    # the rule in 2 ms instead of 24)
    size = jax.lax.cond(_jumps(w), feature_size, lambda w: jnp.asarray(jnp.inf), w)
    return size, jnp.min(excess), ~jnp.any(centre - w > singular_level(w.dtype) * w)


def singular_level(dtype) -> float:
    """The shift excess `(|a_0| - w) / w` below which a point counts as
    unshifted: the rounding of its row sum, `1e3 eps` of the coefficients'
    dtype (at least 1e-12). A float32 Neumann operator on blocks valued 1.1
    and 3333.3 had excesses of a few `eps` at every point: under a fixed
    1e-12 it was taken for shifted and got lines, which have no exact
    factorization of a singular level, where the same operator in float64
    was singular and plain. (In float32 neither configuration reaches 1e-4
    on it at 256^2: float32's floor there is about 2e-3.)"""
    return max(1e-12, 1e3 * float(jnp.finfo(dtype).eps))


def _jump_faces(w, axis: int):
    """Per face between two neighbours along `axis`, whether `w` jumps there
    (differs by more than `JUMP`)."""
    n = w.shape[axis]
    left, right = (jax.lax.slice_in_dim(w, a, b, axis=axis) for a, b in ((0, n - 1), (1, n)))
    return jnp.maximum(left, right) > JUMP * jnp.minimum(left, right)


def _jumps(w):
    """Whether `w` jumps anywhere (`feature_size`'s test, without the gaps)."""
    return functools.reduce(jnp.logical_or, [jnp.any(_jump_faces(w, a)) for a in range(w.ndim)])


def shift_weight(excess: float, size: float) -> float:
    """The least shift excess over the points times `size^2`: the same ratio
    on the Galerkin level of spacing `size` (a shift grows by `2^d` per
    level, a coupling by `2^(d-2)`)."""
    return excess * size ** 2


def plain(reason: str) -> Choice:
    return Choice("collapsed", "direct", PLAIN_SIZE, reason)


def choose(op: StencilOperator, concrete: bool) -> Choice:
    """The configuration `op`'s coefficients ask for (the module's rule)."""
    if not concrete:
        return plain("traced coefficients: the plain configuration")
    if op.ndim not in (2, 3) or all(b == "periodic" for b in op.boundary):
        return plain("a 1-D or all-periodic grid: the plain configuration")
    if all(jnp.ndim(c) == 0 for c in op.stored.values()):
        return plain("constant coefficients: the plain configuration")
    with jax.ensure_compile_time_eval():   # concrete coefficients closed over by a `jit`
        size, excess, singular = (v.item() for v in _measures(op))
    if singular:
        return plain("a singular operator (no Dirichlet edge, no shift): the plain "
                     "configuration, whose coarsest level is pseudo-inverted")
    points, d = math.prod(op.shape), op.ndim
    reach = (points / PLAIN_SIZE) ** (1 / d)       # the plain coarsest spacing
    if not SPACING <= size < reach:
        return plain(f"features of {size:g} cells (lines pay from {SPACING} to {reach:.3g})")
    weight = shift_weight(excess, size)
    if weight >= SHIFTED[d]:
        return plain(f"the shift dominates at the features' scale ({weight:.3g})")
    spacing = SPACING
    while points // spacing ** d > LINES_SIZE:
        spacing *= 2
    if spacing > size:
        return plain(f"features of {size:g} cells finer than the coarsest spacing the lines "
                     f"afford here ({spacing})")
    return Choice("full" if d == 3 else "collapsed", "lines", points // spacing ** d,
                  f"features of {size:g} cells: solved by lines at spacing {spacing}")
