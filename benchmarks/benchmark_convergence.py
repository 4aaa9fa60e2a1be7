"""Convergence of every Krylov variant, with and without preconditioners.

    python benchmarks/benchmark_convergence.py [--json PATH] [--plot PATH] [--small]

Problems: the 5-point 2-D Poisson operator on a 512 x 512 grid (CG variants
and GMRES) and upwind convection-diffusion on 256 x 256 with convection
strength 10 (GMRES), right-hand side of ones-plus-noise, rtol 1e-8. For each
run: iterations (accepted steps), matvecs, the true final relative residual
`||b - A x|| / ||b||`, the status, the wall time of one warm run, and the
residual history (plotted with `--plot`, which needs matplotlib: the `bench`
extra). `--small` uses 64 x 64 and 32 x 32 grids (a smoke test).
"""

import json
import time

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from problems import convection_diffusion, parse_args, poisson  # noqa: E402

import solvax as sx  # noqa: E402

RTOL = 1e-8
RESTART = 30


def line_blocks(n, bs, diag, lower, upper):
    """Diagonal blocks of the operator along axis 0 (lines of `bs` grid rows)."""
    block = diag * np.eye(bs) + lower * np.eye(bs, k=-1) + upper * np.eye(bs, k=1)
    return jnp.asarray(np.broadcast_to(block, (n // bs, bs, bs)).copy())


def preconditioners(name, matvec, n, b):
    """The preconditioners tried for a problem (name -> precond or None)."""
    shift = 10.0 / (n + 1) if name == "convection-diffusion" else 0.0
    out = {"none": None,
           "jacobi": sx.jacobi(jnp.full((n, n), 4.0 + shift)),
           "block_jacobi(16)": sx.block_jacobi(line_blocks(n, 16, 4.0 + shift, -1.0 - shift,
                                                           -1.0))}
    if name == "poisson":
        lo, hi = sx.estimate_spectrum(matvec, b, steps=30)
        out["chebyshev(4)"] = sx.chebyshev(matvec, float(hi) / 30, 1.1 * float(hi), degree=4)
    return out


def solvers(name):
    max_restarts = 100
    gmres = {
        "gmres cgs2": dict(fn=sx.gmres, restart=RESTART, orthogonalization="cgs2",
                           max_restarts=max_restarts),
        "gmres one_sync": dict(fn=sx.gmres, restart=RESTART, orthogonalization="one_sync",
                               max_restarts=max_restarts),
    }
    if name != "poisson":
        return gmres
    cg = {
        "pcg standard": dict(fn=sx.pcg, method="standard", max_steps=5000),
        "pcg single_reduction": dict(fn=sx.pcg, method="single_reduction", max_steps=5000),
        "pcg pipelined": dict(fn=sx.pcg, method="pipelined", max_steps=5000),
        "pcg pipelined, replacement/50": dict(fn=sx.pcg, method="pipelined", max_steps=5000,
                                              residual_replacement=50),
    }
    return {**cg, **gmres}


def run_one(matvec, b, options, precond):
    options = dict(options)
    fn = options.pop("fn")
    solve = jax.jit(lambda b: fn(matvec, b, precond=precond, rtol=RTOL, record_history=True,
                                 **options))
    jax.block_until_ready(solve(b))  # compile
    start = time.perf_counter()
    sol = jax.block_until_ready(solve(b))
    seconds = time.perf_counter() - start
    bnorm = float(jnp.linalg.norm(b))
    true = float(jnp.linalg.norm(b - matvec(sol.x))) / bnorm
    its = int(sol.iterations)
    history = np.asarray(sol.history) / bnorm
    history = history[np.isfinite(history)]
    cycles = 0
    if fn is sx.gmres:  # one_sync spends one extra matvec per cycle
        cycles = -(-its // RESTART) if options["orthogonalization"] == "one_sync" else 0
    return dict(iterations=its, matvecs=its + cycles + 1,  # + the true-residual matvec
                true_relative_residual=true, status=sx.Status(int(sol.status)).name,
                seconds=seconds, history=history.tolist())


def main():
    args = parse_args(__doc__)

    sizes = {"poisson": 64, "convection-diffusion": 32} if args.small else {
        "poisson": 512, "convection-diffusion": 256}
    rng = np.random.default_rng(0)
    results = []
    header = f"{'problem':22s} {'solver':30s} {'precond':17s} {'its':>6s} {'matvecs':>7s} " \
             f"{'true rel. res.':>14s} {'status':>10s} {'time (s)':>9s}"
    print(f"jax {jax.__version__}, rtol {RTOL}, GMRES restart {RESTART}\n{header}")
    for problem, n in sizes.items():
        matvec = poisson if problem == "poisson" else convection_diffusion(10.0)
        b = jnp.asarray(1.0 + 0.1 * rng.standard_normal((n, n)))
        for pname, precond in preconditioners(problem, matvec, n, b).items():
            for sname, options in solvers(problem).items():
                row = dict(problem=f"{problem} {n}x{n}", solver=sname, precond=pname,
                           **run_one(matvec, b, options, precond))
                results.append(row)
                print(f"{row['problem']:22s} {sname:30s} {pname:17s} {row['iterations']:6d} "
                      f"{row['matvecs']:7d} {row['true_relative_residual']:14.3e} "
                      f"{row['status']:>10s} {row['seconds']:9.3f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"jax": jax.__version__, "rtol": RTOL, "restart": RESTART,
                       "results": results}, f, indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        problems = list(dict.fromkeys(r["problem"] for r in results))
        fig, axes = plt.subplots(1, len(problems), figsize=(7 * len(problems), 5))
        for ax, problem in zip(np.atleast_1d(axes), problems):
            for r in results:
                if r["problem"] == problem:
                    ax.semilogy(r["history"], label=f"{r['solver']} / {r['precond']}", lw=1)
            ax.axhline(RTOL, color="k", ls=":", lw=0.8)
            ax.set(title=problem, xlabel="iteration (accepted step)",
                   ylabel="relative residual norm")
            ax.legend(fontsize=6, ncol=2)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
