"""The cycle: `Multigrid`, a callable pytree running V, W or F cycles over
the levels, the registered smoother on each and the coarsest level's
treatment at the bottom."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .coarse import CoarseSolve
from .fusion import scan_unroll
from .levels import Level, Tail, crop_grid, pad_grid
from .smoothers import SMOOTHERS

#: The cycles by name (`multigrid(cycle=...)`; `Multigrid.recurse` holds what each does).
CYCLES = ("V", "W", "F")


@jax.tree_util.register_pytree_node_class
class Multigrid:
    """A multigrid cycle `r -> z ~ A^{-1} r` (see `multigrid`).

    `levels`: the levels built one by one (the finest ones and the
    coarsest); a `Tail` of padded levels, where there is one, lies between
    the last two. `coarse_solve`: the coarsest level's treatment (a
    `CoarseSolve`); `smoother`: a name in `SMOOTHERS`, run with `steps` and
    `lower`; `dtype`: the cycle's precision (None: the operator's).
    """

    def __init__(self, levels: list, coarse_solve: CoarseSolve, cycle: str, smoother: str,
                 steps: int, lower: float, dtype=None, tail: Tail | None = None):
        self.explicit, self.tail, self.coarse_solve = levels, tail, coarse_solve
        self.cycle, self.smoother, self.steps, self.lower = cycle, smoother, steps, lower
        self.dtype = dtype

    def tree_flatten(self):
        return ((self.explicit, self.coarse_solve, self.tail),
                (self.cycle, self.smoother, self.steps, self.lower, self.dtype))

    @classmethod
    def tree_unflatten(cls, aux, leaves):
        levels, coarse_solve, tail = leaves
        cycle, smoother, steps, lower, dtype = aux
        return cls(levels, coarse_solve, cycle, smoother, steps, lower, dtype, tail)

    @property
    def levels(self) -> list:
        """Every level, finest first, each on its own grid."""
        if self.tail is None:
            return self.explicit
        padded = [self.tail.level(j) for j in range(len(self.tail.shapes))]
        return self.explicit[:-1] + padded + self.explicit[-1:]

    @property
    def coarse(self) -> str:
        """How the coarsest level is treated: a name in `COARSE` (`"direct"`,
        `"lines"` or `"chebyshev"`)."""
        return self.coarse_solve.name

    @property
    def coarse_inverse(self):
        """The coarsest level's dense pseudo-inverse (`coarse="direct"`), else None."""
        return getattr(self.coarse_solve, "inverse", None)

    @property
    def shapes(self) -> list:
        """The grid shape of every level, finest first."""
        return [lv.op.shape for lv in self.levels]

    def __call__(self, r):
        shape = self.explicit[0].op.shape
        if jnp.shape(r) != shape:
            raise ValueError(f"the multigrid preconditioner acts on arrays of the grid's shape "
                             f"{shape}; got {jnp.shape(r)}.")
        # `dtype` given: the cycle runs in it, whatever the input's precision
        own = jnp.result_type(*self.explicit[0].op.stored.values())
        dtype = self.dtype if self.dtype is not None else jnp.result_type(r, own)
        # the cycle's last step is computed into memory (`computed`): XLA
        # does not recompute it inside each consumer of `z` (a Krylov
        # method's inner product and its update of the search direction)
        if self.tail is not None and self.cycle == "V":
            z = self._cycle(self.explicit, 0, r.astype(dtype), "V", tail=True)
        else:
            z = self._cycle(self.levels, 0, r.astype(dtype), self.cycle)
        return z.astype(r.dtype)

    def _cycle(self, levels: list, k: int, r, kind: str, tail: bool = False):
        """One cycle from level `k` of `levels` for the residual `r`: `kind` V
        (one coarse correction), W (two, each a W-cycle) or F (two: an
        F-cycle, then a V-cycle on what it left). With `tail`, `levels` are
        the explicit ones, and the `Tail` corrects the last but one."""
        if k == len(levels) - 1:
            return self.coarse_solve(levels[-1], r)
        level, coarse = levels[k], levels[k + 1]
        x, rc = self._down(level, r)
        if tail and k == len(levels) - 2:
            e = self._tail_cycle(rc)
        else:
            e = self._cycle(levels, k + 1, rc, kind, tail)
        if kind != "V" and k + 2 < len(levels):
            again = "W" if kind == "W" else "V"
            left = level.keep()(lambda e: rc - coarse.op(e), e)
            e = e + self._cycle(levels, k + 1, left, again)
        return self._up(level, x, r, e)

    def _smooth(self, level: Level, x, r, post: bool):
        """The smoother's `steps` steps for `A x = r` from `x` (zero if None)."""
        return SMOOTHERS[self.smoother](level, x, r, steps=self.steps, lower=self.lower,
                                        post=post)

    def _down(self, level: Level, r):
        """A level's way down: `(x, rc)`, `x` smoothed from zero for `A x = r`
        and `rc` its residual restricted, each computed into memory."""
        keep = level.keep()
        x = self._smooth(level, None, r, post=False)
        residual = keep(lambda x: r - level.op(x), x)
        return x, keep(lambda res: level.transfer.restrict(res, keep), residual)

    def _up(self, level: Level, x, r, e):
        """A level's way up: the coarse correction `e` prolonged onto `x`, then
        smoothed for `A x = r`."""
        keep = level.keep()
        x = keep(lambda x, e: x + level.transfer.prolong(e, keep), x, e)
        return self._smooth(level, x, r, post=True)

    def _tail_cycle(self, r):
        """The V-cycle's part on the `Tail`'s levels (`r` on the first's grid,
        which is the padded shape): a scan down (smoothing, residual,
        restriction), the coarsest level, a scan up (prolongation, smoothing).
        Each level's smoothed iterate and right-hand side are stacked for the
        way up (their grids padded: small, the tail's levels are), the scans
        unrolled where the backend wants it (`scan_unroll`)."""
        tail, bottom = self.tail, self.explicit[-1]
        unroll = scan_unroll(len(tail.shapes))

        def down(r, level):
            x, rc = self._down(level, r)
            return pad_grid(rc, tail.padded), (x, r)

        rc, (xs, rs) = jax.lax.scan(down, r, tail.levels, unroll=unroll)
        e = self._cycle([bottom], 0, crop_grid(rc, bottom.op.shape), "V")

        def up(e, item):
            level, x, r = item
            return self._up(level, x, r, crop_grid(e, level.transfer.coarse_shape)), None

        e, _ = jax.lax.scan(up, pad_grid(e, tail.padded), (tail.levels, xs, rs), reverse=True,
                            unroll=unroll)
        return e
