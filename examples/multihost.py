"""The same sharded solve on one machine, on 2 local CPU processes, or on a cluster.

On a cluster (one process per host or per GPU), under SLURM or Open MPI:

    srun python examples/multihost.py --cluster          # or: mpirun -n 4 python ...

Locally, 2 CPU processes x 4 devices on loopback, supervised:

    python examples/multihost.py --local 2

Every process runs this file; `jax.distributed` joins them into one global
mesh, and the solve below is exactly the single-process code.
"""

import argparse
import os
import sys


def solve_and_report():
    import jax

    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import solvax as sx

    mesh = Mesh(np.array(jax.devices()), ("i",))  # built from jax.devices() order
    n = 1024 * len(jax.devices())
    sharding = NamedSharding(mesh, P("i"))
    d = jax.make_array_from_callback((n,), sharding, lambda idx: (3.0 + np.arange(n) / n)[idx])
    b = jax.make_array_from_callback((n,), sharding, lambda idx: np.ones(n)[idx])

    def operator(d):  # coefficients are arguments: a global array cannot be a closure constant
        return lambda x: d * x - 0.5 * jnp.roll(x, 1) - 0.5 * jnp.roll(x, -1)

    def solve(d, b):
        return sx.pcg(operator(d), b, single_reduction=True)

    sol = jax.jit(solve)(d, b)
    report = sx.count_collectives(lambda d, b: solve(d, b).x, d, b)

    def local(value):  # a replicated scalar: read this process's copy
        return np.asarray(value.addressable_data(0))

    print(f"process {jax.process_index()}/{jax.process_count()}: {len(jax.local_devices())} "
          f"local devices, converged={bool(local(sol.converged))} in "
          f"{int(local(sol.iterations))} steps, collectives {report.by_kind}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", action="store_true",
                        help="call jax.distributed.initialize() with no arguments")
    parser.add_argument("--local", type=int, metavar="N",
                        help="launch N local CPU processes and supervise them")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.local:
        from solvax import distributed

        result = distributed.launch(os.path.abspath(__file__), ["--worker"],
                                    num_processes=args.local, local_devices=4, timeout=300)
        print(result.report())
        sys.exit(0 if result.ok else 1)
    if args.worker:
        from solvax import distributed

        distributed.initialize()
    elif args.cluster:
        import jax

        jax.distributed.initialize()  # SLURM / Open MPI / cloud TPU auto-detection
    solve_and_report()


if __name__ == "__main__":
    main()
