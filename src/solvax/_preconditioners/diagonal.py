"""Diagonal and block-diagonal preconditioners (Jacobi, block Jacobi):
collective-free, applying one communicates nothing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._core import checks
from .._core.dense import PRECISION, inv

PyTree = Any


def jacobi(diagonal: PyTree) -> Callable[[PyTree], PyTree]:
    """Diagonal (Jacobi) preconditioner `r -> r / diag(A)`, leaf by leaf.

    Args:
        diagonal: the diagonal of `A`, a pytree shaped like the vectors
            (each leaf sharded like its vector leaf; nonzero entries), or a
            `StencilOperator` (its centre coefficients: `sx.jacobi(A)` is
            `sx.jacobi(A.diagonal())`).

    Returns:
        `precond(r)`, elementwise: no communication. A pytree (a
        `jax.tree_util.Partial`), so it can be returned by
        `newton_krylov`'s `precond_builder`.

    Raises:
        TypeError: non-floating leaves.
    """
    if _is_operator(diagonal):   # an operator is a pytree too: not a diagonal
        diagonal = diagonal.diagonal()
    checks.check_vector("diagonal", diagonal)
    inverse = jax.tree_util.tree_map(lambda d: 1 / d, diagonal)
    return jax.tree_util.Partial(_scaled_by, inverse)


def _is_operator(x) -> bool:
    """Whether `x` is an operator that knows its diagonal (a `StencilOperator`:
    a pytree of coefficients, which `jacobi` must not take for a diagonal),
    rather than an array (whose `diagonal` is a matrix's) or a pytree of them."""
    return (not isinstance(x, jax.Array | np.ndarray | np.generic)
            and callable(getattr(x, "diagonal", None)))


def _scaled_by(inverse: PyTree, r: PyTree) -> PyTree:
    return jax.tree_util.tree_map(lambda i, v: (i * v).astype(v.dtype), inverse, r)


def block_jacobi(blocks: jax.Array) -> Callable[[jax.Array], jax.Array]:
    """Block-Jacobi preconditioner from dense diagonal blocks, inverted once.

    The vector's leading axis (length `nb * bs`) is split into `nb` blocks of
    `bs` rows; block `i` is multiplied by `inv(blocks[i])`. When each shard
    holds whole blocks (its share of the leading axis is a multiple of `bs`),
    applying it is local: a reshape of the leading axis and a batched matmul.

    Args:
        blocks: `(nb, bs, bs)` diagonal blocks of `A` (nonsingular).

    Returns:
        `precond(r)` for arrays `r` of shape `(nb * bs, *rest)`.

    Raises:
        ValueError: `blocks` is not a stack of square matrices, or (when
            applied) `r`'s leading axis is not `nb * bs`.
    """
    checks.check_vector("blocks", blocks)
    if blocks.ndim != 3 or blocks.shape[1] != blocks.shape[2]:
        raise ValueError(f"`blocks` must have shape (nb, bs, bs); got {tuple(blocks.shape)}.")
    nb, bs, _ = blocks.shape
    inverse = inv(blocks)  # LU factorization, once

    def precond(r):
        if r.shape[0] != nb * bs:
            raise ValueError(f"block_jacobi: the vector's leading axis must be nb * bs = "
                             f"{nb * bs}; got shape {tuple(r.shape)}.")
        local = r.reshape(nb, bs, *r.shape[1:])
        out = jnp.einsum("nij,nj...->ni...", inverse.astype(jnp.result_type(inverse, r)), local,
                         precision=PRECISION)
        return out.reshape(r.shape).astype(r.dtype)

    return precond
