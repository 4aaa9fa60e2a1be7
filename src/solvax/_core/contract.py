"""The driver's contract: the `Problem` a method reads (every traced value a
leaf), the `Outcome` it returns, a `Method` (name and `run`), and the
stopping threshold."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import reduce, tree
from .closure import Closed

PyTree = Any


@jax.tree_util.register_pytree_node_class
class Static:
    """A concrete option (a Python or NumPy number) kept out of the traced
    leaves: a tolerance given as a number stays a constant of every solve's
    trace. A traced leaf would be an input of `custom_linear_solve`, which
    inside `shard_map` under `grad(jit(...))` passes it on as a varying value
    where the traced solve expects an invariant one ("mul requires varying
    manual axes to match")."""

    def __init__(self, value):
        self.value = value

    def tree_flatten(self):
        return (), self.value

    @classmethod
    def tree_unflatten(cls, value, _):
        return cls(value)


def as_option(value):
    """`value` as a `Static` where it is a concrete number, else as it is."""
    return value if isinstance(value, jax.Array | jax.core.Tracer) else Static(value)


class Problem(NamedTuple):
    """Everything a method reads: a pytree, every traced value a leaf.

    `A` and `b` are differentiated; the rest does not change the solution.
    Fields a method has no use for may be None.
    """

    A: Closed  # x -> A x
    b: PyTree
    x0: PyTree | None = None  # None: start from zero
    precond: Closed | None = None  # r -> M r; None: the identity
    rtol: Any = 0.0  # a traced scalar, or a `Static` number; `tolerances()` reads them
    atol: Any = 0.0
    ip: reduce.Reduction | None = None
    data: PyTree = None  # a method's own traced arguments (linear_solve: the user's solvers)
    null: PyTree = None  # like `b`: spans the null space of A and A^T (`finish` tests b on it)

    def real_dtype(self):
        """The real dtype of the iteration (of `b`'s common dtype, at least float32)."""
        return jnp.finfo(tree.result_dtype(self.b)).dtype

    def size(self) -> int:
        """Entries of `b` in all (static): inside `shard_map` the local size times
        the devices along `axis_name`, so defaults that scale with the problem
        (iteration limits, GMRES's basis size) are the same as under `jit`."""
        return tree.size(self.b) * int(np.prod([jax.lax.psum(1, name)
                                                for name in self.ip.reduced_axes()]))

    def step_limit(self, max_steps: int | None) -> int:
        """`max_steps`, by default `10 * size()`."""
        return 10 * self.size() if max_steps is None else max_steps

    def history(self, length: int, record: bool) -> jax.Array | None:
        """A NaN-filled residual history of `length` (None unless recorded)."""
        return jnp.full((length,), jnp.nan, self.real_dtype()) if record else None

    def residual(self):
        """`(x, r)` before an iteration: `(0, b)`, or `(x0, b - A x0)` (one matvec)."""
        if self.x0 is None:
            return tree.zeros_like(self.b), self.b
        return self.x0, tree.sub(self.b, self.A(self.x0))

    def settled(self, x, r, bb):
        """`(x, r)` from `residual()`, with the answer exactly 0 where `b = 0`
        (`bb = ||b||^2 = 0`), whatever `x0` (from zero: unchanged)."""
        if self.x0 is None:
            return x, r
        zero_b = bb == 0
        return tree.where(zero_b, tree.zeros_like(self.b), x), tree.where(zero_b, self.b, r)

    def start(self, rtol, atol):
        """`(x, r, tol2)` before an iteration: from zero, with `tol2 = inf`
        (the first step's `<r, r>` is `||b||^2` and sets it, no reduction of
        its own), or from `x0`, with one setup reduction for `||b||^2`;
        `tol2 = max(atol, rtol ||b||)^2`."""
        x, r = self.residual()
        if self.x0 is None:
            return x, r, jnp.asarray(jnp.inf, self.real_dtype())
        bb = jnp.real(self.ip.dot(self.b, self.b))
        x, r = self.settled(x, r, bb)
        return x, r, squared_threshold(bb, rtol, atol)

    def tolerances(self) -> tuple[jax.Array, jax.Array]:
        """`(rtol, atol)` in `real_dtype()`."""
        return option_value(self.rtol, self.real_dtype()), option_value(self.atol,
                                                                        self.real_dtype())


def option_value(value, dtype) -> jax.Array:
    """A tolerance (a `Static` number or a traced scalar) as a `dtype` scalar."""
    return jnp.asarray(value.value if isinstance(value, Static) else value, dtype)


def invalid_tolerances(rtol, atol) -> jax.Array:
    """A traced `rtol` or `atol` that is negative, NaN or infinite (concrete
    ones are refused at trace time)."""
    return ~(rtol >= 0) | ~(atol >= 0) | (rtol == jnp.inf) | (atol == jnp.inf)


def threshold(bb, rtol, atol):
    """The stopping threshold `max(atol, rtol ||b||)` from `bb = ||b||^2`."""
    return jnp.maximum(atol, rtol * reduce.real_sqrt(bb))


def squared_threshold(bb, rtol, atol):
    """`threshold(bb, rtol, atol)^2` (no square root)."""
    return jnp.maximum(atol * atol, rtol * rtol * bb)


class Outcome(NamedTuple):
    """What a method returns; `finish` makes it a `Solution`."""

    x: PyTree
    status: jax.Array  # RUNNING, CONVERGED (by the method's own test) or a breakdown
    iterations: jax.Array
    history: jax.Array | None = None
    # (||b - A x||, max(atol, rtol ||b||), ||x||) when the method measured them itself
    residual: tuple[jax.Array, jax.Array, jax.Array] | None = None
    recycle: PyTree = None  # gcrot: the space for the next solve (scale-free: A U = C)


class Method(NamedTuple):
    name: str
    run: Callable[..., Outcome]  # run(problem, **static options)
