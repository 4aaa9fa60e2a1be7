"""Functions whose traced closures are explicit pytree leaves."""

from __future__ import annotations

import jax


@jax.tree_util.register_pytree_node_class
class Closed:
    """A function with the traced values it closes over made explicit: they are
    the pytree's leaves, so a `Closed` can be an argument of `custom_jvp` and
    be called in a later trace (`Closed(fn, consts)(*args) = fn(*args, *consts)`)."""

    def __init__(self, fn, consts):
        self.fn, self.consts = fn, tuple(consts)

    def __call__(self, *args):
        return self.fn(*args, *self.consts)

    def tree_flatten(self):
        return self.consts, self.fn

    @classmethod
    def tree_unflatten(cls, fn, consts):
        return cls(fn, consts)


def close(fn, *example_args) -> Closed:
    """`fn` as a `Closed` (one trace, with arguments like `example_args`)."""
    return Closed(*jax.closure_convert(fn, *example_args))


def apply_transposed(y, A):
    return jax.linear_transpose(A, y)(y)[0]


def transposed(A: Closed) -> Closed:
    """`y -> A^T y` for a linear `A` (its leaves are `A`'s)."""
    return Closed(apply_transposed, (A,))
