"""A multigrid level (operator, smoother scale, transfer), the padded tail of
alike coarse levels stacked for one scanned body, and the set-up's
compiled steps."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ..stencil import StencilOperator
from .fusion import computed, repeated
from .transfer import Transfer


def jitted(fn, *static):
    """`fn` compiled (set-up steps run as one program each when called eagerly;
    under an enclosing `jit` they are inlined)."""
    return jax.jit(fn, static_argnums=static)


def dinv(op: StencilOperator, v):
    """`D^{-1} v`: a division by the stencil's centre (no stored inverse)."""
    return v / op.diagonal().astype(v.dtype)


@jax.tree_util.register_pytree_node_class
class Level:
    """One level: its operator, `lambda_max` of `D^{-1} A` (its smoothers'
    scale) and the transfer to the level below (None on the coarsest).
    `looped`: its grid is on one device, and a smoother's repeated step runs
    as a loop (`fusion.repeated`); on a grid that may be split across
    devices the steps stay unrolled, so that a solve's step loop is the
    innermost loop with collectives (what `count_collectives` reports)."""

    def __init__(self, op: StencilOperator, lmax, transfer, looped: bool):
        self.op, self.lmax, self.transfer, self.looped = op, lmax, transfer, looped

    def tree_flatten(self):
        return (self.op, self.lmax, self.transfer), self.looped

    def keep(self):
        """`fn, *args -> fn(*args)` computed into memory before what reads it
        (`fusion.computed`, keyed on this level's set-up value `lmax`)."""
        return functools.partial(computed, self.lmax)

    def repeated(self, step, times: int, x):
        """`step` applied `times` times to `x`: `fusion.repeated`, a loop
        where `looped`, else unrolled."""
        return repeated(step, times, x, self.looped)

    @classmethod
    def tree_unflatten(cls, aux, leaves):
        return cls(*leaves, aux)


@jax.tree_util.register_pytree_node_class
class Tail:
    """Coarse levels written once: each level's arrays padded to the shape of
    the first (`padded`) and stacked on a leading axis, so their set-up and
    their part of a V-cycle are one `lax.scan` body each instead of one
    program section per level (XLA compiles every section's kernels: a
    1024 x 1024 hierarchy's eight levels took 6-7 s to compile).

    A padded level is its grid in the low corner, and outside it the
    identity, coupled to nothing: a product, a smoothing step and the
    transfers (weights 0 outside: `make_transfer` of a row without neighbours)
    act on the grid exactly as on the grid alone, and keep zeros outside.
    `shapes`: each level's own grid."""

    def __init__(self, levels, shapes: tuple, padded: tuple):
        self.levels, self.shapes, self.padded = levels, shapes, padded

    def tree_flatten(self):
        return (self.levels,), (self.shapes, self.padded)

    @classmethod
    def tree_unflatten(cls, aux, leaves):
        return cls(leaves[0], *aux)

    def level(self, j: int) -> Level:
        """Level `j` on its own grid (sliced out of the stack)."""
        lv = jax.tree_util.tree_map(lambda a: a[j], self.levels)
        return _crop_level(lv, self.padded, self.shapes[j], 0)

    def split(self) -> tuple:
        """`(level 0, the others)`: level 0 on its grid (the padded shape: its
        cycle wastes nothing), the others padded to level 1's grid only."""
        rest = jax.tree_util.tree_map(lambda a: a[1:], self.levels)
        rest = _crop_level(rest, self.padded, self.shapes[1], 1)
        return self.level(0), Tail(rest, self.shapes[1:], self.shapes[1])


def _crop_level(level: Level, padded: tuple, shape: tuple, lead: int) -> Level:
    """`level`'s arrays (grids `padded` after `lead` stacking axes) cut to
    their low corner of `shape` (the sizes differ by powers of two: so do
    those of the sampled interpolation weights)."""
    def crop(a):
        if a.ndim != lead + len(shape):   # lambda_max
            return a
        size = a.shape[:lead] + tuple(n * m // p for n, m, p in zip(a.shape[lead:], shape, padded))
        return jax.lax.slice(a, (0,) * a.ndim, size)

    op, transfer = level.op, level.transfer
    op = StencilOperator({o: crop(c) for o, c in op.stored.items()}, shape, op.boundary,
                         op.axis_names, op.symmetric)
    transfer = Transfer(jax.tree_util.tree_map(crop, transfer.weights), shape, transfer.axes,
                         transfer.boundary, transfer.axis_names)
    return Level(op, level.lmax, transfer, level.looped)


def cropped(op: StencilOperator, shape: tuple) -> StencilOperator:
    """A padded level's operator on its own grid (`shape`)."""
    stored = {o: crop_grid(jnp.broadcast_to(c, op.shape), shape) for o, c in op.stored.items()}
    return StencilOperator(stored, shape, op.boundary, op.axis_names, op.symmetric)


def padded_to(op: StencilOperator, shape: tuple) -> StencilOperator:
    """`op` in the low corner of a grid of `shape`: the identity outside it (the
    centre 1, every other entry 0). Its entries pointing outside the grid are
    0 already (a Galerkin operator couples to nothing outside)."""
    widths = [(0, n - m) for n, m in zip(shape, op.shape)]
    stored = {o: jnp.pad(jnp.broadcast_to(c, op.shape), widths,
                         constant_values=0 if any(o) else 1)
              for o, c in sorted(op.stored.items())}
    return StencilOperator(stored, shape, op.boundary, op.axis_names, op.symmetric)


def pad_grid(x, shape: tuple):
    return jnp.pad(x, [(0, n - m) for n, m in zip(shape, x.shape)])


def crop_grid(x, shape: tuple):
    return jax.lax.slice(x, (0,) * x.ndim, shape)
