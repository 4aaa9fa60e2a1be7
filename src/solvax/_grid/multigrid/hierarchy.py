"""The hierarchy: which axes to coarsen (semicoarsening from the stencil's
couplings, the devices splitting each axis), the levels built one by one,
and the alike coarse levels built by one scanned body (`Tail`)."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from ..stencil import StencilOperator
from .coarse import global_size
from .fusion import computed
from .galerkin import galerkin_operator
from .levels import Level, Tail, cropped, jitted, padded_to
from .smoothers import smoothing_data
from .transfer import coarse_shape, make_transfer


def is_concrete(op: StencilOperator) -> bool:
    return not any(isinstance(c, jax.core.Tracer) for c in op.stored.values())


def _strengths(op: StencilOperator) -> list:
    """Per axis, the mean coupling of a point to its two neighbours on that axis."""
    out = []
    for axis in range(op.ndim):
        total = 0.0
        for o, c in op.entries.items():
            if o[axis] != 0 and sum(map(abs, o)) == 1:
                total += float(np.mean(np.abs(np.asarray(c))))   # concrete: host-side
        out.append(total)
    return out


def shards_of(op: StencilOperator) -> tuple:
    """Per grid axis, how many devices split it: read from a concrete
    coefficient array's sharding (1 per axis when there is none to read)."""
    for c in op.stored.values():
        sharding = getattr(c, "sharding", None)
        if jnp.ndim(c) == op.ndim and isinstance(sharding, jax.sharding.NamedSharding):
            sizes = dict(sharding.mesh.shape)
            spec = tuple(sharding.spec) + (None,) * op.ndim
            out = []
            for entry in spec[:op.ndim]:
                names = entry if isinstance(entry, tuple) else (entry,)
                out.append(math.prod(sizes[name] for name in names if name is not None))
            return tuple(out)
    return (1,) * op.ndim


def _coarsenable(shape: tuple, boundary: tuple, shards: tuple, axis_names: tuple) -> list:
    """The axes of a grid that can be coarsened: at least 3 points (an even
    number on a periodic axis) and at least one coarse point per device
    splitting them; inside a `shard_map` block an even number (the whole
    grid's `2 j + 1` stays in the block)."""
    def able(n, b, d, name):
        if name is not None:
            return n % 2 == 0
        return n >= 3 and not (b == "periodic" and n % 2) and n // 2 >= d

    return [a for a, args in enumerate(zip(shape, boundary, shards, axis_names)) if able(*args)]


def _axes_to_coarsen(op: StencilOperator, threshold: float, shards: tuple) -> tuple:
    """The axes to coarsen below `op`: those with at least 3 points (an even
    number on a periodic axis) that keep at least one coarse point per
    device splitting them (`shards`), and whose coupling is at least
    `threshold` times the strongest coarsenable one's (semicoarsening where
    the operator is anisotropic; every axis when the coefficients are
    traced)."""
    able = _coarsenable(op.shape, op.boundary, shards, op.axis_names)
    if not able or not is_concrete(op):
        return tuple(able)
    s = _strengths(op)
    strongest = max(s[a] for a in able)
    if not strongest > 0:
        return tuple(able)
    return tuple(a for a in able if s[a] >= threshold * strongest)


#: The levels from the first with at most 1/`_TAIL_FRACTION` of the finest
#: grid's points on are built and cycled by one scanned body (`Tail`) where
#: at least `_TAIL_LEVELS` of them are coarsened alike. (Poisson 1024^2: its
#: levels from 128^2 on; the first call of MG-CG compiled in 5.2 s instead of
#: 7.2, with the same warm time. From 256^2 on: 4.1 s, but 22 ms more set-up
#: and 2 ms more per cycle: the padded levels' wasted work.)
_TAIL_FRACTION = 64


_TAIL_LEVELS = 3


def _tail_plan(op: StencilOperator, depth: int, *, finest: int, coarse_size: int,
               max_levels: int, shards: tuple, interpolation: str, one_device: bool):
    """`(shapes, axes)` where the levels from `op` (the `depth`-th) on form a
    `Tail`: `shapes` the grids of the tail's levels and of the coarsest one
    after it, each coarsened along the same `axes` from an even size; None
    where they do not, or where the levels are not known to be alike at
    trace time: concrete coefficients (semicoarsening reads them), the
    finest level (the operator as given), a grid that may be split across
    devices (`one_device`: one device in the process, or `shards` all 1
    given; a padded level of a sharded grid moved its blocks, one more
    all-gather per cycle on 8 devices) or a periodic axis; and levels
    larger than 1/`_TAIL_FRACTION` of the finest grid (`finest` points),
    whose padding would cost time."""
    if (not one_device or depth < 1 or is_concrete(op) or interpolation != "collapsed"
            or math.prod(op.shape) * _TAIL_FRACTION > finest
            or any(name is not None for name in op.axis_names) or "periodic" in op.boundary):
        return None
    shapes, axes, shape = [op.shape], None, op.shape
    while not (depth + 1 >= max_levels or math.prod(shape) <= coarse_size):
        able = tuple(_coarsenable(shape, op.boundary, shards, op.axis_names))
        if not able:
            break
        if axes not in (None, able) or any(shape[a] % 2 for a in able):
            return None
        axes, shape, depth = able, coarse_shape(shape, able), depth + 1
        shapes.append(shape)
    if len(shapes) - 1 < _TAIL_LEVELS:
        return None
    return tuple(shapes), axes


def _tail(op: StencilOperator, shapes: tuple, axes: tuple):
    """The `Tail` of the levels of grids `shapes[:-1]` from `op` (the first),
    and the coarsest level's operator (grid `shapes[-1]`): one scanned body
    per level: `lambda_max` (Lanczos inside the level's grid), the transfer
    and the Galerkin operator, padded back to the first level's shape."""
    padded = shapes[0]
    op = padded_to(op, padded)   # its arrays full-sized, the offsets sorted

    def body(op, region):
        lmax = smoothing_data(op, True, region)
        transfer = make_transfer(op, axes)
        return (padded_to(galerkin_operator(op, transfer, lmax, split=True), padded),
                Level(op, lmax, transfer, True))

    regions = jnp.asarray(np.array(shapes[:-1], np.int32))
    last, levels = jax.lax.scan(body, op, regions)
    return Tail(levels, shapes[:-1], padded), cropped(last, shapes[-1])


def build_hierarchy(op: StencilOperator, *, coarse_size: int, max_levels: int,
               semicoarsening: float, shards: tuple, interpolation: str,
               one_device: bool, materialize: bool = False) -> tuple:
    """`(levels, tail)`: the levels from `op` (the finest) built one by one
    until the coarsest, or until the ones left form a `Tail` (`_tail_plan`;
    then `levels` ends with that tail's first level and the coarsest).

    `materialize` (a narrowed hierarchy on one device: `multigrid` with a
    `dtype` or `storage_dtype` narrower than the operator's): each Galerkin
    operator is computed into memory (`computed`) before the next level's
    set-up and the level's narrowed copy read it. XLA:CPU otherwise fused
    it into what reads it and computed it again there (at 96^3 the set-up
    with bfloat16 storage took 202 ms against 114 for float32 storage; now
    87 against 84).
    Measured in one process, interleaved, Poisson 1024^2 to 1e-12, set-up
    included: float64 CG with the float32 cycle 234 against 242 ms,
    refinement with float32 MG-CG 219 against 234; but the all-float64
    MG-CG 373 against 349 (its set-up alone and its solve alone unchanged),
    so a hierarchy in the operator's own precision is not materialized.
    Not on a sharded grid either: fusion barriers there made XLA exchange
    the steps' halos separately (`galerkin_operator`). (Computing each level from
    the one above as stored in bfloat16 also avoids the duplicate, but took
    63 CG iterations against 50 at 96^3.)
    """
    levels, finest = [], math.prod(op.shape)
    while True:
        plan = _tail_plan(op, len(levels), finest=finest, coarse_size=coarse_size,
                          max_levels=max_levels, shards=shards, interpolation=interpolation,
                          one_device=one_device)
        if plan is not None:   # the levels from here on alike: one scanned body
            tail, op = _tail(op, *plan)
            first, tail = tail.split()
            return levels + [first, Level(op, smoothing_data(op, False), None, True)], tail
        last = len(levels) + 1 >= max_levels or global_size(op) <= coarse_size
        axes = () if last else _axes_to_coarsen(op, semicoarsening, shards)
        # Lanczos where a smoother reads lambda_max: not on the finest level
        # nor on the coarsest (solved, or smoothed by its own bounds)
        lmax = jitted(smoothing_data, 1)(op, bool(levels) and bool(axes))
        full = interpolation == "full" and len(axes) >= 2 and not any(
            b == "periodic" and (n // 2) % 3 for b, n in zip(op.boundary, op.shape))
        transfer = (jitted(make_transfer, 1, 2)(op, axes, full, lmax if one_device else None)
                    if axes else None)
        levels.append(Level(op, lmax, transfer, one_device))
        if not axes:
            return levels, None
        galerkin = functools.partial(jitted(galerkin_operator, 3), split=one_device)
        op = (computed(lmax, galerkin, op, transfer, lmax) if materialize
              else galerkin(op, transfer, lmax))
