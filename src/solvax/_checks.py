"""Trace-time validation shared by every solver: errors name the argument and the fix."""

from __future__ import annotations

import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any


def _describe(tree: PyTree) -> str:
    def one(leaf):
        return f"{jnp.dtype(leaf.dtype).name}{list(leaf.shape)}"

    return str(jax.tree_util.tree_map(one, tree))


def check_vector(name: str, tree: PyTree) -> None:
    """`tree` is a non-empty pytree of inexact (float or complex) arrays."""
    leaves = jax.tree_util.tree_leaves(tree)
    if not leaves:
        raise ValueError(f"`{name}` must be an array or a pytree with at least one array leaf.")
    for leaf in leaves:
        if not hasattr(leaf, "dtype") or not hasattr(leaf, "shape"):
            raise TypeError(f"`{name}` must hold arrays; found a leaf of type "
                            f"{type(leaf).__name__}. Convert it with `jnp.asarray`.")
        if not jnp.issubdtype(leaf.dtype, jnp.inexact):
            raise TypeError(f"`{name}` must have floating-point or complex leaves; got dtype "
                            f"{leaf.dtype}. Cast it, e.g. `b.astype(jnp.float64)`.")


def check_like(name: str, tree: PyTree, ref_name: str, ref: PyTree) -> None:
    """`tree` has `ref`'s pytree structure and, leaf by leaf, its shape and dtype."""
    t_struct = jax.tree_util.tree_structure(tree)
    r_struct = jax.tree_util.tree_structure(ref)
    if t_struct != r_struct:
        raise ValueError(
            f"`{name}` must have the same pytree structure as `{ref_name}`.\n"
            f"  {name}: {t_struct}\n  {ref_name}: {r_struct}\n"
            f"Return (or pass) a pytree built like `{ref_name}`."
        )
    for t, r in zip(jax.tree_util.tree_leaves(tree), jax.tree_util.tree_leaves(ref)):
        if tuple(t.shape) != tuple(r.shape) or jnp.dtype(t.dtype) != jnp.dtype(r.dtype):
            raise ValueError(
                f"`{name}` must match `{ref_name}` leaf by leaf in shape and dtype.\n"
                f"  {name}: {_describe(tree)}\n  {ref_name}: {_describe(ref)}\n"
                f"Cast or reshape so each leaf agrees (e.g. `.astype({ref_name}.dtype)`)."
            )


def check_callable(name: str, fn) -> None:
    if not callable(fn):
        raise TypeError(f"`{name}` must be a function of a vector; got {type(fn).__name__}.")


def check_tolerance(name: str, value) -> None:
    """A tolerance is a non-negative real number (checked when concrete)."""
    if isinstance(value, jax.core.Tracer):
        return
    arr = np.asarray(value)
    if arr.shape != () or not np.issubdtype(arr.dtype, np.number) or np.iscomplexobj(arr):
        raise TypeError(f"`{name}` must be a real scalar; got {value!r}.")
    if not np.isfinite(arr) or arr < 0:
        raise ValueError(f"`{name}` must be finite and >= 0; got {value!r}.")


def check_int(name: str, value, minimum: int) -> int:
    """A static integer option at least `minimum`."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, np.integer)):
        raise TypeError(f"`{name}` must be a Python int (it fixes loop bounds and buffer "
                        f"sizes at trace time); got {value!r}.")
    if value < minimum:
        raise ValueError(f"`{name}` must be >= {minimum}; got {value}.")
    return int(value)


def check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"`{name}` must be one of {', '.join(map(repr, choices))}; "
                         f"got {value!r}.")


def is_real(tree: PyTree) -> bool:
    return all(not jnp.issubdtype(leaf.dtype, jnp.complexfloating)
               for leaf in jax.tree_util.tree_leaves(tree))

