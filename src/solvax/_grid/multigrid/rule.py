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
4. the shift does not dominate at the features' scale (`shift_weight`: a
   backward-Euler operator with a large `1/dt` is well served by the plain
   cycle, three times cheaper per iteration);
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

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

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
#: `shift_weight` at least this: the shift dominates at the features' scale.
SHIFTED = 0.05


class Choice(NamedTuple):
    """`multigrid`'s resolved `interpolation`, `coarse` and `coarse_size`,
    and in words why (`Multigrid.choice`)."""

    interpolation: str
    coarse: str
    coarse_size: int
    reason: str


def _couplings(op: StencilOperator) -> tuple:
    """`(w, centre)` on the host: per point the sum of the off-diagonal
    entries' magnitudes, and the diagonal's magnitude."""
    zero = (0,) * op.ndim
    with jax.ensure_compile_time_eval():   # concrete coefficients closed over by a `jit`
        entries = op.entries
        w = sum(jnp.abs(c) for o, c in entries.items() if o != zero)
        centre = jnp.abs(entries.get(zero, 0.0))
    return (np.broadcast_to(np.asarray(w), op.shape),
            np.broadcast_to(np.asarray(centre), op.shape))


def feature_size(w: np.ndarray) -> float:
    """The least distance (in cells) between two jumps of `w` along a grid
    line, over every axis (a jump: neighbours differing by more than
    `JUMP`); inf where no line has two jumps (none, or one interface)."""
    least = math.inf
    for axis in range(w.ndim):
        a = np.moveaxis(w, axis, -1)
        left, right = a[..., :-1], a[..., 1:]
        jump = np.maximum(left, right) > JUMP * np.minimum(left, right)
        faces = np.flatnonzero(jump)          # in C order: line by line
        if faces.size < 2:
            continue
        line = faces // jump.shape[-1]
        gaps = np.diff(faces)[line[1:] == line[:-1]]
        if gaps.size:
            least = min(least, float(gaps.min()))
    return least


def shift_weight(w: np.ndarray, centre: np.ndarray, size: float) -> float:
    """The least, over the points, of the diagonal's part not balanced by the
    couplings (the shift) relative to them, times `size^2`: the same ratio
    on the Galerkin level of spacing `size` (a shift grows by `2^d` per
    level, a coupling by `2^(d-2)`)."""
    coupled = w > 0
    if not coupled.any():
        return math.inf
    excess = np.maximum(centre[coupled] - w[coupled], 0) / w[coupled]
    return float(excess.min()) * size ** 2


def plain(reason: str) -> Choice:
    return Choice("collapsed", "direct", PLAIN_SIZE, reason)


def choose(op: StencilOperator, concrete: bool) -> Choice:
    """The configuration `op`'s coefficients ask for (the module's rule)."""
    if not concrete:
        return plain("traced coefficients: the plain configuration")
    if op.ndim not in (2, 3) or all(b == "periodic" for b in op.boundary):
        return plain("a 1-D or all-periodic grid: the plain configuration")
    if all(np.ndim(c) == 0 for c in op.stored.values()):
        return plain("constant coefficients: the plain configuration")
    w, centre = _couplings(op)
    if not (centre - w > 1e-12 * w).any():
        return plain("a singular operator (no Dirichlet edge, no shift): the plain "
                     "configuration, whose coarsest level is pseudo-inverted")
    size = feature_size(w)
    points, d = math.prod(op.shape), op.ndim
    reach = (points / PLAIN_SIZE) ** (1 / d)       # the plain coarsest spacing
    if not SPACING <= size < reach:
        return plain(f"features of {size:g} cells (lines pay from {SPACING} to {reach:.3g})")
    weight = shift_weight(w, centre, size)
    if weight >= SHIFTED:
        return plain(f"the shift dominates at the features' scale ({weight:.3g})")
    spacing = SPACING
    while points // spacing ** d > LINES_SIZE:
        spacing *= 2
    if spacing > size:
        return plain(f"features of {size:g} cells finer than the coarsest spacing the lines "
                     f"afford here ({spacing})")
    return Choice("full" if d == 3 else "collapsed", "lines", points // spacing ** d,
                  f"features of {size:g} cells: solved by lines at spacing {spacing}")
