"""Geometric multigrid on structured grids, built from stencils.

A hierarchy of `StencilOperator`s: each coarse operator is the Galerkin
product `R A P` computed in stencil form, in closed form one coarsened axis
at a time (`_galerkin_axis`: each coarse entry a sum of products of the fine
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
"""

from __future__ import annotations

import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np

from . import _block_tridiagonal, _checks, _dense, _precond
from ._stencil import StencilOperator, _edge_mask, _shifts, _unit_shift, global_index, stored_half

CYCLES = ("V", "W", "F")
# Jacobi's damping times lambda_max(D^-1 A), by grid dimension: the classic
# optima for the 3-point and the 5-point Laplacian (omega = 2/3 and 4/5 with
# lambda_max = 2). 8/5 for 3-D grids too: measured, CG took one iteration
# fewer with it than with 4/3 on Poisson 1024^2 and 64^3 (8 against 9), and
# 12/7 (the 7-point optimum) one more than 8/5 on the 3-D anisotropic problem.
_JACOBI_DAMPING = {1: 4 / 3, 2: 8 / 5}
SMOOTHERS = ("jacobi", "chebyshev", "gauss_seidel")
COARSE = ("direct", "chebyshev", "lines")
# the largest coarsest level (points) per treatment: a dense pseudo-inverse
# holds size^2 numbers; the line factorization n m^2 (m the points of a line)
_COARSE_LIMIT = {"direct": 4096, "chebyshev": 4096, "lines": 65536}
INTERPOLATIONS = ("collapsed", "full")


def _along(x, axis: int, start: int, stop: int):
    return jax.lax.slice_in_dim(x, start, stop, axis=axis)


def _prolong_axis(c, axis: int, n: int, periodic: bool, weights: dict, name=None):
    """Interpolation along `axis` from `nc = n // 2` coarse points to `n` fine
    ones: fine `2 j + 1` is coarse `j`; fine `2 j` is `w_minus[j] c[j - 1] +
    w_plus[j] c[j]`, with `c` zero past its ends (a Neumann edge's weights
    are folded onto its one neighbour at set-up) or wrapped (periodic)."""
    nc = c.shape[axis]
    w_minus, w_plus = weights["minus"], weights["plus"]
    left = _unit_shift(c, axis, -1, "periodic" if periodic else "dirichlet", name)  # c[j - 1]
    evens = _along(w_minus, axis, 0, nc) * left + _along(w_plus, axis, 0, nc) * c
    fine = jnp.stack([evens, c], axis=axis + 1)
    fine = fine.reshape(c.shape[:axis] + (2 * nc,) + c.shape[axis + 1:])
    if n == 2 * nc:
        return fine
    last = _along(w_minus, axis, nc, nc + 1) * _along(c, axis, nc - 1, nc)
    return jnp.concatenate([fine, last], axis=axis)


def _every_other(x, axis: int, phase: int):
    """`x` at the points `phase, phase + 2, ...` of `axis` (phase 0: the even
    points, `(n + 1) // 2` of them; 1: the odd ones, `n // 2`), by a reshape
    into pairs. (A strided slice did the same on one device, but on a
    sharded axis JAX 0.4.38's partitioner turned it into a gather: all-gathers
    of its indices and all-reduces that replicated whole coarse arrays.)"""
    n = x.shape[axis]
    pairs = _along(x, axis, 0, 2 * (n // 2))
    pairs = pairs.reshape(x.shape[:axis] + (n // 2, 2) + x.shape[axis + 1:])
    out = jax.lax.index_in_dim(pairs, phase, axis + 1, keepdims=False)
    if phase == 0 and n % 2:   # the last point of an odd axis
        out = jnp.concatenate([out, _along(x, axis, n - 1, n)], axis=axis)
    return out


def _coarse_shape(shape: tuple, axes: tuple) -> tuple:
    return tuple(n // 2 if a in axes else n for a, n in enumerate(shape))


@jax.tree_util.register_pytree_node_class
class _Transfer:
    """Prolongation from the grid coarsened along `axes` to `shape`, one axis
    at a time, and restriction, its exact transpose."""

    def __init__(self, weights: list, shape: tuple, axes: tuple, boundary: tuple,
                 axis_names: tuple, centres: list | None = None):
        self.weights, self.shape, self.axes, self.boundary = weights, shape, axes, boundary
        self.axis_names = axis_names
        # "full" interpolation: per class of points fine along two or more of
        # the coarsened axes, (offsets, their weights, the class's mask)
        self.centres = centres or []

    def tree_flatten(self):
        leaves = [(w, m) for _, w, m in self.centres]
        offsets = tuple(o for o, _, _ in self.centres)
        return (self.weights, leaves), (self.shape, self.axes, self.boundary, self.axis_names,
                                        offsets)

    @classmethod
    def tree_unflatten(cls, aux, leaves):
        weights, centres = leaves
        *rest, offsets = aux
        return cls(weights, *rest, [(o, w, m) for o, (w, m) in zip(offsets, centres)])

    @property
    def full(self) -> bool:
        """Whether the points inside a coarse cell are interpolated from the
        whole stencil (then `R A P` is computed by probing, `_galerkin`)."""
        return bool(self.centres)

    @property
    def coarse_shape(self) -> tuple:
        return _coarse_shape(self.shape, self.axes)

    def prolong(self, c, keep=None):
        """`P c`; `keep` (`functools.partial(_computed, flag)`), where given,
        computes the values each class of points inside the coarse cells
        reads into memory first (XLA:CPU otherwise recomputes them at each
        of the up to 26 offsets it reads them at, and each class reads the
        one before: a 64^3 full-interpolation set-up took 9.6 s)."""
        for axis, weights in zip(self.axes, self.weights):
            c = _prolong_axis(c, axis, self.shape[axis], self.boundary[axis] == "periodic",
                              weights, self.axis_names[axis])
        boundary = tuple("periodic" if b == "periodic" else "dirichlet" for b in self.boundary)
        for offsets, weights, mask in self.centres:
            # a point inside a coarse cell from its neighbours in the cell's
            # faces and edges (interpolated before it) and corners (coarse)
            def inside(c, offsets=offsets, weights=weights, mask=mask):
                near = _shifts(c, list(offsets), boundary, self.axis_names)
                return jnp.where(mask, sum(w * v for w, v in zip(weights, near)), c)
            c = inside(c) if keep is None else keep(inside, c)
        return c

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
            zero = _along(zero, axis, 0, self.coarse_shape[axis])
        _, transpose = jax.vjp(functools.partial(self.prolong, keep=keep), 0 * zero)
        (rc,) = transpose(r)
        return rc


def _transfer(op: StencilOperator, axes: tuple, full: bool = False) -> _Transfer:
    """Operator-dependent interpolation (Dendy's black-box multigrid, one axis
    at a time): along axis `a`, a fine point between two coarse ones takes
    them with weights `|a_-| / |a_0|` and `|a_+| / |a_0|`, the stencil
    collapsed onto the axis (entries summed over the other axes' offsets),
    so the interpolation follows the flux across a coefficient jump (and is
    linear, 1/2 and 1/2, for a constant coefficient; 1/3 next to a
    cell-centred Dirichlet edge)."""
    shape = op.shape
    entries = op.entries   # a symmetric operator's other half built once
    weights = []
    for t, axis in enumerate(axes):
        n, nc = shape[axis], shape[axis] // 2

        def sampled(c, t=t, axis=axis):
            """`c` at the points this step interpolates: fine even points along
            `axis`, fine along the axes already prolonged, coarse (odd) along
            the rest (sampled before any arithmetic: a quarter of the work)."""
            c = _every_other(jnp.broadcast_to(c, shape), axis, 0)
            for later in axes[t + 1:]:
                c = _every_other(c, later, 1)
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
    centres = _centres(op, axes) if full else []
    return _Transfer(weights, shape, axes, op.boundary, op.axis_names, centres)


def _centres(op: StencilOperator, axes: tuple) -> list:
    """Dendy's interpolation inside a coarse cell (black-box multigrid): a
    fine point that is fine along the coarsened axes `F` (two or more of
    them) and coarse along the other coarsened ones takes `-sum_o a_o e(x + o)
    / a_0` over the offsets `o` within `F`, with the stencil (in Dirichlet
    form) collapsed over the axes outside `F`, from neighbours that are fine
    along fewer of the axes (interpolated before it) or coarse. Classes in
    order of `|F|`: in 2-D the cell centres, in 3-D the face centres, then
    the cell centres. Per class `(offsets, weights, mask)` on the fine grid;
    weights `|a_o| / |a_0|` (`-a_o / a_0` for an M-matrix, as the edges'
    collapsed weights)."""
    form = _dirichlet_form(op)
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
            safe = jnp.where(centre > 0, centre, 1)
            offsets = sorted(collapsed)
            weights = [jnp.where(centre > 0, jnp.abs(collapsed[o]) / safe, 0) for o in offsets]
            mask = functools.reduce(jnp.logical_and, [
                parity[a] == (0 if a in F else 1) for a in axes])
            out.append((tuple(offsets), weights, mask))
    return out


def _dirichlet_form(op: StencilOperator) -> StencilOperator:
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
            edge = _edge_mask(op.shape, axis, o[axis], op.axis_names[axis])
            entries[inward] = entries.get(inward, 0.0) + jnp.where(edge, entries[o], 0.0)
            entries[o] = jnp.where(edge, 0.0, entries[o])
        boundary[axis] = "dirichlet"
    return StencilOperator(entries, op.shape, tuple(boundary), op.axis_names)


def _galerkin_axis(op: StencilOperator, axis: int, weights: dict) -> StencilOperator:
    """`P_a^T A P_a` for the interpolation `P_a` along one axis (`_prolong_axis`)
    of a stencil in Dirichlet form (`_dirichlet_form`: each axis Dirichlet or
    periodic), in closed form.

    Coarse point `J` is fine `2 J + 1`; it interpolates to the fine points
    `2 J + 1 + s` (s = -1, 0, 1) with weights `alpha_s[J]` (`w_plus[J]`, 1,
    `w_minus[J + 1]`). So the coarse entry at offset `(O, q)` (`O` along the
    axis, `q` along the others) is the sum over `s`, `t` with `2 O + t - s`
    an offset `o` of the fine stencil of `alpha_s[J] A[2 J + 1 + s; (o, q)]
    alpha_t[J + O]` (the last at the column's position, shifted with zeros
    outside the grid: what lies outside couples to nothing)."""
    shape, name, kind = op.shape, op.axis_names[axis], op.boundary[axis]
    n = shape[axis]
    nc = n // 2
    coarse = tuple(nc if a == axis else m for a, m in enumerate(shape))

    def following(evens, last):
        """From the values at the fine points `2 J` (J < nc), those at `2 J + 2`:
        past the last coarse point, `last()` (the value at the fine point `2 nc`
        of an odd axis) or what the boundary puts outside."""
        if n > 2 * nc:
            return jnp.concatenate([_along(evens, axis, 1, nc), last()], axis=axis)
        return _unit_shift(evens, axis, 1, kind, name)

    def rows(c):
        """`c` at the fine rows `2 J`, `2 J + 1`, `2 J + 2` (s = -1, 0, 1)."""
        even = _along(_every_other(c, axis, 0), axis, 0, nc)   # an odd axis's last: below
        odd = _every_other(c, axis, 1)
        return {-1: even, 0: odd, 1: following(even, lambda: _along(c, axis, 2 * nc, n))}

    # the weights are sampled at the fine even points (nc of them, nc + 1 on an odd axis)
    w_minus, w_plus = (_along(weights[k], axis, 0, nc) for k in ("minus", "plus"))
    w_next = following(w_minus, lambda: _along(weights["minus"], axis, nc, nc + 1))
    alpha = {-1: w_plus, 0: jnp.ones_like(w_plus), 1: w_next}
    fine = op.entries   # a symmetric operator's other half: its stored half shifted
    terms = {}     # coarse offset -> [(s, t, fine offset)]
    for o in fine:
        for big in (-1, 0, 1):
            for s in (-1, 0, 1):
                t = o[axis] + s - 2 * big
                if t in (-1, 0, 1):
                    target = tuple(big if a == axis else v for a, v in enumerate(o))
                    terms.setdefault(target, []).append((s, t, o))
    offsets = sorted(terms)
    if op.symmetric:   # so is `P^T A P`: its stored half only
        offsets = [o for o in offsets if stored_half(o)]
    shifted = {t: dict(zip(offsets, _shifts(alpha[t], offsets, op.boundary, op.axis_names)))
               for t in (-1, 0, 1)}
    fine_rows = {o: rows(jnp.broadcast_to(c, shape)) for o, c in fine.items()}
    entries = {}
    for target in offsets:
        total = 0.0
        for s, t, o in terms[target]:
            total = total + alpha[s] * fine_rows[o][s] * shifted[t][target]
        entries[target] = total
    return StencilOperator(entries, coarse, op.boundary, op.axis_names, op.symmetric)


def _galerkin(op: StencilOperator, transfer: _Transfer, flag=None) -> StencilOperator:
    """`R A P` as a stencil (offsets in {-1, 0, 1} per axis) in closed form:
    `P` is one interpolation per coarsened axis (the last applied last), so
    `R A P` is one single-axis product after another, the last axis first.
    (Fusion barriers between the steps, and before each level's set-up,
    saved about 5 % of the set-up on one device but added collectives to
    it on a sharded grid, 110 -> 119 in the 64 x 64 P('i', None) row of
    `python -m solvax`: XLA no longer shared the halos of the steps. A
    narrowed hierarchy on one device computes the result into memory:
    `_hierarchy`.)
    `flag`: the level's `lambda_max`, a replicated scalar for `_computed`."""
    if transfer.full:
        out = _galerkin_probed(op, transfer, flag)
    else:
        out = _dirichlet_form(op)
        for axis, weights in reversed(list(zip(transfer.axes, transfer.weights))):
            out = _galerkin_axis(out, axis, weights)
    # a coarse axis of one point (outside a shard_map block, not wrapped)
    # couples along it to nothing
    flat = [a for a, (m, name, b) in enumerate(zip(out.shape, out.axis_names, out.boundary))
            if m == 1 and name is None and b != "periodic"]
    entries = {o: c for o, c in out.stored.items() if not any(o[a] for a in flat)}
    return StencilOperator(entries, out.shape, out.boundary, op.axis_names, out.symmetric)


def _galerkin_probed(op: StencilOperator, transfer: _Transfer, flag) -> StencilOperator:
    """`R A P` for any transfer whose coarse stencil reaches one point per
    axis, by probing: with the coarse grid coloured by its indices modulo 3
    along every axis, `y_c = R A P 1_c` holds at each coarse point `J` its
    coupling to the one point `J + o` of colour `c` within reach, for each
    offset `o`. (Exact wherever the colouring is: a periodic axis whose
    coarse length is not a multiple of 3 takes the collapsed interpolation,
    see `multigrid`.) 3^d applications of `P`, `A` and `R` per level."""
    shape = transfer.coarse_shape
    names = op.axis_names
    index = [global_index(shape, a, names[a])[0] for a in range(op.ndim)]
    dtype = jnp.result_type(*op.stored.values())
    colours = list(itertools.product(range(3), repeat=op.ndim))
    hits = jnp.stack([functools.reduce(jnp.logical_and, [i % 3 == k for i, k in zip(index, c)])
                      for c in colours]).astype(dtype)
    # one trace of `R A P` mapped over the colours (unrolled, 27 traces of a
    # 3-D transfer took minutes to compile); (3^d, *coarse shape)
    keep = functools.partial(_computed, flag)
    probes = jax.lax.map(lambda hit: transfer.restrict(op(transfer.prolong(hit, keep)), keep),
                         hits)
    offsets = list(itertools.product((-1, 0, 1), repeat=op.ndim))
    if op.symmetric:
        offsets = [o for o in offsets if stored_half(o)]
    entries = {}
    for o in offsets:
        # the colour of J + o, as the probes' index
        colour = sum(((i + v) % 3) * 3 ** (op.ndim - 1 - a)
                     for a, (i, v) in enumerate(zip(index, o)))
        entries[o] = jnp.take_along_axis(probes, colour[None], axis=0)[0]
    boundary = tuple("dirichlet" if b == "neumann" else b for b in op.boundary)
    return StencilOperator(entries, shape, boundary, names, op.symmetric)


def _is_concrete(op: StencilOperator) -> bool:
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


def _shards_of(op: StencilOperator) -> tuple:
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
    if not able or not _is_concrete(op):
        return tuple(able)
    s = _strengths(op)
    strongest = max(s[a] for a in able)
    if not strongest > 0:
        return tuple(able)
    return tuple(a for a in able if s[a] >= threshold * strongest)


def _smoothing_data(op: StencilOperator, lanczos: bool = True, region=None):
    """`lambda_max` for a level: the largest eigenvalue of `D^{-1} A`
    bounded by Gershgorin's bound (`1 + max_i sum_j |a_ij| / |a_ii|`), and
    with `lanczos` by the smaller of it and 1.1 times a 10-step Lanczos
    estimate from a fixed rough start (set-up only; its reductions are not
    in the cycle).

    Gershgorin's bound is an upper bound, so smoothing with it is safe; it is
    near-tight for a diffusion stencil (`2 - O(h^2)` for the 5-point
    Laplacian) and loose for Galerkin operators of coefficient jumps (3-D
    blocks jumping by 1e4: 15 iterations with it on every level, 10 with
    Lanczos). The finest level takes it alone (`multigrid`): its Lanczos
    steps were a third of the set-up (memory-bound passes over the whole
    grid), and without them the measured iterations change by at most one.
    So does the coarsest, whose `lambda_max` steers no smoother (it is
    solved, or smoothed with its own bounds: `_coarse_bounds`).
    `region`: on a padded level (`_Tail`), its grid's size per axis (the
    start vector is zero outside it).
    """
    gershgorin = _gershgorin(op)
    if not lanczos:
        return gershgorin
    _, ritz = _ritz_values(op, 10, region)
    return _capped(ritz, gershgorin)


def _gershgorin(op: StencilOperator):
    """Gershgorin's bound on `lambda_max(D^{-1} A)`, over the whole grid."""
    off = sum(jnp.abs(jnp.broadcast_to(c, op.shape)) for o, c in op.entries.items() if any(o))
    gershgorin = 1 + jnp.max(off * jnp.abs(1 / op.diagonal()))
    names = tuple(name for name in op.axis_names if name is not None)
    return jax.lax.pmax(gershgorin, names) if names else gershgorin


def _ritz_values(op: StencilOperator, steps: int, region=None):
    """The extreme Ritz values of `steps` Lanczos steps on `D^{-1/2} A D^{-1/2}`
    (the spectrum of `D^{-1} A`) from a fixed rough start (set-up only)."""
    diag = op.diagonal()
    # computed in the program from an index, not embedded: a constant of the
    # grid's size (2 MB for a 512^2 level) made the program text 6 MB and
    # its compile slower
    dtype = jnp.abs(diag).dtype
    index = jax.lax.iota(jnp.int32, math.prod(op.shape)).reshape(op.shape).astype(dtype)
    v = jnp.sin(index * 2.399963 + 0.3).astype(diag.dtype)
    v = v + 0 * diag   # shaped, sharded (and in a shard_map block, varying) like the grid
    if region is not None:   # a padded level: its grid only (Lanczos stays there)
        inside = functools.reduce(jnp.logical_and, [
            jax.lax.broadcasted_iota(jnp.int32, op.shape, a) < region[a] for a in range(op.ndim)])
        v = jnp.where(inside, v, 0)
    root = jnp.sqrt(jnp.abs(1 / diag))
    names = tuple(name for name in op.axis_names if name is not None)
    return _precond.estimate_spectrum(lambda u: root * op(root * u), v, steps=steps,
                                      axis_name=names or None)


def _capped(ritz, gershgorin):
    """1.1 times a Ritz estimate of `lambda_max`, at most Gershgorin's bound
    (the bound alone where the estimate is not finite)."""
    lmax = jnp.where(jnp.isfinite(ritz), jnp.minimum(1.1 * ritz, gershgorin), gershgorin)
    return lmax.astype(gershgorin.dtype)


def _coarse_bounds(op: StencilOperator, steps: int = 20):
    """`(lambda_min, lambda_max)` of `D^{-1} A` on the coarsest level, for its
    Chebyshev polynomial: the extreme Ritz values of `steps` Lanczos steps
    (at most the level's size; an invariant subspace stops them early),
    `lambda_max` raised by 10 % and capped by Gershgorin's bound as for the
    smoothers. The Ritz `lambda_min` lies above the true one: the modes
    below it are damped less, not amplified (see `Multigrid._chebyshev`)."""
    gershgorin = _gershgorin(op)
    lmin, ritz = _ritz_values(op, steps)
    lmax = _capped(ritz, gershgorin)
    # a non-finite or non-positive estimate (a singular level): the interval's
    # lower end as a small fraction of the upper, as for the smoothers
    lmin = jnp.where(jnp.isfinite(lmin) & (lmin > 0), jnp.minimum(lmin, 0.5 * lmax), 1e-3 * lmax)
    return lmin.astype(gershgorin.dtype), lmax


def _global_size(op: StencilOperator) -> int:
    return math.prod(n * (1 if name is None else jax.lax.psum(1, name))
                     for n, name in zip(op.shape, op.axis_names))


def _gather(x, axis_names: tuple):
    """The whole grid from the blocks of a `shard_map` (every block gets it)."""
    for axis, name in enumerate(axis_names):
        if name is not None:
            x = jax.lax.all_gather(x, name, axis=axis, tiled=True)
    return x


def _own_block(x, shape: tuple, axis_names: tuple):
    """This block of the whole grid `x` (the inverse of `_gather`)."""
    for axis, name in enumerate(axis_names):
        if name is not None:
            start = jax.lax.axis_index(name) * shape[axis]
            x = jax.lax.dynamic_slice_in_dim(x, start, shape[axis], axis=axis)
    return x


def _gathered_operator(op: StencilOperator) -> StencilOperator:
    """The coarsest operator on the whole grid (inside `shard_map`: gathered)."""
    if all(name is None for name in op.axis_names):
        return op
    entries = {o: _gather(jnp.broadcast_to(c, op.shape), op.axis_names)
               for o, c in op.entries.items()}
    shape = next(iter(entries.values())).shape
    return StencilOperator(entries, shape, op.boundary)


def _dense_inverse(op: StencilOperator):
    """The pseudo-inverse of the coarsest operator as a dense matrix."""
    size = math.prod(op.shape)
    dtype = jnp.result_type(*op.stored.values())
    eye = jnp.eye(size, dtype=dtype).reshape((size,) + op.shape)
    columns = jax.vmap(op)(eye).reshape(size, size)   # row k: A e_k
    return _dense.pinv(columns.T)


@jax.tree_util.register_pytree_node_class
class _Lines:
    """A direct solve of the coarsest level by block LU along one grid axis
    (`axis`, not periodic): row block `j` is the hyperplane `j` of the grid
    and couples to the planes `j - 1` and `j + 1` only (a 3^d-point stencil
    is block tridiagonal), so the factorization costs `n m^3` and a solve
    `n m^2` for `n` planes of `m` points: a coarsest level of 128^2 points
    is factored in about 10^9 flops and solved in 10^7, where a dense
    inverse would hold 2.7 * 10^8 numbers (`block_tridiagonal_factor`:
    block elimination without pivoting between blocks, stable for SPD and
    block diagonally dominant levels; a singular level, e.g. pure Neumann,
    has no exact factorization: `multigrid`'s `coarse`)."""

    def __init__(self, factors, axis: int):
        self.factors, self.axis = factors, axis

    def tree_flatten(self):
        return (self.factors,), self.axis

    @classmethod
    def tree_unflatten(cls, axis, leaves):
        return cls(leaves[0], axis)

    def __call__(self, grid):
        planes = jnp.moveaxis(grid, self.axis, 0)
        factors = jax.tree_util.tree_map(
            lambda a: a.astype(grid.dtype) if jnp.issubdtype(a.dtype, jnp.inexact) else a,
            self.factors)
        z = _block_tridiagonal.block_tridiagonal_solve_factored(
            factors, planes.reshape(planes.shape[0], math.prod(planes.shape[1:])))
        return jnp.moveaxis(z.reshape(planes.shape), 0, self.axis)


def _line_axis(boundary: tuple, shape: tuple) -> int | None:
    """The axis `coarse="lines"` factors along: the longest one that is not
    periodic (the fewest points per plane: the least memory and work), None
    if every axis is periodic."""
    able = [a for a, b in enumerate(boundary) if b != "periodic"]
    return max(able, key=lambda a: shape[a]) if able else None


def _in_plane_shift(shape: tuple, offset: tuple, boundary: tuple) -> np.ndarray:
    """The 0/1 matrix `S` with `(S x)[q] = x[q + offset]` on a grid of `shape`
    (flattened), zero past a Dirichlet edge, wrapped on a periodic axis."""
    index = np.indices(shape).reshape(len(shape), math.prod(shape))
    target = index + np.asarray(offset, dtype=int)[:, None]
    inside = np.ones(index.shape[1], bool)
    for a, (n, b) in enumerate(zip(shape, boundary)):
        if b == "periodic":
            target[a] %= n
        else:
            inside &= (target[a] >= 0) & (target[a] < n)
    size = index.shape[1]
    out = np.zeros((size, size))
    rows = np.arange(size)[inside]
    cols = np.ravel_multi_index(tuple(target[:, inside]), shape) if shape else rows
    out[rows, cols] = 1.0
    return out


def _line_factors(op: StencilOperator) -> _Lines:
    """`_Lines` for the coarsest operator (the whole grid): its stencil in
    Dirichlet form (Neumann edges folded in) written as the blocks of the
    planes along its longest non-periodic axis, factored once."""
    form = _dirichlet_form(op)
    form = StencilOperator({o: _replicated(jnp.broadcast_to(c, op.shape))
                            for o, c in form.stored.items()},
                           op.shape, form.boundary, form.axis_names, form.symmetric)
    axis = _line_axis(form.boundary, op.shape)
    others = tuple(a for a in range(op.ndim) if a != axis)
    plane = tuple(op.shape[a] for a in others)
    m = math.prod(plane)
    dtype = jnp.result_type(*form.stored.values())
    blocks = {s: jnp.zeros((op.shape[axis], m, m), dtype) for s in (-1, 0, 1)}
    for o, c in form.entries.items():
        rows = jnp.moveaxis(jnp.broadcast_to(c, op.shape), axis, 0).reshape(op.shape[axis], m)
        shift = _in_plane_shift(plane, tuple(o[a] for a in others),
                                tuple(form.boundary[a] for a in others))
        blocks[o[axis]] = blocks[o[axis]] + rows[:, :, None] * jnp.asarray(shift, dtype)
    factors = _block_tridiagonal.block_tridiagonal_factor(blocks[-1], blocks[0], blocks[1])
    return _Lines(factors, axis)


def _replicated(x):
    """`x` held whole by every device of a sharded grid under `jit`: an
    identity triangular solve along its leading axis, whose operands XLA's
    partitioner replicates (the coarsest grid in a cycle; the coefficients
    the line factors are computed from: factors computed from a grid still
    split across devices came out split too, and every cycle gathered them
    again, 256 KB per cycle for a 32^2 level on 8 devices). Where the dtype
    is emulated (float64 on a TPU, which lowers no float64 triangular solve)
    a product with the identity at full precision, exact too, whose sharded
    contraction the partitioner also returns replicated."""
    rows = x.reshape(x.shape[0], math.prod(x.shape[1:]))
    eye = jnp.eye(rows.shape[0], dtype=x.dtype)
    if _dense.emulated(x.dtype):
        return _dense.mm(eye, rows).reshape(x.shape)
    solved = jax.lax.linalg.triangular_solve(eye, rows, left_side=True, lower=True)
    return solved.reshape(x.shape)


def _computed(runtime_true, fn, *args):
    """`fn(*args)`, computed into memory before what reads it (on the CPU).

    XLA's CPU backend fuses a stencil's input into the stencil and then
    recomputes it at every offset read: two Jacobi steps in a row ran 13.8
    ms on a 1024 x 1024 grid instead of 5.2, a residual read at stride 2 by
    the restriction 11 ms instead of 1.6. A conditional is a fusion barrier
    there (an optimization barrier is not), and `fn` inside its branch
    writes its result straight into the conditional's output (copying a
    result computed outside cost half a cycle: 53 ms against 28 for a
    1024 x 1024 float64 V-cycle). Its predicate is a value the compiler
    cannot fold (`runtime_true`, a replicated scalar computed at set-up,
    e.g. `lambda_max == lambda_max`, behind an optimization barrier: a
    hierarchy closed over by a jitted function is a constant there, and
    XLA folded the comparison and dropped 28 of a 1024 x 1024 cycle's 35
    conditionals, 14 -> 44 ms), so it costs no communication.
    Elsewhere (GPU: a conditional's predicate goes to the host) `fn(*args)`
    as is."""
    if jax.default_backend() != "cpu":
        return fn(*args)
    flag = jax.lax.optimization_barrier(runtime_true)
    return jax.lax.cond(flag == flag, fn, functools.partial(_untaken, fn), *args)


def _untaken(fn, *args):
    """`_computed`'s branch that never runs, typed like `fn`'s output (inside
    `shard_map`, varying over the same mesh axes; the compiler drops `fn`
    here): the first argument where that has the type (a copy: XLA:CPU
    compiles no kernel for it, 35 fewer for Poisson 1024^2), else zeros."""
    out = fn(*args)
    first = jax.tree_util.tree_leaves(args[:1])
    if (isinstance(out, jax.Array) and len(first) == 1 and jnp.shape(first[0]) == out.shape
            and jnp.result_type(first[0]) == out.dtype):
        return first[0]
    return jax.tree_util.tree_map(jnp.zeros_like, out)


def _jitted(fn, *static):
    """`fn` compiled (set-up steps run as one program each when called eagerly;
    under an enclosing `jit` they are inlined)."""
    return jax.jit(fn, static_argnums=static)


def _dinv(op: StencilOperator, v):
    """`D^{-1} v`: a division by the stencil's centre (no stored inverse)."""
    return v / op.diagonal().astype(v.dtype)


@jax.tree_util.register_pytree_node_class
class _Level:
    """One level: its operator, `lambda_max` of `D^{-1} A` (its smoothers'
    scale) and the transfer to the level below (None on the coarsest)."""

    def __init__(self, op: StencilOperator, lmax, transfer):
        self.op, self.lmax, self.transfer = op, lmax, transfer

    def tree_flatten(self):
        return (self.op, self.lmax, self.transfer), None

    @classmethod
    def tree_unflatten(cls, aux, leaves):
        return cls(*leaves)


#: The levels from the first with at most 1/`_TAIL_FRACTION` of the finest
#: grid's points on are built and cycled by one scanned body (`_Tail`) where
#: at least `_TAIL_LEVELS` of them are coarsened alike. (Poisson 1024^2: its
#: levels from 128^2 on; the first call of MG-CG compiled in 5.2 s instead of
#: 7.2, with the same warm time. From 256^2 on: 4.1 s, but 22 ms more set-up
#: and 2 ms more per cycle: the padded levels' wasted work.)
_TAIL_FRACTION = 64
_TAIL_LEVELS = 3


@jax.tree_util.register_pytree_node_class
class _Tail:
    """Coarse levels written once: each level's arrays padded to the shape of
    the first (`padded`) and stacked on a leading axis, so their set-up and
    their part of a V-cycle are one `lax.scan` body each instead of one
    program section per level (XLA compiles every section's kernels: a
    1024 x 1024 hierarchy's eight levels took 6-7 s to compile).

    A padded level is its grid in the low corner, and outside it the
    identity, coupled to nothing: a product, a smoothing step and the
    transfers (weights 0 outside: `_transfer` of a row without neighbours)
    act on the grid exactly as on the grid alone, and keep zeros outside.
    `shapes`: each level's own grid."""

    def __init__(self, levels, shapes: tuple, padded: tuple):
        self.levels, self.shapes, self.padded = levels, shapes, padded

    def tree_flatten(self):
        return (self.levels,), (self.shapes, self.padded)

    @classmethod
    def tree_unflatten(cls, aux, leaves):
        return cls(leaves[0], *aux)

    def level(self, j: int) -> _Level:
        """Level `j` on its own grid (sliced out of the stack)."""
        lv = jax.tree_util.tree_map(lambda a: a[j], self.levels)
        return _crop_level(lv, self.padded, self.shapes[j], 0)

    def split(self) -> tuple:
        """`(level 0, the others)`: level 0 on its grid (the padded shape: its
        cycle wastes nothing), the others padded to level 1's grid only."""
        rest = jax.tree_util.tree_map(lambda a: a[1:], self.levels)
        rest = _crop_level(rest, self.padded, self.shapes[1], 1)
        return self.level(0), _Tail(rest, self.shapes[1:], self.shapes[1])


def _crop_level(level: _Level, padded: tuple, shape: tuple, lead: int) -> _Level:
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
    transfer = _Transfer(jax.tree_util.tree_map(crop, transfer.weights), shape, transfer.axes,
                         transfer.boundary, transfer.axis_names)
    return _Level(op, level.lmax, transfer)


def _cropped(op: StencilOperator, shape: tuple) -> StencilOperator:
    """A padded level's operator on its own grid (`shape`)."""
    stored = {o: _crop_grid(jnp.broadcast_to(c, op.shape), shape) for o, c in op.stored.items()}
    return StencilOperator(stored, shape, op.boundary, op.axis_names, op.symmetric)


def _padded(op: StencilOperator, shape: tuple) -> StencilOperator:
    """`op` in the low corner of a grid of `shape`: the identity outside it (the
    centre 1, every other entry 0). Its entries pointing outside the grid are
    0 already (a Galerkin operator couples to nothing outside)."""
    widths = [(0, n - m) for n, m in zip(shape, op.shape)]
    stored = {o: jnp.pad(jnp.broadcast_to(c, op.shape), widths,
                         constant_values=0 if any(o) else 1)
              for o, c in sorted(op.stored.items())}
    return StencilOperator(stored, shape, op.boundary, op.axis_names, op.symmetric)


def _pad_grid(x, shape: tuple):
    return jnp.pad(x, [(0, n - m) for n, m in zip(shape, x.shape)])


def _crop_grid(x, shape: tuple):
    return jax.lax.slice(x, (0,) * x.ndim, shape)


def _tail_plan(op: StencilOperator, depth: int, *, finest: int, coarse_size: int,
               max_levels: int, shards: tuple, interpolation: str, one_device: bool):
    """`(shapes, axes)` where the levels from `op` (the `depth`-th) on form a
    `_Tail`: `shapes` the grids of the tail's levels and of the coarsest one
    after it, each coarsened along the same `axes` from an even size; None
    where they do not, or where the levels are not known to be alike at
    trace time: concrete coefficients (semicoarsening reads them), the
    finest level (the operator as given), a grid that may be split across
    devices (`one_device`: one device in the process, or `shards` all 1
    given; a padded level of a sharded grid moved its blocks, one more
    all-gather per cycle on 8 devices) or a periodic axis; and levels
    larger than 1/`_TAIL_FRACTION` of the finest grid (`finest` points),
    whose padding would cost time."""
    if (not one_device or depth < 1 or _is_concrete(op) or interpolation != "collapsed"
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
        axes, shape, depth = able, _coarse_shape(shape, able), depth + 1
        shapes.append(shape)
    if len(shapes) - 1 < _TAIL_LEVELS:
        return None
    return tuple(shapes), axes


def _tail(op: StencilOperator, shapes: tuple, axes: tuple):
    """The `_Tail` of the levels of grids `shapes[:-1]` from `op` (the first),
    and the coarsest level's operator (grid `shapes[-1]`): one scanned body
    per level: `lambda_max` (Lanczos inside the level's grid), the transfer
    and the Galerkin operator, padded back to the first level's shape."""
    padded = shapes[0]
    op = _padded(op, padded)   # its arrays full-sized, the offsets sorted

    def body(op, region):
        lmax = _smoothing_data(op, True, region)
        transfer = _transfer(op, axes)
        return _padded(_galerkin(op, transfer, lmax), padded), _Level(op, lmax, transfer)

    regions = jnp.asarray(np.array(shapes[:-1], np.int32))
    last, levels = jax.lax.scan(body, op, regions)
    return _Tail(levels, shapes[:-1], padded), _cropped(last, shapes[-1])


@jax.tree_util.register_pytree_node_class
class Multigrid:
    """A multigrid cycle `r -> z ~ A^{-1} r` (see `multigrid`)."""

    def __init__(self, levels: list, coarse_inverse, cycle: str, smoother: str, steps: int,
                 lower: float, dtype=None, coarse_bounds=None, coarse_degree: int = 0,
                 tail: _Tail | None = None):
        # the levels built one by one (the finest ones and the coarsest); a
        # `_Tail` of padded levels, where there is one, lies between the last two
        self.explicit = levels
        self.tail = tail
        self.coarse_inverse = coarse_inverse    # None with a Chebyshev coarsest level
        self.coarse_bounds = coarse_bounds      # its (lambda_min, lambda_max) of D^-1 A
        self.cycle, self.smoother, self.steps, self.lower = cycle, smoother, steps, lower
        self.dtype = dtype
        self.coarse_degree = coarse_degree

    def tree_flatten(self):
        return ((self.explicit, self.coarse_inverse, self.coarse_bounds, self.tail),
                (self.cycle, self.smoother, self.steps, self.lower, self.dtype,
                 self.coarse_degree))

    @classmethod
    def tree_unflatten(cls, aux, leaves):
        levels, inverse, bounds, tail = leaves
        cycle, smoother, steps, lower, dtype, degree = aux
        return cls(levels, inverse, cycle, smoother, steps, lower, dtype, bounds, degree, tail)

    @property
    def levels(self) -> list:
        """Every level, finest first, each on its own grid."""
        if self.tail is None:
            return self.explicit
        padded = [self.tail.level(j) for j in range(len(self.tail.shapes))]
        return self.explicit[:-1] + padded + self.explicit[-1:]

    @property
    def coarse(self) -> str:
        """How the coarsest level is treated: `"direct"`, `"lines"` or `"chebyshev"`."""
        if self.coarse_inverse is None:
            return "chebyshev"
        return "lines" if isinstance(self.coarse_inverse, _Lines) else "direct"

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
        # the cycle's last step is computed into memory (`_computed`): XLA
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
        the explicit ones, and the `_Tail` corrects the last but one."""
        if k == len(levels) - 1 and self.coarse_inverse is None:
            # smoothed, not solved: a fixed polynomial (SPD for an SPD level),
            # halos only, no gather of a grid still split across devices
            level = levels[-1]
            lmin, lmax = (jnp.asarray(v).astype(jnp.abs(r).dtype) for v in self.coarse_bounds)
            return self._chebyshev(level, None, r, lmin, lmax, self.coarse_degree)
        if k == len(levels) - 1:
            return self._solve_coarsest(r)
        level, coarse = levels[k], levels[k + 1]
        x, rc = self._down(level, r)
        if tail and k == len(levels) - 2:
            e = self._tail_cycle(rc)
        else:
            e = self._cycle(levels, k + 1, rc, kind, tail)
        if kind != "V" and k + 2 < len(levels):
            again = "W" if kind == "W" else "V"
            left = _computed(level.lmax, lambda e: rc - coarse.op(e), e)
            e = e + self._cycle(levels, k + 1, left, again)
        return self._up(level, x, r, e)

    def _down(self, level: _Level, r):
        """A level's way down: `(x, rc)`, `x` smoothed from zero for `A x = r`
        and `rc` its residual restricted, each computed into memory."""
        keep = functools.partial(_computed, level.lmax)
        x = self._smooth(level, None, r, post=False)
        residual = keep(lambda x: r - level.op(x), x)
        return x, keep(lambda res: level.transfer.restrict(res, keep), residual)

    def _up(self, level: _Level, x, r, e):
        """A level's way up: the coarse correction `e` prolonged onto `x`, then
        smoothed for `A x = r`."""
        keep = functools.partial(_computed, level.lmax)
        x = keep(lambda x, e: x + level.transfer.prolong(e, keep), x, e)
        return self._smooth(level, x, r, post=True)

    def _tail_cycle(self, r):
        """The V-cycle's part on the `_Tail`'s levels (`r` on the first's grid,
        which is the padded shape): a scan down (smoothing, residual,
        restriction), the coarsest level, a scan up (prolongation, smoothing).
        Each level's smoothed iterate and right-hand side are stacked for the
        way up (their grids padded: small, the tail's levels are). Off the
        CPU the scans are unrolled: a loop's predicate goes to the host there,
        once per level and cycle (as `_computed`'s conditional would)."""
        tail, bottom = self.tail, self.explicit[-1]
        unroll = 1 if jax.default_backend() == "cpu" else len(tail.shapes)

        def down(r, level):
            x, rc = self._down(level, r)
            return _pad_grid(rc, tail.padded), (x, r)

        rc, (xs, rs) = jax.lax.scan(down, r, tail.levels, unroll=unroll)
        e = self._cycle([bottom], 0, _crop_grid(rc, bottom.op.shape), "V")

        def up(e, item):
            level, x, r = item
            return self._up(level, x, r, _crop_grid(e, level.transfer.coarse_shape)), None

        e, _ = jax.lax.scan(up, _pad_grid(e, tail.padded), (tail.levels, xs, rs), reverse=True,
                            unroll=unroll)
        return e

    def _solve_coarsest(self, r):
        """The coarsest level solved directly. Its grid is gathered (inside
        `shard_map`) and replicated (under `jit`, `_replicated`: so it is
        gathered once; a product with a sharded vector would be partial sums
        and an all-reduce on a two-axis mesh), then multiplied by the dense
        inverse or solved by lines, whose result is replicated too (XLA's
        partitioner otherwise split the scan over the planes to match the
        sharded result, which JAX 0.4.38 failed to compile); each device
        keeps its block."""
        names = self.explicit[-1].op.axis_names
        grid = _gather(r, names)      # inside shard_map: the whole coarsest grid
        if isinstance(self.coarse_inverse, _Lines):
            z = _replicated(self.coarse_inverse(_replicated(grid)))
        else:
            inverse = self.coarse_inverse.astype(r.dtype)
            whole = _replicated(grid.reshape(inverse.shape[0], 1))
            z = _dense.mm(inverse, whole)[:, 0].reshape(grid.shape)
        return _own_block(z, r.shape, names)

    def _smooth(self, level: _Level, x, r, post: bool = False):
        """`steps` steps of the smoother for `A x = r` from `x` (zero if None),
        each computed into memory (`_computed`) before the next reads it.
        `D^{-1}` is a division by the stencil's centre inside each step (the
        step's stencil reads it anyway: one array less to read and to keep)."""
        dinv = functools.partial(_dinv, level.op)
        lmax = level.lmax.astype(jnp.abs(r).dtype)
        keep = functools.partial(_computed, level.lmax)
        if self.smoother == "jacobi":
            omega = _JACOBI_DAMPING[min(level.op.ndim, 2)] / lmax
            for _ in range(self.steps):
                if x is None:
                    x = keep(lambda: omega * dinv(r))
                else:
                    x = keep(lambda x: x + omega * dinv(r - level.op(x)), x)
            return x
        if self.smoother == "gauss_seidel":
            return self._gauss_seidel(level, x, r, reverse=post)
        # Chebyshev in D^{-1} A on [lower * 1.1 lmax, 1.1 lmax]
        upper = 1.1 * lmax
        return self._chebyshev(level, x, r, self.lower * upper, upper, self.steps)

    def _gauss_seidel(self, level: _Level, x, r, reverse: bool):
        """`steps` multicolour Gauss-Seidel sweeps: the points coloured by their
        index parity along each axis (2^d colours: no two points of a colour
        couple in a 3^d-point stencil), each colour relaxed exactly from the
        latest values of the others. Pre-smoothing sweeps the colours in one
        order, post-smoothing in the reverse (so the cycle stays symmetric).
        Halos only: each colour's update is a masked stencil application."""
        op = level.op
        parity = [global_index(op.shape, a, op.axis_names[a])[0] % 2 for a in range(op.ndim)]
        colours = list(itertools.product((0, 1), repeat=op.ndim))
        if reverse:
            colours = colours[::-1]
        masks = [functools.reduce(jnp.logical_and, [p == c for p, c in zip(parity, colour)])
                 for colour in colours]
        keep = functools.partial(_computed, level.lmax)
        for _ in range(self.steps):
            for mask in masks:
                if x is None:
                    x = keep(lambda mask=mask: jnp.where(mask, _dinv(op, r), 0))
                else:
                    x = keep(lambda x, mask=mask: jnp.where(mask, x + _dinv(op, r - op(x)), x), x)
        return x

    def _chebyshev(self, level: _Level, x, r, low, upper, steps: int):
        """`steps` steps of Chebyshev's iteration in `D^{-1} A` on `[low, upper]`
        for `A x = r` from `x` (zero if None), each computed into memory
        (Saad, Alg. 12.1). Eigenvalues below `low` are damped less, never
        amplified: the polynomial stays in `(0, 1]` there, so the map
        `r -> x` from zero is SPD for an SPD operator."""
        dinv = functools.partial(_dinv, level.op)
        keep = functools.partial(_computed, level.lmax)
        theta, delta = (upper + low) / 2, (upper - low) / 2

        def first(x):
            res = r - level.op(x)
            d = dinv(res) / theta
            return res, d, x + d

        if x is None:     # from zero: the residual is `r` itself (no copy of it)
            res, d = r, keep(lambda: dinv(r) / theta)
            x = d
        else:
            res, d, x = keep(first, x)
        rho = delta / theta
        for _ in range(steps - 1):
            rho_next = 1 / (2 * theta / delta - rho)

            def step(res, d, x, rho=rho, rho_next=rho_next):
                res = res - level.op(d)
                d = rho_next * rho * d + (2 * rho_next / delta) * dinv(res)
                return res, d, x + d

            res, d, x = keep(step, res, d, x)
            rho = rho_next
        return x


def multigrid(operator: StencilOperator, *, cycle: str = "V", smoother: str = "jacobi",
              steps: int = 2, coarse_size: int = 64, max_levels: int = 30,
              semicoarsening: float = 0.5, chebyshev_lower: float = 0.25,
              shards: tuple | None = None, dtype=None, coarse: str = "direct",
              coarse_degree: int = 8, interpolation: str = "collapsed",
              storage_dtype=None) -> Multigrid:
    """A geometric multigrid preconditioner for a structured-grid operator.

    Builds a hierarchy from `operator`'s stencil: each level coarsens the
    grid by two along its strongly coupled axes (all of them for an
    isotropic operator; only the strong ones where it is anisotropic:
    semicoarsening), with the Galerkin coarse operator `R A P`
    (operator-dependent interpolation `P`, `R = P^T`) computed as a
    stencil; the coarsest level (at most `coarse_size` points, or nothing
    left to coarsen) is solved with a dense pseudo-inverse. Applying it runs one cycle from zero.

    With symmetric smoothing (the same `steps` before and after) the cycle
    is symmetric positive definite for an SPD operator, so it preconditions
    `pcg`; it preconditions `gmres`, `bicgstab`, `idrs` and `minres` (SPD
    operators) alike. A cycle computes no inner product: on a sharded grid
    it communicates only halos (collective-permutes) and the coarsest grid.

    Example:
        ```python
        A = sx.diffusion_operator(k, spacing=1 / 256)     # k: (256, 256)
        sol = sx.pcg(A, f, precond=sx.multigrid(A))      # ~10 iterations at any size
        ```

    Args:
        operator: a `StencilOperator` whose offsets are within one point
            per axis (e.g. from `diffusion_operator` or `stencil_operator`).
        cycle: `"V"`, `"W"` or `"F"` (on each level an F-cycle then a
            V-cycle below it: between V and W in work). V and W cycles are
            symmetric (for CG); an F-cycle is not (use it with `gmres`,
            `bicgstab` or `multigrid_solve`).
        smoother: `"jacobi"` (damped, `omega = 8 / (5 lambda_max(D^-1 A))`
            on 2- and 3-D grids, `4 / (3 lambda_max)` on 1-D ones)
            or `"chebyshev"` (a polynomial in `D^-1 A` over
            `[chebyshev_lower * 1.1 lambda_max, 1.1 lambda_max]`), with
            `lambda_max` estimated per level at set-up by power iteration.
        steps: smoothing steps (Chebyshev: degree) before and after the
            coarse correction (>= 1).
        coarse_size: the largest coarsest grid (points): at most 4096 for
            `coarse="direct"` and `"chebyshev"`, 65536 for `"lines"`.
        max_levels: the most levels (>= 1).
        semicoarsening: an axis is coarsened when its coupling is at least
            this fraction of the strongest axis's (in `(0, 1]`; 1e-12 or so
            coarsens every axis). Measured from concrete coefficients; when
            they are traced (set-up under `jit`), every axis is coarsened.
        chebyshev_lower: the lower end of the Chebyshev interval as a
            fraction of its upper end (in `(0, 1)`).
        shards: per grid axis, the number of devices splitting it; no level
            has fewer points than that along the axis (XLA's partitioner
            reshuffles a sharded axis shorter than its mesh axis with
            all-to-alls and all-reduces). Read from the coefficients'
            sharding when they are concrete arrays; pass it when the set-up
            is traced under `jit`, e.g. `shards=(8, 1)` for `P("i", None)`
            on 8 devices. All ones (or a process with one device) says the
            grid is on one device: under `jit` the coarse levels from 1/64
            of the finest grid's points down are then padded to one shape
            and compiled once (a shorter compile; `docs/multigrid.md`).
        coarse: how the coarsest level is treated. `"direct"` (default): a
            dense pseudo-inverse computed at set-up; on a grid still split
            across devices its residual is gathered once per cycle (one
            all-gather: a global synchronization in every Krylov
            iteration). `"chebyshev"`: smoothed, not solved: a Chebyshev
            polynomial of degree `coarse_degree` in `D^-1 A` over the
            level's `[lambda_min, lambda_max]` (20 Lanczos steps at
            set-up); a cycle then communicates only halos. It pays where a
            global collective costs more than `coarse_degree` neighbour
            exchanges of the tiny coarsest grid (many devices); on a few
            devices the gather is cheaper (`docs/multigrid.md`).
            `"lines"`: solved directly by block LU along the longest
            non-periodic grid axis (each plane of the grid one block: a
            3^d-point stencil is block tridiagonal), which allows a much
            larger coarsest level (`coarse_size` up to 65536 points; a
            128^2 level is factored in about 10^9 flops and solved in 10^7
            per cycle (measured on one CPU: 113 ms and 7.8 ms), gathered
            like `"direct"` on a sharded grid). For
            coefficients that jump on small blocks, stopping the hierarchy
            before its grids get coarser than the blocks is what makes
            multigrid robust (random blocks of contrast 1e4, 512^2, 4^2
            blocks: 8 CG iterations with `coarse="lines",
            coarse_size=16384` and full interpolation with Gauss-Seidel,
            against 98 with the W-cycle down to 8^2; `docs/multigrid.md`).
            For a nonsingular coarsest level: a singular one (a pure
            Neumann operator without a shift) has no exact factorization,
            and the solve either still meets its tolerance (checked on the
            true residual) or stops with a non-converged status; its
            pseudo-inverse (`"direct"`) is the sound choice there.
        coarse_degree: the Chebyshev degree with `coarse="chebyshev"` (>= 1;
            matvecs on the coarsest level per cycle).
        interpolation: `"collapsed"` (default): one coarsened axis at a time,
            each fine point from its two coarse neighbours along the axis
            with weights from the stencil collapsed onto it, and `R A P` in
            closed form. `"full"` (black-box multigrid, Dendy): the points
            inside a coarse cell (fine along two or more coarsened axes)
            from all their neighbours with the whole stencil's weights, and
            `R A P` by probing (3^d applications of the transfer per level:
            a slower set-up); for coefficients that jump on small blocks
            (`docs/multigrid.md`). A level with a periodic axis whose coarse
            length is not a multiple of 3 is interpolated `"collapsed"`.
        dtype: the precision of the hierarchy and of every cycle: None (the
            operator's) or a narrower one, e.g. `jnp.float32` for a float64
            operator. The set-up casts the operator's coefficients to it;
            a cycle casts its input to it and its output back to the
            input's dtype. The Krylov method's residuals and convergence
            test stay in the operator's precision, so a float64 solve with a
            float32 cycle still reaches float64 tolerances (Poisson 1024^2:
            the same 8 CG iterations to 1e-8) at half the memory traffic
            per cycle. The preconditioner is then linear only up to float32
            rounding: CG and GMRES still reach 1e-11 and 1e-10 with it in
            at most one more iteration (tested; `docs/multigrid.md`).

        storage_dtype: the precision the hierarchy's arrays are stored in
            after set-up (every level's coefficients and interpolation
            weights): None (as computed) or a narrower real floating dtype,
            `jnp.bfloat16` or `jnp.float16` included. The set-up runs in
            `dtype` (or the operator's precision) and the cycle computes in
            it too; only the bytes each smoothing step and transfer reads
            shrink (bfloat16 keeps 3 digits of each coefficient: the cycle
            stays symmetric, a slightly different preconditioner;
            `docs/precision.md`). The coarsest level's inverse stays in
            `dtype`.

    Returns:
        A `Multigrid`: a callable `r -> z` (the `precond` of any solver) and
        a pytree; `shapes` lists the levels' grids.

    Raises:
        TypeError, ValueError: an operator that is not a `StencilOperator`,
            offsets farther than one point, an unknown cycle or smoother,
            out-of-range numbers.
    """
    if not isinstance(operator, StencilOperator):
        raise TypeError("`operator` must be a StencilOperator (from sx.stencil_operator or "
                        "sx.diffusion_operator): multigrid coarsens its stencil; got "
                        f"{type(operator).__name__}.")
    if any(abs(v) > 1 for o in operator.entries for v in o):
        raise ValueError("`operator`'s offsets must be within one point per axis (a 3-, 9- "
                         f"or 27-point stencil) for multigrid; got {sorted(operator.entries)}.")
    _checks.check_choice("cycle", cycle, CYCLES)
    _checks.check_choice("smoother", smoother, SMOOTHERS)
    _checks.check_choice("coarse", coarse, COARSE)
    _checks.check_choice("interpolation", interpolation, INTERPOLATIONS)
    coarse_degree = _checks.check_int("coarse_degree", coarse_degree, 1)
    steps = _checks.check_int("steps", steps, 1)
    coarse_size = _coarse_size(coarse, coarse_size, operator)
    max_levels = _checks.check_int("max_levels", max_levels, 1)
    if not 0 < float(semicoarsening) <= 1:
        raise ValueError(f"`semicoarsening` must be in (0, 1]; got {semicoarsening!r}.")
    if not 0 < float(chebyshev_lower) < 1:
        raise ValueError(f"`chebyshev_lower` must be in (0, 1); got {chebyshev_lower!r}.")
    dtype, storage_dtype, narrowed = _precisions(operator, dtype, storage_dtype)
    # the grid known to be on one device (`_tail_plan`): said so by `shards`,
    # or nowhere else to be (traced coefficients do not tell)
    if shards is None:
        shards, one_device = _shards_of(operator), jax.device_count() == 1
    elif (not isinstance(shards, tuple | list) or len(shards) != operator.ndim
          or not all(isinstance(d, int) and d >= 1 for d in shards)):
        raise ValueError(f"`shards` must give, per grid axis, the number of devices splitting "
                         f"it (ints >= 1, {operator.ndim} of them); got {shards!r}.")
    else:
        one_device = all(d == 1 for d in shards)
    shards = tuple(shards)
    # a preconditioner changes how a solve gets there, not where: the
    # solvers' implicit adjoints do not differentiate it, so neither does
    # the set-up (no derivative of its eigenvalue estimates or gathers)
    op = jax.lax.stop_gradient(operator)
    if dtype is not None:
        op = jax.tree_util.tree_map(lambda c: c.astype(dtype), op)
    levels, tail = _hierarchy(op, coarse_size=coarse_size, max_levels=max_levels,
                              semicoarsening=float(semicoarsening), shards=shards,
                              interpolation=interpolation, one_device=one_device,
                              materialize=one_device and narrowed)
    bounds = inverse = None
    if coarse == "chebyshev":
        bounds = _jitted(_coarse_bounds)(levels[-1].op)
    elif coarse == "lines":
        inverse = _jitted(_line_factors)(_gathered_operator(levels[-1].op))
    else:
        inverse = _jitted(_dense_inverse)(_gathered_operator(levels[-1].op))
    if storage_dtype is not None:
        _check_storage_range(levels, storage_dtype)
        levels = [_stored_as(lv, storage_dtype) for lv in levels]
        if tail is not None:
            tail = _Tail(_stored_as(tail.levels, storage_dtype), tail.shapes, tail.padded)
    return Multigrid(levels, inverse, cycle, smoother, steps, float(chebyshev_lower), dtype,
                     bounds, coarse_degree if coarse == "chebyshev" else 0, tail)


def _hierarchy(op: StencilOperator, *, coarse_size: int, max_levels: int,
               semicoarsening: float, shards: tuple, interpolation: str,
               one_device: bool, materialize: bool = False) -> tuple:
    """`(levels, tail)`: the levels from `op` (the finest) built one by one
    until the coarsest, or until the ones left form a `_Tail` (`_tail_plan`;
    then `levels` ends with that tail's first level and the coarsest).

    `materialize` (a narrowed hierarchy on one device: `multigrid` with a
    `dtype` or `storage_dtype` narrower than the operator's): each Galerkin
    operator is computed into memory (`_computed`) before the next level's
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
    the steps' halos separately (`_galerkin`). (Computing each level from
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
            return levels + [first, _Level(op, _smoothing_data(op, False), None)], tail
        last = len(levels) + 1 >= max_levels or _global_size(op) <= coarse_size
        axes = () if last else _axes_to_coarsen(op, semicoarsening, shards)
        # Lanczos where a smoother reads lambda_max: not on the finest level
        # nor on the coarsest (solved, or smoothed by its own bounds)
        lmax = _jitted(_smoothing_data, 1)(op, bool(levels) and bool(axes))
        full = interpolation == "full" and len(axes) >= 2 and not any(
            b == "periodic" and (n // 2) % 3 for b, n in zip(op.boundary, op.shape))
        transfer = _jitted(_transfer, 1, 2)(op, axes, full) if axes else None
        levels.append(_Level(op, lmax, transfer))
        if not axes:
            return levels, None
        galerkin = _jitted(_galerkin)
        op = (_computed(lmax, galerkin, op, transfer, lmax) if materialize
              else galerkin(op, transfer, lmax))


def _coarse_size(coarse: str, coarse_size, operator: StencilOperator) -> int:
    """`coarse_size` checked against what `coarse` can treat."""
    if coarse == "lines" and _line_axis(operator.boundary, operator.shape) is None:
        raise ValueError("`coarse=\"lines\"` factors the coarsest level along an axis that is "
                         "not periodic, and every axis of this operator is periodic: use "
                         "`coarse=\"direct\"` (its pseudo-inverse handles the constant "
                         "null space).")
    limit = _COARSE_LIMIT[coarse]
    if isinstance(coarse_size, int) and not isinstance(coarse_size, bool) and coarse_size > limit:
        hint = ("" if coarse == "lines" else " For a larger coarsest level pass "
                f"`coarse=\"lines\"` (a block LU along grid lines, up to "
                f"{_COARSE_LIMIT['lines']} points).")
        raise ValueError(f"`coarse_size` must be at most {limit} with `coarse=\"{coarse}\"`; "
                         f"got {coarse_size}.{hint}")
    return _checks.check_int("coarse_size", coarse_size, 1, limit)


def _precisions(operator: StencilOperator, dtype, storage_dtype) -> tuple:
    """`multigrid`'s `(dtype, storage_dtype)` checked against the operator's
    own precision (at least float32 for the set-up), and whether either
    narrows the hierarchy below it (`_hierarchy`'s `materialize`)."""
    own = jnp.result_type(*operator.entries.values())
    if jnp.finfo(own).bits < 32:
        raise TypeError(f"`operator` has {jnp.dtype(own).name} coefficients; multigrid's "
                        "set-up needs float32 or wider. Build the operator in float32 and "
                        f"pass `storage_dtype=jnp.{jnp.dtype(own).name}` to store the hierarchy "
                        "in half precision (the cycle computes in float32).")
    if dtype is not None:
        dtype = _cycle_dtype(dtype, own)
    if storage_dtype is not None:
        storage_dtype = _storage_dtype(storage_dtype, dtype or own)
    narrowed = any(d is not None and jnp.dtype(d).itemsize < jnp.dtype(own).itemsize
                   for d in (dtype, storage_dtype))
    return dtype, storage_dtype, narrowed


def _stored_as(level: _Level, dtype) -> _Level:
    """A level (or a `_Tail`'s stack of them) with its coefficients and
    interpolation weights stored in `dtype` (`_check_storage_range` says
    whether it holds them); its `lambda_max` stays as computed."""
    def narrow(w):
        return w.astype(dtype) if jnp.issubdtype(w.dtype, jnp.floating) else w

    transfer = jax.tree_util.tree_map(narrow, level.transfer)
    return _Level(level.op.astype(dtype), level.lmax, transfer)


def _check_storage_range(levels: list, dtype) -> None:
    """Refuse a storage dtype that cannot hold the hierarchy's coefficients
    (concrete ones; float16 tops out at 65504, and Galerkin coefficients grow
    level by level: a 3-D field of contrast 1e3 at 96^3 reaches 3e6 on its
    coarsest level). A traced set-up cannot be checked: there a coefficient
    that overflows makes the solve's status NONFINITE."""
    if not all(_is_concrete(lv.op) for lv in levels):
        return
    largest = max(float(jnp.max(jnp.abs(jnp.asarray(c)))) for lv in levels
                  for c in lv.op.stored.values())
    limit = float(jnp.finfo(dtype).max)
    if not largest < limit:
        raise ValueError(f"`storage_dtype={jnp.dtype(dtype).name}` cannot hold this hierarchy: "
                         f"its largest coefficient is {largest:.3g} (the dtype's largest "
                         f"finite value {limit:.3g}). Use `storage_dtype=jnp.bfloat16` "
                         "(float32's range, 3 digits) or a wider dtype.")


def _storage_dtype(dtype, precision):
    """`multigrid`'s `storage_dtype`: a real floating dtype no wider than the
    hierarchy's `precision` (16-bit ones included), for a real operator."""
    try:
        dtype = jnp.dtype(dtype)
    except TypeError:
        dtype = None
    if jnp.issubdtype(precision, jnp.complexfloating):
        raise TypeError("`storage_dtype` is for real operators; a complex operator's hierarchy "
                        "is stored in its own precision (pass None).")
    if (dtype is None or not jnp.issubdtype(dtype, jnp.floating)
            or dtype.itemsize > jnp.dtype(precision).itemsize):
        raise TypeError(f"`storage_dtype` must be None or a real floating dtype no wider than "
                        f"the hierarchy's {jnp.dtype(precision).name}, e.g. jnp.bfloat16 or "
                        f"jnp.float16; got {dtype!r}.")
    return dtype


def _cycle_dtype(dtype, own):
    """`multigrid`'s `dtype` checked against the operator's own `own`: a
    floating (complex for a complex operator) dtype of 32 bits or more."""
    try:
        dtype = jnp.dtype(dtype)
    except TypeError:
        dtype = None
    complex_operator = jnp.issubdtype(own, jnp.complexfloating)
    kind = jnp.complexfloating if complex_operator else jnp.floating
    if dtype is None or not jnp.issubdtype(dtype, kind) or jnp.finfo(dtype).bits < 32:
        example = "jnp.complex64" if complex_operator else "jnp.float32"
        raise TypeError(f"`dtype` must be None (the operator's {jnp.dtype(own).name}) or a "
                        f"{'complex' if complex_operator else 'real'} floating dtype of 32 bits "
                        f"or more such as {example}.")
    return jax.dtypes.canonicalize_dtype(dtype)
