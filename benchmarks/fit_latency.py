"""Fit a latency-bandwidth model of a Krylov iteration on this mesh and project it.

    python benchmarks/fit_latency.py [--json PATH] [--plot PATH] [--small] [--n-local N]

(the committed results: `--json benchmarks/results/scaling.json --plot
docs/figures/scaling.png`)

The model, per iteration of a method on P devices:

    t(P) = t_local + syncs * alpha * ceil(log2 P) + bytes * beta

- `alpha`: seconds per all-reduce per tree level, fitted from the time of a
  loop of scalar all-reduces (`psum` inside `shard_map`) minus the same loop
  without them, on meshes of 1, 2, 4, ... devices (as many as there are);
- `beta`: seconds per byte of all-reduce payload, the slope of the time of a
  vector all-reduce against its size (1 KiB to 1 MiB) on the largest mesh;
- `t_local`: the method's measured time per iteration on one device with the
  per-device size (n = 512 by default: the latency benchmark of
  `benchmark_peers.py`, 4096 unknowns on 8 devices; a diagonal
  operator, so the local work is the vector updates);
- `syncs`, `bytes`: the all-reduces per iteration and their bytes, read from
  the compiled program on the largest mesh (`solvax.count_collectives`; an
  s-step outer step counts as s iterations).

The check against the measured time on the largest mesh multiplies `t_local`
by the number of devices per CPU core when the devices are emulated CPU
devices (8 on 2 cores run their local work 4 at a time); the projection
assumes devices with their own compute.

It prints alpha and beta, compares the model with the measured time per
iteration on the largest mesh, and projects every CG and BiCGStab variant to
10^4 devices (`--plot` draws it, `--json` saves it). It is a model: it ignores
overlap of communication with work (pipelined CG's reason to exist), network
topology and contention, and noise from other jobs. To refit on a real
cluster, run this script there (under `jax.distributed`, one process per
host): alpha and beta are measured on whatever devices `jax.devices()`
returns. On this machine's emulated CPU devices an "all-reduce" is a
rendezvous of threads in one process, so alpha here is a software latency,
not a network's.
"""

import argparse
import json
import math
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
from problems import latency_problem, median_time  # noqa: E402

import solvax as sx  # noqa: E402

PROJECT_TO = (1, 8, 64, 512, 4096, 10_000)


def mesh_of(p):
    return Mesh(np.array(jax.devices()[:p]), ("i",))


def allreduce_seconds(p, size, loops):
    """Time of one all-reduce of `size` float64 numbers per device on p devices:
    a loop of `loops` of them minus the same loop without the all-reduce."""
    mesh = mesh_of(p)

    def body(reduce):
        def local(v):
            def step(_, v):
                w = 0.5 * v + 1.0
                return jax.lax.psum(w, "i") / p if reduce else w
            return jax.lax.fori_loop(0, loops, step, v)
        return sx.shard_map(local, mesh=mesh, in_specs=P("i"), out_specs=P("i"), check=False)

    x = jax.device_put(jnp.ones(p * size), NamedSharding(mesh, P("i")))
    return (median_time(body(True), x) - median_time(body(False), x)) / loops


def fit_alpha(loops):
    """alpha by least squares through the origin of t(P) against ceil(log2 P)."""
    sizes = [2 ** k for k in range(int(math.log2(len(jax.devices()))) + 1)]
    times = {p: allreduce_seconds(p, 1, loops) for p in sizes}
    levels = {p: math.ceil(math.log2(p)) for p in sizes}
    alpha = (sum(times[p] * levels[p] for p in sizes)
             / max(1, sum(levels[p] ** 2 for p in sizes)))
    return alpha, times


def fit_beta(loops):
    """beta: slope of the all-reduce time against its payload on the largest mesh."""
    p = len(jax.devices())
    sizes = [128, 1024, 8192, 131072]  # float64 numbers: 1 KiB .. 1 MiB
    times = [allreduce_seconds(p, s, max(10, loops // 16)) for s in sizes]
    slope, _ = np.polyfit([8 * s for s in sizes], times, 1)
    return max(float(slope), 0.0), dict(zip([8 * s for s in sizes], times))


def methods(iterations):
    """The CG and BiCGStab variants of the latency benchmark (name -> (solve, s))."""
    def pcg(**options):
        return lambda d, b: sx.pcg(lambda x: d * x, b, rtol=0.0, max_steps=iterations,
                                   **options).x

    def bicgstab(**options):
        return lambda d, b: sx.bicgstab(lambda x: d * x, b, rtol=0.0, max_steps=iterations,
                                        **options).x

    return {"pcg standard": (pcg(), 1),
            "pcg single_reduction": (pcg(method="single_reduction"), 1),
            "pcg pipelined": (pcg(method="pipelined"), 1),
            "pcg s_step s=2": (pcg(method="s_step", s=2), 2),
            "pcg s_step s=4": (pcg(method="s_step", s=4), 4),
            "pcg s_step s=8": (pcg(method="s_step", s=8), 8),
            "bicgstab standard": (bicgstab(), 1),
            "bicgstab one_sync": (bicgstab(method="one_sync"), 1)}


def problem(p, n_local):
    """The latency benchmark's system with `n_local` unknowns on each of p devices."""
    return latency_problem(p * n_local, NamedSharding(mesh_of(p), P("i")))


def model(row, alpha, beta, p, shared=1.0):
    """The model's time per iteration on p devices; `shared`: how many devices
    share one core's compute (1 on real devices; P / CPUs on emulated ones)."""
    return (shared * row["local_s"] + row["syncs"] * alpha * math.ceil(math.log2(p))
            + row["bytes"] * beta)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="write the fit and projection as JSON")
    parser.add_argument("--plot", metavar="PATH", help="draw the projection (needs matplotlib)")
    parser.add_argument("--small", action="store_true", help="short loops (a smoke test)")
    parser.add_argument("--n-local", type=int, default=512, help="unknowns per device")
    args = parser.parse_args()
    loops, iterations = (200, 40) if args.small else (2000, 200)
    p_max = len(jax.devices())

    alpha, alpha_times = fit_alpha(loops)
    beta, beta_times = fit_beta(loops)
    print(f"jax {jax.__version__}, {p_max} {jax.devices()[0].platform} devices, "
          f"{os.cpu_count()} CPUs")
    print("scalar all-reduce (us): " + ", ".join(
        f"P={p}: {1e6 * t:.1f}" for p, t in alpha_times.items()))
    print(f"alpha = {1e6 * alpha:.2f} us per all-reduce per tree level (ceil(log2 P))")
    print(f"beta  = {1e9 * beta:.3f} ns per byte ({1e-9 / beta if beta else float('inf'):.2f} "
          "GB/s of all-reduce payload)")

    rows = []
    one, many = problem(1, args.n_local), problem(p_max, args.n_local)
    # emulated devices share the host's cores: their local work is serialized
    shared = max(1.0, p_max / (os.cpu_count() or 1)) if jax.devices()[0].platform == "cpu" else 1
    print(f"\nper iteration, n = {args.n_local} per device; model vs measured on {p_max} devices "
          f"(local work x {shared:g}: {p_max} devices share the CPUs)")
    print(f"{'method':22s} {'syncs':>6s} {'bytes':>6s} {'local us':>9s} "
          f"{'model us':>9s} {'measured us':>11s}")
    for name, (solve, s) in methods(iterations).items():
        report = sx.count_collectives(solve, *many)
        row = dict(method=name, syncs=report.per_iteration / s,
                   bytes=report.bytes_per_iteration / s,
                   local_s=median_time(solve, *one) / iterations,
                   measured_s=median_time(solve, *many) / iterations)
        row["model_s"] = model(row, alpha, beta, p_max, shared)
        row["projection_s"] = {p: model(row, alpha, beta, p) for p in PROJECT_TO}
        rows.append(row)
        print(f"{name:22s} {row['syncs']:6.3g} {row['bytes']:6.0f} {1e6 * row['local_s']:9.1f} "
              f"{1e6 * row['model_s']:9.1f} {1e6 * row['measured_s']:11.1f}", flush=True)

    print("\nprojected us per iteration (the model, not a measurement)")
    print(f"{'method':22s} " + " ".join(f"{f'P={p}':>9s}" for p in PROJECT_TO))
    for row in rows:
        print(f"{row['method']:22s} " + " ".join(
            f"{1e6 * row['projection_s'][p]:9.1f}" for p in PROJECT_TO))
    out = dict(jax=jax.__version__, devices=p_max, platform=jax.devices()[0].platform,
               cpu_count=os.cpu_count(), n_local=args.n_local, shared=shared,
               alpha_s=alpha, beta_s_per_byte=beta, allreduce_s=alpha_times,
               allreduce_s_by_bytes=beta_times, methods=rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        plot(out, args.plot)


def plot(out, path):
    """Projected time per iteration against the number of devices."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.8))
    ps = np.unique(np.round(np.logspace(0, 4, 60)).astype(int))
    colors = {"pcg": plt.cm.Blues, "bicgstab": plt.cm.Oranges}
    for i, row in enumerate(out["methods"]):
        family = row["method"].split()[0]
        shade = colors[family](0.45 + 0.1 * (i % 6))
        t = [1e6 * model(row, out["alpha_s"], out["beta_s_per_byte"], p) for p in ps]
        ax.plot(ps, t, color=shade, ls="--" if family == "bicgstab" else "-",
                label=f"{row['method']} ({row['syncs']:.3g} syncs/it)")
        ax.plot([out["devices"]], [1e6 * row["measured_s"]], "o", color=shade, ms=4)
        ax.plot([out["devices"]], [1e6 * row["model_s"]], "x", color=shade, ms=5)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("devices P")
    ax.set_ylabel("time per iteration (us)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.set_title(f"Model: t = t_local + syncs x {1e6 * out['alpha_s']:.1f} us x ceil(log2 P) "
                 f"+ bytes x {1e9 * out['beta_s_per_byte']:.2f} ns, {out['n_local']} unknowns "
                 "per device", fontsize=9)
    fig.text(0.01, 0.01, f"Fitted on {out['devices']} emulated {out['platform']} devices "
             f"(jax {out['jax']}, {out['cpu_count']} CPUs). At P = {out['devices']}: dots "
             f"measured, crosses the model with local work x {out['shared']:g} (the devices "
             "share the cores). A model: no overlap, no topology, no contention.", fontsize=7)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
