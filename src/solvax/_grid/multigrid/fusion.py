"""How the backend compiles a cycle: the CPU's fusion barriers
(`computed`), the unrolling of scans (`scan_unroll`) and repeated steps
(`repeated`). The cycle's arithmetic calls these and reads the same on
every backend."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ..._core import target


def computed(runtime_true, fn, *args):
    """`fn(*args)`, computed into memory before what reads it (on the CPU).

    XLA's CPU backend fuses a stencil's input into the stencil and then
    recomputes it at every offset read: two Jacobi steps in a row ran 13.8
    ms on a 1024 x 1024 grid instead of 5.2, a residual read at stride 2 by
    the restriction 11 ms instead of 1.6. A conditional is a fusion barrier
    there (an optimization barrier is not), and `fn` inside its branch
    writes its result straight into the conditional's output (copying a
    result computed outside cost half a cycle: 53 ms against 28 for a
    1024 x 1024 float64 V-cycle). Its predicate is a value the compiler
    cannot fold (`runtime_true`, a replicated scalar computed at set-up,
    e.g. `lambda_max == lambda_max`, behind an optimization barrier: a
    hierarchy closed over by a jitted function is a constant there, and
    XLA folded the comparison and dropped 28 of a 1024 x 1024 cycle's 35
    conditionals, 14 -> 44 ms), so it costs no communication.
    Elsewhere (GPU: a conditional's predicate goes to the host), and where
    `runtime_true` is None (no barrier asked: a grid that may be split
    across devices), `fn(*args)` as is."""
    if runtime_true is None or not target.fusion_barriers():
        return fn(*args)
    flag = jax.lax.optimization_barrier(runtime_true)
    return jax.lax.cond(flag == flag, fn, functools.partial(_untaken, fn), *args)


def _untaken(fn, *args):
    """`computed`'s branch that never runs, typed like `fn`'s output (inside
    `shard_map`, varying over the same mesh axes; the compiler drops `fn`
    here): the first argument where that has the type (a copy: XLA:CPU
    compiles no kernel for it, 35 fewer for Poisson 1024^2), else zeros."""
    out = fn(*args)
    first = jax.tree_util.tree_leaves(args[:1])
    if (isinstance(out, jax.Array) and len(first) == 1 and jnp.shape(first[0]) == out.shape
            and jnp.result_type(first[0]) == out.dtype):
        return first[0]
    return jax.tree_util.tree_map(jnp.zeros_like, out)


def scan_unroll(length: int) -> int:
    """A loop's `unroll` over `length` levels (or visits): the target's
    (`target.loop_unroll`: 1, a loop, everywhere). Unrolled on a TPU, the
    tail's levels were compiled once each (the first call of a 4096^2 MG-CG
    took 75 s there); unrolled on a GPU, a W-cycle's program grew
    exponentially with its levels, while a loop with a known trip count
    keeps its predicate on the device there too."""
    return target.loop_unroll(length)


def repeated(step, times: int, x, loop: bool = True):
    """`step` applied `times` times to `x` (a pytree): with `loop`, a loop
    whose body is the step's code once, so a program does not grow with a
    smoother's `steps` (`scan_unroll`);
    without it, or for a single step, the steps called in turn."""
    if not loop or times <= 1:
        for _ in range(times):
            x = step(x)
        return x
    return jax.lax.fori_loop(0, times, lambda _, x: step(x), x,
                             unroll=scan_unroll(times) > 1)
