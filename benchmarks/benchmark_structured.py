"""Block-tridiagonal solves: block sizes, factor once / solve many, dense and scalar references.

    python benchmarks/benchmark_structured.py [--json PATH] [--small]

Systems of n = 4096 block rows with m x m blocks (m = 1, 2, 4, 8, 16),
block diagonally dominant, a batch of 64 independent systems (`jax.vmap`),
float64 on the CPU. Reported per block size (median of 5 warm runs):
`block_tridiagonal_solve` (factor and solve), `block_tridiagonal_factor`
alone, `block_tridiagonal_solve_factored` with existing factors (the solve
of a reused matrix), a dense `jnp.linalg.solve` of the same systems where
the dense matrices fit (n m <= 1024 unknowns, so n is cut to 1024 / m for
that comparison, marked), and `tridiagonal_solve` for m = 1. Also the
sharded batch: the 64 systems split over 8 emulated devices against one
device; and the partitioned solve: one system of 8 n block rows (m = 4)
with its solve axis split over 8 emulated devices
(`partitioned_block_tridiagonal_solve`) against `block_tridiagonal_solve` on
one device, with its error and collectives. `--small` uses n = 64 and a
batch of 8; `--only blocks|sharded|partitioned` runs one part.
"""

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from problems import median_time as timed  # noqa: E402
from problems import parse_args, write_json  # noqa: E402

import solvax as sx  # noqa: E402

DENSE_LIMIT = 1024  # unknowns per system for the dense comparison


def systems(batch, n, m, seed=0):
    rng = np.random.default_rng(seed)
    lower, diag, upper = (rng.standard_normal((batch, n, m, m)) for _ in range(3))
    diag = diag + 3.0 * m * np.eye(m)
    rhs = rng.standard_normal((batch, n, m))
    return tuple(jnp.asarray(a) for a in (lower, diag, upper, rhs))


def dense_matrices(lower, diag, upper):
    n = diag.shape[1]

    def one(lo, d, up):
        A = (jnp.einsum("ij,iab->iajb", jnp.eye(n, k=-1), lo)
             + jnp.einsum("ij,iab->iajb", jnp.eye(n), d)
             + jnp.einsum("ij,iab->iajb", jnp.eye(n, k=1), up))
        return A.reshape(n * d.shape[-1], -1)

    return jax.vmap(one)(lower, diag, upper)


def block_sizes(batch, n):
    """The table over block sizes: solve, factor, solve with factors, dense, scalar."""
    solve = jax.vmap(sx.block_tridiagonal_solve)
    factor = jax.vmap(sx.block_tridiagonal_factor)
    solve_factored = jax.vmap(sx.block_tridiagonal_solve_factored)
    rows = []
    print(f"jax {jax.__version__}, float64, batch {batch}, n = {n} block rows (dense: "
          f"n m <= {DENSE_LIMIT})")
    print(f"{'m':>3s} {'solve s':>9s} {'factor s':>9s} {'solve_factored s':>16s} "
          f"{'dense n':>8s} {'dense s':>9s} {'block (same n) s':>16s} {'tridiagonal s':>13s}")
    for m in (1, 2, 4, 8, 16):
        lower, diag, upper, rhs = systems(batch, n, m)
        f = jax.jit(factor)(lower, diag, upper)
        row = dict(m=m, n=n, batch=batch, solve_s=timed(solve, lower, diag, upper, rhs),
                   factor_s=timed(factor, lower, diag, upper),
                   solve_factored_s=timed(solve_factored, f, rhs))
        nd = min(n, max(1, DENSE_LIMIT // m))
        small = tuple(a[:, :nd] for a in (lower, diag, upper, rhs))
        A = dense_matrices(*small[:3])
        row["dense_n"] = nd
        def dense_solve(A, r):
            return jnp.linalg.solve(A, r.reshape(r.shape[0], -1, 1))[..., 0]

        row["dense_s"] = timed(dense_solve, A, small[3])
        row["block_same_n_s"] = timed(solve, *small)
        err = jnp.linalg.norm(solve(*small).reshape(batch, -1) - dense_solve(A, small[3])
                              ) / jnp.linalg.norm(small[3])
        row["error_vs_dense"] = float(err)
        if m == 1:
            bands = [a[..., 0, 0].T for a in (lower, diag, upper)]
            row["tridiagonal_s"] = timed(
                lambda lo, d, up, r: sx.tridiagonal_solve(lo, d, up, r), *bands, rhs[..., 0].T)
        rows.append(row)
        tri = f"{row['tridiagonal_s']:13.4f}" if "tridiagonal_s" in row else f"{'-':>13s}"
        print(f"{m:3d} {row['solve_s']:9.4f} {row['factor_s']:9.4f} "
              f"{row['solve_factored_s']:16.4f} {nd:8d} {row['dense_s']:9.4f} "
              f"{row['block_same_n_s']:16.4f} {tri}", flush=True)
    return rows


def sharded_batch(batch, n):
    """The batch of systems (m = 4) split over 8 devices against one device."""
    solve = jax.vmap(sx.block_tridiagonal_solve)
    mesh = Mesh(np.array(jax.devices()[:8]), ("i",))
    lower, diag, upper, rhs = systems(batch, n, 4)
    sharded = [jax.device_put(a, NamedSharding(mesh, P("i"))) for a in (lower, diag, upper, rhs)]
    one = timed(solve, lower, diag, upper, rhs)
    eight = timed(solve, *sharded)
    collectives = sx.count_collectives(solve, *sharded).total
    print(f"m = 4, batch {batch} sharded over 8 devices: {eight:.4f} s (one device {one:.4f} s), "
          f"{collectives} collectives")
    return dict(m=4, devices=8, seconds=eight, one_device_seconds=one, collectives=collectives)


def partitioned(n):
    """One system of 8 n block rows (m = 4), its solve axis split over 8 devices."""
    mesh = Mesh(np.array(jax.devices()[:8]), ("i",))
    lower, diag, upper, rhs = (a[0] for a in systems(1, 8 * n, 4))
    sharded = [jax.device_put(a, NamedSharding(mesh, P("i"))) for a in (lower, diag, upper, rhs)]

    def split(*a):
        return sx.partitioned_block_tridiagonal_solve(*a, axis_name="i", mesh=mesh)

    one = timed(sx.block_tridiagonal_solve, lower, diag, upper, rhs)
    eight = timed(split, *sharded)
    reference = sx.block_tridiagonal_solve(lower, diag, upper, rhs)
    error = float(jnp.linalg.norm(jax.jit(split)(*sharded) - reference)
                  / jnp.linalg.norm(reference))
    kinds = sx.count_collectives(split, *sharded).by_kind
    print(f"m = 4, {8 * n} block rows, solve axis over 8 devices: {eight:.4f} s (one device "
          f"{one:.4f} s), relative difference {error:.1e}, collectives {kinds}")
    return dict(m=4, n=8 * n, devices=8, seconds=eight, one_device_seconds=one,
                relative_difference=error, collectives=kinds)


def main():
    args = parse_args(__doc__)
    batch, n = (8, 64) if args.small else (64, 4096)
    out = {"jax": jax.__version__, "cpu_count": os.cpu_count()}
    if args.only in ("", "blocks"):
        out["rows"] = block_sizes(batch, n)
    if args.only in ("", "sharded"):
        out["sharded_batch"] = sharded_batch(batch, n)
    if args.only in ("", "partitioned"):
        out["partitioned"] = partitioned(n)
    write_json(args.json, out)


if __name__ == "__main__":
    main()
