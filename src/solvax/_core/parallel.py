"""`shard_map` helpers: run local work per device without adding collectives."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from . import checks


def shard_map(f: Callable, *, mesh: Mesh, in_specs, out_specs, check: bool = True) -> Callable:
    """`jax.shard_map` on new JAX, `jax.experimental.shard_map.shard_map` on 0.4.x.

    Args:
        f: the per-shard function.
        mesh: the device mesh.
        in_specs, out_specs: `PartitionSpec`s of the inputs and outputs.
        check: `check_vma` on new JAX; keep it on: solvax allocates work
            buffers from the operands and keeps diagnostics invariant, so the
            check passes. On 0.4.x the older `check_rep` checker has no
            replication rule for a `while` loop inside a custom derivative, so
            it is off there (gradients of a `psum` then follow 0.4.x's
            unchecked convention: differentiate per-shard losses).

    Returns:
        The mapped function.
    """
    if hasattr(jax, "shard_map"):
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check)
    from jax.experimental.shard_map import shard_map as legacy  # jax < 0.6

    return legacy(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


def _spec(rank: int, batch_axis: int, axis_name, name: str) -> P:
    if not -rank <= batch_axis < rank:
        raise ValueError(f"`{name}` = {batch_axis} is out of range for rank {rank}: pass an "
                         f"axis in [{-rank}, {rank - 1}].")
    entries = [None] * rank
    entries[batch_axis % rank] = axis_name
    return P(*entries)


def _ranks(name: str, rank) -> tuple[list[int], bool]:
    """Normalize an int or a sequence of ints; say whether it was a sequence."""
    many = isinstance(rank, Sequence)
    ranks = list(rank) if many else [rank]
    for r in ranks:
        checks.check_int(name, r, 1)
    return ranks, many


def shard_batch(
    local_function: Callable[..., Any],
    *,
    mesh: Mesh,
    input_rank: int | Sequence[int],
    output_rank: int | Sequence[int],
    output_batch_axis: int = 0,
    axis_name: str = "i",
    input_batch_axis: int = 0,
) -> Callable[..., Any]:
    """Run `local_function` on each device's own slice of a batch, with no collective.

    Every positional input of the returned function is an array whose batch
    axis (`input_batch_axis`) is split over the mesh axis `axis_name`; each
    device calls `local_function` on its own slice only, and the outputs are
    reassembled along `output_batch_axis`. Nothing is communicated: the
    compiled function holds no collective (check with `count_collectives`).

    For example, the batched tridiagonal solve with the batch on the trailing axis:

    ```python
    solve = sx.shard_batch(sx.tridiagonal_solve, mesh=mesh, input_rank=2,
                           output_rank=2, input_batch_axis=1, output_batch_axis=1)
    x = jax.jit(solve)(lower, diag, upper, rhs)   # each (n, batch)
    ```

    Args:
        local_function: `f(*local_inputs) -> local_output(s)`; must treat
            batch entries independently.
        mesh: the device mesh.
        input_rank: rank of every input (an int), or one rank per input.
        output_rank: rank of the output (an int), or one rank per output of
            a tuple-returning `local_function`.
        output_batch_axis: the batch axis of every output.
        axis_name: the mesh axis that splits the batch.
        input_batch_axis: the batch axis of every input.

    Returns:
        A function of the global inputs returning the global output(s).

    Raises:
        ValueError: if `axis_name` is not a mesh axis, a rank is < 1 or a batch
            axis is out of range; at call time, if the number of inputs does not
            match `input_rank`.
    """
    if axis_name not in mesh.axis_names:
        raise ValueError(f"`axis_name` {axis_name!r} is not an axis of the mesh "
                         f"{tuple(mesh.axis_names)}.")
    in_ranks, _ = _ranks("input_rank", input_rank)
    out_ranks, many_out = _ranks("output_rank", output_rank)
    out_specs = [_spec(r, output_batch_axis, axis_name, "output_batch_axis") for r in out_ranks]
    out_specs = tuple(out_specs) if many_out else out_specs[0]

    def run(*args):
        ranks = in_ranks * len(args) if len(in_ranks) == 1 else in_ranks
        if len(ranks) != len(args):
            raise ValueError(f"`input_rank` gives {len(in_ranks)} ranks but the function was "
                             f"called with {len(args)} inputs.")
        for k, (arg, r) in enumerate(zip(args, ranks)):
            if not hasattr(arg, "ndim") or not hasattr(arg, "dtype"):
                raise TypeError(f"input {k} must be an array (its batch axis is split over "
                                f"the mesh); got a {type(arg).__name__}. Convert it with "
                                "`jnp.asarray`.")
            if arg.ndim != r:
                raise ValueError(f"input {k} has rank {arg.ndim}; `input_rank` says {r}.")
        in_specs = tuple(_spec(r, input_batch_axis, axis_name, "input_batch_axis")
                         for r in ranks)
        return shard_map(local_function, mesh=mesh, in_specs=in_specs, out_specs=out_specs)(*args)

    return run
