"""Leaf-wise vector algebra on pytrees.

Every function here acts on each leaf separately and never ravels, reshapes to
1-D or concatenates leaves, so each leaf keeps its own sharding. Reductions
(inner products, norms) live in `reduce.py`, not here.

A *basis* is a pytree whose leaves carry one extra leading axis of length m
(the basis index); it is allocated from an operand so every leaf inherits that
operand's sharding on the trailing axes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from . import target
from .dense import PRECISION

PyTree = Any
MatVec = Callable[[PyTree], PyTree]

tree_map = jax.tree_util.tree_map


def zeros_like(x: PyTree) -> PyTree:
    return tree_map(jnp.zeros_like, x)


def add(x: PyTree, y: PyTree) -> PyTree:
    return tree_map(jnp.add, x, y)


def sub(x: PyTree, y: PyTree) -> PyTree:
    return tree_map(jnp.subtract, x, y)


def like(a, leaf):
    """The scalar (or small array) `a` in `leaf`'s dtype: every mixed-dtype
    operation casts explicitly, so solvers run under strict dtype promotion."""
    return jnp.asarray(a).astype(leaf.dtype)


def scale(a, x: PyTree) -> PyTree:
    """`a * x` for a scalar `a`, cast to each leaf's dtype."""
    return tree_map(lambda leaf: like(a, leaf) * leaf, x)


def axpy(a, x: PyTree, y: PyTree) -> PyTree:
    """`a * x + y` for a scalar `a`."""
    return tree_map(lambda u, v: like(a, v) * u.astype(v.dtype) + v, x, y)


def after(x: PyTree, dep: PyTree) -> PyTree:
    """`x`, made data-dependent on `dep` (`x + 0 * dep`, leaf by leaf; `dep`
    shaped like `x` or a scalar).

    A loop body that reads an old vector to build `dep` and also overwrites
    that vector with `x` leaves XLA two unordered readers of the old buffer,
    and its copy insertion then copies the whole vector every step. The
    dependency orders `x` after `dep`, so the update happens in place. Exact
    for finite `dep`; a non-finite `dep` makes `x` non-finite too (which the
    solvers report as `NONFINITE`).
    """
    if isinstance(dep, jax.Array | jax.core.Tracer) and jnp.ndim(dep) == 0:  # a scalar
        return tree_map(lambda u: u + jnp.zeros((), u.dtype) * dep.astype(u.dtype), x)
    return tree_map(lambda u, v: u + jnp.zeros((), u.dtype) * v.astype(u.dtype), x, dep)


def where(pred, x: PyTree, y: PyTree) -> PyTree:
    """Select `x` where the scalar `pred` holds, else `y` (leaf by leaf)."""
    return tree_map(lambda u, v: jnp.where(pred, u, v), x, y)


def result_dtype(x: PyTree):
    """The common dtype of all leaves, at least float32: complex if any leaf
    is, as wide as the widest leaf. From the dtypes alone, so a weakly typed
    leaf counts with its own width, and no promotion rule is consulted (the
    same under strict dtype promotion)."""
    dtypes = [jnp.dtype(leaf.dtype) for leaf in jax.tree_util.tree_leaves(x)]
    bits = max([32] + [8 * jnp.finfo(d).dtype.itemsize for d in dtypes])
    if any(jnp.issubdtype(d, jnp.complexfloating) for d in dtypes):
        return jnp.dtype(f"complex{2 * bits}")
    return jnp.dtype(f"float{bits}")


def size(x: PyTree) -> int:
    """Total number of entries over all leaves (static)."""
    return sum(int(leaf.size) for leaf in jax.tree_util.tree_leaves(x))


# ---------------------------------------------------------------- bases

def basis_alloc(x: PyTree, m: int) -> PyTree:
    """A basis of `m` zero vectors shaped like `x`: leaves `(m, *leaf.shape)`."""
    return tree_map(lambda leaf: jnp.broadcast_to(jnp.zeros_like(leaf), (m, *leaf.shape)), x)


def basis_get(basis: PyTree, j) -> PyTree:
    """Vector `j` of the basis."""
    return tree_map(lambda leaf: jax.lax.dynamic_index_in_dim(leaf, j, 0, keepdims=False), basis)


def basis_set(basis: PyTree, j, x: PyTree) -> PyTree:
    """The basis with vector `j` replaced by `x`."""
    return tree_map(
        lambda leaf, v: jax.lax.dynamic_update_index_in_dim(leaf, v.astype(leaf.dtype), j, 0),
        basis,
        x,
    )


def basis_fill(basis: PyTree, j, rows: list[PyTree], pred) -> PyTree:
    """The basis with rows `j, j + 1, ...` set to `rows` where the scalar
    `pred` holds, else to zeros.

    For rows that are still zero (or no longer needed once `pred` fails: the
    Arnoldi cycle then ends). The update never reads the basis, so XLA writes
    the rows in place instead of copying the whole basis every step, and
    consecutive rows go in one update (one pass, one kernel)."""

    def fill(leaf, *vs):
        block = jnp.stack([jnp.where(pred, v, jnp.zeros_like(v)).astype(leaf.dtype) for v in vs])
        return jax.lax.dynamic_update_slice_in_dim(leaf, block, j, 0)

    return tree_map(fill, basis, *rows)


def basis_of(vectors: list[PyTree]) -> PyTree:
    """The basis whose rows are `vectors`: each leaf stacked on a new leading
    axis (the sharding of the vector axes is kept; nothing is flattened)."""
    return tree_map(lambda *leaves: jnp.stack(leaves), *vectors)


def basis_join(parts: list[PyTree]) -> PyTree:
    """Bases (leaves `(m_i, *leaf.shape)`) joined along the basis axis into one
    of `sum(m_i)` rows: the vector axes are untouched."""
    return tree_map(lambda *leaves: jnp.concatenate(leaves, axis=0), *parts)


def basis_mix(basis: PyTree, coeffs) -> PyTree:
    """The basis whose row i is `sum_j coeffs[i, j] * basis[j]`: one contraction
    over the basis axis per leaf, reading the basis once (a GEMM, or on a TPU
    a sum: `combines_by_gemm`)."""
    return tree_map(lambda leaf: _contract_basis_axis(coeffs, leaf), basis)


def basis_combine(basis: PyTree, coeffs) -> PyTree:
    """`sum_j coeffs[j] * basis[j]`: a contraction over the basis axis only."""
    return basis_combine_many(basis, [coeffs])[0]


def basis_combine_many(basis: PyTree, coeffs: list) -> list[PyTree]:
    """`[sum_j c[j] * basis[j] for c in coeffs]` in one pass over the basis.

    Per leaf one contraction of the stacked coefficients `(s, m)` with the
    basis `(m, ...)` that reads the basis once, faster than separate
    combinations (measured: `docs/krylov.md`, "whole-basis copies in GMRES"):
    a GEMM, or on a TPU an elementwise sum (`combines_by_gemm`)."""
    stacked = jnp.stack(coeffs)
    combined = tree_map(lambda leaf: _contract_basis_axis(stacked, leaf), basis)
    return [tree_map(lambda leaf, i=i: leaf[i], combined) for i in range(len(coeffs))]


def combines_by_gemm(backend: str | None = None) -> bool:
    """The rule for how a basis is combined (`basis_combine_many`, `basis_mix`).

    - **CPU and GPU**: a GEMM (`tensordot` over the basis axis), one pass
      over the basis.
    - **TPU**: an elementwise product summed over the basis axis (a
      reduction fusion, also one pass). A `dot` there makes XLA's layout
      assignment interleave the basis rows into the matrix unit's tiles
      (layout `{2,0,1}` for a 2-D leaf), and every Arnoldi step's write of
      a new row then costs copies: one-sync GMRES(30) at 2048^2 took 2.92 ms
      per matvec with the GEMM and 1.67 ms with the sum (jax.scipy's: 1.54),
      on a TPU v5e chip (`benchmarks/results/tpu.md`).

    `backend` defaults to JAX's default backend (the target of a `jit`
    without explicit devices)."""
    backend = target.platform() if backend is None else backend
    return backend != "tpu"


def _contract_basis_axis(coeffs: jax.Array, leaf: jax.Array) -> jax.Array:
    """`coeffs (s, m)` times a basis leaf `(m, *shape)` over the basis axis:
    `(s, *shape)`, by the backend's rule (`combines_by_gemm`)."""
    coeffs = like(coeffs, leaf)
    if combines_by_gemm():
        return jnp.tensordot(coeffs, leaf, axes=(1, 0), precision=PRECISION)
    return jnp.sum(coeffs.reshape(coeffs.shape + (1,) * (leaf.ndim - 1)) * leaf[None], axis=1)
