"""What a traced function holds: its closures made explicit pytree leaves
(`Closed`), and the mesh axes its collectives run over (`axes_communicated`)."""

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


#: Primitives that name mesh axes without communicating.
_LOCAL_AXIS_PRIMITIVES = {"pvary", "pcast", "axis_index", "pbroadcast"}


def axes_communicated(jaxpr) -> set:
    """The mesh axes a jaxpr's collectives (`ppermute`, `psum`, ...) run over,
    free in it: a collective over an axis that a `shard_map` inside the jaxpr
    binds is that `shard_map`'s own business (a self-contained halo-exchange
    operator called from plain `jit`), not a coupling of the caller's shards."""
    axes = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name not in _LOCAL_AXIS_PRIMITIVES:
            for key in ("axis_name", "axes"):
                names = eqn.params.get(key, ())
                names = names if isinstance(names, tuple | list) else (names,)
                axes.update(n for n in names if isinstance(n, str))
        inner = set()
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    inner |= axes_communicated(sub)
        axes |= inner - _axes_bound_by(eqn)
    return axes


def _axes_bound_by(eqn) -> set:
    """The mesh axes an equation binds for its body: a `shard_map`'s manual axes
    (`newly_manual_axes` on current JAX; the mesh's axes less `auto` on 0.4)."""
    if eqn.primitive.name != "shard_map":
        return set()
    if "newly_manual_axes" in eqn.params:
        return set(eqn.params["newly_manual_axes"])
    return set(eqn.params["mesh"].axis_names) - set(eqn.params.get("auto", ()))
