"""Convergence of every Krylov variant, with and without preconditioners.

    python benchmarks/benchmark_convergence.py [--json PATH] [--plot PATH] [--small] [--only SOLVER]

Problems: the 5-point 2-D Poisson operator on a 512 x 512 grid (CG variants
and GMRES), upwind convection-diffusion on 256 x 256 with convection
strength 10 (nonsymmetric: GMRES, BiCGStab, IDR(s)) and a saddle-point
system on two 128 x 128 grids (symmetric indefinite: MINRES, GMRES, with
`scipy.sparse.linalg.minres` for reference) and a high-contrast diffusion
on 32 x 32 (condition 2e8: where each s-step basis stops converging, with and
without Jacobi), right-hand side of ones-plus-noise, rtol 1e-8. For each
run: iterations (accepted steps), matvecs, the true final relative residual
`||b - A x|| / ||b||`, the status, the wall time of one warm run, and the
residual history (`--plot` draws which preconditioner helps which method,
`plot_results.py` every figure from the JSON; matplotlib: the `bench`
extra). `--small` uses 64 x 64, 32 x 32 and 16 x 16 grids and each preconditioner
with the first solver only (a smoke test). For
scipy's MINRES the iterations are those after which its iterate first meets
the same true relative residual (its own test is a backward error).
"""

import json
import time

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import scipy.sparse.linalg as spl  # noqa: E402
from problems import (  # noqa: E402
    convection_diffusion,
    high_contrast,
    parse_args,
    poisson,
    saddle_point,
)

import solvax as sx  # noqa: E402

RTOL = 1e-8
RESTART = 30


def line_blocks(n, bs, diag, lower, upper):
    """Diagonal blocks of the operator along axis 0 (lines of `bs` grid rows)."""
    block = diag * np.eye(bs) + lower * np.eye(bs, k=-1) + upper * np.eye(bs, k=1)
    return jnp.asarray(np.broadcast_to(block, (n // bs, bs, bs)).copy())


def preconditioners(name, matvec, n, b):
    """The preconditioners tried for a problem (name -> precond or None)."""
    if name == "saddle-point":  # MINRES needs an SPD preconditioner: |diagonal|, 1 on p
        return {"none": None,
                "jacobi": sx.jacobi({"u": jnp.full((n, n), 4.0), "p": jnp.ones((n, n))})}
    if name == "high-contrast":  # the diagonal of -div(k grad): the contrast
        diag = jax.vmap(lambda i: matvec(jax.nn.one_hot(i, n * n).reshape(n, n)).ravel()[i])(
            jnp.arange(n * n)).reshape(n, n)
        return {"none": None, "jacobi": sx.jacobi(diag)}
    shift = 10.0 / (n + 1) if name == "convection-diffusion" else 0.0
    out = {"none": None,
           "jacobi": sx.jacobi(jnp.full((n, n), 4.0 + shift)),
           "block_jacobi(16)": sx.block_jacobi(line_blocks(n, 16, 4.0 + shift, -1.0 - shift,
                                                           -1.0))}
    if name == "poisson":
        lo, hi = sx.estimate_spectrum(matvec, b, steps=30)
        out["chebyshev(4)"] = sx.chebyshev(matvec, float(hi) / 30, 1.1 * float(hi), degree=4)
    return out


def solvers(name, small=False):
    max_restarts = 100
    gmres = {
        "gmres cgs2": dict(fn=sx.gmres, restart=RESTART, orthogonalization="cgs2",
                           max_restarts=max_restarts),
        "gmres one_sync": dict(fn=sx.gmres, restart=RESTART, orthogonalization="one_sync",
                               max_restarts=max_restarts),
    }
    if name == "saddle-point":
        return {"minres": dict(fn=sx.minres, max_steps=20000), **gmres}
    if name == "high-contrast":  # condition 2e8: where each s-step basis stops
        return {"pcg standard": dict(fn=sx.pcg, method="standard", max_steps=20000),
                "pcg pipelined": dict(fn=sx.pcg, method="pipelined", max_steps=20000),
                **{f"pcg s_step s={s} {basis}": dict(fn=sx.pcg, method="s_step", s=s,
                                                     basis=basis, max_steps=20000)
                   for basis in ("chebyshev", "newton", "monomial")
                   for s in ((4,) if small else (2, 4, 8))}}
    if name == "convection-diffusion":
        return {**gmres,
                "bicgstab standard": dict(fn=sx.bicgstab, method="standard", max_steps=5000),
                "bicgstab one_sync": dict(fn=sx.bicgstab, method="one_sync", max_steps=5000),
                **{f"idrs s={s}": dict(fn=sx.idrs, s=s, max_steps=10000)
                   for s in ((4,) if small else (1, 2, 4, 8))}}
    cg = {
        "pcg standard": dict(fn=sx.pcg, method="standard", max_steps=5000),
        "pcg single_reduction": dict(fn=sx.pcg, method="single_reduction", max_steps=5000),
        "pcg pipelined": dict(fn=sx.pcg, method="pipelined", max_steps=5000),
        "pcg pipelined, replacement/50": dict(fn=sx.pcg, method="pipelined", max_steps=5000,
                                              residual_replacement=50),
        **{f"pcg s_step s={s}": dict(fn=sx.pcg, method="s_step", s=s, max_steps=5000)
           for s in ((4,) if small else (2, 4, 8))},
    }
    return {**cg, **gmres}


def matvecs_of(fn, options, its):
    """Matvecs of a solve of `its` iterations, the final true residual's included."""
    if fn is sx.bicgstab:  # two per step; the one-sync recurrences start with two more
        return 2 * its + (2 if options["method"] == "one_sync" else 0) + 1
    if fn is sx.gmres and options["orthogonalization"] == "one_sync":
        return its + -(-its // RESTART) + 1  # one extra matvec per cycle
    return its + 1  # CG (s-step too), IDR(s) (iterations are matvecs), MINRES (one per step)


def scipy_minres_steps(matvec, b, rtol):
    """Steps after which scipy's MINRES iterate first meets the true relative
    residual `rtol` (checked with a true residual every step)."""
    leaves, treedef = jax.tree_util.tree_flatten(b)
    shapes = [leaf.shape for leaf in leaves]
    sizes = [leaf.size for leaf in leaves]

    def unflat(v):
        parts = np.split(np.asarray(v), np.cumsum(sizes)[:-1])
        return jax.tree_util.tree_unflatten(treedef, [jnp.asarray(p.reshape(s))
                                                      for p, s in zip(parts, shapes)])

    def flat(t):
        return np.concatenate([np.asarray(leaf).ravel() for leaf in jax.tree_util.tree_leaves(t)])

    mv = jax.jit(matvec)
    n = sum(sizes)
    op = spl.LinearOperator((n, n), matvec=lambda v: flat(mv(unflat(v))), dtype=np.float64)
    rhs = flat(b)
    target = rtol * np.linalg.norm(rhs)
    met = []
    spl.minres(op, rhs, rtol=1e-15, maxiter=20000,
               callback=lambda x: met.append(np.linalg.norm(rhs - op.matvec(x)) <= target))
    return met.index(True) + 1 if True in met else None


def run_one(matvec, b, options, precond):
    options = dict(options)
    fn = options.pop("fn")
    solve = jax.jit(lambda b: fn(matvec, b, precond=precond, rtol=RTOL, record_history=True,
                                 **options))
    jax.block_until_ready(solve(b))  # compile
    start = time.perf_counter()
    sol = jax.block_until_ready(solve(b))
    seconds = time.perf_counter() - start
    bnorm = norm(b)
    true = norm(jax.tree_util.tree_map(jnp.subtract, b, matvec(sol.x))) / bnorm
    its = int(sol.iterations)
    history = np.asarray(sol.history) / bnorm
    history = history[np.isfinite(history)]
    return dict(iterations=its, matvecs=matvecs_of(fn, options, its),
                true_relative_residual=true, status=sx.Status(int(sol.status)).name,
                seconds=seconds, history=history.tolist())


def norm(tree):
    return float(jnp.sqrt(sum(jnp.sum(jnp.abs(leaf) ** 2)
                              for leaf in jax.tree_util.tree_leaves(tree))))


def main():
    args = parse_args(__doc__)

    sizes = {"poisson": 64, "convection-diffusion": 32, "saddle-point": 16,
             "high-contrast": 16} if args.small else {
        "poisson": 512, "convection-diffusion": 256, "saddle-point": 128, "high-contrast": 32}
    rng = np.random.default_rng(0)
    results = []
    header = f"{'problem':22s} {'solver':30s} {'precond':17s} {'its':>6s} {'matvecs':>7s} " \
             f"{'true rel. res.':>14s} {'status':>10s} {'time (s)':>9s}"
    print(f"jax {jax.__version__}, rtol {RTOL}, GMRES restart {RESTART}\n{header}")
    operators = {"poisson": poisson, "convection-diffusion": convection_diffusion(10.0),
                 "saddle-point": saddle_point, "high-contrast": high_contrast(1e6)}
    for problem, n in sizes.items():
        matvec = operators[problem]
        b = jnp.asarray(1.0 + 0.1 * rng.standard_normal((n, n)))
        if problem == "saddle-point":
            b = {"u": b, "p": jnp.asarray(0.1 * rng.standard_normal((n, n)))}
        for pname, precond in preconditioners(problem, matvec, n, b).items():
            for k, (sname, options) in enumerate(solvers(problem, args.small).items()):
                # a smoke run: every solver unpreconditioned, each preconditioner once
                if args.only not in sname or (args.small and pname != "none" and k > 0):
                    continue
                row = dict(problem=f"{problem} {n}x{n}", solver=sname, precond=pname,
                           **run_one(matvec, b, options, precond))
                results.append(row)
                print(f"{row['problem']:22s} {sname:30s} {pname:17s} {row['iterations']:6d} "
                      f"{row['matvecs']:7d} {row['true_relative_residual']:14.3e} "
                      f"{row['status']:>10s} {row['seconds']:9.3f}", flush=True)
        if problem == "saddle-point" and args.only in "minres":
            steps = scipy_minres_steps(matvec, b, RTOL)
            results.append(dict(problem=f"{problem} {n}x{n}", solver="scipy minres",
                                precond="none", iterations=steps, matvecs=steps,
                                true_relative_residual=RTOL, status="reference", seconds=None,
                                history=[]))
            print(f"{problem + f' {n}x{n}':22s} {'scipy minres':30s} {'none':17s} {steps:6d}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"jax": jax.__version__, "rtol": RTOL, "restart": RESTART,
                       "results": results}, f, indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        plot(results, args.plot)


def plot(results, path):
    """The preconditioner figure of `plot_results.py` for these runs (the
    other figures: `python benchmarks/plot_results.py` on the saved JSON)."""
    import plot_results

    plot_results.preconditioners(results, {"jax": jax.__version__}, path)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
