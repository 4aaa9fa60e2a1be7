"""Many right-hand sides at once with `vmap`: one reduction per step, whatever their number.

    python examples/many_rhs.py [--n 4096] [--batch 64]

A batch of right-hand sides solved by `jax.vmap(pcg)` on 8 emulated devices:
each CG step's reduction carries the products of every system in one
all-reduce, so the synchronizations per step are those of a single solve.
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


def reductions_per_step(batch, n, mesh):
    """`(total, per step)` collectives of a vmapped single-reduction CG."""
    d = jax.device_put(jnp.asarray(2.0 + np.random.default_rng(0).random(n)),
                       NamedSharding(mesh, P("i")))
    B = jax.device_put(jnp.ones((batch, n)), NamedSharding(mesh, P(None, "i")))
    solve = jax.vmap(lambda b: sx.pcg(lambda x: d * x, b, method="single_reduction").x)
    report = sx.count_collectives(solve, B)
    return report.total, report.per_iteration


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    mesh = Mesh(np.array(jax.devices()), ("i",))
    print(f"{'right-hand sides':>16s} {'collectives':>11s} {'per CG step':>11s}")
    for batch in sorted({1, 4, args.batch}):
        total, per_step = reductions_per_step(batch, args.n, mesh)
        print(f"{batch:16d} {total:11d} {per_step:11d}")
    d = 2.0 + jnp.arange(args.n) / args.n
    B = jnp.stack([jnp.sin(k * jnp.arange(args.n)) + 1.0 for k in range(args.batch)])
    sols = jax.jit(jax.vmap(lambda b: sx.pcg(lambda x: d * x, b)))(B)
    print(f"{args.batch} systems: all converged: {bool(jnp.all(sols.converged))}, "
          f"steps {int(jnp.min(sols.iterations))}..{int(jnp.max(sols.iterations))}")


if __name__ == "__main__":
    main()
