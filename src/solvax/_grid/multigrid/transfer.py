"""Transfers between levels: interpolation along each coarsened axis
(collapsed, or black-box over whole coarse cells), restriction its exact
transpose, and the stencil's Dirichlet form both read."""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp

from ..stencil import StencilOperator, edge_mask, global_index, unit_shift
from .fusion import computed

INTERPOLATIONS = ("collapsed", "full")


def dirichlet_form(op: StencilOperator) -> StencilOperator:
    """The same matrix with every Neumann axis's boundary folded into the
    entries: at a cell on the edge, the entry pointing out (at the repeated
    edge value) is added to the entry of the same offset with this axis's
    component 0, and the axis becomes Dirichlet (nothing outside). A
    symmetric operator couples to nothing outside already: only the names
    change."""
    if op.symmetric:
        boundary = tuple("dirichlet" if b == "neumann" else b for b in op.boundary)
        return StencilOperator(op.stored, op.shape, boundary, op.axis_names, True)
    entries = {o: jnp.broadcast_to(c, op.shape) for o, c in op.entries.items()}
    boundary = list(op.boundary)
    for axis, kind in enumerate(op.boundary):
        if kind != "neumann":
            continue
        for o in [o for o in entries if o[axis]]:
            inward = tuple(0 if a == axis else v for a, v in enumerate(o))
            edge = edge_mask(op.shape, axis, o[axis], op.axis_names[axis])
            entries[inward] = entries.get(inward, 0.0) + jnp.where(edge, entries[o], 0.0)
            entries[o] = jnp.where(edge, 0.0, entries[o])
        boundary[axis] = "dirichlet"
    return StencilOperator(entries, op.shape, tuple(boundary), op.axis_names)


def axis_slice(x, axis: int, start: int, stop: int):
    return jax.lax.slice_in_dim(x, start, stop, axis=axis)


def _prolong_axis(c, axis: int, n: int, periodic: bool, weights: dict, name=None):
    """Interpolation along `axis` from `nc = n // 2` coarse points to `n` fine
    ones: fine `2 j + 1` is coarse `j`; fine `2 j` is `w_minus[j] c[j - 1] +
    w_plus[j] c[j]`, with `c` zero past its ends (a Neumann edge's weights
    are folded onto its one neighbour at set-up) or wrapped (periodic)."""
    nc = c.shape[axis]
    w_minus, w_plus = weights["minus"], weights["plus"]
    left = unit_shift(c, axis, -1, "periodic" if periodic else "dirichlet", name)  # c[j - 1]
    evens = axis_slice(w_minus, axis, 0, nc) * left + axis_slice(w_plus, axis, 0, nc) * c
    fine = jnp.stack([evens, c], axis=axis + 1)
    fine = fine.reshape(c.shape[:axis] + (2 * nc,) + c.shape[axis + 1:])
    if n == 2 * nc:
        return fine
    last = axis_slice(w_minus, axis, nc, nc + 1) * axis_slice(c, axis, nc - 1, nc)
    return jnp.concatenate([fine, last], axis=axis)


def every_other(x, axis: int, phase: int):
    """`x` at the points `phase, phase + 2, ...` of `axis` (phase 0: the even
    points, `(n + 1) // 2` of them; 1: the odd ones, `n // 2`), by a reshape
    into pairs. (A strided slice did the same on one device, but on a
    sharded axis JAX 0.4.38's partitioner turned it into a gather: all-gathers
    of its indices and all-reduces that replicated whole coarse arrays.)"""
    n = x.shape[axis]
    pairs = axis_slice(x, axis, 0, 2 * (n // 2))
    pairs = pairs.reshape(x.shape[:axis] + (n // 2, 2) + x.shape[axis + 1:])
    out = jax.lax.index_in_dim(pairs, phase, axis + 1, keepdims=False)
    if phase == 0 and n % 2:   # the last point of an odd axis
        out = jnp.concatenate([out, axis_slice(x, axis, n - 1, n)], axis=axis)
    return out


def sampled(x, phases: tuple):
    """`x` at every other point from `phase` along each `(axis, phase)` of
    `phases` (`every_other` axis by axis)."""
    for axis, phase in phases:
        x = every_other(x, axis, phase)
    return x


def placed(v, phases: tuple, shape: tuple):
    """The inverse of `sampled`: `v` at those points of a grid of `shape`,
    zero between them (interleaved by a reshape, as `every_other` splits)."""
    for axis, phase in phases:
        n, zero = shape[axis], jnp.zeros_like(v)
        out = jnp.stack([v, zero] if phase == 0 else [zero, v], axis=axis + 1)
        out = out.reshape(v.shape[:axis] + (2 * v.shape[axis],) + v.shape[axis + 1:])
        if out.shape[axis] > n:     # phase 0 of an odd axis: one point past its end
            out = axis_slice(out, axis, 0, n)
        elif out.shape[axis] < n:   # phase 1 of an odd axis: its last point is even
            out = jnp.concatenate([out, axis_slice(zero, axis, 0, 1)], axis=axis)
        v = out
    return v


def coarse_shape(shape: tuple, axes: tuple) -> tuple:
    return tuple(n // 2 if a in axes else n for a, n in enumerate(shape))


@jax.tree_util.register_pytree_node_class
class Transfer:
    """Prolongation from the grid coarsened along `axes` to `shape`, one axis
    at a time, and restriction, its exact transpose."""

    def __init__(self, weights: list, shape: tuple, axes: tuple, boundary: tuple,
                 axis_names: tuple, centres: list | None = None):
        self.weights, self.shape, self.axes, self.boundary = weights, shape, axes, boundary
        self.axis_names = axis_names
        # "full" interpolation: per class of points fine along two or more of
        # the coarsened axes, (offsets, their weights at the class's points,
        # the class's mask, its phases: `(axis, parity)` per coarsened axis)
        self.centres = centres or []

    def tree_flatten(self):
        leaves = [(w, m) for _, w, m, _ in self.centres]
        static = tuple((o, p) for o, _, _, p in self.centres)
        return (self.weights, leaves), (self.shape, self.axes, self.boundary, self.axis_names,
                                        static)

    @classmethod
    def tree_unflatten(cls, aux, leaves):
        weights, centres = leaves
        *rest, static = aux
        return cls(weights, *rest, [(o, w, m, p) for (o, p), (w, m) in zip(static, centres)])

    @property
    def full(self) -> bool:
        """Whether the points inside a coarse cell are interpolated from the
        whole stencil (then `R A P` is computed by probing, `galerkin_operator`)."""
        return bool(self.centres)

    @property
    def coarse_shape(self) -> tuple:
        return coarse_shape(self.shape, self.axes)

    def prolong(self, c, keep=None):
        """`P c`; `keep` (`functools.partial(computed, flag)`), where given,
        computes the values each class of points inside the coarse cells
        reads into memory first (XLA:CPU otherwise recomputes them at each
        of the up to 26 offsets it reads them at, and each class reads the
        one before: a 64^3 full-interpolation set-up took 9.6 s)."""
        for axis, weights in zip(self.axes, self.weights):
            c = _prolong_axis(c, axis, self.shape[axis], self.boundary[axis] == "periodic",
                              weights, self.axis_names[axis])
        boundary = tuple("periodic" if b == "periodic" else "dirichlet" for b in self.boundary)
        for offsets, weights, mask, phases in self.centres:
            # a point inside a coarse cell from its neighbours in the cell's
            # faces and edges (interpolated before it) and corners (coarse),
            # computed at the class's points only (a quarter of the grid in
            # 2-D, an eighth in 3-D) and placed back
            def inside(c, offsets=offsets, weights=weights, mask=mask, phases=phases):
                near = self._neighbours(c, offsets, phases, boundary)
                value = sum(w * v for w, v in zip(weights, near))
                return jnp.where(mask, placed(value, phases, c.shape), c)
            c = inside(c) if keep is None else keep(inside, c)
        return c

    def _neighbours(self, c, offsets: tuple, phases: tuple, boundary: tuple) -> list:
        """`c[x + o]` at the points `x` of one class (`phases`) for each offset
        `o`: each from the parity sub-grid of `c` that `x + o` lies on (cut
        once per parity: `every_other`), shifted back by one sub-grid point
        along the axes where `o` steps down from an even point; an odd
        axis's odd sub-grid is one point short, zero-extended (its even last
        point's `+1` neighbour is past a Dirichlet edge)."""
        subs, out = {}, []
        for o in offsets:
            parity = tuple((p + o[a]) % 2 for a, p in phases)
            if parity not in subs:
                x = sampled(c, tuple((a, q) for (a, _), q in zip(phases, parity)))
                for (a, p), q in zip(phases, parity):
                    if q != p and c.shape[a] % 2:   # the odd sub-grid of an odd axis
                        x = jnp.concatenate([x, jnp.zeros_like(axis_slice(x, a, 0, 1))], axis=a)
                subs[parity] = x
            x = subs[parity]
            for a, p in phases:
                if p == 0 and o[a] == -1:
                    x = unit_shift(x, a, -1, boundary[a], self.axis_names[a])
            out.append(x)
        return out

    def restrict(self, r, keep=None):
        """`P^T r`, by transposing `prolong`: pads become slices and the
        interleaving reshape a split, so on a sharded grid it moves the same
        halos back. (A strided convolution ran 15 % faster on one device but
        made XLA's partitioner reshard the grid with all-to-alls.)"""
        # the transpose at a zero coarse grid cut from `r` (so that in a
        # shard_map block it varies over the mesh axes as `r` does: an
        # invariant template would make the transpose sum over the blocks)
        zero = r
        for axis in self.axes:
            zero = axis_slice(zero, axis, 0, self.coarse_shape[axis])
        _, transpose = jax.vjp(functools.partial(self.prolong, keep=keep), 0 * zero)
        (rc,) = transpose(r)
        return rc


def make_transfer(op: StencilOperator, axes: tuple, full: bool = False, flag=None) -> Transfer:
    """Operator-dependent interpolation (Dendy's black-box multigrid, one axis
    at a time): along axis `a`, a fine point between two coarse ones takes
    them with weights `|a_-| / |a_0|` and `|a_+| / |a_0|`, the stencil
    collapsed onto the axis (entries summed over the other axes' offsets),
    so the interpolation follows the flux across a coefficient jump (and is
    linear, 1/2 and 1/2, for a constant coefficient; 1/3 next to a
    cell-centred Dirichlet edge). `flag` (a grid on one device; the level's
    `lambda_max`): each full-interpolation class's weights computed into
    memory from its collapsed stencil (`fusion.computed`: XLA:CPU otherwise
    recomputed the sums in each of up to 26 weights; a 64^3 level's
    transfer compiled in 1.73 s, 0.77 so)."""
    shape = op.shape
    entries = op.entries   # a symmetric operator's other half built once
    weights = []
    for t, axis in enumerate(axes):
        n, nc = shape[axis], shape[axis] // 2

        def sampled(c, t=t, axis=axis):
            """`c` at the points this step interpolates: fine even points along
            `axis`, fine along the axes already prolonged, coarse (odd) along
            the rest (sampled before any arithmetic: a quarter of the work)."""
            c = every_other(jnp.broadcast_to(c, shape), axis, 0)
            for later in axes[t + 1:]:
                c = every_other(c, later, 1)
            return c

        zero = sampled(jnp.zeros((), jnp.result_type(*op.stored.values())))
        collapsed = {s: zero for s in (-1, 0, 1)}
        for o, c in entries.items():
            collapsed[o[axis]] = collapsed[o[axis]] + sampled(c)
        centre = jnp.abs(collapsed[0])
        safe = jnp.where(centre > 0, centre, 1)
        pair = [jnp.where(centre > 0, jnp.abs(collapsed[s]) / safe, 0.5) for s in (-1, 1)]
        w_minus, w_plus = pair
        if op.boundary[axis] == "neumann":
            # the coarse grid extended by its edge value: fold the outside
            # weight onto the edge point
            even_shape = w_plus.shape
            first, _ = global_index(even_shape, axis, op.axis_names[axis])
            w_plus = jnp.where(first == 0, w_plus + w_minus, w_plus)
            w_minus = jnp.where(first == 0, 0, w_minus)
            if n > 2 * nc:
                w_minus = jnp.where(first == nc, w_minus + w_plus, w_minus)
        weights.append(dict(minus=w_minus, plus=w_plus))
    centres = _centres(op, axes, flag) if full else []
    return Transfer(weights, shape, axes, op.boundary, op.axis_names, centres)


def _centres(op: StencilOperator, axes: tuple, flag=None) -> list:
    """Dendy's interpolation inside a coarse cell (black-box multigrid): a
    fine point that is fine along the coarsened axes `F` (two or more of
    them) and coarse along the other coarsened ones takes `-sum_o a_o e(x + o)
    / a_0` over the offsets `o` within `F`, with the stencil (in Dirichlet
    form) collapsed over the axes outside `F`, from neighbours that are fine
    along fewer of the axes (interpolated before it) or coarse. Classes in
    order of `|F|`: in 2-D the cell centres, in 3-D the face centres, then
    the cell centres. Per class `(offsets, weights, mask, phases)`: the
    weights `|a_o| / |a_0|` (`-a_o / a_0` for an M-matrix, as the edges'
    collapsed weights) at the class's points (`sampled` by its phases), its
    mask on the fine grid."""
    form = dirichlet_form(op)
    entries = {o: jnp.broadcast_to(c, op.shape) for o, c in form.entries.items()}
    parity = {a: global_index(op.shape, a, op.axis_names[a])[0] % 2 for a in axes}
    out = []
    for size in range(2, len(axes) + 1):
        for F in itertools.combinations(axes, size):
            collapsed = {}
            for o, c in entries.items():
                key = tuple(v if a in F else 0 for a, v in enumerate(o))
                collapsed[key] = collapsed.get(key, 0.0) + c
            zero = (0,) * op.ndim
            centre = jnp.abs(collapsed.pop(zero, jnp.zeros(op.shape)))
            offsets = sorted(collapsed)
            phases = tuple((a, 0 if a in F else 1) for a in axes)

            def ratios(centre, collapsed, offsets=offsets, phases=phases):
                safe = jnp.where(centre > 0, centre, 1)
                return [sampled(jnp.where(centre > 0, jnp.abs(collapsed[o]) / safe, 0), phases)
                        for o in offsets]

            weights = computed(flag, ratios, centre, collapsed)
            mask = functools.reduce(jnp.logical_and, [parity[a] == p for a, p in phases])
            out.append((tuple(offsets), weights, mask, phases))
    return out
