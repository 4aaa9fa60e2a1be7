"""The reduction layer: every inner product and norm in solvax is computed here.

Per-leaf products are `sum(conj(x) * y)` — never `vdot`, `ravel` or
`reshape(-1)`, which all-gather a leaf sharded on a non-leading axis. A solver
asks for *all independent products of one step at once*; the layer stacks the
per-leaf partial products along a new leading axis before the single global
sum, so a step costs one reduction of a k-vector by construction (one
all-reduce under `jit`, one `lax.psum` inside `shard_map`), independent of
whether XLA's all-reduce combiner would have merged separate sums.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

PyTree = Any
Pair = tuple[PyTree, PyTree]


class InnerProduct:
    """The inner product `<x, y> = sum_leaves sum(conj(x) * weight * y)`.

    Args:
        axis_name: inside `shard_map`, the mesh axis (or tuple of axes) the
            vectors are split over; the local partial sums are combined with
            one `lax.psum`, so every shard sees the same global values. Leave
            `None` under plain `jit` (GSPMD inserts the all-reduce).
        weight: optional pytree of positive real weights with the structure of
            the vectors (a diagonal SPD metric).
    """

    def __init__(self, *, axis_name: str | tuple[str, ...] | None = None, weight: PyTree = None):
        self.axis_name = axis_name
        self.weight = weight

    def __repr__(self) -> str:
        return f"InnerProduct(axis_name={self.axis_name!r}, weighted={self.weight is not None})"

    # -- the single reduction -------------------------------------------------
    def _global_sum(self, per_leaf_blocks: list[list[jax.Array]]) -> jax.Array:
        """Sum stacked blocks `(k_i, *leaf.shape)` of every leaf into one k-vector."""
        dtype = jnp.result_type(*[b for blocks in per_leaf_blocks for b in blocks])
        total = None
        for blocks in per_leaf_blocks:
            stacked = blocks[0] if len(blocks) == 1 else jnp.concatenate(
                [b.astype(dtype) for b in blocks], axis=0)  # along the small leading axis only
            partial = jnp.sum(stacked.astype(dtype), axis=tuple(range(1, stacked.ndim)))
            total = partial if total is None else total + partial
        if self.axis_name is not None:
            total = lax.psum(total, self.axis_name)
        return total

    def _weighted(self, y: PyTree) -> PyTree:
        if self.weight is None:
            return y
        return jax.tree_util.tree_map(lambda w, v: w * v, self.weight, y)

    def _leaves(self, x: PyTree) -> list[jax.Array]:
        return jax.tree_util.tree_leaves(x)

    # -- public ----------------------------------------------------------------
    def multi_dot(self, pairs: Sequence[Pair]) -> jax.Array:
        """`[<x_1, y_1>, ..., <x_k, y_k>]` in one reduction."""
        xs = [self._leaves(x) for x, _ in pairs]
        ys = [self._leaves(self._weighted(y)) for _, y in pairs]
        per_leaf = []
        for leaf in range(len(xs[0])):
            per_leaf.append([jnp.stack([jnp.conj(x[leaf]) * y[leaf] for x, y in zip(xs, ys)])])
        return self._global_sum(per_leaf)

    def project(self, basis: PyTree, x: PyTree, pairs: Sequence[Pair] = ()) -> tuple:
        """`(V^H x, [<a, b> for (a, b) in pairs])` in one reduction.

        `basis` has leaves `(m, *leaf.shape)`; the first result has length m.
        """
        coeffs, extras = self.project_many(basis, [x], pairs)
        return coeffs[0], extras

    def project_many(self, basis: PyTree, xs: Sequence[PyTree], pairs: Sequence[Pair] = ()):
        """`([V^H x for x in xs], [<a, b> for (a, b) in pairs])` in one reduction;
        the first result has shape `(len(xs), m)`."""
        m = jax.tree_util.tree_leaves(basis)[0].shape[0]
        vs = self._leaves(basis)
        xws = [self._leaves(self._weighted(x)) for x in xs]
        extra_x = [self._leaves(a) for a, _ in pairs]
        extra_y = [self._leaves(self._weighted(b)) for _, b in pairs]
        per_leaf = []
        for leaf, v in enumerate(vs):
            blocks = [jnp.conj(v) * xw[leaf][None] for xw in xws]
            if pairs:
                blocks.append(jnp.stack([jnp.conj(a[leaf]) * b[leaf]
                                         for a, b in zip(extra_x, extra_y)]))
            per_leaf.append(blocks)
        total = self._global_sum(per_leaf)
        return total[: m * len(xs)].reshape(len(xs), m), total[m * len(xs):]

    def dot(self, x: PyTree, y: PyTree) -> jax.Array:
        return self.multi_dot([(x, y)])[0]

    def norm(self, x: PyTree) -> jax.Array:
        return real_sqrt(self.dot(x, x))


class _CallableInnerProduct(InnerProduct):
    """Wraps a user function `(x, y) -> scalar`; each product is its own reduction."""

    def __init__(self, fn: Callable[[PyTree, PyTree], jax.Array]):
        super().__init__()
        self.fn = fn

    def __repr__(self) -> str:
        return f"InnerProduct({self.fn!r})"

    def multi_dot(self, pairs):
        return jnp.stack([jnp.asarray(self.fn(x, y)) for x, y in pairs])

    def project_many(self, basis, xs, pairs=()):
        coeffs = jnp.stack([jax.vmap(lambda v, x=x: jnp.asarray(self.fn(v, x)))(basis)
                            for x in xs])
        extras = self.multi_dot(pairs) if pairs else jnp.zeros((0,), coeffs.dtype)
        return coeffs, extras


def real_sqrt(value: jax.Array) -> jax.Array:
    """`sqrt(max(Re(value), 0))`: a norm from a squared norm."""
    return jnp.sqrt(jnp.maximum(jnp.real(value), 0))


def resolve(inner_product=None, axis_name=None) -> InnerProduct:
    """The `InnerProduct` a solver uses for its `inner_product=` / `axis_name=` options."""
    if inner_product is None:
        return InnerProduct(axis_name=axis_name)
    if axis_name is not None:
        raise ValueError(
            "Pass either `inner_product` or `axis_name`, not both: "
            "use `InnerProduct(axis_name=..., weight=...)` to combine them."
        )
    if isinstance(inner_product, InnerProduct):
        return inner_product
    if callable(inner_product):
        return _CallableInnerProduct(inner_product)
    raise TypeError(
        "`inner_product` must be None, a `solvax.InnerProduct` or a function "
        f"`(x, y) -> scalar`; got {type(inner_product).__name__}."
    )


__all__ = ["InnerProduct", "resolve", "real_sqrt"]
