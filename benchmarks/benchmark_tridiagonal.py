"""Partitioned tridiagonal solve on 8 emulated devices vs the single-device solve.

    python benchmarks/benchmark_tridiagonal.py [--n 1048576] [--batch 8] [--json PATH]

Times (median of 5 warm runs) the solve of a diagonally dominant system of
`n` rows with `batch` right-hand sides: the single-device Thomas (`lax.scan`)
and LAPACK (`lax`) solves, and `partitioned_tridiagonal_solve` with the rows
split over 8 emulated CPU devices. Emulated devices share this machine's
cores, so the ratio measures the algorithm's overhead and parallel slack on
this host, not a real multi-device speed-up.
"""

import argparse
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
from problems import write_json  # noqa: E402

import solvax as sx  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2**20)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    n, batch = args.n, args.batch
    lower, upper = rng.standard_normal((2, n))
    diag = 2.5 + np.abs(lower) + np.abs(upper)
    rhs = rng.standard_normal((n, batch))
    single = [jnp.asarray(a) for a in (lower, diag, upper, rhs)]
    mesh = Mesh(np.array(jax.devices()[:8]), ("i",))
    sharded = [jax.device_put(a, NamedSharding(mesh, P("i"))) for a in single]

    results = {"jax": jax.__version__, "n": n, "batch": batch, "devices": 8,
               "cpu_count": os.cpu_count()}
    for method in ("thomas", "lax"):
        one = jax.jit(lambda *a, method=method: sx.tridiagonal_solve(*a, method=method))
        part = jax.jit(lambda *a, method=method: sx.partitioned_tridiagonal_solve(
            *a, axis_name="i", mesh=mesh, method=method))
        t_one, t_part = timed(one, *single), timed(part, *sharded)
        err = float(jnp.linalg.norm(part(*sharded) - one(*single)) / jnp.linalg.norm(one(*single)))
        results[method] = {"single_device_s": t_one, "partitioned_8_s": t_part,
                           "ratio_partitioned_over_single": t_part / t_one,
                           "relative_difference": err}
        print(f"{method:6s}: single device {t_one * 1e3:8.2f} ms, partitioned over 8 devices "
              f"{t_part * 1e3:8.2f} ms, ratio {t_part / t_one:5.2f}, rel. diff {err:.1e}")
    report = sx.count_collectives(lambda *a: sx.partitioned_tridiagonal_solve(
        *a, axis_name="i", mesh=mesh), *sharded)
    results["collectives"] = {"total": report.total, "by_kind": report.by_kind,
                              "bytes": report.bytes_by_kind}
    print(f"collectives of the partitioned solve: {report.total} {report.by_kind}, "
          f"bytes {report.bytes_by_kind}; load average {os.getloadavg()}")
    write_json(args.json, results)


if __name__ == "__main__":
    main()
