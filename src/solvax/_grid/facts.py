"""What a `StencilOperator` with concrete coefficients can say about itself,
tested numerically on the host with NumPy at trace time (no JAX program is
compiled for it): whether it is symmetric (so that `pcg` can refuse one that
is not) and whether constants are its null space (so that a solve can tell
an inconsistent `b`). Where it cannot be told (traced coefficients, a block
of a grid inside `shard_map`), None."""

from __future__ import annotations

import jax
import numpy as np

_PAD = {"dirichlet": "constant", "neumann": "edge", "periodic": "wrap"}


def concrete(op) -> bool:
    """The whole grid's coefficients are known here (not traced, not a block)."""
    return (all(n is None for n in op.axis_names)
            and not any(isinstance(c, jax.core.Tracer) for c in op.stored.values()))


def _shifted(x, offset, boundary):
    """`x[i + offset]` with what lies outside given by the boundary per axis."""
    for axis, (step, kind) in enumerate(zip(offset, boundary)):
        if step:
            width = [(0, 0)] * x.ndim
            width[axis] = (abs(step), abs(step))
            padded = np.pad(x, width, mode=_PAD[kind])
            x = np.take(padded, np.arange(x.shape[axis]) + abs(step) + step, axis=axis)
    return x


def _apply(op, x):
    """`A x` in float64 NumPy from every offset's coefficients (`op.entries`)."""
    entries = op.entries if op.symmetric else op.stored
    boundary = op._closed() if op.symmetric else op.boundary
    return sum(np.asarray(c, np.float64) * _shifted(x, o, boundary) for o, c in entries.items())


def _small(value, scale, dtype) -> bool:
    return bool(abs(value) <= 1e3 * np.finfo(dtype).eps * scale)


def _dtype(op):
    return np.result_type(*[np.asarray(c).dtype for c in op.stored.values()])


def symmetric(op) -> bool | None:
    """`<u, A v> = <A u, v>` to rounding for two random vectors (a
    nonsymmetric stencil fails with probability one), or None."""
    if not concrete(op):
        return None
    u, v = np.random.default_rng(0).standard_normal((2, *op.shape))
    au, av = _apply(op, u), _apply(op, v)
    scale = np.linalg.norm(au) * np.linalg.norm(v) + np.linalg.norm(u) * np.linalg.norm(av)
    return _small(np.sum(u * av) - np.sum(au * v), scale, _dtype(op))


def annihilates_constants(op) -> bool | None:
    """Every row (`A 1 = 0`) and every column (`1^T A v = 0` for a random
    `v`) of the stencil sums to zero, to rounding, or None."""
    if not concrete(op):
        return None
    v = np.random.default_rng(1).standard_normal(op.shape)
    rows, av = _apply(op, np.ones(op.shape)), _apply(op, v)
    scale = float(np.max(np.abs(np.asarray(op.stored.get((0,) * len(op.shape), 0.0)))))
    dtype = _dtype(op)
    return (scale > 0 and _small(np.max(np.abs(rows)), 10 * scale, dtype)
            and _small(np.sum(av), 10 * scale * np.sqrt(v.size) * np.linalg.norm(v), dtype))
