"""Geometric multigrid on structured grids, built from stencils.

A hierarchy of `StencilOperator`s: each coarse operator is the Galerkin
product `R A P` computed in stencil form, in closed form one coarsened axis
at a time (`galerkin.py`: each coarse entry a sum of products of the fine
entries at three rows with the interpolation weights), so variable,
discontinuous and anisotropic coefficients coarsen as the operator says, and
set-up is elementwise array algebra that runs under `jit` with traced
coefficients. (It replaced probing `R A P` with one indicator per colour of
a 3-colouring: 2 to 3 times the set-up time, and wrong on periodic axes of
two coarse points, where the offsets -1 and +1 are the same neighbour.)

Transfers are linear interpolation along each coarsened axis (coarse point
`j` is fine point `2 j + 1`; the boundary extends the coarse grid as the
operator's boundary does) and restriction its exact transpose
(`jax.linear_transpose`), so a V-cycle with matching pre- and post-smoothing
is symmetric. Everything in a cycle is elementwise work, one-sided pads and
slices (halos: collective-permutes on a sharded axis), and reshapes that
interleave or split the points of an axis; nothing reduces. The coarsest
level is solved directly with a (pseudo-)inverse computed at set-up.

The package, one concept per module, each importing only those above it:
`fusion` (the backend's fusion barriers and scan unrolling), `transfer`
(interpolation and restriction), `galerkin` (`R A P` in stencil form),
`levels` (a level, the padded tail of alike levels), `smoothers` (their
spectral bounds and the `SMOOTHERS` registry), `coarse` (the coarsest
level's treatments, the `COARSE` registry), `hierarchy` (which axes to
coarsen, the levels built), `cycle` (`Multigrid`: V, W and F cycles),
`rule` (the default configuration read from the coefficients), `builder`
(`multigrid`: its options checked and resolved, the hierarchy built).
"""

from .builder import multigrid
from .coarse import COARSE, CoarseSolve, register_coarse
from .cycle import CYCLES, Multigrid
from .smoothers import SMOOTHERS, Smoother, register_smoother
from .transfer import INTERPOLATIONS

__all__ = ["COARSE", "CYCLES", "INTERPOLATIONS", "SMOOTHERS", "CoarseSolve", "Multigrid",
           "Smoother", "multigrid", "register_coarse", "register_smoother"]
