"""Structured-grid operators that know their stencil.

A `StencilOperator` is `y[i] = sum over offsets o of entries[o][i] * x[i + o]`
on a 1-, 2- or 3-D grid, with what lies outside the grid set per axis by the
boundary: `"dirichlet"` (zero), `"neumann"` (the boundary value repeated) or
`"periodic"` (wrapped). It is a pytree (its entries are leaves, so they may
be traced: a new coefficient field every time step) and a callable, usable
as the `matvec` of every solver. Each shifted copy of `x` is a slice of one
padded array: under `jit` with `x` sharded, XLA's partitioner turns the pad
and slices of a sharded axis into halo exchanges (collective-permutes), and
no vector is gathered (`tests/test_stencil.py` pins it).

`diffusion_operator` builds the cell-centred finite-volume `-div(k grad u) +
shift u` as such an operator, so that its stencil is known to what is built
on it (a multigrid hierarchy coarsens stencils, not matrices).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._core import checks
from . import facts

BOUNDARIES = ("dirichlet", "neumann", "periodic")
_PAD_MODE = {"neumann": "edge", "periodic": "wrap"}


@jax.tree_util.register_pytree_node_class
class StencilOperator:
    """`x -> sum_o entries[o] * shift(x, o)` on a grid (see `stencil_operator`).

    Attributes:
        entries: offset tuple -> coefficient array of the grid's shape (or a
            scalar for a constant coefficient): every offset of the stencil.
        shape: the grid's shape.
        boundary: one of `BOUNDARIES` per axis.
        symmetric: whether the operator is stored by half (as
            `diffusion_operator` and the multigrid hierarchy built from it
            store theirs): `stored` then holds the centre and the offsets
            whose first nonzero component is positive; the coupling the other
            way is the same number, `entries[-o][i] = entries[o][i - o]`, and
            nothing couples to points outside a non-periodic axis. A
            matrix-vector product then reads half the off-diagonal arrays.
        stored: the coefficient arrays kept (all of `entries` when not
            symmetric): the pytree's leaves.
    """

    def __init__(self, entries: dict, shape: tuple, boundary: tuple, axis_names: tuple = None,
                 symmetric: bool = False, singular: bool | None = None):
        self.stored = entries
        self.shape = shape
        self.boundary = boundary
        self.axis_names = axis_names or (None,) * len(shape)
        self.symmetric = symmetric
        self.singular = singular  # known by construction (`null_vector`); None: test it

    def tree_flatten(self):
        offsets = tuple(self.stored)
        return (tuple(self.stored[o] for o in offsets),
                (offsets, self.shape, self.boundary, self.axis_names, self.symmetric,
                 self.singular))

    @classmethod
    def tree_unflatten(cls, aux, leaves):
        offsets, shape, boundary, axis_names, symmetric, singular = aux
        return cls(dict(zip(offsets, leaves)), shape, boundary, axis_names, symmetric, singular)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def entries(self) -> dict:
        """Every offset's coefficients (a symmetric operator's other half
        shifted from the stored one: `entries[-o][i] = entries[o][i - o]`)."""
        if not self.symmetric:
            return self.stored
        full, closed = dict(self.stored), self._closed()
        for o, c in self.stored.items():
            if any(o):
                back = tuple(-v for v in o)
                full[back] = shift_all(jnp.broadcast_to(c, self.shape), [back], closed,
                                     self.axis_names)[0]
        return full

    def _closed(self) -> tuple:
        """Per axis, what lies outside for a symmetric operator (it couples to
        nothing there): zero, or wrapped on a periodic axis."""
        return tuple("periodic" if b == "periodic" else "dirichlet" for b in self.boundary)

    def __call__(self, x):
        if jnp.shape(x) != self.shape:
            raise ValueError(f"the stencil operator acts on arrays of shape {self.shape}; got "
                             f"{jnp.shape(x)}.")
        dtype = jnp.result_type(x, *self.stored.values())
        x = x.astype(dtype)
        if self.symmetric:
            return self._symmetric_product(x)
        shifts = shift_all(x, list(self.stored), self.boundary, self.axis_names)
        y = None
        for k, coefficient in enumerate(self.stored.values()):
            term = coefficient * shifts[k]
            y = term if y is None else y + term
        return y

    def _symmetric_product(self, x):
        """`A x` from the stored half: row `i` takes `e_o[i] x[i + o]` and, for
        the coupling the other way, `e_o[i - o] x[i - o]`, i.e. the product
        `e_o x` moved by `-o`. The moved products are summed axis by axis
        before each move (`_placed`), so a sharded axis sends one halo per
        direction, as the full stencil's shifts of `x` do."""
        closed = self._closed()
        offsets = [o for o in self.stored if any(o)]
        shifts = shift_all(x, offsets, closed, self.axis_names)
        y = self.stored.get((0,) * self.ndim, 0.0) * x
        for o, shifted in zip(offsets, shifts):
            y = y + self.stored[o] * shifted
        back = {tuple(-v for v in o): self.stored[o] * x for o in offsets}
        return y + _placed(back, closed, self.axis_names) if back else y

    def astype(self, dtype) -> StencilOperator:
        """The same stencil with its coefficients stored in `dtype` (e.g.
        `jnp.bfloat16`: half the bytes a product reads). A product computes in
        the wider of `dtype` and the vector's precision, so a bfloat16-stored
        operator applied to float32 vectors computes in float32 (the
        coefficients rounded to bfloat16's 3 digits once, here)."""
        stored = {o: jnp.asarray(c).astype(dtype) for o, c in self.stored.items()}
        return StencilOperator(stored, self.shape, self.boundary, self.axis_names,
                               self.symmetric, self.singular)

    def is_symmetric(self) -> bool | None:
        """Whether `A^T = A` (True when stored by half), or None where it
        cannot be told (`facts.symmetric`)."""
        return True if self.symmetric else facts.symmetric(self)

    def null_vector(self, dtype):
        """The constant grid of `dtype` where it spans the null space of both
        `A` and `A^T` (periodic or pure Neumann boundaries and no shift: then
        `A x = b` is solvable only for `b` of zero mean); else None, also
        where it cannot be told (`facts.annihilates_constants`)."""
        singular = facts.annihilates_constants(self) if self.singular is None else self.singular
        return jnp.ones(self.shape, dtype) if singular else None

    def diagonal(self):
        """The operator's diagonal (the centre entry), an array of the grid's shape."""
        centre = self.stored.get((0,) * self.ndim, 0.0)
        dtype = jnp.result_type(*self.stored.values())
        return jnp.broadcast_to(jnp.asarray(centre, dtype), self.shape)

    def __repr__(self):
        return (f"StencilOperator(shape={self.shape}, offsets={sorted(self.entries)}, "
                f"boundary={self.boundary}{', symmetric' if self.symmetric else ''})")


def stored_half(offset: tuple) -> bool:
    """The offsets a symmetric operator stores: the centre and those whose
    first nonzero component is positive."""
    first = next((v for v in offset if v), 1)
    return first > 0


def shift_all(x, offsets: list, boundary: tuple, axis_names: tuple) -> list:
    """`[x[i + o] for each offset o]`, each built from unit shifts along one
    axis at a time (memoized: `(2, 0)` is `(1, 0)` shifted once more). A unit
    shift pads one side of its axis by one (zero, edge or wrap) and slices:
    XLA's partitioner turns that into one collective-permute on a sharded
    axis. (Padding every axis at once and slicing each offset from it cost
    6 collective-permutes instead of 2 for a 5-point stencil on P('i', None),
    8 instead of 4 on P('i', 'j'); one convolution with a one-hot kernel per
    offset took 2.5 ms per 512 x 512 matvec on the CPU against 1.1 ms.)"""
    memo = {(0,) * x.ndim: x}

    def shifted(offset):
        if offset not in memo:
            axis = max(a for a, o in enumerate(offset) if o)
            step = 1 if offset[axis] > 0 else -1
            previous = tuple(o - step if a == axis else o for a, o in enumerate(offset))
            memo[offset] = unit_shift(shifted(previous), axis, step, boundary[axis],
                                       axis_names[axis])
        return memo[offset]

    return [shifted(offset) for offset in offsets]


def _placed(terms: dict, boundary: tuple, axis_names: tuple):
    """`sum over o of terms[o][i + o]`, with what lies outside as `boundary`
    says, moving along the last axis first and summing the terms that share
    their offset's leading components before the next move: one shift of a
    sum instead of one per term (on a sharded axis: one halo per direction)."""
    ndim = len(boundary)
    groups = dict(terms)
    for axis in reversed(range(ndim)):
        merged = {}
        for o, term in groups.items():   # `o`: the offset's first `axis + 1` components
            if o[axis]:
                along = tuple(o[axis] if a == axis else 0 for a in range(ndim))
                term = shift_all(term, [along], boundary, axis_names)[0]
            key = o[:axis]
            merged[key] = term if key not in merged else merged[key] + term
        groups = merged
    return groups[()]


def unit_shift(x, axis: int, step: int, kind: str, name=None):
    """`x[i + step]` along `axis` (`step` = +1 or -1), outside the grid as `kind`
    says; `name`: the mesh axis that splits the grid axis into the blocks of
    a `shard_map` (the halo then comes from the neighbour). Dirichlet: one
    `lax.pad` with a negative low (or high) edge, which XLA fuses into its
    consumer as well as a slice (half the time of a pad then a slice on the
    CPU); Neumann and periodic pad by the edge or the
    wrapped value and slice."""
    if name is not None:
        return _halo_shift(x, axis, step, kind, name)
    if kind == "dirichlet":
        config = [(0, 0, 0)] * x.ndim
        config[axis] = (-1, 1, 0) if step > 0 else (1, -1, 0)
        return jax.lax.pad(x, jnp.zeros((), x.dtype), config)
    pads = [(0, 0)] * x.ndim
    pads[axis] = (0, 1) if step > 0 else (1, 0)
    xp = jnp.pad(x, pads, mode=_PAD_MODE[kind])
    index = [slice(None)] * x.ndim
    index[axis] = slice(1, None) if step > 0 else slice(0, -1)
    return xp[tuple(index)]


def _halo_shift(x, axis: int, step: int, kind: str, name):
    """`unit_shift` of a block inside `shard_map`: the face this block lacks is
    its neighbour's, sent by one `ppermute` over `name`; at the grid's ends
    (the first and last blocks) it is zero (a block with no sender receives
    zeros), the block's own edge (Neumann) or the wrapped block's (periodic)."""
    devices = jax.lax.psum(1, name)
    n = x.shape[axis]
    if step > 0:       # x[i + 1]: my last row is the next block's first
        face, keep = jax.lax.slice_in_dim(x, 0, 1, axis=axis), jax.lax.slice_in_dim(x, 1, n,
                                                                                    axis=axis)
        pairs = [(d, d - 1) for d in range(1, devices)]
        wrap, edge_device = (0, devices - 1), devices - 1
    else:              # x[i - 1]: my first row is the previous block's last
        face, keep = (jax.lax.slice_in_dim(x, n - 1, n, axis=axis),
                      jax.lax.slice_in_dim(x, 0, n - 1, axis=axis))
        pairs = [(d, d + 1) for d in range(devices - 1)]
        wrap, edge_device = (devices - 1, 0), 0
    if kind == "periodic":
        pairs.append(wrap)
    received = jax.lax.ppermute(face, name, pairs)
    if kind == "neumann":
        own = (jax.lax.slice_in_dim(x, n - 1, n, axis=axis) if step > 0
               else jax.lax.slice_in_dim(x, 0, 1, axis=axis))
        received = jnp.where(jax.lax.axis_index(name) == edge_device, own, received)
    parts = [keep, received] if step > 0 else [received, keep]
    return jnp.concatenate(parts, axis=axis)


def _axis_names(axis_names, ndim: int) -> tuple:
    """`axis_names` checked: None, or one mesh axis name (or None) per grid axis."""
    if axis_names is None:
        return (None,) * ndim
    names = tuple(axis_names) if isinstance(axis_names, tuple | list) else None
    if names is None or len(names) != ndim or not all(a is None or isinstance(a, str)
                                                      for a in names):
        raise ValueError(f"`axis_names` gives, per grid axis, the `shard_map` mesh axis that "
                         f"splits it or None ({ndim} entries, e.g. ('i', None)); got "
                         f"{axis_names!r}.")
    return names


def global_index(shape: tuple, axis: int, name):
    """The grid index along `axis` of each point of a block (its position in
    the whole grid inside `shard_map`), and the whole grid's length."""
    local = jax.lax.broadcasted_iota(jnp.int32, shape, axis)
    if name is None:
        return local, shape[axis]
    return local + jax.lax.axis_index(name) * shape[axis], shape[axis] * jax.lax.psum(1, name)


def stencil_operator(entries: Mapping, *, shape: tuple | None = None,
                     boundary: str | tuple = "dirichlet", axis_names=None) -> StencilOperator:
    """A structured-grid operator given by its stencil.

    `y[i] = sum over offsets o of entries[o][i] * x[i + o]`, for `i` over a
    1-, 2- or 3-D grid; `x[j]` for `j` outside the grid is given by the
    boundary of that axis: `"dirichlet"` (0), `"neumann"` (the nearest
    boundary value) or `"periodic"` (wrapped).

    Example:
        ```python
        five_point = sx.stencil_operator(
            {(0, 0): 4.0, (1, 0): -1.0, (-1, 0): -1.0, (0, 1): -1.0, (0, -1): -1.0},
            shape=(64, 64))
        sol = sx.pcg(five_point, b)
        ```

    Args:
        entries: a mapping from offset tuples (one int per grid axis) to the
            coefficients: arrays of the grid's shape (variable coefficients,
            sharded like `x`, possibly traced) or scalars (constant ones).
        shape: the grid's shape; needed only when every entry is a scalar.
        boundary: one of `"dirichlet"`, `"neumann"`, `"periodic"`, or a tuple
            of them, one per axis.
        axis_names: inside `shard_map`, per grid axis the mesh axis that
            splits it into the blocks this function sees (or None), e.g.
            `("i", None)`: `shape` and the entries are then one block's, and
            the halos come from the neighbours by `ppermute`.

    Returns:
        A `StencilOperator`: a callable `x -> A x` (usable as any solver's
        `matvec`) and a pytree, with `diagonal()`.

    Raises:
        TypeError, ValueError: entries that are not such a mapping, offsets
            of the wrong length, coefficient arrays of another shape, an
            unknown boundary.
    """
    if not isinstance(entries, Mapping) or not entries:
        raise TypeError("`entries` must be a non-empty mapping from offset tuples to "
                        f"coefficients, e.g. {{(0,): 2.0, (1,): -1.0, (-1,): -1.0}}; got "
                        f"{type(entries).__name__}.")
    arrays = {o: c for o, c in entries.items() if jnp.ndim(c) > 0}
    shapes = {tuple(jnp.shape(c)) for c in arrays.values()}
    if shape is None:
        if not shapes:
            raise ValueError("every entry is a scalar: pass the grid's `shape`.")
        shape = next(iter(shapes))
    shape = tuple(int(n) for n in shape)
    if not 1 <= len(shape) <= 3 or min(shape) < 1:
        raise ValueError(f"`shape` must be a 1-, 2- or 3-D grid shape; got {shape}.")
    if shapes - {shape}:
        raise ValueError(f"coefficient arrays in `entries` must have the grid's shape {shape} "
                         f"(or be scalars); got shapes {sorted(shapes)}.")
    clean = {}
    for offset, coefficient in entries.items():
        if not (isinstance(offset, tuple) and len(offset) == len(shape)
                and all(isinstance(o, int | np.integer) for o in offset)):
            raise ValueError(f"offsets in `entries` must be tuples of {len(shape)} ints (one "
                             f"per grid axis); got {offset!r}.")
        if any(abs(int(o)) >= n for o, n in zip(offset, shape)):
            raise ValueError(f"offset {offset!r} in `entries` reaches past the grid {shape}.")
        coefficient = jnp.asarray(coefficient)
        if not jnp.issubdtype(coefficient.dtype, jnp.inexact):
            coefficient = coefficient.astype(jnp.result_type(float))
        clean[tuple(int(o) for o in offset)] = coefficient
    return StencilOperator(clean, shape, _boundaries(boundary, len(shape)),
                           _axis_names(axis_names, len(shape)))


def _boundaries(boundary, ndim: int) -> tuple:
    """`boundary` as one name per axis, each checked."""
    names = (boundary,) * ndim if isinstance(boundary, str) else tuple(boundary)
    if len(names) != ndim:
        raise ValueError(f"`boundary` must be one name or {ndim} (one per axis); got "
                         f"{boundary!r}.")
    for name in names:
        checks.check_choice("boundary", name, BOUNDARIES)
    return names


def diffusion_operator(k: Any, *, shape: tuple | None = None, spacing: Any = 1.0,
                       boundary: str | tuple = "dirichlet", shift: Any = 0.0,
                       axis_names=None) -> StencilOperator:
    """The cell-centred finite-volume `-div(k grad u) + shift * u` on a grid.

    The flux through the face between neighbouring cells `i` and `i + e_a` is
    `k_face (u_i - u_{i+e_a}) / h_a^2` per unit cell, with `k_face` the
    harmonic mean `2 k_i k_j / (k_i + k_j)` of the two cells (so a
    coefficient that jumps by orders of magnitude stays conservative). On a
    `"dirichlet"` boundary the face lies half a cell out, where `u = 0`
    (`2 k_i u_i / h_a^2`); `"neumann"`: no flux; `"periodic"`: the faces
    wrap. Symmetric; positive definite for Dirichlet boundaries or
    `shift > 0`.

    Example:
        ```python
        A = sx.diffusion_operator(k_field, spacing=1 / 256)  # k_field: (256, 256)
        sol = sx.pcg(A, f, precond=sx.jacobi(A.diagonal()))
        ```

    Args:
        k: the diffusion coefficient: a positive scalar, an array of the
            grid's shape, or a tuple of them, one per axis (anisotropic,
            e.g. `k=(1e-3, 1.0)`); may be traced.
        shape: the grid's shape; needed only when `k` has no array.
        spacing: the cell size, one number or one per axis.
        boundary: `"dirichlet"`, `"neumann"`, `"periodic"` or one per axis.
        shift: a scalar or an array of the grid's shape added to the diagonal.
        axis_names: inside `shard_map`, per grid axis the mesh axis that
            splits it (or None); `k`, `shift` and `shape` are then one
            block's (see `stencil_operator`).

    Returns:
        A `StencilOperator` with the `2 ndim + 1` offsets of the 3-, 5- or
        7-point stencil, stored by half (`symmetric`: the centre and one
        face per axis; a matrix-vector product reads `ndim + 1`
        coefficient arrays instead of `2 ndim + 1`).

    Raises:
        TypeError, ValueError: `k` or `shift` arrays of another shape, a
            `k` tuple of the wrong length, a concrete `k` that is not
            positive, a non-positive spacing, an unknown boundary.
    """
    per_axis = isinstance(k, tuple | list)
    ks = list(k) if per_axis else None
    arrays = [c for c in (ks if per_axis else [k]) + [shift] if jnp.ndim(c) > 0]
    shapes = {tuple(jnp.shape(c)) for c in arrays}
    if shape is None:
        if not shapes:
            raise ValueError("`k` and `shift` are scalars: pass the grid's `shape`.")
        shape = next(iter(shapes))
    shape = tuple(int(n) for n in shape)
    ndim = len(shape)
    if not 1 <= ndim <= 3 or min(shape) < 1:
        raise ValueError(f"`shape` must be a 1-, 2- or 3-D grid shape; got {shape}.")
    if shapes - {shape}:
        raise ValueError(f"`k` and `shift` arrays must have the grid's shape {shape}; got "
                         f"shapes {sorted(shapes)}.")
    if per_axis and len(ks) != ndim:
        raise ValueError(f"`k` as a tuple gives one coefficient per axis: {ndim} for the grid "
                         f"{shape}; got {len(ks)}.")
    ks = ks if per_axis else [k] * ndim
    for c in ks:
        if isinstance(c, jax.core.Tracer):
            continue
        values = np.asarray(c)
        if not np.all(np.isfinite(values)):
            raise ValueError(f"`k` must be finite (a diffusion coefficient); it holds "
                             f"{int(np.sum(np.isnan(values)))} NaN and "
                             f"{int(np.sum(np.isinf(values)))} infinite entries.")
        if not np.all(values > 0):
            raise ValueError(f"`k` must be positive (a diffusion coefficient); its smallest "
                             f"entry is {values.min()!r}.")
    h = spacing if isinstance(spacing, tuple | list) else (spacing,) * ndim
    if len(h) != ndim or not all(float(v) > 0 for v in h):
        raise ValueError(f"`spacing` must be positive, one number or {ndim}; got {spacing!r}.")
    bounds = _boundaries(boundary, ndim)
    names = _axis_names(axis_names, ndim)
    dtype = jnp.result_type(*ks, shift)
    if not jnp.issubdtype(dtype, jnp.inexact):
        dtype = jnp.result_type(float)
    centre = jnp.broadcast_to(jnp.asarray(shift, dtype), shape)
    entries = {}
    for axis in range(ndim):
        kc = jnp.broadcast_to(jnp.asarray(ks[axis], dtype), shape)
        faces = _face_coefficients(kc, axis, bounds[axis], names[axis])
        scale = 1.0 / float(h[axis]) ** 2
        # stored by half: the face to the -1 side is the neighbour's +1 face
        offset = tuple(1 if a == axis else 0 for a in range(ndim))
        inside = _interior(shape, axis, 1, bounds[axis], names[axis])
        entries[offset] = (-faces[1] * scale * inside).astype(dtype)
        centre = centre + (faces[1] + faces[-1]) * scale
    entries[(0,) * ndim] = centre.astype(dtype)
    # constants are the null space (whatever `k`, traced too) exactly when no
    # axis is Dirichlet and there is no shift: every row then sums to zero
    if "dirichlet" in bounds:
        singular = False
    elif isinstance(shift, jax.core.Tracer):
        singular = None
    else:
        singular = not np.any(np.asarray(shift) != 0)
    return StencilOperator(entries, shape, bounds, names, symmetric=True, singular=singular)


def _face_coefficients(kc, axis: int, boundary: str, name=None) -> dict:
    """Per cell, the coefficients of its two faces on `axis` (keys +1, -1): the
    harmonic mean with the neighbour on that side; at the grid's edge `2 k`
    (Dirichlet, the face half a cell out), 0 (Neumann) or the wrapped
    neighbour's mean. One mean per face: a cell's face on side -1 is its
    neighbour's on side +1 (the mean is symmetric in its two cells, so both
    cells get the same number), shifted in."""
    kind = "periodic" if boundary == "periodic" else "dirichlet"
    neighbour = unit_shift(kc, axis, 1, kind, name)
    plus = 2 * kc * neighbour / (kc + neighbour)
    minus = unit_shift(plus, axis, -1, kind, name)
    if boundary == "periodic":
        return {1: plus, -1: minus}
    outside = 2 * kc if boundary == "dirichlet" else jnp.zeros_like(kc)
    return {side: jnp.where(edge_mask(kc.shape, axis, side, name), outside, mean)
            for side, mean in ((1, plus), (-1, minus))}


def edge_mask(shape: tuple, axis: int, side: int, name=None):
    """True at the cells whose `side` face on `axis` is the grid's edge."""
    if name is not None:
        index, n = global_index(shape, axis, name)
        return index == (n - 1 if side == 1 else 0)
    index = np.arange(shape[axis])
    edge = index == (shape[axis] - 1 if side == 1 else 0)
    return edge.reshape([-1 if a == axis else 1 for a in range(len(shape))])


def _interior(shape: tuple, axis: int, side: int, boundary: str, name=None):
    """1 where the neighbour on `side` of `axis` is a cell of the grid (or
    wrapped), 0 at the edge: the off-diagonal entry there couples to nothing."""
    if boundary == "periodic":
        return 1.0
    return jnp.where(edge_mask(shape, axis, side, name), 0.0, 1.0)
