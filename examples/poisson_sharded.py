"""A 2-D Poisson solve sharded over 8 emulated CPU devices, with its collective report.

    python examples/poisson_sharded.py [--n 256]

The grid is split by rows over the mesh axis "i" (`P('i', None)`); the
5-point stencil's neighbours across shards are found by XLA (collective
permutes), every inner product of the solve by one all-reduce per CG step.
`count_collectives` reads both from the compiled program.
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


def laplacian(u):
    """-Δu with Dirichlet boundaries, 5 points, grid spacing 1/(n + 1)."""
    n = u.shape[0]
    up = jnp.pad(u, 1)
    return (4 * u - up[:-2, 1:-1] - up[2:, 1:-1] - up[1:-1, :-2] - up[1:-1, 2:]) * (n + 1) ** 2


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=256, help="grid points per side")
    n = parser.parse_args().n
    mesh = Mesh(np.array(jax.devices()), ("i",))
    rows = NamedSharding(mesh, P("i", None))
    x = np.linspace(0, 1, n + 2)[1:-1]
    # u = x(1 - x) y(1 - y): -Δu = 2 (x(1 - x) + y(1 - y)); the 5-point stencil is
    # exact on it (quadratic along each axis), so the error below is the solver's
    q = x * (1 - x)
    f = jax.device_put(jnp.asarray(2 * (q[:, None] + q[None, :])), rows)

    @jax.jit
    def solve(f):
        return sx.pcg(laplacian, f, rtol=1e-10, method="single_reduction")

    sol = solve(f)
    exact = np.outer(q, q)
    print(f"{len(jax.devices())} devices, {n} x {n} grid, sharding {sol.x.sharding.spec}")
    print(f"status {sx.Status(int(sol.status)).name}, {int(sol.iterations)} CG steps, "
          f"true relative residual {float(sol.residual_norm / jnp.linalg.norm(f)):.1e}")
    error = float(jnp.max(jnp.abs(sol.x - exact)) / np.max(exact))
    print(f"max relative error against the exact solution: {error:.1e}")
    print(sx.count_collectives(lambda f: solve(f).x, f))


if __name__ == "__main__":
    main()
