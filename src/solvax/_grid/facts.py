"""What a `StencilOperator` with concrete coefficients can say about itself,
tested numerically on the host at trace time: whether it is symmetric (so
that `pcg` can refuse one that is not) and whether constants are its null
space (so that a solve can tell an inconsistent `b`). Where it cannot be
told (traced coefficients, a block of a grid inside `shard_map`), None."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def concrete(op) -> bool:
    """The whole grid's coefficients are known here (not traced, not a block)."""
    return (all(n is None for n in op.axis_names)
            and not any(isinstance(c, jax.core.Tracer) for c in op.stored.values()))


def symmetric(op) -> bool | None:
    """`<u, A v> = <A u, v>` to rounding for two random vectors (a
    nonsymmetric stencil fails with probability one), or None."""
    if not concrete(op):
        return None
    rng = np.random.default_rng(0)
    u, v = (rng.standard_normal(op.shape) for _ in range(2))
    dtype = jnp.result_type(*op.stored.values())
    with jax.ensure_compile_time_eval():  # concrete also inside a trace
        au, av = (np.asarray(op(jnp.asarray(w, dtype)), np.float64) for w in (u, v))
    gap = abs(np.sum(u * av) - np.sum(au * v))
    scale = np.linalg.norm(au) * np.linalg.norm(v) + np.linalg.norm(u) * np.linalg.norm(av)
    return bool(gap <= 1e3 * np.finfo(dtype).eps * scale)


def annihilates_constants(op) -> bool | None:
    """Every row and every column of the stencil sums to zero (to rounding
    next to the largest diagonal entry), or None."""
    if not concrete(op):
        return None
    with jax.ensure_compile_time_eval():  # concrete also inside a trace
        one = jnp.ones(op.shape, jnp.result_type(*op.stored.values()))
        sums = [op(one)]
        if not op.symmetric:
            sums.append(jax.linear_transpose(op, one)(one)[0])
        scale = float(np.max(np.abs(np.asarray(op.diagonal()))))
    eps = np.finfo(one.dtype).eps
    return scale > 0 and all(float(np.max(np.abs(np.asarray(t)))) <= 100 * eps * scale
                             for t in sums)
