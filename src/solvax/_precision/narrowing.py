"""Operators and preconditioners evaluated in a narrower precision.

`lowered(fn, like, dtype)` re-evaluates a function's jaxpr (traced once at
`like`) with every floating value in it, inputs, closed-over arrays and
literals alike, narrowed to `dtype` (complex values to the complex dtype of
the same width), and every dtype its primitives name (a `convert_element_type`
to float64, an `iota`, a dot's accumulation type) narrowed the same way. So
an operator written for float64, whatever it closes over, applies in float32
without being rewritten: what iterative refinement's inner solves run.
Calls (`jit`, custom derivatives, checkpoints) are inlined; loops and
conditionals inside the function are refused (their bodies would need the same
rewrite): such operators take an explicit low-precision version instead.

`mixed_precision(precond, dtype)` is the cast at the door for any
preconditioner: its input cast to `dtype`, the preconditioner applied in
`dtype` (a pytree preconditioner such as `multigrid`'s with its floating
leaves cast; a plain function lowered as above), its output cast back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np

from .._core import tree
from .._core.closure import Closed, close

PyTree = Any

# primitives that call a jaxpr (inlined), by the name of the parameter holding it
_CALLS = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
          "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr",
          "custom_vjp_call_jaxpr": "fun_jaxpr", "remat": "jaxpr", "checkpoint": "jaxpr",
          "remat2": "jaxpr"}


def narrowed(dtype, target) -> np.dtype:
    """`dtype` narrowed to `target`'s width: floating dtypes wider than
    `target` become `target`, complex ones the complex dtype of that width;
    everything else (integers, booleans, narrower floats) is kept."""
    dtype, target = np.dtype(dtype), np.dtype(target)
    if jnp.issubdtype(dtype, jnp.complexfloating):
        wanted = jnp.dtype(jnp.complex64 if target.itemsize <= 4 else jnp.complex128)
        return wanted if dtype.itemsize > wanted.itemsize else dtype
    if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize > target.itemsize:
        return target
    return dtype


def cast(x, target):
    """An array (or NumPy scalar) narrowed to `target` (`narrowed`)."""
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return x
    new = narrowed(dtype, target)
    if new == dtype:
        return x
    if isinstance(x, np.ndarray | np.generic):
        return np.asarray(x, new)
    return jax.lax.convert_element_type(x, new)


def _retyped(value, target):
    """A primitive's parameter with the dtypes it names narrowed."""
    if isinstance(value, np.dtype) or (isinstance(value, type)
                                       and issubclass(value, np.generic)):
        return narrowed(value, target)
    return value


def _nested(value) -> bool:
    """Whether a primitive's parameter holds a jaxpr (a loop's or branch's body)."""
    if isinstance(value, tuple | list):
        return any(_nested(v) for v in value)
    return isinstance(value, jex.Jaxpr | jex.ClosedJaxpr)


def _evaluate(jaxpr, consts, args, target):
    env = {}

    def read(v):
        if isinstance(v, jex.Literal):
            return cast(v.val, target)
        return env[v]

    for v, value in zip(jaxpr.constvars, consts):
        env[v] = cast(value, target)
    for v, value in zip(jaxpr.invars, args):
        env[v] = cast(value, target)
    for eqn in jaxpr.eqns:
        values = [read(v) for v in eqn.invars]
        name = eqn.primitive.name
        if name in _CALLS and _CALLS[name] in eqn.params:
            inner = eqn.params[_CALLS[name]]
            body, inner_consts = (inner.jaxpr, inner.consts) if hasattr(inner, "consts") else (
                inner, ())
            outs = _evaluate(body, inner_consts, values, target)
        elif any(_nested(p) for p in eqn.params.values()):
            raise TypeError(
                f"solvax cannot evaluate this function in {np.dtype(target).name}: it holds a "
                f"`{name}` (a loop or conditional). Give a version of it in that precision "
                "(`inner_matvec=` for iterative refinement), or a pytree operator whose "
                "arrays can be cast.")
        else:
            params = {k: _retyped(p, target) for k, p in eqn.params.items()}
            outs = eqn.primitive.bind(*values, **params)
            if not eqn.primitive.multiple_results:
                outs = [outs]
        for v, out in zip(eqn.outvars, outs):
            env[v] = out
    return [read(v) for v in jaxpr.outvars]


class _Lowered:
    """The function behind `lowered`: its jaxpr (static) evaluated narrowed."""

    def __init__(self, jaxpr, treedef, target):
        self.jaxpr, self.treedef, self.target = jaxpr, treedef, np.dtype(target)

    def __call__(self, x, *consts):
        flat = jax.tree_util.tree_leaves((x, consts))
        out = _evaluate(self.jaxpr.jaxpr, self.jaxpr.consts, flat, self.target)
        return jax.tree_util.tree_unflatten(self.treedef, out)


def lowered(fn: Closed, like: PyTree, dtype) -> Closed:
    """`fn` (a `Closed` from the driver) applied in `dtype`: the same leaves
    (cast when it runs), its jaxpr traced once at `like` and re-evaluated
    with every floating value narrowed (module docstring). Raises TypeError
    where the function holds a loop or conditional."""
    jaxpr, shape = jax.make_jaxpr(fn.fn, return_shape=True)(like, *fn.consts)
    treedef = jax.tree_util.tree_structure(shape)
    lowered_fn = _Lowered(jaxpr, treedef, dtype)
    # the rewrite is checked here, at trace time, on shapes only
    jax.eval_shape(lowered_fn, tree.tree_map(lambda v: cast(v, dtype), like), *fn.consts)
    return Closed(lowered_fn, fn.consts)


@jax.tree_util.register_pytree_node_class
class MixedPrecision:
    """A preconditioner applied in another precision (see `mixed_precision`)."""

    def __init__(self, precond, dtype):
        self.precond, self.dtype = precond, np.dtype(dtype)

    def tree_flatten(self):
        return (self.precond,), self.dtype

    @classmethod
    def tree_unflatten(cls, dtype, leaves):
        return cls(leaves[0], dtype)

    def __call__(self, r):
        inner = tree.tree_map(lambda v: cast(v, self.dtype), r)
        if jax.tree_util.tree_leaves(self.precond):   # a pytree: its arrays cast
            applied = jax.tree_util.tree_map(lambda c: cast(c, self.dtype), self.precond)
        else:
            applied = lowered(close(self.precond, r), r, self.dtype)
        out = applied(inner)
        return tree.tree_map(lambda o, v: o.astype(v.dtype), out, r)


def mixed_precision(precond: Callable[[PyTree], PyTree], dtype=jnp.float32) -> MixedPrecision:
    """A preconditioner applied in a narrower precision: `r` cast to `dtype`,
    `precond` applied there, its output cast back to `r`'s dtype.

    A pytree preconditioner (`multigrid(A)`, `jacobi(d)`, any registered
    callable pytree) runs with its floating arrays cast to `dtype` (what
    `multigrid(A, dtype=jnp.float32)` does at set-up); a plain function is
    re-evaluated with its closed-over arrays and constants narrowed
    (`solvax._precision.lowered`; one with a loop or conditional inside is
    refused with a TypeError). Half the bytes per application in float32:
    for memory-bound preconditioners (stencils, multigrid cycles) close to
    half the time.

    Where it is safe: the preconditioner is then linear only up to `dtype`'s
    rounding. Flexible methods (`gmres`, `gcrot`: right-preconditioned, the
    directions kept) and `iterative_refinement`'s inner solves take any
    preconditioner; `pcg` reaches float64 tolerances with it as long as the
    low-precision preconditioner stays symmetric positive definite (a
    symmetric multigrid cycle or Jacobi in float32 does: tested to 1e-11),
    typically in at most one more iteration.

    Args:
        precond: `r -> M r` on pytrees (a pytree callable or a function).
        dtype: the precision to apply it in: a floating dtype of 32 bits or
            more (`jnp.float32`; complex vectors use `complex64`).

    Returns:
        A callable pytree `r -> M r`, usable as any solver's `precond`.

    Raises:
        TypeError: `precond` not callable, or `dtype` not a floating dtype
            of 32 bits or more.
    """
    if not callable(precond):
        raise TypeError(f"`precond` must be a callable `r -> M r`; got {precond!r}.")
    return MixedPrecision(precond, checked_dtype("dtype", dtype))


def checked_dtype(name: str, dtype) -> np.dtype:
    """A real floating dtype of 32 bits or more (Krylov vectors and the
    preconditioned vectors they read stay at least float32)."""
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        dtype = None
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating) or dtype.itemsize < 4:
        raise TypeError(f"`{name}` must be a real floating dtype of 32 bits or more, such as "
                        f"jnp.float32 (complex vectors take the complex dtype of its width); "
                        f"got {dtype!r}. Half precision (bfloat16, float16) is for stored "
                        "coefficients, not for Krylov vectors.")
    return jax.dtypes.canonicalize_dtype(dtype)
