"""The cycle: `Multigrid`, a callable pytree running V, W or F cycles over
the levels, the registered smoother on each and the coarsest level's
treatment at the bottom."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..._core import target
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

    def is_symmetric(self) -> bool | None:
        """Whether the cycle is a symmetric operator (what CG needs of a
        preconditioner): V and W cycles of a symmetric operator are; an
        F-cycle is not. None where the operator cannot tell (traced)."""
        if self.cycle == "F":
            return False
        return self.explicit[0].op.is_symmetric()

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
        # an F-cycle as loops (`scan_unroll`): each level's code once, F or
        # V by a runtime flag (`_cycle`)
        f = jnp.bool_(True) if self.cycle == "F" and scan_unroll(2) == 1 else None
        if self.tail is None or self.cycle == "W":   # see `_cycle`
            z = self._cycle(self.levels, 0, r.astype(dtype), self.cycle, tail=False, f=f)
        else:
            z = self._cycle(self.explicit, 0, r.astype(dtype), self.cycle, tail=True, f=f)
        return z.astype(r.dtype)

    def _cycle(self, levels: list, k: int, r, kind: str, tail: bool, f=None):
        """One cycle from level `k` of `levels` for the residual `r`: `kind` V
        (one coarse correction), W (two, each a W-cycle) or F (two: an
        F-cycle, then a V-cycle on what it left). With `tail`, `levels` are
        the explicit ones and the `Tail`'s cycle (`_tail_cycle`) corrects the
        last but one.

        A W-cycle's two visits of the level below are a two-step loop (the
        second from the residual the first left), so its program holds each
        level's code once; written as recursion it doubled per level (a
        2048^2 W-cycle's first call took 157 s on a TPU v5e). It runs every
        level on its own grid, not the padded `Tail`: it visits level `j`
        `2^j` times, and on padded grids each visit paid the padding (2048^2
        MG-CG on the CPU: 11.2 s warm against 3.9 s). An F-cycle visits a
        level about `j` times and runs the tail by one loop over its moves
        (`_moving`; 5.0 s against 4.6 s warm at 2048^2 for a program that does
        not grow with the levels). Its second visit is a V-cycle: written as
        recursion (a GPU, where loops are unrolled) the program holds each
        level's code once per F and V path above it; where loops are wanted
        (`f`, a traced flag: this visit is an F-cycle, else a V-cycle) the two
        visits are a two-step loop like the W-cycle's, the second skipped
        by a conditional unless `f`, and each level's code is there once
        (Poisson 1024^2: 9757 HLO lines against 5472 for a V-cycle before)."""
        if k == len(levels) - 1:
            return self.coarse_solve(levels[-1], r)
        level = levels[k]
        x, rc = self._down(level, r)
        at_tail = tail and k == len(levels) - 2
        if at_tail:
            below, twice = self._tail_cycle, kind != "V"
        else:
            def below(r, kind, f=None):
                return self._cycle(levels, k + 1, r, kind, tail, f)
            twice = kind != "V" and k + 2 < len(levels)

        def left(e):
            """The residual the coarse correction `e` leaves, computed into memory."""
            coarse = self.tail.level(0) if at_tail else levels[k + 1]
            return level.keep()(lambda e: rc - coarse.op(e), e)

        if f is not None:
            flagged = self._tail_f_or_v if at_tail else (lambda r, f: below(r, "F", f))
            e = self._flagged_f(flagged, rc, left, f, twice)
        elif not twice:
            e = below(rc, kind)
        elif kind == "F":
            e = below(rc, "F")
            e = e + below(left(e), "V")
        else:
            def visit(i, e):
                if not target.branches_on_device():  # left(0) is rc: no branch
                    return e + below(left(e), "W")
                return e + below(jax.lax.cond(i > 0, left, lambda e: rc, e), "W")

            e = jax.lax.fori_loop(0, 2, visit, jnp.zeros_like(rc),
                                  unroll=scan_unroll(2) > 1)
        return self._up(level, x, r, e)

    def _flagged_f(self, below, rc, left, f, twice: bool):
        """The coarse correction of an F-cycle's level (`f` true) or a
        V-cycle's (`f` false), `f` traced, each way down (`below(r, f)`) once
        in the program: two visits in a loop, the second skipped unless `f`."""
        if not twice:
            return below(rc, f)

        def visit(i, e):
            def taken(e):
                return e + below(jax.lax.cond(i > 0, left, lambda e: rc, e), f & (i == 0))
            return jax.lax.cond((i == 0) | f, taken, lambda e: e, e)

        def selected(i, e):
            # no conditional (a GPU: `target.branches_on_device`): left(0) is
            # rc, and a skipped visit runs on a zero residual, whose
            # correction is exactly zero (every step of a cycle is linear):
            # a V-path level costs two visits, as a W-cycle's does
            r = jnp.where((i == 0) | f, left(e), jnp.zeros_like(rc))
            return e + below(r, f & (i == 0))

        step = visit if target.branches_on_device() else selected
        return jax.lax.fori_loop(0, 2, step, jnp.zeros_like(rc))

    def _tail_f_or_v(self, r, f):
        """The `Tail`'s part of an F-cycle (its moves) or of a V-cycle (its
        scans), chosen by the traced `f`."""
        if not target.branches_on_device():  # both computed (small: the tail's levels)
            return jnp.where(f, self._moving(r, "F"), self._tail_cycle(r, "V"))
        return jax.lax.cond(f, lambda r: self._moving(r, "F"),
                            lambda r: self._tail_cycle(r, "V"), r)

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

    def _tail_cycle(self, r, kind: str):
        """The cycle's part on the `Tail`'s levels and the coarsest (`r` on the
        tail's first grid, which is the padded shape), each level's code once
        in the program.

        A V-cycle: a scan down (smoothing, residual, restriction), the
        coarsest level, a scan up (prolongation, smoothing); each level's
        smoothed iterate and right-hand side stacked for the way up (their
        grids padded: small, the tail's levels are), the scans unrolled where
        the backend wants it (`scan_unroll`). An F-cycle: its fixed order of
        moves (`_moves`) run by one loop (`_moving`)."""
        tail, bottom = self.tail, self.explicit[-1]
        if kind != "V":
            return self._moving(r, kind)
        unroll = scan_unroll(len(tail.shapes))

        def down(r, level):
            x, rc = self._down(level, r)
            return pad_grid(rc, tail.padded), (x, r)

        rc, (xs, rs) = jax.lax.scan(down, r, tail.levels, unroll=unroll)
        e = self.coarse_solve(bottom, crop_grid(rc, bottom.op.shape))

        def up(e, item):
            level, x, r = item
            return self._up(level, x, r, crop_grid(e, level.transfer.coarse_shape)), None

        e, _ = jax.lax.scan(up, pad_grid(e, tail.padded), (tail.levels, xs, rs), reverse=True,
                            unroll=unroll)
        return e

    def _moving(self, r, kind: str):
        """An F-cycle on the `Tail` and the coarsest level as a loop over
        its moves (`_moves`), the level a loop variable: per level `j` (the
        coarsest is `m`, held padded) its iterate `x[j]`, right-hand side
        `rhs[j]` and `first[j]`, the correction its first visit left (zero
        before a second visit). A down move smooths level `j` and restricts
        its residual to `rhs[j + 1]`; the coarsest is solved; an again move
        keeps level `j + 1`'s correction in `first[j + 1]` and makes the
        residual it left `rhs[j + 1]`; an up move prolongs `first[j + 1] +
        x[j + 1]` onto level `j` and smooths."""
        tail, bottom = self.tail, self.explicit[-1]
        m, padded = len(tail.shapes), tail.padded
        moves = jnp.asarray(np.array(_moves(m, kind), np.int32))
        stack = jnp.zeros((m + 1,) + padded, r.dtype)

        def at(j):
            return jax.tree_util.tree_map(lambda a: a[j], tail.levels)

        def down(j, x, rhs, first):
            xj, rc = self._down(at(j), rhs[j])
            return x.at[j].set(xj), rhs.at[j + 1].set(pad_grid(rc, padded)), first.at[j + 1].set(0)

        def solve(j, x, rhs, first):
            e = self.coarse_solve(bottom, crop_grid(rhs[m], bottom.op.shape))
            return x.at[m].set(pad_grid(e, padded)), rhs, first

        def again(j, x, rhs, first):
            left = at(j).keep()(lambda e, r: r - at(j + 1).op(e), x[j + 1], rhs[j + 1])
            return x, rhs.at[j + 1].set(left), first.at[j + 1].set(x[j + 1])

        def up(j, x, rhs, first):
            lv = at(j)
            e = crop_grid(first[j + 1] + x[j + 1], lv.transfer.coarse_shape)
            return x.at[j].set(self._up(lv, x[j], rhs[j], e)), rhs, first

        def move(i, state):
            what, j = moves[i, 0], moves[i, 1]
            if not target.branches_on_device():  # every kind computed, one selected
                outs = [kind(j, *state) for kind in (down, solve, again, up)]
                return jax.tree_util.tree_map(
                    lambda *vs: jnp.select([what == w for w in range(4)], vs), *outs)
            return jax.lax.switch(what, (down, solve, again, up), j, *state)

        state = (stack, stack.at[0].set(r), stack)
        x, _, _ = jax.lax.fori_loop(0, moves.shape[0], move, state)
        return x[0]


#: An F-cycle's moves on the tail (`_moves`): (what, level).
_DOWN, _SOLVE, _AGAIN, _UP = range(4)


def _moves(m: int, kind: str, j: int = 0) -> list:
    """The moves of a `kind` cycle from level `j` of `m` levels above the
    coarsest (level `m`), in order: as `Multigrid._cycle` recurses."""
    if j == m:
        return [(_SOLVE, m)]
    out = [(_DOWN, j)] + _moves(m, kind, j + 1)
    if kind == "F" and j + 1 < m:   # then a V-cycle on what it left
        out += [(_AGAIN, j)] + _moves(m, "V", j + 1)
    return out + [(_UP, j)]
