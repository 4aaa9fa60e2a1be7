"""Trace-time validation shared by every solver: errors name the argument and the fix."""

from __future__ import annotations

import contextlib
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
    """`tree` is a non-empty pytree of inexact (float or complex) arrays, and
    not an operator (`check_not_operator`)."""
    check_not_operator(name, tree)
    leaves = jax.tree_util.tree_leaves(tree)
    if not leaves:
        raise ValueError(f"`{name}` must be an array or a pytree with at least one array leaf.")
    for leaf in leaves:
        if not hasattr(leaf, "dtype") or not hasattr(leaf, "shape"):
            raise TypeError(f"`{name}` must hold arrays; found a leaf of type "
                            f"{type(leaf).__name__}. Convert it with `jnp.asarray`.")
        if not jnp.issubdtype(leaf.dtype, jnp.inexact):
            raise TypeError(f"`{name}` must have floating-point or complex leaves; got dtype "
                            f"{leaf.dtype}. Cast it, e.g. `{name}.astype(jnp.float64)`.")
    if sum(int(np.size(leaf)) for leaf in leaves) == 0:
        raise ValueError(f"`{name}` has no entries (every leaf has size 0): there is nothing "
                         "to solve.")


def check_not_operator(name: str, tree: PyTree) -> None:
    """`tree`, a vector argument, is not a callable: an operator such as a
    `StencilOperator` is a pytree of floating arrays too, and would otherwise
    pass for a vector and fail later, inside the solve, under another name."""
    if callable(tree) and not isinstance(tree, jax.Array | np.ndarray):
        raise TypeError(f"`{name}` is a callable ({type(tree).__name__}): an operator, not a "
                        f"vector. Pass `{name}` as an array or a pytree of arrays; the "
                        "operator goes first (`solver(A, b, ...)`).")


def check_precision(name: str, tree: PyTree) -> None:
    """At least float32: 16-bit rounding (1e-3) stops any Krylov method short of
    useful tolerances, and their reductions would need a wider accumulator."""
    for leaf in jax.tree_util.tree_leaves(tree):
        if jnp.finfo(leaf.dtype).bits < 32:
            raise TypeError(
                f"`{name}` has a {jnp.dtype(leaf.dtype).name} leaf; solvax's Krylov solvers "
                f"need float32 or wider. Cast it, e.g. `{name}.astype(jnp.float32)`, and make "
                "the operator return that dtype. Half precision is for stored coefficients "
                "(`StencilOperator.astype(jnp.bfloat16)`, `multigrid(..., storage_dtype=)`), "
                "and `iterative_refinement` gives float64 answers from float32 work.")


def strong(tree: PyTree) -> PyTree:
    """`tree` with weakly typed leaves made strongly typed (same dtype): solver
    state then has one fixed type. Solutions come back strongly typed, as from
    `jnp.linalg.solve`."""
    return jax.tree_util.tree_map(lambda leaf: jnp.asarray(leaf, leaf.dtype), tree)


def check_like(name: str, tree: PyTree, ref_name: str, ref: PyTree) -> None:
    """`tree` has `ref`'s pytree structure and, leaf by leaf, its shape and dtype."""
    check_not_operator(name, tree)
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


#: Step counters are int32 (also under x64): a limit must fit one.
INT32_MAX = 2**31 - 1


def check_int(name: str, value, minimum: int, maximum: int = INT32_MAX) -> int:
    """A static integer option in `[minimum, maximum]`."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, np.integer)):
        raise TypeError(f"`{name}` must be a Python int (it fixes loop bounds and buffer "
                        f"sizes at trace time); got {value!r}.")
    if value < minimum:
        raise ValueError(f"`{name}` must be >= {minimum}; got {value}.")
    if value > maximum:
        raise ValueError(f"`{name}` must be <= {maximum} (the step counters are int32); "
                         f"got {value}.")
    return int(value)


def check_shapes_like(name: str, tree: PyTree, ref_name: str, ref: PyTree) -> None:
    """`tree` has `ref`'s structure and, leaf by leaf, its shape (any dtype)."""
    if jax.tree_util.tree_structure(tree) != jax.tree_util.tree_structure(ref) or any(
            tuple(t.shape) != tuple(r.shape) for t, r in
            zip(jax.tree_util.tree_leaves(tree), jax.tree_util.tree_leaves(ref))):
        raise ValueError(f"`{name}` must have the structure and leaf shapes of `{ref_name}`.\n"
                         f"  {name}: {_describe(tree)}\n  {ref_name}: {_describe(ref)}")


def check_positive(name: str, tree: PyTree) -> None:
    """Every entry real, finite and > 0 (checked where concrete)."""
    for leaf in jax.tree_util.tree_leaves(tree):
        if isinstance(leaf, jax.core.Tracer):
            continue
        arr = np.asarray(leaf)
        if np.iscomplexobj(arr) or not np.all(np.isfinite(arr)) or not np.all(arr > 0):
            raise ValueError(f"`{name}` must hold finite real entries > 0 (an inner product's "
                             "weights); got entries that are not.")


@contextlib.contextmanager
def failures_named(name: str):
    """Re-raise a failure of the user's function `name` (traced inside this
    block on arguments shaped like `b`) as a `TypeError` that names it."""
    try:
        yield
    except Exception as e:
        raise TypeError(f"calling `{name}` on arguments shaped like `b` failed "
                        f"({type(e).__name__}: {e}). It must take and return pytrees "
                        "shaped like `b`.") from e


def check_flag(name: str, value) -> bool:
    """An option that is a flag takes a bool (any truthy object is not one)."""
    if not isinstance(value, bool | np.bool_):
        raise TypeError(f"`{name}` must be True or False; got {value!r}.")
    return bool(value)


def check_axis_name(value) -> None:
    """`axis_name`: None, a mesh axis name or a non-empty tuple of them."""
    names = value if isinstance(value, tuple) else (value,)
    if value is not None and (not names or not all(isinstance(n, str) for n in names)):
        raise TypeError("`axis_name` must be the name of a mesh axis (a str, e.g. 'i') or a "
                        f"tuple of such names, from inside `shard_map`; got {value!r}.")


def check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"`{name}` must be one of {', '.join(map(repr, choices))}; "
                         f"got {value!r}.")


def check_symmetric(solver: str, matvec, precond) -> None:
    """`matvec` and `precond` are not known to be nonsymmetric: an operator
    that can tell (`is_symmetric()`: a `StencilOperator` with concrete
    coefficients, a `Multigrid` cycle) and says False is refused, with the
    solvers that fit it. Where it cannot tell (any callable, traced
    coefficients), the solve's divergence stop is what catches it."""
    for name, op in (("matvec", matvec), ("precond", precond)):
        test = getattr(op, "is_symmetric", None)
        if test is not None and test() is False:
            what = ("a nonsymmetric operator" if name == "matvec" else
                    "a preconditioner that is not symmetric (a multigrid cycle of a "
                    "nonsymmetric stencil, or an F-cycle)")
            raise ValueError(f"`{solver}` needs a symmetric `{name}`; this is {what}. Use "
                             "`gmres` or `bicgstab` (or `idrs`), which take it.")
