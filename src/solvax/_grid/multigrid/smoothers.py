"""Smoothers and their spectral bounds: `lambda_max` of `D^-1 A` per level
(Gershgorin, Lanczos), and the `SMOOTHERS` registry: damped Jacobi,
multicolour Gauss-Seidel, Chebyshev. A smoother is one function and one
`register_smoother` line."""

from __future__ import annotations

import functools
import itertools
import math
from typing import Protocol

import jax
import jax.numpy as jnp

from ..._preconditioners.polynomial import estimate_spectrum
from ..stencil import StencilOperator, global_index
from .levels import Level, dinv

# Jacobi's damping times lambda_max(D^-1 A), by grid dimension: the classic
# optima for the 3-point and the 5-point Laplacian (omega = 2/3 and 4/5 with
# lambda_max = 2). 8/5 for 3-D grids too: measured, CG took one iteration
# fewer with it than with 4/3 on Poisson 1024^2 and 64^3 (8 against 9), and
# 12/7 (the 7-point optimum) one more than 8/5 on the 3-D anisotropic problem.
_JACOBI_DAMPING = {1: 4 / 3, 2: 8 / 5}


class Smoother(Protocol):
    """`steps` steps for `A x = r` on `level` from `x` (zero if None): the
    pre-smoother (`post=False`) or the post-smoother (`post=True`; the two
    together keep the cycle symmetric). `lower`: `multigrid`'s
    `chebyshev_lower`. Each step is computed into memory (`fusion.computed`)
    before the next reads it."""

    def __call__(self, level: Level, x, r, *, steps: int, lower: float, post: bool): ...


#: The smoothers by name (`multigrid(smoother=...)`): `register_smoother` adds one.
SMOOTHERS: dict[str, Smoother] = {}


def register_smoother(name: str):
    """A decorator: `fn` becomes the smoother `name`."""
    def register(fn: Smoother) -> Smoother:
        SMOOTHERS[name] = fn
        return fn

    return register


def smoothing_data(op: StencilOperator, lanczos: bool = True, region=None):
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
    solved, or smoothed with its own bounds: `spectrum_bounds`).
    `region`: on a padded level (`Tail`), its grid's size per axis (the
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
    return estimate_spectrum(lambda u: root * op(root * u), v, steps=steps,
                                      axis_name=names or None)


def _capped(ritz, gershgorin):
    """1.1 times a Ritz estimate of `lambda_max`, at most Gershgorin's bound
    (the bound alone where the estimate is not finite)."""
    lmax = jnp.where(jnp.isfinite(ritz), jnp.minimum(1.1 * ritz, gershgorin), gershgorin)
    return lmax.astype(gershgorin.dtype)


def spectrum_bounds(op: StencilOperator, steps: int = 20):
    """`(lambda_min, lambda_max)` of `D^{-1} A` on the coarsest level, for its
    Chebyshev polynomial: the extreme Ritz values of `steps` Lanczos steps
    (at most the level's size; an invariant subspace stops them early),
    `lambda_max` raised by 10 % and capped by Gershgorin's bound as for the
    smoothers. The Ritz `lambda_min` lies above the true one: the modes
    below it are damped less, not amplified (see `chebyshev`)."""
    gershgorin = _gershgorin(op)
    lmin, ritz = _ritz_values(op, steps)
    lmax = _capped(ritz, gershgorin)
    # a non-finite or non-positive estimate (a singular level): the interval's
    # lower end as a small fraction of the upper, as for the smoothers
    lmin = jnp.where(jnp.isfinite(lmin) & (lmin > 0), jnp.minimum(lmin, 0.5 * lmax), 1e-3 * lmax)
    return lmin.astype(gershgorin.dtype), lmax


@register_smoother("jacobi")
def damped_jacobi(level: Level, x, r, *, steps: int, lower: float, post: bool):
    """Damped Jacobi, `omega = _JACOBI_DAMPING / lambda_max(D^-1 A)`. `D^{-1}`
    is a division by the stencil's centre inside each step (the step's
    stencil reads it anyway: one array less to read and to keep)."""
    omega = _JACOBI_DAMPING[min(level.op.ndim, 2)] / level.lmax.astype(jnp.abs(r).dtype)
    keep = level.keep()
    def step(x):
        return keep(lambda x: x + omega * dinv(level.op, r - level.op(x)), x)

    if x is None:   # the first step from zero
        x, steps = keep(lambda: omega * dinv(level.op, r)), steps - 1
    return level.repeated(step, steps, x)


@register_smoother("gauss_seidel")
def gauss_seidel(level: Level, x, r, *, steps: int, lower: float, post: bool):
    """Multicolour Gauss-Seidel sweeps: the points coloured by their index
    parity along each axis (2^d colours: no two points of a colour couple in
    a 3^d-point stencil), each colour relaxed exactly from the latest values
    of the others. Pre-smoothing sweeps the colours in one order,
    post-smoothing in the reverse (so the cycle stays symmetric). Halos
    only: each colour's update is a masked stencil application."""
    op = level.op
    parity = [global_index(op.shape, a, op.axis_names[a])[0] % 2 for a in range(op.ndim)]
    colours = list(itertools.product((0, 1), repeat=op.ndim))
    if post:
        colours = colours[::-1]
    masks = [functools.reduce(jnp.logical_and, [p == c for p, c in zip(parity, colour)])
             for colour in colours]
    keep = level.keep()

    def relaxed(x, masks):
        for mask in masks:
            x = keep(lambda x, mask=mask: jnp.where(mask, x + dinv(op, r - op(x)), x), x)
        return x

    if x is None:   # the first sweep from zero: its first colour from r alone
        x = keep(lambda: jnp.where(masks[0], dinv(op, r), 0))
        x, steps = relaxed(x, masks[1:]), steps - 1
    return level.repeated(lambda x: relaxed(x, masks), steps, x)


@register_smoother("chebyshev")
def chebyshev_smoother(level: Level, x, r, *, steps: int, lower: float, post: bool):
    """Chebyshev's iteration in `D^{-1} A` on `[lower * 1.1 lambda_max, 1.1
    lambda_max]` (`chebyshev`), `steps` its degree."""
    upper = 1.1 * level.lmax.astype(jnp.abs(r).dtype)
    return chebyshev(level, x, r, lower * upper, upper, steps)


def chebyshev(level: Level, x, r, low, upper, steps: int):
    """`steps` steps of Chebyshev's iteration in `D^{-1} A` on `[low, upper]`
    for `A x = r` from `x` (zero if None), each computed into memory
    (Saad, Alg. 12.1). Eigenvalues below `low` are damped less, never
    amplified: the polynomial stays in `(0, 1]` there, so the map
    `r -> x` from zero is SPD for an SPD operator. Also the coarsest level's
    treatment `coarse="chebyshev"` (`coarse.ChebyshevLevel`)."""
    keep = level.keep()
    theta, delta = (upper + low) / 2, (upper - low) / 2

    def first(x):
        res = r - level.op(x)
        d = dinv(level.op, res) / theta
        return res, d, x + d

    if x is None:     # from zero: the residual is `r` itself (no copy of it)
        res, d = r, keep(lambda: dinv(level.op, r) / theta)
        x = d
    else:
        res, d, x = keep(first, x)

    def step(state):
        res, d, x, rho = state
        rho_next = 1 / (2 * theta / delta - rho)

        def update(res, d, x):
            res = res - level.op(d)
            d = rho_next * rho * d + (2 * rho_next / delta) * dinv(level.op, res)
            return res, d, x + d

        return (*keep(update, res, d, x), rho_next)

    return level.repeated(step, steps - 1, (res, d, x, delta / theta))[2]
