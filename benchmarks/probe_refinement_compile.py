"""Compile-time probe (x64 on): which part of the refinement's first call costs on a TPU.

`python benchmarks/probe_refinement_compile.py N CASE ...` prints, per case,
trace+lower and compile seconds (nothing is run)."""
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

jax.config.update("jax_enable_x64", True)
import solvax as sx  # noqa: E402

n = int(sys.argv[1])
k64 = jnp.ones((n, n))
b64 = jnp.asarray(np.random.default_rng(0).standard_normal((n, n)))
k32, b32 = k64.astype(jnp.float32), b64.astype(jnp.float32)
h = 1.0 / n


def op(k):
    return sx.diffusion_operator(k, spacing=h)


cases = {
    "mgcg32": (lambda k, b: sx.pcg(op(k), b, precond=sx.multigrid(op(k)), rtol=1e-7).x, (k32, b32)),
    "build64": (lambda k, b: jax.tree_util.tree_leaves(op(k)), (k64, b64)),
    "resid64": (lambda k, b: b - op(k)(b), (k64, b64)),
    "dot64": (lambda k, b: jnp.vdot(b, b), (k64, b64)),
    "select64": (lambda k, b: jnp.where(b[0, 0] > 0, b, k), (k64, b64)),
    "ref_plain": (lambda k, b: sx.iterative_refinement(op(k), b, rtol=1e-10).x, (k64, b64)),
    "ref_mg": (lambda k, b: sx.iterative_refinement(
        op(k), b, precond=sx.multigrid(op(k), dtype=jnp.float32), rtol=1e-10).x, (k64, b64)),
    # the whole Solution: its status keeps ||x||^2 (summed beside ||r||^2 each
    # step) alive, which `x` alone drops; at 4096^2 a TPU compiled this for more
    # than 120 s until `reduce.sums_in_sequence` (27 s since)
    "ref_mg_whole": (lambda k, b: sx.iterative_refinement(
        op(k), b, precond=sx.multigrid(op(k), dtype=jnp.float32), rtol=1e-10), (k64, b64)),
    # the preconditioner from float32 coefficients (no float64 work in its set-up)
    "ref_mg32op": (lambda k, b: sx.iterative_refinement(
        op(k), b, precond=sx.multigrid(op(k.astype(jnp.float32))), rtol=1e-10).x, (k64, b64)),
}
for name in sys.argv[2:]:
    fn, args = cases[name]
    t = time.perf_counter()
    low = jax.jit(fn).lower(*args)
    t1 = time.perf_counter()
    low.compile()
    print(f"{name} {n}^2: lower {t1 - t:.1f} s, compile {time.perf_counter() - t1:.1f} s",
          flush=True)
