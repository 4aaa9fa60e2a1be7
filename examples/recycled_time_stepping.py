"""Implicit time stepping on a sharded grid, the Krylov space recycled from step to step.

    python examples/recycled_time_stepping.py [--n 128] [--steps 12] [--k 16]

Backward Euler for `u_t = div(k(t) grad u)` on an n x n grid split by rows
over 8 emulated CPU devices (`P('i', None)`), with a coefficient field that
drifts a little every step: each step solves `(I / dt - div k grad) u_new =
u / dt`. Plain CG with Jacobi starts every solve from nothing; deflated CG
(`pcg(recycle=...)`) hands the space of slow modes it found to the next
step. The space is a pytree like `u` with a leading axis of `k`: it stays
sharded like the grid. Prints the iterations of every step for both, and
the collectives of one recycled step (two all-reduces per CG step, halos,
no gather).
"""

import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import solvax as sx  # noqa: E402

DT = 1e-2


def operator(k):
    n = k.shape[0]
    return sx.diffusion_operator(k, spacing=1 / n, shift=1 / DT)


def field(n, t):
    x = (np.arange(n) + 0.5) / n
    X, Y = np.meshgrid(x, x, indexing="ij")
    return 1.0 + 0.5 * np.sin(2 * np.pi * (X + Y) + 0.3 * t)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=128, help="grid points per side")
    parser.add_argument("--steps", type=int, default=12, help="time steps")
    parser.add_argument("--k", type=int, default=16, help="size of the recycled space")
    args = parser.parse_args()
    n = args.n
    rows = NamedSharding(Mesh(np.array(jax.devices()), ("i",)), P("i", None))
    x = (np.arange(n) + 0.5) / n
    u0 = jax.device_put(jnp.asarray(np.exp(-100 * ((x[:, None] - 0.3) ** 2
                                                   + (x[None, :] - 0.5) ** 2))), rows)

    @jax.jit
    def plain(k, u):
        A = operator(k)
        return sx.pcg(A, u / DT, x0=u, precond=sx.jacobi(A.diagonal()), rtol=1e-8)

    @jax.jit
    def first(k, u):
        A = operator(k)
        return sx.pcg(A, u / DT, x0=u, precond=sx.jacobi(A.diagonal()), rtol=1e-8,
                      recycle_size=args.k)

    @jax.jit
    def recycled(k, u, space):
        A = operator(k)
        return sx.pcg(A, u / DT, x0=u, precond=sx.jacobi(A.diagonal()), rtol=1e-8,
                      recycle=space)

    print(f"{len(jax.devices())} devices, {n} x {n} grid, {args.steps} backward-Euler "
          f"steps, recycled space of {args.k}")
    print("step  CG+Jacobi  deflated CG+Jacobi (+ k refresh matvecs)")
    u_plain = u_rec = u0
    space, totals = None, [0, 0]
    for step in range(args.steps):
        k = jax.device_put(jnp.asarray(field(n, step * DT)), rows)
        a = plain(k, u_plain)
        b = first(k, u_rec) if space is None else recycled(k, u_rec, space)
        assert bool(a.converged) and bool(b.converged)
        u_plain, u_rec, space = a.x, b.x, b.recycle
        refresh = 0 if step == 0 else args.k
        totals[0] += int(a.iterations)
        totals[1] += int(b.iterations) + refresh
        print(f"{step:4d}  {int(a.iterations):9d}  {int(b.iterations):9d} (+{refresh})")
    print(f"total matvecs: CG {totals[0]}, deflated CG {totals[1]} "
          f"({totals[1] / totals[0]:.2f}x)")
    print(f"the space keeps the grid's sharding behind its leading axis of {args.k}: "
          f"{tuple(space.U.sharding.spec)}")
    print(f"solutions agree: {float(jnp.max(jnp.abs(u_plain - u_rec))):.1e}")
    print(sx.count_collectives(lambda k, u, s: recycled(k, u, s).x, k, u_rec, space))


if __name__ == "__main__":
    main()
