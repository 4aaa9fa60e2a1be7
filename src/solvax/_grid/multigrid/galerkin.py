"""The Galerkin coarse operator `R A P` computed in stencil form: in closed
form one coarsened axis at a time, or by probing for full interpolation."""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp

from ..stencil import StencilOperator, global_index, shift_all, stored_half, unit_shift
from .fusion import computed
from .transfer import Transfer, axis_slice, dirichlet_form, every_other


def _galerkin_axis(op: StencilOperator, axis: int, weights: dict, flag=None
                   ) -> StencilOperator:
    """`P_a^T A P_a` for the interpolation `P_a` along one axis (`_prolong_axis`)
    of a stencil in Dirichlet form (`dirichlet_form`: each axis Dirichlet or
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
            return jnp.concatenate([axis_slice(evens, axis, 1, nc), last()], axis=axis)
        return unit_shift(evens, axis, 1, kind, name)

    def rows(c):
        """`c` at the fine rows `2 J`, `2 J + 1`, `2 J + 2` (s = -1, 0, 1)."""
        even = axis_slice(every_other(c, axis, 0), axis, 0, nc)   # an odd axis's last: below
        odd = every_other(c, axis, 1)
        return {-1: even, 0: odd, 1: following(even, lambda: axis_slice(c, axis, 2 * nc, n))}

    # the weights are sampled at the fine even points (nc of them, nc + 1 on an odd axis)
    w_minus, w_plus = (axis_slice(weights[k], axis, 0, nc) for k in ("minus", "plus"))
    w_next = following(w_minus, lambda: axis_slice(weights["minus"], axis, nc, nc + 1))
    alpha = {-1: w_plus, 0: jnp.ones_like(w_plus), 1: w_next}
    fine = op.entries   # a symmetric operator's other half: its stored half shifted
    terms = _axis_terms(fine, axis)
    offsets = sorted(terms)
    if op.symmetric:   # so is `P^T A P`: its stored half only
        offsets = [o for o in offsets if stored_half(o)]
    def products(alpha, fine):
        """The coarse entries from the weights and the fine entries: each
        one sum of the terms above, its rows and shifted weights read by
        that sum from the inputs."""
        shifted = {t: dict(zip(offsets, shift_all(alpha[t], offsets, op.boundary,
                                                  op.axis_names))) for t in (-1, 0, 1)}
        fine_rows = {o: rows(jnp.broadcast_to(c, shape)) for o, c in fine.items()}
        entries = {}
        for target in offsets:
            total = 0.0
            for s, t, o in terms[target]:
                total = total + alpha[s] * fine_rows[o][s] * shifted[t][target]
            entries[target] = total
        return entries

    entries = computed(flag, products, alpha, dict(fine))
    return StencilOperator(entries, coarse, op.boundary, op.axis_names, op.symmetric)


def _axis_terms(fine_offsets, axis: int) -> dict:
    """`_galerkin_axis`'s terms: per coarse offset (`O` along `axis`), the
    `(s, t, o)` with `2 O + t - s` the `axis` component of a fine offset `o`
    (the other components as they are), `s` and `t` in {-1, 0, 1}."""
    terms = {}
    for o in fine_offsets:
        for big in (-1, 0, 1):
            for s in (-1, 0, 1):
                t = o[axis] + s - 2 * big
                if t in (-1, 0, 1):
                    target = tuple(big if a == axis else v for a, v in enumerate(o))
                    terms.setdefault(target, []).append((s, t, o))
    return terms


def galerkin_operator(op: StencilOperator, transfer: Transfer, flag=None,
                      split: bool = False) -> StencilOperator:
    """`R A P` as a stencil (offsets in {-1, 0, 1} per axis) in closed form:
    `P` is one interpolation per coarsened axis (the last applied last), so
    `R A P` is one single-axis product after another, the last axis first.
    (Fusion barriers between the steps, and before each level's set-up,
    saved about 5 % of the set-up on one device but added collectives to
    it on a sharded grid, 110 -> 119 in the 64 x 64 P('i', None) row of
    `python -m solvax`: XLA no longer shared the halos of the steps. A
    narrowed hierarchy on one device computes the result into memory:
    `build_hierarchy`.)
    `flag`: the level's `lambda_max`, a replicated scalar for `computed`.
    `split` (a grid on one device): each axis product computed inside
    one fusion barrier (`computed`), so that its inputs (the fine entries
    and the weights) are in memory and each coarse entry is one kernel that
    reads its fine rows and shifted weights from them. XLA:CPU otherwise
    fused the inputs' own arithmetic into every term that reads them,
    recomputed, and compiled hundreds of instructions per fusion (two 2-D
    levels at 512^2: set-up 51 -> 17 ms, compile 3.3 -> 1.4 s). Computing
    the rows and shifted weights into memory first, as before, cost a
    kernel and a pass over memory each: Poisson 1024^2's program 636 ->
    433 kernels without them, its set-up 136 -> 105 ms (float32: 88 -> 70),
    128^3 324 -> 229 ms, 64^3 in float32 25 -> 13 ms. Not on a sharded
    grid, where the barriers cost halos (above)."""
    if transfer.full:
        out = _galerkin_probed(op, transfer, flag)
    else:
        out = dirichlet_form(op)
        for axis, weights in reversed(list(zip(transfer.axes, transfer.weights))):
            out = _galerkin_axis(out, axis, weights, flag if split else None)
    # a coarse axis of one point (outside a shard_map block, not wrapped)
    # couples along it to nothing
    flat = [a for a, (m, name, b) in enumerate(zip(out.shape, out.axis_names, out.boundary))
            if m == 1 and name is None and b != "periodic"]
    entries = {o: c for o, c in out.stored.items() if not any(o[a] for a in flat)}
    return StencilOperator(entries, out.shape, out.boundary, op.axis_names, out.symmetric)


def _galerkin_probed(op: StencilOperator, transfer: Transfer, flag) -> StencilOperator:
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
    keep = functools.partial(computed, flag)
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
